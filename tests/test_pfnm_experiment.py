"""The PFNM experiments on the bundled digits (pixels in [0, 1], as the reference feeds MNIST)."""

import pytest

from bnpfed.data import load_dataset
from bnpfed.federated.pfnm import PFNMSettings, run_pfnm_experiment, width_sweep


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", standardize=False)


@pytest.fixture(scope="module")
def homogeneous_run(digits):
    settings = PFNMSettings(clients=5, sigma2=0.3, gamma0=1.0, methods=("local", "ensemble", "fedavg", "pfnm",
                                                                         "kmeans"))
    return run_pfnm_experiment(digits, settings, progress=False)


def test_one_shot_pfnm_beats_the_mean_local_model_and_fedavg_without_shared_init(homogeneous_run):
    pfnm = homogeneous_run.row("pfnm (1 round)").accuracy
    assert pfnm > homogeneous_run.row("local (mean)").accuracy
    assert pfnm > homogeneous_run.row("fedavg (1 round)").accuracy
    assert homogeneous_run.row("fedavg (1 round)").note == "no shared init"


def test_rows_report_width_parameters_and_rounds(homogeneous_run):
    pfnm = homogeneous_run.row("pfnm (1 round)")
    (width,) = pfnm.hidden
    assert pfnm.parameters == 64 * width + width + width * 10 + 10
    assert pfnm.rounds == 1 and pfnm.seconds > 0
    assert homogeneous_run.row("k-means").hidden == pfnm.hidden  # same global width as PFNM
    ens = homogeneous_run.row("ensemble")
    assert ens.hidden == [500] and ens.parameters == 5 * homogeneous_run.row("local (mean)").parameters
    assert len(homogeneous_run.local_accuracies) == 5


def test_same_seed_gives_the_same_numbers(digits):
    settings = PFNMSettings(clients=3, epochs=2, sigma2=0.3, methods=("local", "pfnm"))
    a = run_pfnm_experiment(digits, settings, progress=False)
    b = run_pfnm_experiment(digits, settings, progress=False)
    c = run_pfnm_experiment(digits, PFNMSettings(clients=3, epochs=2, sigma2=0.3, methods=("local", "pfnm"),
                                                  seed=1), progress=False)
    assert a.as_dict()["rows"] == b.as_dict()["rows"] or _rows_equal_but_seconds(a, b)
    assert [r.accuracy for r in a.rows] != [r.accuracy for r in c.rows]


def _rows_equal_but_seconds(a, b):
    return [(r.method, r.accuracy, r.hidden) for r in a.rows] == [(r.method, r.accuracy, r.hidden) for r in b.rows]


def test_communication_rounds_record_accuracy_and_width_per_round(digits):
    settings = PFNMSettings(clients=4, epochs=3, round_epochs=2, rounds=3, sigma2=0.3, partition="dirichlet",
                            methods=("pfnm", "pfnm-rounds", "fedavg-rounds"))
    run = run_pfnm_experiment(digits, settings, progress=False)
    assert [h["round"] for h in run.history["pfnm"]] == [1, 2, 3]
    assert [h["round"] for h in run.history["fedavg"]] == [1, 2, 3]
    assert run.history["pfnm"][0]["accuracy"] == run.row("pfnm (1 round)").accuracy
    assert run.row("pfnm (3 rounds)").rounds == 3
    assert all(len(h["hidden"]) == 1 and h["hidden"][0] >= 1 for h in run.history["pfnm"])


def test_federated_selection_picks_the_best_candidate_on_the_clients_held_out_data(digits):
    settings = PFNMSettings(clients=4, epochs=3, select="federated", grid_sigma2=(0.1, 1.0), grid_gamma0=(1.0,),
                            methods=("pfnm",))
    run = run_pfnm_experiment(digits, settings, progress=False)
    assert len(run.curve) == 2
    best = max(run.curve, key=lambda c: c["validation"])
    assert run.selection["by"] == "federated"
    assert run.selection["sigma2"] == best["sigma2"]
    assert run.selection["validation_accuracy"] == best["validation"]
    assert run.row("pfnm (1 round)").hidden == best["hidden"]


def test_two_hidden_layers_bottom_up_does_not_collapse_the_top_layer(digits):
    settings = PFNMSettings(clients=4, epochs=5, hidden=(50, 50), sigma2=0.3, methods=("local", "pfnm"))
    run = run_pfnm_experiment(digits, settings, progress=False)
    assert run.row("pfnm (1 round)").hidden[1] > 50


def test_width_sweep_returns_points_for_both_sets_of_constants(digits):
    points = width_sweep(digits, PFNMSettings(clients=3, epochs=2), sigma2=(0.1, 1.0), gamma0=(1.0,),
                         progress=False)
    assert {p["constants"] for p in points} == {"bnpfed", "reference"} and len(points) == 4
    assert all(0 <= p["accuracy"] <= 1 and p["width"] >= 1 for p in points)


@pytest.mark.parametrize("bad, match", [
    (dict(clients=0), "clients"), (dict(partition="iid"), "partition"), (dict(select="test"), "select"),
    (dict(methods=("pfnm", "magic")), "unknown methods"), (dict(holdout=1.5), "holdout"),
])
def test_bad_settings_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        PFNMSettings(**bad)
