"""The experiment harness: comparison methods as a registry, run on the bundled digits (pixels in [0, 1] for PFNM, as
the reference feeds MNIST)."""

import json
import math

import pytest

from bnpfed.combine import rules as combine
from bnpfed.data import load_dataset
from bnpfed.federated.config import PFNM_NETWORK, NetworkConfig, PartitionConfig, PFNMConfig, TrainingConfig
from bnpfed.experimental import ExperimentalOptions
from bnpfed.federated.config import FusionConfig
from bnpfed.federated.methods import (ExperimentConfig, MethodOption, MethodResult, available_methods, check_methods,
                                      method_options, method_spec, register_method, run_experiment, width_sweep)
from bnpfed.federated.registry import unregister_method


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", standardize=False)


def run(ds, *, clients=5, methods=("local", "pfnm"), rounds=1, epochs=10, hidden=(100,), seed=0, **pfnm):
    return run_experiment(ds, partition=PartitionConfig(clients=clients),
                          network=NetworkConfig(hidden=hidden, init="reference"),
                          training=TrainingConfig(epochs=epochs, round_epochs=2, amsgrad=True, weight_decay=1e-6),
                          pfnm=PFNMConfig(**{"hyperparameters": "fixed", "sigma2": 0.3, **pfnm}),
                          config=ExperimentConfig(methods=methods, rounds=rounds, seed=seed))


@pytest.fixture(scope="module")
def homogeneous_run(digits):
    return run(digits, methods=("local", "ensemble", "fedavg-oneshot", "pfnm", "kmeans"))


def test_every_row_of_one_model_carries_its_bootstrap_intervals_and_its_paired_difference_from_the_ensemble(
        homogeneous_run, digits):
    """A row's intervals are bootstrap_intervals of its own test probabilities under the experiment's seed; its
    comparison with the ensemble is paired_bootstrap of the two rows' probabilities; local-mean (a mean over models)
    has none. The metrics are the row's."""
    from bnpfed.metrics import bootstrap_intervals, debiased_calibration_error, paired_bootstrap
    from bnpfed.seeding import Stream, derive_seed

    result = homogeneous_run
    seed = derive_seed(0, Stream.BOOTSTRAP)
    assert result.row("local-mean").intervals == {} and result.row("local-mean").test_probs is None
    for row in result.rows[1:]:
        expected = bootstrap_intervals(row.test_probs, digits.y_test, seed=seed, ece_bins=15)
        assert row.intervals == {m: list(v) for m, v in expected.items()}, row.method
        assert row.intervals["accuracy"][0] <= row.accuracy <= row.intervals["accuracy"][1]
        assert row.ece_debiased == debiased_calibration_error(row.test_probs, digits.y_test)
    ensemble = result.row("ensemble").test_probs
    assert [c["method"] for c in result.comparisons] == ["local-min", "local-max", "fedavg-oneshot", "pfnm", "kmeans"]
    pfnm = next(c for c in result.comparisons if c["method"] == "pfnm")
    assert pfnm == {"method": "pfnm", "against": "ensemble",
                    **paired_bootstrap(result.row("pfnm").test_probs, ensemble, digits.y_test, seed=seed, ece_bins=15)}
    assert pfnm["accuracy"]["difference"] == pytest.approx(result.row("pfnm").accuracy
                                                           - result.row("ensemble").accuracy, abs=1e-12)
    assert result.paired("pfnm", "ensemble", seed=seed, ece_bins=15) == {k: v for k, v in pfnm.items()
                                                                          if k not in ("method", "against")}
    with pytest.raises(ValueError, match="local-mean: expected a row that kept its test probabilities"):
        result.paired("local-mean", "pfnm")
    assert json.loads(json.dumps(result.as_dict()))["comparisons"][0]["against"] == "ensemble"


def test_a_row_of_rounds_carries_the_intervals_of_its_final_global_model(digits):
    from bnpfed.metrics import bootstrap_intervals
    from bnpfed.seeding import Stream, derive_seed

    result = run(digits, clients=3, epochs=1, methods=("fedavg",), rounds=2)
    row = result.row("fedavg")
    assert len(row.history) == 2 and "ece_debiased" in row.history[-1] and "intervals" not in row.history[-1]
    assert row.accuracy == pytest.approx(float((row.test_probs.argmax(1) == digits.y_test).double().mean()))
    seed = derive_seed(0, Stream.BOOTSTRAP)
    assert row.intervals["nll"] == list(bootstrap_intervals(row.test_probs, digits.y_test, metrics=["nll"],
                                                            seed=seed)["nll"])
    assert result.comparisons == []   # no ensemble row, and FedAvg is the row itself


def test_one_shot_pfnm_beats_the_mean_local_model_and_fedavg_without_shared_init(homogeneous_run):
    pfnm = homogeneous_run.row("pfnm").accuracy
    assert pfnm > homogeneous_run.row("local-mean").accuracy
    assert pfnm > homogeneous_run.row("fedavg-oneshot").accuracy
    assert homogeneous_run.row("fedavg-oneshot").note == "each client from its own init"


def test_rows_report_width_parameters_and_calibration(homogeneous_run):
    pfnm = homogeneous_run.row("pfnm")
    (width,) = pfnm.hidden
    assert pfnm.parameters == 64 * width + width + width * 10 + 10
    assert pfnm.rounds == 1 and pfnm.server_seconds > 0
    assert all(0 <= getattr(pfnm, m) for m in ("nll", "ece", "brier"))
    assert homogeneous_run.row("kmeans").hidden == pfnm.hidden   # at PFNM's global width
    ens = homogeneous_run.row("ensemble")
    assert ens.hidden == [500] and ens.parameters == 5 * homogeneous_run.row("local-mean").parameters
    assert len(homogeneous_run.local_accuracies) == 5
    assert [r.method for r in homogeneous_run.rows] == ["local-mean", "local-min", "local-max", "ensemble",
                                                        "fedavg-oneshot", "pfnm", "kmeans"]   # unique names
    json.dumps(homogeneous_run.as_dict(), allow_nan=False)


def test_same_seed_gives_the_same_numbers(digits):
    a, b, c = (run(digits, clients=3, epochs=2, seed=s) for s in (0, 0, 1))
    assert [(r.method, r.accuracy, r.hidden) for r in a.rows] == [(r.method, r.accuracy, r.hidden) for r in b.rows]
    assert [r.accuracy for r in a.rows] != [r.accuracy for r in c.rows]


def test_communication_rounds_record_accuracy_and_width_per_round(digits):
    result = run(digits, clients=4, epochs=3, rounds=3, methods=("pfnm", "pfnm-rounds", "fedavg"))
    rows = {r.method: r for r in result.rows}
    assert [h["round"] for h in rows["pfnm-rounds"].history] == [1, 2, 3]
    assert [h["round"] for h in rows["fedavg"].history] == [1, 2, 3]
    assert rows["pfnm-rounds"].history[0]["accuracy"] == rows["pfnm"].accuracy   # round 1 is the one-shot match
    assert rows["pfnm-rounds"].rounds == 3 and rows["pfnm-rounds"].hidden == rows["pfnm-rounds"].history[-1]["hidden"]


def test_federated_selection_picks_the_best_candidate_on_the_clients_held_out_data(digits):
    result = run_experiment(digits, partition=PartitionConfig(clients=4), network=PFNM_NETWORK,
                            training=TrainingConfig(epochs=3, amsgrad=True),
                            config=ExperimentConfig(methods=("pfnm",), select="federated", grid_sigma2=(0.1, 1.0),
                                                    grid_gamma0=(1.0,)))
    curve = result.selection.curve
    assert len(curve) == 2
    best = max(curve, key=lambda c: (c["validation"], -sum(c["hidden"])))
    assert result.selection.by == "federated" and result.selection.config.sigma2 == best["sigma2"]
    assert result.selection.score == best["validation"]
    assert result.row("pfnm").hidden == best["hidden"]
    assert all("test" in c for c in curve)   # recorded, never used to choose


def test_two_hidden_layers_bottom_up_does_not_collapse_the_top_layer(digits):
    result = run(digits, clients=4, epochs=5, hidden=(50, 50))
    assert result.row("pfnm").hidden[1] > 50


def test_width_sweep_returns_points_for_both_sets_of_constants(digits):
    points = width_sweep(digits, partition=PartitionConfig(clients=3), network=PFNM_NETWORK,
                         training=TrainingConfig(epochs=2), sigma2=(0.1, 1.0), gamma0=(1.0,))
    assert {p["constants"] for p in points} == {"bnpfed", "reference"} and len(points) == 4
    assert all(0 <= p["accuracy"] <= 1 and p["width"] >= 1 for p in points)


def test_adding_a_method_is_one_function_and_one_registration(digits):
    def best_local(experiment):
        models = experiment.local_models()
        reports = [experiment.evaluate_network(net) for net in models]
        best = max(reports, key=lambda r: r["accuracy"])
        return MethodResult("best-local", **best)

    register_method("best-local", best_local)
    try:
        assert "best-local" in available_methods()
        result = run(digits, clients=3, epochs=2, methods=("local", "best-local"))
        assert result.row("best-local").accuracy == result.row("local-max").accuracy
        with pytest.raises(ValueError, match="name: expected a method name not registered yet, got 'best-local'"):
            register_method("best-local", best_local)
    finally:
        unregister_method("best-local")
    assert "best-local" not in available_methods()
    with pytest.raises(ValueError, match="name: expected a registered method, got 'best-local'"):
        unregister_method("best-local")


def test_a_methods_options_are_looked_up_in_the_registry_not_parsed_from_its_name():
    spec = method_spec("match:heads=pooled:rule=gaa")
    assert (spec.name, spec.given(), str(spec)) == ("match", {"rule": "gaa", "heads": "pooled"},
                                                     "match:rule=gaa:heads=pooled")
    assert ExperimentConfig(methods=("pfnm", "match:rule=eaa")).methods == ("pfnm", "match:rule=eaa")
    for text, message in (("pfnm:rule=gaa", "pfnm takes the options \\['heads'\\], got 'rule'"),
                          ("match:rule=nope", "match's rule: expected one of"),
                          ("match:rule=gaa:rule=eaa", "expected each option once"),
                          ("match:rule", "expected name:key=value options"),
                          ("nope", "methods: expected one of")):
        with pytest.raises(ValueError, match=message):
            method_spec(text)


@pytest.mark.parametrize("old, new", [("match-gaa-pooled", "match:rule=gaa:heads=pooled"),
                                      ("match-pvi", "match:rule=pvi"), ("pfnm-pooled", "pfnm:heads=pooled"),
                                      ("fedma-pooled", "fedma:heads=pooled"), ("conflation", "fusion:rule=conflation")])
def test_the_old_method_names_keep_working_for_one_release_and_name_their_spec(old, new):
    with pytest.warns(DeprecationWarning, match=f"write '{new}'"):
        assert str(method_spec(old)) == new
    with pytest.warns(DeprecationWarning):
        assert ExperimentConfig(methods=(old,)).methods == (new,)


def test_two_specs_that_give_one_row_are_refused_before_anything_runs():
    configs = dict(pfnm=PFNMConfig(heads="pooled"), fusion=FusionConfig())
    with pytest.raises(ValueError, match="'pfnm' and 'pfnm:heads=pooled' both give the row 'pfnm-pooled'"):
        check_methods(ExperimentConfig(methods=("pfnm", "pfnm:heads=pooled")), configs)
    assert len(check_methods(ExperimentConfig(methods=("pfnm", "pfnm:heads=pooled")),
                             dict(pfnm=PFNMConfig(), fusion=FusionConfig()))) == 2
    with pytest.raises(ValueError, match="pool_temperature: the temperature of pooled heads"):
        check_methods(ExperimentConfig(methods=("pfnm",)), dict(pfnm=PFNMConfig(pool_temperature=2.0, heads="fused"),
                                                                 fusion=FusionConfig()))


def test_a_registered_method_takes_its_options_with_their_defaults_from_the_configs(digits):
    calls = []

    def rows(experiment, weights):
        calls.append(weights)
        return MethodResult(f"uniform-{weights}", accuracy=0.5)

    register_method("uniform", rows, options={"weights": MethodOption(("size", "uniform"), "fusion", "weights")},
                    label=lambda o: f"uniform-{o['weights']}")
    try:
        assert method_options("uniform")["weights"].values() == ["size", "uniform"]
        result = run_experiment(digits, partition=PartitionConfig(clients=2), network=NetworkConfig(hidden=(8,)),
                                config=ExperimentConfig(methods=("uniform", "uniform:weights=uniform")))
        assert calls == ["size", "uniform"] and [r.method for r in result.rows] == ["uniform-size", "uniform-uniform"]
    finally:
        unregister_method("uniform")


def test_every_fusion_rule_is_an_option_of_fusion_and_so_is_a_newly_registered_rule(digits):
    assert set(combine.available_rules()) <= set(method_options("fusion")["rule"].values())
    combine.register_rule("first", lambda locs, variances, weights, **_: (locs[0], variances[0]))
    try:
        assert "first" in method_options("fusion")["rule"].values()
        result = run_experiment(load_dataset("digits"), partition=PartitionConfig(clients=2),
                                network=NetworkConfig(hidden=(8,)), training=TrainingConfig(epochs=1),
                                config=ExperimentConfig(methods=("fusion:rule=first",), predictive_samples=2))
        row = result.row("first")
        assert math.isfinite(row.accuracy) and row.mean_sigma > 0 and row.history[0]["round"] == 1
    finally:
        combine._RULES.pop("first")


def test_a_run_at_chance_accuracy_says_so(digits):
    result = run_experiment(digits, partition=PartitionConfig(clients=2), network=NetworkConfig(hidden=(8,)),
                            training=TrainingConfig(epochs=1, lr=1000.0),
                            config=ExperimentConfig(methods=("local", "fedavg")))
    assert any("local models: test accuracy" in w and "at chance" in w for w in result.warnings)


def test_a_grid_of_fixed_values_is_chosen_from_a_config_with_empirical_bayes_settings(digits):
    """The grid's candidates hold fixed values, so the settings of empirical Bayes (``starts``, ``stop``) that the
    experiment's PFNM config carries for its empirical-Bayes methods go back to their defaults in them instead of
    being refused there; the selection runs and its chosen config has the defaults."""
    from bnpfed.federated.config import EB_DEFAULTS
    result = run_experiment(digits, partition=PartitionConfig(clients=3), network=PFNM_NETWORK,
                            training=TrainingConfig(epochs=2, amsgrad=True),
                            pfnm=PFNMConfig(experimental=ExperimentalOptions(starts="both", stop="fixed-point")),
                            config=ExperimentConfig(methods=("pfnm",), select="federated", grid_sigma2=(0.1, 1.0),
                                                    grid_gamma0=(1.0,)))
    chosen = result.selection.config
    assert chosen.fixed and {k: getattr(chosen, k) for k in EB_DEFAULTS} == EB_DEFAULTS


def test_one_round_of_fedavg_from_a_shared_init_is_a_one_shot_row_beside_fedavg_from_own_inits(digits):
    """fedavg-oneshot:init=shared averages clients trained once from one initialisation: the same network as fedavg
    after one round; fedavg-oneshot (own initialisations) is the other row. The option's default follows
    network.shared_init, and the rows are named by it."""
    result = run(digits, clients=3, epochs=2, methods=("fedavg-oneshot", "fedavg-oneshot:init=shared", "fedavg"))
    own, shared, fedavg = result.rows
    assert (own.method, shared.method) == ("fedavg-oneshot", "fedavg-oneshot-shared")
    assert (own.note, shared.note) == ("each client from its own init", "one round from a shared init")
    assert [shared.accuracy, shared.nll, shared.parameters] == [fedavg.accuracy, fedavg.nll, fedavg.parameters]
    assert shared.nll < own.nll   # averaging units of one initialisation, not of unrelated ones
    assert method_options("fedavg-oneshot")["init"].values() == ["own", "shared"]
    configs = dict(network=NetworkConfig(shared_init=True), pfnm=PFNMConfig(), fusion=FusionConfig())
    with pytest.raises(ValueError, match="'fedavg-oneshot' and 'fedavg-oneshot:init=shared' both give the row"):
        check_methods(ExperimentConfig(methods=("fedavg-oneshot", "fedavg-oneshot:init=shared")), configs)
    with pytest.raises(ValueError, match="reads, default: expected exactly one"):
        MethodOption(("a", "b"), None, "no way to read it")
