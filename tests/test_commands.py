"""``bnpfed pfnm``, ``bnpfed fuse`` and ``bnpfed demo``: every argument and input file checked before any training,
plain words when a run diverges, one vocabulary, the plots, and one JSON layout."""

import json
import math
import re

import numpy as np
import pytest
import torch

from bnpfed.cli import build_parser, main
from bnpfed.commands import fuse, pfnm
from bnpfed.data import NPZ_FORMAT
import bnpfed.federated as methods   # the face the commands call through
from bnpfed.experimental import ExperimentalOptions
from bnpfed.federated.config import PAPER_MIN_VARIANCE, BayesianConfig, PartitionConfig, PFNMConfig, TrainingConfig
from bnpfed.report import RECORD_SCHEMA, command_record, command_results, read_record
from bnpfed.clients import TrainingDiverged
import bnpfed.matching as recovery   # the face the demo calls through

TINY = ["--clients", "3", "--epochs", "1", "--hidden", "16", "--no-progress"]


def exit_code(argv) -> int:
    """``bnpfed argv``'s exit status, whether it returned it or argparse exited."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Bad input files (and a folder, and a good flat .npz), by name."""
    root = tmp_path_factory.mktemp("inputs")
    rng = np.random.default_rng(0)

    def save(name, **arrays):
        np.savez(root / name, **arrays)
        return str(root / name)

    good = dict(x_train=rng.random((60, 5), dtype=np.float32), y_train=np.arange(60) % 3,
                x_test=rng.random((12, 5), dtype=np.float32), y_test=np.arange(12) % 3)
    nan = dict(good, x_train=np.where(np.eye(60, 5) > 0, np.nan, good["x_train"]))
    (root / "text.npz").write_text("x_train,y_train\n1,2\n")
    return {
        "missing": str(root / "missing.npz"),
        "wrong_keys": save("wrong_keys.npz", x_train=good["x_train"], labels=good["y_train"]),
        "mismatched": save("mismatched.npz", **dict(good, x_test=rng.random((12, 6), dtype=np.float32))),
        "nan": save("nan.npz", **nan),
        "text": str(root / "text.npz"),
        "flat": save("flat.npz", **good),
        "small_images": save("small_images.npz", **dict(good, x_train=rng.random((60, 6, 6), dtype=np.float32),
                                                         x_test=rng.random((12, 6, 6), dtype=np.float32))),
        "typo": save("typo.npz", **dict(good, y_test=np.where(np.arange(12) == 0, 999, good["y_test"]))),
        "folder": str(root),
    }


SHARED = [  # (argv, the flag the message must name): the same flags in pfnm and fuse
    (["--device", "tpu"], "--device"),
    (["--device", "cuda:7"], "--device"),   # no CUDA device here (or not that many)
    (["--seed", "-1"], "--seed"),
    (["--threads", "0"], "--threads"),
    (["--threads", "1000"], "--threads"),   # more than the CPUs this process may use
    (["--rounds", "0"], "--rounds"),
    (["--epochs", "0"], "--epochs"),
    (["--lr", "0"], "--lr"),
    (["--lr", "nan"], "--lr"),
    (["--batch-size", "0"], "--batch-size"),
    (["--weight-decay", "-1"], "--weight-decay"),
    (["--lr-decay", "-1"], "--lr-decay"),
    (["--round-epochs", "0"], "--round-epochs"),
    (["--alpha", "0"], "--alpha"),
    (["--partition", "dirichlet", "--min-size", "100000"], "--min-size"),
    (["--partition", "shards"], "--partition"),
    (["--partition", "dirichlet", "--alpha", "0.001", "--clients", "100"], "--min-size"),
    (["--clients", "0"], "--clients"),
    (["--clients", "5000"], "--clients"),
    (["--fraction", "0"], "--fraction"),
    (["--fraction", "1.5"], "--fraction"),
    (["--hidden", "16,0"], "--hidden"),
    (["--hidden", "16,x"], "--hidden"),
    (["--arch", "lenet", "--hidden", "50"], "--hidden"),  # LeNet's widths are fixed: not silently ignored
    (["--dataset", "imagenet"], "--dataset"),
    (["--dataset", "mnist"], "--data-dir"),
    (["--dataset", "npz:{missing}"], "--dataset"),
    (["--dataset", "npz:{wrong_keys}"], "--dataset"),
    (["--dataset", "npz:{mismatched}"], "--dataset"),
    (["--dataset", "npz:{nan}"], "--dataset"),
    (["--dataset", "npz:{text}"], "--dataset"),
    (["--dataset", "npz:{typo}"], "--dataset"),  # one label 999: classes 3 .. 998 empty, not a 1000-class model
    (["--dataset", "npz:{typo}", "--num-classes", "10"], "--num-classes"),
    (["--num-classes", "10"], "--num-classes"),  # digits knows its classes
    (["--json", "{folder}"], "--json"),
    (["--plot", "{folder}/plot.json"], "--plot"),
    (["--plot", "{folder}/plot"], "--plot"),
    (["--augment", "crop", "--dataset", "npz:{flat}"], "--augment"),   # crops need images: refused, not skipped
    (["--augment", "rotate"], "--augment"),
]
PFNM_ONLY = [
    (["--sigma2", "0"], "--sigma2"),
    (["--sigma2", "-1"], "--sigma2"),
    (["--sigma2", "nan"], "--sigma2"),
    (["--sigma2", "inf"], "--sigma2"),
    (["--sigma2", "0.3,0"], "--sigma2"),
    (["--sigma2", "0.1,0.2,0.3", "--hidden", "100"], "--sigma2"),  # 3 values for 1 hidden layer: before training
    (["--gamma0", "1,2", "--arch", "lenet"], "--gamma0"),  # LeNet has 4 matched groups
    (["--sigma0-2", "0"], "--sigma0-2"),
    (["--gamma0", "0"], "--gamma0"),
    (["--sweeps", "-1"], "--sweeps"),
    (["--experimental", "stop=exact"], "--experimental"),
    (["--experimental", "stop=fixed-point", "--hyperparameters", "fixed"], "--experimental"),   # empirical Bayes only
    (["--experimental", "later-rounds=fixed"], "--experimental"),   # matched fusion's, not read by pfnm
    (["--experimental", "starts"], "--experimental"),
    (["--experimental", "nope=1"], "--experimental"),
    (["--holdout", "1.5"], "--holdout"),
    (["--grid-sigma2", "0.1,0"], "--grid-sigma2"),
    (["--select", "operating-point", "--grid-gamma0", "1"], "--grid-gamma0"),   # a grid of another selection
    (["--noise-factors", "0.5"], "--noise-factors"),   # only with --select operating-point
    (["--tolerance", "2"], "--tolerance"),
    (["--select", "operating-point", "--noise-factors", "1,0.5"], "--noise-factors"),
    (["--select", "operating-point", "--noise-factors", "0.5,0"], "--noise-factors"),
    (["--select", "operating-point", "--tolerance", "-1"], "--tolerance"),
    (["--select", "operating-point", "--sigma2", "0.1"], "--sigma2"),   # nothing left to scale
    (["--select", "operating-point", "--hyperparameters", "fixed"], "--select"),
    (["--width-sweep", "--select", "federated"], "--select"),
    (["--methods", "foo"], "--methods"),
    (["--methods", "pfnm,pfnm"], "--methods"),
    (["--ece-bins", "0"], "--ece-bins"),
    (["--width-sweep", "--sweep-sigma2", "0"], "--sweep-sigma2"),
    (["--width-sweep", "--sweep-gamma0", "nan"], "--sweep-gamma0"),
    (["--width-sweep", "--clients", "3,4"], "--clients"),
    (["--width-sweep", "--rounds", "3"], "--rounds"),  # the sweep matches round 1's models: not silently ignored
    (["--sweep-sigma2", "0.1"], "--sweep-sigma2"),  # only with --width-sweep
    (["--sweep-gamma0", "1"], "--sweep-gamma0"),
    (["--clients", "3,3"], "--clients"),
    (["--arch", "resnet"], "--arch"),
    (["--dataset", "npz:{flat}", "--arch", "lenet"], "--arch"),
    (["--dataset", "npz:{small_images}", "--arch", "simple-cnn"], "--arch"),
    (["--dataset", "npz:{small_images}", "--arch", "lenet-paper"], "--arch"),
    (["--layerwise-retrain", "-1"], "--layerwise-retrain"),
    (["--layerwise-retrain", "2", "--direction", "top-down"], "--layerwise-retrain"),
    (["--max-width", "0"], "--max-width"),
    (["--max-width", "x"], "--max-width"),
    (["--max-width", "10,20", "--hidden", "100"], "--max-width"),  # 2 values for 1 hidden layer: before training
    (["--max-params", "0"], "--max-params"),
    (["--max-params", "half"], "--max-params"),
    (["--width-sweep", "--max-width", "50"], "--max-width"),  # the sweep shows widths: a limit is not ignored
    (["--width-sweep", "--max-params", "none"], "--max-params"),
    (["--limit-from-round", "2"], "--limit-from-round"),   # no limit to start later: not a no-op
    (["--limit-from-round", "0", "--max-params", "ensemble"], "--limit-from-round"),
    (["--limit-from-round", "2", "--max-params", "ensemble", "--layerwise-retrain", "1"], "--limit-from-round"),
]
FUSE_ONLY = [
    (["--rule", "foo"], "--rule"),
    (["--match-on", "means"], "--match-on"),   # only with --align match
    (["--align", "match", "--match-on", "weights"], "--match-on"),
    (["--experimental", "starts=both"], "--experimental"),   # only with --align match
    (["--align", "match", "--experimental", "starts=even"], "--experimental"),
    (["--experimental", "stop=fixed-point"], "--experimental"),   # only with --align match
    (["--align", "match", "--experimental", "stop=exact"], "--experimental"),
    (["--align", "match", "--experimental", "schedule=jacobi"], "--experimental"),   # PFNM's, not fuse's
    (["--rule", "eaa,eaa"], "--rule"),
    (["--local-epochs", "0"], "--epochs"),
    (["--min-variance", "-1"], "--min-variance"),
    (["--pooling-samples", "1"], "--pooling-samples"),
    (["--predictive-samples", "0"], "--predictive-samples"),
    (["--samples", "0"], "--predictive-samples"),
    (["--prior-scale", "0"], "--prior-scale"),
    (["--init-scale", "nan"], "--init-scale"),
    (["--ece-bins", "0"], "--ece-bins"),
    (["--dataset", "npz:{flat}", "--arch", "lenet"], "--arch"),
]
DEMO = [
    (["--sigma2", "0"], "--sigma2"),
    (["--sigma2", "-1"], "--sigma2"),
    (["--sigma2", "nan"], "--sigma2"),
    (["--sigma2", "inf"], "--sigma2"),
    (["--noise", "0"], "--sigma2"),
    (["--sigma0-2", "0"], "--sigma0-2"),
    (["--gamma0", "0"], "--gamma0"),
    (["--seed", "-1"], "--seed"),
    (["--clients", "0"], "--clients"),
    (["--dim", "0"], "--dim"),
    (["--sweeps", "-1"], "--sweeps"),
    (["--json", "{folder}"], "--json"),
    (["--gamma0", "1e6", "--clients", "3", "--dim", "5"], "--gamma0"),  # 7 TiB of score matrices
    (["--dim", "1000000"], "--dim"),  # 8 GB of coordinates
]
CASES = ([("pfnm", *case) for case in SHARED + PFNM_ONLY] + [("fuse", *case) for case in SHARED + FUSE_ONLY]
         + [("demo", *case) for case in DEMO])


@pytest.mark.parametrize("command, argv, flag", CASES,
                         ids=[f"{c}:{' '.join(a)}" for c, a, _ in CASES])
def test_a_bad_argument_or_file_exits_2_naming_its_flag_before_anything_trains(command, argv, flag, files, capsys,
                                                                              monkeypatch):
    def trained(*args, **kwargs):
        raise AssertionError("the command started working before it checked its arguments")

    for module, name in ((methods, "run_experiment"), (methods, "width_sweep"), (recovery, "match_recovery")):
        monkeypatch.setattr(module, name, trained)
    argv = [a.format(**files) for a in argv]
    assert exit_code([command, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert re.match(rf"bnpfed {command}: error: (argument )?{re.escape(flag)}[:/ ]", err), err


@pytest.mark.parametrize("command", ["pfnm", "fuse"])
def test_a_command_run_in_process_leaves_torchs_thread_count_as_it_found_it(command, capsys):
    """``--threads`` holds while the command trains; a command called from Python (a notebook, these tests) leaves
    no thread count behind it: results of the code after it do not depend on which command ran first."""
    before = torch.get_num_threads()
    other = 2 if before != 2 else 1
    extra = ["--methods", "pfnm"] if command == "pfnm" else ["--rounds", "1", "--rule", "eaa", "--no-fedavg"]
    torch.set_num_threads(other)
    try:
        assert main([command, *TINY, *extra, "--threads", str(3 - other)]) == 0
        assert torch.get_num_threads() == other
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------------ diverging runs


def test_a_diverging_pfnm_run_warns_that_it_sits_at_chance(capsys):
    assert main(["pfnm", *TINY, "--lr", "1e6", "--methods", "local,ensemble,kmeans,pfnm,fedavg"]) == 0
    err = capsys.readouterr().err
    for method in ("local models", "ensemble", "kmeans", "pfnm", "fedavg"):  # every global model, not one of them
        assert re.search(rf"^warning: {method}: test accuracy 0\.\d+ is at chance", err, re.M), (method, err)


def test_a_diverging_fusion_run_exits_1_with_one_line(capsys):
    assert main(["fuse", *TINY, "--lr", "1000", "--rounds", "1", "--rule", "eaa", "--no-fedavg"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("bnpfed fuse: error: ") and err.count("\n") == 1 and "diverged" in err, err


def test_a_fusion_run_whose_first_loss_is_not_finite_names_the_flags_of_the_starting_point(capsys):
    assert main(["fuse", *TINY, "--init-scale", "1e10", "--rounds", "1", "--rule", "eaa", "--no-fedavg"]) == 1
    err = capsys.readouterr().err
    assert "before any parameter update" in err and "--init-scale 1e+10" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("error, words", [
    (TrainingDiverged("DeterministicClient.fit", 1, 3, 10, math.inf, 1000.0, "the loss is inf"),
     "diverged at epoch 1, step 3 of 10: the loss is inf"),
    (ValueError("Expected parameter scale\ntensor([[nan]])"), "training failed (ValueError: Expected parameter scale)"),
])
def test_an_error_while_training_exits_1_with_one_line(error, words, monkeypatch, capsys):
    def diverge(*args, **kwargs):
        raise error

    monkeypatch.setattr(methods, "run_experiment", diverge)
    assert main(["pfnm", *TINY]) == 1
    err = capsys.readouterr().err
    assert err.startswith("bnpfed pfnm: error: ") and words in err and err.count("\n") == 1, err


# ------------------------------------------------------------------------------------------------ output


@pytest.fixture
def figures(monkeypatch):
    """The figures the commands save, kept open for the test to read."""
    saved = []

    def keep(fig, path, **kwargs):
        fig.savefig(path)
        saved.append(fig)

    monkeypatch.setattr(pfnm, "save_figure", keep)
    monkeypatch.setattr(fuse, "save_figure", keep)
    yield saved
    import matplotlib.pyplot as plt

    for fig in saved:
        plt.close(fig)


def check_record(path, command: str) -> dict:
    """The JSON layout every command writes (:data:`bnpfed.report.RECORD_SCHEMA`, validated with jsonschema, and
    read back by :func:`bnpfed.report.read_record`)."""
    import jsonschema

    payload = json.loads(path.read_text())
    jsonschema.validate(payload, RECORD_SCHEMA)
    record = read_record(path)
    assert record.command == command and record.runs == payload["results"]["runs"]
    assert list(payload) == ["command", "arguments", "settings", "versions", "timestamp", "results"]
    assert payload["command"] == command and "func" not in payload["arguments"]
    assert sorted(payload["versions"]) == ["bnpfed", "flwr", "pyro", "python", "torch"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", payload["timestamp"])
    return payload


def test_pfnm_one_round_prints_its_hyper_parameters_and_writes_json_and_a_bar_chart(tmp_path, capsys, figures):
    out_json, out_png = tmp_path / "out" / "pfnm.json", tmp_path / "pfnm.png"
    assert main(["pfnm", *TINY, "--hyperparameters", "fixed", "--sigma2", "0.3", "--methods",
                 "local,ensemble,pfnm,kmeans", "--json", str(out_json), "--plot", str(out_png)]) == 0
    out = capsys.readouterr().out
    assert "PFNM hyper-parameters: fixed: sigma2 0.3, sigma0_2 1, gamma0 1" in out
    assert "server_seconds: the server's aggregation time" in out
    assert f"wrote results to {out_json}" in out and f"wrote plot to {out_png}" in out
    payload = check_record(out_json, "pfnm")
    assert payload["arguments"]["sigma2"] == 0.3 and payload["settings"]["pfnm"]["sigma2"] == 0.3
    assert payload["settings"]["partition"]["clients"] == 3 and payload["settings"]["training"]["epochs"] == 1
    rows = payload["results"]["runs"][0]["rows"]
    assert [r["method"] for r in rows] == ["local-mean", "local-min", "local-max", "ensemble", "pfnm", "kmeans"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    ax_acc, ax_width = fig.axes
    assert ax_acc.get_xlabel() == "test accuracy" and "width" in ax_width.get_xlabel()
    assert [t.get_text() for t in ax_acc.get_yticklabels()] == [r["method"] for r in rows]
    assert fig.legends == [] and ax_acc.get_legend() is None
    from matplotlib.container import ErrorbarContainer
    bars = [c for c in ax_acc.containers if isinstance(c, ErrorbarContainer)]   # a 95 % interval per model's row
    assert len(bars) == len([r for r in rows if r["intervals"]]) == len(rows) - 1   # all but local-mean
    for bar, row in zip(bars, [r for r in rows if r["intervals"]]):
        segment = bar.lines[2][0].get_segments()[0]
        assert [segment[0][0], segment[1][0]] == pytest.approx(row["intervals"]["accuracy"])
    assert "digits" in fig._suptitle.get_text() and "J = 3" in fig._suptitle.get_text()
    assert "paired with the ensemble on the same 450 test examples" in out
    comparisons = payload["results"]["runs"][0]["comparisons"]
    assert [c["method"] for c in comparisons] == ["local-min", "local-max", "pfnm", "kmeans"]
    assert all(c["against"] == "ensemble" and c["accuracy"]["low"] <= c["accuracy"]["high"] for c in comparisons)


def test_pfnm_over_rounds_plots_curves_per_round_with_integer_ticks(tmp_path, figures):
    assert main(["pfnm", *TINY, "--rounds", "2", "--round-epochs", "1", "--methods", "ensemble,pfnm,pfnm-rounds",
                 "--plot", str(tmp_path / "rounds.png")]) == 0
    (fig,) = figures
    ax_acc, ax_width = fig.axes
    assert ax_acc.get_xlabel() == "communication round" and ax_acc.get_ylabel() == "test accuracy"
    assert all(float(t).is_integer() for t in ax_acc.get_xticks())
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["ensemble (one shot)", "pfnm (one shot)", "pfnm-rounds"]


def test_pfnm_over_several_J_draws_every_method_against_J(tmp_path, capsys, figures):
    out_json = tmp_path / "j.json"
    assert main(["pfnm", "--clients", "2,3", "--epochs", "1", "--hidden", "16", "--no-progress", "--methods",
                 "local,fedavg-oneshot,fedavg,pfnm", "--json", str(out_json), "--plot", str(tmp_path / "j.png")]) == 0
    assert capsys.readouterr().out.count("PFNM hyper-parameters:") == 2
    payload = check_record(out_json, "pfnm")
    assert payload["settings"]["partition"]["clients"] == [2, 3] and len(payload["results"]["runs"]) == 2
    (fig,) = figures
    ax_acc, _ = fig.axes
    assert [line.get_label() for line in ax_acc.lines] == ["local-mean", "fedavg-oneshot", "fedavg", "pfnm"]
    assert list(ax_acc.get_xticks()) == [2, 3] and ax_acc.get_xlabel() == "number of clients J"


def test_width_sweep_plots_accuracy_against_width_with_its_pareto_fronts(tmp_path, figures):
    out_json = tmp_path / "sweep.json"
    assert main(["pfnm", *TINY, "--width-sweep", "--sweep-sigma2", "0.05,1", "--sweep-gamma0", "1",
                 "--json", str(out_json), "--plot", str(tmp_path / "sweep.png")]) == 0
    points = check_record(out_json, "pfnm")["results"]["runs"][0]["rows"]
    assert [(p["constants"], p["sigma2"]) for p in points] == [("bnpfed", 0.05), ("bnpfed", 1.0),
                                                               ("reference", 0.05), ("reference", 1.0)]
    (fig,) = figures
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "bnpfed constants: Pareto front" in labels and "reference constants: Pareto front" in labels


def test_the_default_width_sweep_spans_one_client_to_J_clients():
    assert min(pfnm.SWEEP_SIGMA2) <= 0.02 and max(pfnm.SWEEP_SIGMA2) >= 0.5 and len(pfnm.SWEEP_SIGMA2) >= 10


def test_fuse_prints_the_table_and_writes_json_and_a_grid_of_panels(tmp_path, capsys, figures):
    out_json, out_png = tmp_path / "fuse.json", tmp_path / "fuse.png"
    assert main(["fuse", "--clients", "3", "--rounds", "2", "--local-epochs", "1", "--hidden", "16", "--rule",
                 "eaa,conflation", "--samples", "2", "--weights", "uniform", "--partition", "hetero", "--json",
                 str(out_json), "--plot", str(out_png), "--no-progress", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    for word in ("dirichlet partition", "100 bins", "eaa", "conflation", "fedavg", "mean_sigma", "server_seconds"):
        assert word in out
    assert "gaa" not in out and f"wrote results to {out_json}" in out
    payload = check_record(out_json, "fuse")
    settings = payload["settings"]
    assert settings["training"]["epochs"] == 1 and settings["partition"]["partition"] == "dirichlet"
    assert settings["fusion"]["weights"] == "uniform" and settings["config"]["predictive_samples"] == 2
    assert settings["config"]["methods"] == ["fusion:rule=eaa", "fusion:rule=conflation", "fedavg"]
    rows = payload["results"]["runs"][0]["rows"]
    assert [r["method"] for r in rows] == ["eaa", "conflation", "fedavg"]
    assert all(len(r["history"]) == 2 for r in rows) and rows[2]["mean_sigma"] is None
    (fig,) = figures
    # accuracy, NLL, ECE, ECE with 15 bins, the debiased error, Brier, mean sigma; the legend; one panel spare
    assert len(fig.axes) == 9 and not fig.axes[7].axison and not fig.axes[8].axison
    assert [ax.get_title() for ax in fig.axes[3:5]] == ["ECE, 15 bins", "debiased L2 calibration error"]
    assert [t.get_text() for t in fig.axes[7].get_legend().get_texts()] == ["eaa", "conflation", "fedavg"]
    assert all(ax.get_legend() is None for ax in fig.axes[:7])
    from matplotlib.container import ErrorbarContainer   # each line's final model: its 95 % interval
    assert len([c for c in fig.axes[0].containers if isinstance(c, ErrorbarContainer)]) == 3
    assert "paired with the fedavg on the same" in out   # no ensemble row: FedAvg is the reference
    assert [c["method"] for c in payload["results"]["runs"][0]["comparisons"]] == ["eaa", "conflation"]
    assert "J = 3" in fig._suptitle.get_text() and "dirichlet" in fig._suptitle.get_text()


# ------------------------------------------------------------------------------------------------ vocabulary


def parsed(argv):
    return build_parser().parse_args(argv)


def test_fuse_paper_is_the_published_setting_and_explicit_flags_win():
    plan = fuse.prepare(parsed(["fuse", "--paper"]))
    assert plan["network"].arch == "lenet-paper" and plan["fusion"].min_variance == PAPER_MIN_VARIANCE
    assert float(plan["dataset"].x_train.min()) >= 0 and float(plan["dataset"].x_train.max()) <= 1
    plan = fuse.prepare(parsed(["fuse", "--paper", "--arch", "mlp", "--standardize", "--min-variance", "0"]))
    assert plan["network"].arch == "mlp" and plan["fusion"].min_variance == 0
    assert float(plan["dataset"].x_train.min()) < 0
    plan = fuse.prepare(parsed(["fuse"]))
    assert plan["network"].arch == "mlp" and plan["fusion"].min_variance == 1e-16
    assert float(plan["dataset"].x_train.min()) < 0


def test_fuse_takes_the_clients_prior_variance_kl_weight_and_scale_rate():
    plan = fuse.prepare(parsed(["fuse", "--prior-variance", "empirical-bayes", "--kl-weight", "0.1",
                                "--scale-lr-factor", "1"]))
    bayesian = plan["bayesian"]
    assert (bayesian.prior_variance, bayesian.kl_weight, bayesian.scale_lr_factor) == ("empirical-bayes", 0.1, 1.0)
    assert fuse.prepare(parsed(["fuse"]))["bayesian"] == BayesianConfig()
    with pytest.raises(ValueError, match="kl_weight"):
        fuse.prepare(parsed(["fuse", "--kl-weight", "0"]))


def test_fuse_takes_the_atom_posterior_rule_with_align_match_only():
    plan = fuse.prepare(parsed(["fuse", "--align", "match", "--rule", "conflation,atom-posterior"]))
    assert "match:rule=atom-posterior" in plan["config"].methods and "match:rule=conflation" in plan["config"].methods
    assert "fusion:rule=conflation" in plan["config"].methods
    assert "fusion:rule=atom-posterior" not in plan["config"].methods
    with pytest.raises(Exception, match="--rule atom-posterior: expected only with --align match"):
        fuse.prepare(parsed(["fuse", "--rule", "atom-posterior"]))


def test_fuse_takes_pooled_heads_with_align_match_and_not_with_save_global(tmp_path):
    plan = fuse.prepare(parsed(["fuse", "--align", "match", "--rule", "conflation", "--heads", "both",
                                "--rounds", "1"]))
    methods = plan["config"].methods
    assert methods.index("pfnm:heads=pooled") == methods.index("pfnm") + 1
    assert methods[-2:] == ("match:rule=conflation", "match:rule=conflation:heads=pooled")
    pooled = fuse.prepare(parsed(["fuse", "--align", "match", "--rule", "eaa", "--heads", "pooled"]))
    assert "match:rule=eaa:heads=pooled" in pooled["config"].methods
    assert "match:rule=eaa" not in pooled["config"].methods
    rounds = fuse.prepare(parsed(["fuse", "--align", "match", "--rule", "eaa", "--heads", "pooled", "--rounds", "2"]))
    assert "pfnm-rounds" in rounds["config"].methods and "pfnm:heads=pooled" not in rounds["config"].methods
    with pytest.raises(Exception, match="--heads: expected only with --align match"):
        fuse.prepare(parsed(["fuse", "--heads", "pooled"]))
    saving = fuse.prepare(parsed(["fuse", "--align", "match", "--heads", "both", "--save-global", str(tmp_path)]))
    assert "match:rule=conflation:heads=pooled" in saving["config"].methods   # written as a pooled-posterior file


def test_fuse_takes_where_the_matchers_empirical_bayes_starts_with_align_match():
    plan = fuse.prepare(parsed(["fuse", "--align", "match", "--experimental", "starts=both"]))
    assert plan["fusion"].starts == "both" and plan["bayesian"].experimental == ExperimentalOptions()
    assert fuse.prepare(parsed(["fuse", "--align", "match"]))["fusion"].starts == "even-split"


def test_fuse_and_pfnm_take_the_stopping_rule_of_empirical_bayes_as_a_probe():
    plan = fuse.prepare(parsed(["fuse", "--align", "match", "--experimental", "stop=fixed-point"]))
    assert plan["fusion"].stop == "fixed-point"
    assert fuse.prepare(parsed(["fuse", "--align", "match"]))["fusion"].stop == "result"
    assert pfnm.prepare(parsed(["pfnm", "--experimental", "stop=fixed-point"]))["pfnm"].stop == "fixed-point"
    assert pfnm.prepare(parsed(["pfnm"]))["pfnm"].stop == "result"


@pytest.mark.parametrize("command, old, new", [
    ("pfnm", ["--starts", "both", "--inactive", "keep"], "starts=both,inactive=keep"),
    ("fuse", ["--align", "match", "--later-rounds", "rematch", "--round-prior", "posterior"],
     "later-rounds=rematch,round-prior=posterior")])
def test_the_probe_flags_of_bnpfed_0_1_keep_working_with_a_notice_naming_the_new_form(command, old, new, capsys):
    plan = {"pfnm": pfnm, "fuse": fuse}[command].prepare(parsed([command, *old]))
    err = capsys.readouterr().err
    assert f"write --experimental {new}" in err and err.count("\n") == 1, err
    probes = ExperimentalOptions.from_text(new)
    for name in probes.set_fields():
        config = plan["bayesian"] if name == "round_prior" else plan["pfnm" if command == "pfnm" else "fusion"]
        assert getattr(config, name) == getattr(probes, name)


def test_fuse_takes_pvi_rounds_with_align_match_every_client_and_its_damping():
    plan = fuse.prepare(parsed(["fuse", "--align", "match", "--rule", "pvi,conflation", "--experimental",
                                "pvi-damping=0.3"]))
    assert plan["fusion"].pvi_damping == 0.3 and plan["fusion"].rule == "pvi"
    assert "match:rule=pvi" in plan["config"].methods and "fusion:rule=pvi" not in plan["config"].methods
    with pytest.raises(Exception, match="--rule pvi: expected only with --align match"):
        fuse.prepare(parsed(["fuse", "--rule", "pvi"]))
    with pytest.raises(Exception, match="--experimental: pvi-damping: expected only with --rule pvi"):
        fuse.prepare(parsed(["fuse", "--align", "match", "--experimental", "pvi-damping=0.3"]))
    with pytest.raises(Exception, match="--fraction: --rule pvi keeps every client's factor"):
        fuse.prepare(parsed(["fuse", "--align", "match", "--rule", "pvi", "--fraction", "0.5"]))


@pytest.mark.parametrize("command", [pfnm, fuse], ids=["pfnm", "fuse"])
def test_the_cnns_train_at_the_cnn_rate_unless_lr_is_given_and_help_says_which(command, capsys):
    from bnpfed.federated import CNN_LR, FUSION_TRAINING, PFNM_TRAINING
    name = command.__name__.rsplit(".", 1)[-1]
    mlp_rate = {"pfnm": PFNM_TRAINING, "fuse": FUSION_TRAINING}[name].lr
    assert mlp_rate == 0.01 and CNN_LR == 0.001
    assert command.prepare(parsed([name, "--arch", "mlp"]))["training"].lr == mlp_rate
    for arch in ("lenet", "simple-cnn"):
        plan = command.prepare(parsed([name, "--arch", arch]))
        assert plan["training"].lr == CNN_LR
        assert command.prepare(parsed([name, "--arch", arch, "--lr", "0.01"]))["training"].lr == 0.01
    assert command.prepare(parsed([name, "--arch", "mlp", "--lr", "0.003"]))["training"].lr == 0.003
    with pytest.raises(SystemExit):
        main([name, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--lr LR the learning rate (default: 0.01" in text and "0.001 for" in text


def test_pfnm_keeps_pixels_in_0_1_unless_told_and_adds_pfnm_rounds_for_several_rounds():
    plan = pfnm.prepare(parsed(["pfnm"]))
    assert float(plan["dataset"].x_train.min()) >= 0
    assert plan["config"].methods == pfnm.DEFAULT_METHODS and "pfnm-rounds" not in pfnm.DEFAULT_METHODS
    assert plan["pfnm"].warm_start and plan["network"].init == "reference" and plan["training"].amsgrad
    plan = pfnm.prepare(parsed(["pfnm", "--standardize", "--rounds", "3", "--no-warm-start", "--fraction", "0.5"]))
    assert float(plan["dataset"].x_train.min()) < 0
    # with rounds, fedavg runs them: one round of it from the shared init stays in the one-shot comparison
    assert plan["config"].methods == pfnm.DEFAULT_METHODS + ("fedavg-oneshot:init=shared", "pfnm-rounds")
    assert not plan["pfnm"].warm_start and plan["pfnm"].fraction == plan["fusion"].fraction == 0.5
    plan = pfnm.prepare(parsed(["pfnm", "--rounds", "3", "--shared-init"]))   # fedavg-oneshot is that row then
    assert plan["config"].methods == pfnm.DEFAULT_METHODS + ("pfnm-rounds",)


def test_pfnm_max_params_defaults_to_the_configs_auto_and_reads_none_and_ensemble():
    assert pfnm.prepare(parsed(["pfnm"]))["pfnm"].max_params == "auto" == PFNMConfig().max_params
    for given, expected in (("none", None), ("ensemble", "ensemble"), ("5000", 5000), ("auto", "auto")):
        assert pfnm.prepare(parsed(["pfnm", "--max-params", given]))["pfnm"].max_params == expected


@pytest.mark.parametrize("command", ["pfnm", "fuse"])
@pytest.mark.parametrize("alias, partition", [("homo", "iid"), ("homogeneous", "iid"), ("hetero", "dirichlet")])
def test_partition_aliases_mean_the_same_in_both_commands(command, alias, partition):
    plan = getattr({"pfnm": pfnm, "fuse": fuse}[command], "prepare")(parsed([command, "--partition", alias]))
    parts = plan["partitions"] if command == "pfnm" else [plan["partition"]]
    assert parts[0].partition == partition


def subparser(name):
    return build_parser()._subparsers._group_actions[0].choices[name]


def test_the_same_config_field_has_the_same_flag_in_pfnm_and_fuse():
    flags = {name: {s for a in subparser(name)._actions for s in a.option_strings} for name in ("pfnm", "fuse")}
    from dataclasses import fields

    shared = [f.name for f in fields(TrainingConfig)] + [f.name for f in fields(PartitionConfig)] + [
        "hidden", "fraction", "rounds", "seed", "ece_bins", "dataset", "data_dir", "standardize", "threads", "json",
        "plot", "no_progress"]
    for name in shared:
        flag = "--" + name.replace("_", "-")
        assert flag in flags["pfnm"] and flag in flags["fuse"], flag
    assert "--local-epochs" in flags["fuse"] and "--align" in flags["fuse"]   # fuse: none | match (units matched)
    assert "--arch" in flags["pfnm"] and "--arch" in flags["fuse"]


@pytest.mark.parametrize("command", ["pfnm", "fuse", "demo"])
def test_every_option_has_help_and_a_readable_default(command, capsys):
    parser = subparser(command)
    for action in parser._actions:
        assert action.help, action.option_strings
    text = " ".join(parser.format_help().split())
    if command != "demo":   # the whole help: every flag, every text
        with pytest.raises(SystemExit):
            parser.parse_args(["--help-all"])
        text = " ".join(capsys.readouterr().out.split())
    for noise in ("(default: None)", "(default: (", "(default: [", "(default: True)", "(default: False)"):
        assert noise not in text
    if command != "demo":
        assert " ".join(NPZ_FORMAT.split()) in text
        assert "server_seconds: the server's aggregation time" in text


def test_pfnm_estimates_its_hyper_parameters_by_default_and_shows_and_records_them(tmp_path, capsys):
    out_json = tmp_path / "pfnm.json"
    assert main(["pfnm", *TINY, "--methods", "pfnm", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "PFNM hyper-parameters: empirical Bayes: sigma2 estimated, sigma0_2 estimated, gamma0 estimated" in out
    assert "PFNM hyper-parameters per hidden layer" in out
    payload = check_record(out_json, "pfnm")
    (row,) = payload["results"]["runs"][0]["rows"]
    (layer,) = row["hyperparameters"]
    assert {"mu0", "sigma0_2", "sigma2", "gamma0"} <= set(layer["estimated"])
    assert layer["sigma2_scaled"] > 0 and layer["sigma0_2_scaled"] > 0   # the output coordinates' pair
    assert layer["sigma2"] > 0 and layer["sigma0_2"] > 0 and layer["gamma0"] > 0 and len(layer["mu0"]) > 0
    assert payload["settings"]["pfnm"]["sigma2"] is None


def test_pfnm_at_the_operating_point_prints_and_records_every_candidate(tmp_path, capsys):
    out_json = tmp_path / "pfnm.json"
    assert main(["pfnm", *TINY, "--methods", "pfnm", "--select", "operating-point", "--noise-factors", "2,0.5",
                 "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "PFNM operating point (the narrowest global network within 1 paired standard error(s)" in out
    payload = check_record(out_json, "pfnm")
    run = payload["results"]["runs"][0]
    selection = run["selection"]
    assert selection["by"] == "operating-point" and [c["factor"] for c in selection["curve"]] == [2.0, 1.0, 0.5]
    (chosen,) = [c for c in selection["curve"] if c["chosen"]]
    (row,) = run["rows"]
    assert row["hidden"] == chosen["hidden"] and row["parameters"] == chosen["parameters"]
    assert f"sigma2 {chosen['factor']:g} x its estimate" in row["note"]
    assert payload["settings"]["config"]["noise_factors"] == [2.0, 0.5]


def test_pfnm_rounds_record_the_estimates_of_every_round(tmp_path):
    out_json = tmp_path / "pfnm.json"
    assert main(["pfnm", *TINY, "--methods", "pfnm-rounds", "--rounds", "2", "--round-epochs", "1", "--json",
                 str(out_json)]) == 0
    (row,) = json.loads(out_json.read_text())["results"]["runs"][0]["rows"]
    assert [len(h["hyperparameters"]) for h in row["history"]] == [1, 1]
    assert all(h["hyperparameters"][0]["sigma2"] > 0 for h in row["history"])


def test_a_given_sigma2_is_fixed_and_the_others_estimated(tmp_path):
    out_json = tmp_path / "pfnm.json"
    assert main(["pfnm", *TINY, "--methods", "pfnm", "--sigma2", "0.02", "--json", str(out_json)]) == 0
    (row,) = json.loads(out_json.read_text())["results"]["runs"][0]["rows"]
    (layer,) = row["hyperparameters"]
    assert layer["sigma2"] == 0.02 and "sigma2" not in layer["estimated"] and "sigma0_2" in layer["estimated"]


@pytest.mark.parametrize("arch", ["lenet", "simple-cnn-bn"])
def test_pfnm_runs_a_cnn_with_fedma_beside_it_and_reports_its_widths(arch, tmp_path, capsys):
    out_json = tmp_path / "cnn.json"
    assert main(["pfnm", "--arch", arch, "--clients", "2", "--epochs", "1", "--layerwise-retrain", "1",
                 "--no-progress", "--methods", "local,fedavg-oneshot,kmeans,pfnm,fedma", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert f"J = 2 clients, iid partition, {arch}, 1 local epoch" in out
    rows = {r["method"]: r for r in check_record(out_json, "pfnm")["results"]["runs"][0]["rows"]}
    assert list(rows) == ["local-mean", "local-min", "local-max", "fedavg-oneshot", "kmeans", "pfnm", "fedma"]
    assert rows["local-mean"]["hidden"] == [6, 16, 120, 84]
    assert len(rows["pfnm"]["hidden"]) == 4 and rows["kmeans"]["hidden"] == rows["pfnm"]["hidden"]
    assert len(rows["fedma"]["hyperparameters"]) == 4
    assert all(math.isfinite(r["accuracy"]) and r["parameters"] > 0 for r in rows.values())


def test_pfnm_runs_a_cnn_on_npz_images_stored_as_n_h_w_or_n_c_h_w(tmp_path, capsys):
    rng = np.random.default_rng(0)
    for name, shape in (("gray.npz", (12, 12)), ("colour.npz", (3, 32, 32))):
        np.savez(tmp_path / name, x_train=rng.integers(0, 256, (40, *shape), dtype=np.uint8),
                 y_train=np.arange(40) % 4, x_test=rng.integers(0, 256, (8, *shape), dtype=np.uint8),
                 y_test=np.arange(8) % 4)
        assert main(["pfnm", "--dataset", f"npz:{tmp_path / name}", "--arch", "simple-cnn", "--clients", "2",
                     "--epochs", "1", "--no-progress", "--methods", "fedavg-oneshot,pfnm"]) == 0
        assert "simple-cnn, 1 local epoch" in capsys.readouterr().out


def test_pfnm_global_weights_are_the_average_under_empirical_bayes_unless_told(capsys):
    assert main(["pfnm", *TINY, "--methods", "pfnm"]) == 0
    assert "marginal objective, bottom-up, average global weights" in capsys.readouterr().out
    assert main(["pfnm", *TINY, "--methods", "pfnm", "--global-weights", "posterior-mean"]) == 0
    assert "bottom-up, posterior-mean global weights" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ fuse --align match


def inverted_digits_npz(tmp_path):
    from sklearn.datasets import load_digits
    d = load_digits()
    x = (16 - d.images).astype(np.float32) / 16            # inverted digits: out of distribution
    path = tmp_path / "inverted.npz"
    np.savez(path, x_train=x[:1000], y_train=d.target[:1000], x_test=x[1000:], y_test=d.target[1000:])
    return path


def test_fuse_align_match_has_one_row_per_method_with_the_metrics_that_line_up_across_runs(tmp_path, capsys):
    """Rows ensemble, pfnm, fedavg, <rule> (weight-wise, each client from its own init) and match-<rule>; metrics
    accuracy, nll, ece (100 bins), ece15, brier, auroc_max_prob, auroc_entropy, width."""
    out_json = tmp_path / "match.json"
    assert main(["fuse", "--align", "match", "--clients", "3", "--rounds", "1", "--local-epochs", "2", "--hidden",
                 "16", "--rule", "eaa", "--ood", f"npz:{inverted_digits_npz(tmp_path)}", "--json", str(out_json),
                 "--no-progress", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "matched (hidden units of independently initialised clients)" in out
    for word in ("ece15", "auroc_max_prob", "auroc_entropy", "width", "match-eaa"):
        assert word in out
    payload = check_record(out_json, "fuse")
    assert payload["settings"]["fusion"]["align"] == "match" and payload["settings"]["fusion"]["own_init"]
    rows = {r["method"]: r for r in payload["results"]["runs"][0]["rows"]}
    assert list(rows) == ["ensemble", "pfnm", "fedavg", "eaa", "match-eaa"]
    for row in rows.values():
        for metric in ("accuracy", "nll", "ece", "ece15", "brier", "auroc_max_prob", "auroc_entropy", "width"):
            assert row[metric] is not None and math.isfinite(row[metric]), (row["method"], metric)
    assert rows["match-eaa"]["width"] == sum(rows["match-eaa"]["hidden"]) >= 16


@pytest.mark.parametrize("argv, message", [
    (["--tau2", "0.1"], "--tau2: expected only with --align match, got --align none"),
    (["--matcher-device", "cpu"], "--matcher-device: expected only with --align match, got --align none"),
    (["--align", "match", "--matcher-device", "tpu"], "matcher-device: expected 'cpu' or 'cuda[:N]'"),
    (["--align", "match", "--tau2", "-1"], "tau2"),
    (["--ood", "digits"], "--ood: expected another dataset"),
    (["--ood", "npz:/no/such/file.npz"], "--ood: npz dataset file"),
])
def test_fuse_align_and_ood_flags_are_checked_before_anything_trains(argv, message, capsys):
    assert main(["fuse", "--no-progress"] + argv) == 2
    assert message in capsys.readouterr().err


def test_fuse_refuses_a_cuda_device_before_anything_trains(monkeypatch, capsys):
    """Posterior fusion's SVI runs on the CPU only: --device cuda is an error naming the flag, even where torch sees
    a CUDA device."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(methods, "run_experiment", lambda *a, **k: (_ for _ in ()).throw(AssertionError("trained")))
    assert exit_code(["fuse", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device: expected cpu for posterior fusion" in err, err


def test_the_smallest_images_the_pfnm_help_states_are_those_each_network_takes(capsys):
    from bnpfed.federated.clients import initial_network
    from bnpfed.federated.config import NetworkConfig

    with pytest.raises(SystemExit):
        main(["pfnm", "--help-all"])
    text = " ".join(capsys.readouterr().out.split())
    stated = re.search(r"at least (\d+)x\d+ for lenet, (\d+)x\d+ for the others", text)
    assert stated, text
    for arch in ("lenet", "lenet-paper", "simple-cnn", "simple-cnn-bn"):
        size = int(stated.group(1) if arch == "lenet" else stated.group(2))
        initial_network(NetworkConfig(arch=arch), (1, size, size), 10, seed=0)  # runs at the stated size
        with pytest.raises(ValueError, match="image_size"):
            initial_network(NetworkConfig(arch=arch), (1, size - 1, size - 1), 10, seed=0)


def test_the_tables_say_in_words_how_the_hyper_parameters_were_set_and_what_seconds_count(capsys):
    assert main(["pfnm", *TINY, "--methods", "pfnm", "--hyperparameters", "fixed", "--sigma2", "1", "--sigma0-2", "1",
                 "--gamma0", "1"]) == 0
    out = capsys.readouterr().out
    assert "one shot; hyper-parameters given" in out and "by given" not in out, out
    assert main(["demo", "--clients", "3", "--dim", "5"]) == 0
    out = capsys.readouterr().out
    assert "seconds: the wall time of the matching alone" in out and "the matching's\n" not in out, out


def _result(rows):
    return methods.ExperimentResult(settings={}, rows=rows, client_sizes=[1, 1])


def test_a_one_round_fusion_plot_shows_every_method_including_the_one_shot_ones_and_the_ood_auroc(tmp_path,
                                                                                                 figures):
    row = methods.MethodResult
    rows = [row("ensemble", 0.93, nll=0.3, ece=0.1, brier=0.12, auroc_max_prob=0.8, auroc_entropy=0.82),
            row("pfnm", 0.91, nll=0.31, ece=0.08, brier=0.14, auroc_max_prob=0.7, auroc_entropy=0.71),
            row("eaa", 0.89, nll=0.9, ece=0.4, brier=0.4, mean_sigma=0.013, auroc_max_prob=0.6, auroc_entropy=0.6,
                history=[dict(round=1, accuracy=0.89, nll=0.9, ece=0.4, brier=0.4, mean_sigma=0.013,
                              auroc_max_prob=0.6, auroc_entropy=0.6)])]
    fuse.plot_rounds(_result(rows), tmp_path / "one.png")
    (fig,) = figures
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert "OOD AUROC (max probability)" in titles and "OOD AUROC (entropy)" in titles
    accuracy = next(ax for ax in fig.axes if ax.get_title() == "test accuracy")
    assert [t.get_text() for t in accuracy.get_yticklabels()] == ["ensemble", "pfnm", "eaa"]  # nobody left out
    assert [line.get_xdata()[0] for line in accuracy.lines] == [0.93, 0.91, 0.89]
    assert accuracy.get_xlabel() != "communication round"  # one round: no round axis with fractional ticks


def test_a_fusion_plot_over_rounds_draws_one_shot_rows_as_lines_and_names_a_series_hidden_under_another(tmp_path,
                                                                                                     figures):
    row = methods.MethodResult

    def history(acc):
        return [dict(round=k + 1, accuracy=a, nll=1 - a, ece=0.1, brier=0.2) for k, a in enumerate(acc)]

    rows = [row("ensemble", 0.93, nll=0.07, ece=0.1, brier=0.2),
            row("eaa", 0.9, nll=0.1, ece=0.1, brier=0.2, history=history([0.8, 0.9])),
            row("log_variance", 0.9, nll=0.1, ece=0.1, brier=0.2, history=history([0.8, 0.9000001])),
            row("fedavg", 0.85, nll=0.15, ece=0.1, brier=0.2, history=history([0.7, 0.85]))]
    fuse.plot_rounds(_result(rows), tmp_path / "rounds.png")
    (fig,) = figures
    accuracy = next(ax for ax in fig.axes if ax.get_title() == "test accuracy")
    assert list(accuracy.get_xticks()) == [1, 2]
    labels = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert labels == ["ensemble (one shot)", "eaa", "log_variance (on eaa's points)", "fedavg"]


def test_a_convolutional_pfnm_plot_shows_parameters_not_unit_widths(tmp_path, figures):
    out_json = tmp_path / "cnn.json"
    assert main(["pfnm", "--arch", "lenet", "--clients", "3", "--epochs", "1", "--no-progress", "--methods",
                 "ensemble,pfnm", "--json", str(out_json), "--plot", str(tmp_path / "cnn.png")]) == 0
    rows = check_record(out_json, "pfnm")["results"]["runs"][0]["rows"]
    (fig,) = figures
    _, ax_size = fig.axes
    assert ax_size.get_xlabel() == "global parameters"
    assert [int(bar.get_width()) for bar in ax_size.patches] == [r["parameters"] for r in rows]
    assert all(t.get_text().endswith(("k", "M")) or t.get_text() == "0" for t in ax_size.get_xticklabels())


def test_the_progress_bar_has_a_total_per_phase_rounds_times_clients(capsys):
    assert main(["pfnm", "--clients", "3", "--epochs", "1", "--round-epochs", "2", "--hidden", "16", "--methods",
                 "local,fedavg", "--rounds", "2"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"local models \(1 epoch per fit\): +\d+%.*\| 3/3 ", err), err
    assert re.search(r"fedavg: 2 rounds x 3 clients \(2 epochs per fit\): +\d+%.*\| 6/6 ", err), err
    assert main(["pfnm", "--clients", "3", "--epochs", "1", "--hidden", "16", "--methods", "local", "--no-progress"]) == 0
    assert "local models" not in capsys.readouterr().err  # and it can be turned off


@pytest.mark.parametrize("argv, command", [
    (["demo", "--clients", "3", "--dim", "5"], "demo"),
    (["pfnm", *TINY, "--methods", "local,pfnm,fedavg", "--rounds", "2"], "pfnm"),
    (["pfnm", "--clients", "2,3", "--epochs", "1", "--hidden", "16", "--no-progress", "--methods", "pfnm"], "pfnm"),
    (["pfnm", *TINY, "--width-sweep", "--sweep-sigma2", "0.1", "--sweep-gamma0", "1"], "pfnm"),
    (["fuse", *TINY, "--rounds", "2", "--rule", "eaa"], "fuse"),
    (["flower", "sim", "--local", "--supernodes", "2", "--run-config", 'method="pfnm" rounds=2 hidden="8" epochs=1'],
     "flower sim"),
], ids=["demo", "pfnm", "pfnm-several-J", "pfnm-width-sweep", "fuse", "flower-sim"])
def test_every_commands_json_has_the_one_documented_layout(argv, command, tmp_path):
    if command == "flower sim":
        pytest.importorskip("flwr")
    out = tmp_path / "out.json"
    assert main([*argv, "--json", str(out)]) == 0
    payload = check_record(out, command)
    record = read_record(out)
    assert record.rows and all(isinstance(row, dict) for row in record.rows)
    if "--rounds" in argv or "rounds=2" in " ".join(argv):  # every round of every method, one flat record each
        assert record.rounds and {r["round"] for r in record.rounds} == {1, 2}
        for r in record.rounds:
            row = next(x for x in record.runs[r["run"]]["rows"] if x.get("method") == r["method"])
            assert row["method"] == r["method"]
    else:
        assert payload["results"]["rounds"] == [] or command == "pfnm"


def test_a_record_that_breaks_the_layout_is_refused_naming_the_field(tmp_path):
    good = json.loads(json.dumps(command_record("demo", {}, {}, command_results([{"rows": [{"a": 1}]}]))))
    path = tmp_path / "r.json"
    for change, field in ((lambda p: p["results"].pop("rounds"), "results"),
                          (lambda p: p["results"].update(runs=[]), "results.runs"),
                          (lambda p: p["results"]["runs"][0].pop("rows"), r"results.runs\[0\]"),
                          (lambda p: p.pop("versions"), "keys")):
        payload = json.loads(json.dumps(good))
        change(payload)
        path.write_text(json.dumps(payload))
        with pytest.raises(ValueError, match=field):
            read_record(path)
    with pytest.raises(ValueError, match="results: expected command_results"):
        command_record("demo", {}, {}, {"rows": []})


def test_pfnm_meets_a_width_asked_for_and_says_so(tmp_path, capsys):
    """--max-width on the bundled digits: the global layer has at most that many units, and the row says what the
    limit changed (the model's own width -> the one kept)."""
    out = tmp_path / "r.json"
    assert main(["pfnm", "--methods", "pfnm", "--epochs", "2", "--max-width", "95", "--no-progress",
                 "--json", str(out)]) == 0
    row = [r for r in json.loads(out.read_text())["results"]["runs"][0]["rows"] if r["method"] == "pfnm"][0]
    assert row["hidden"][0] <= 95
    assert "max_width['1'] = 95 met (" in row["note"]
    assert any("max_width['1'] = 95" in n for n in row["hyperparameters"][0]["notes"])


@pytest.mark.parametrize("command, extra", [("pfnm", ["--arch", "simple-cnn", "--methods", "ensemble,pfnm,fedma"]),
                                            ("fuse", ["--arch", "lenet-paper", "--rule", "conflation"])])
def test_cifar10_runs_through_both_commands_from_its_jpeg_container(tmp_path, capsys, command, extra):
    """``--dataset cifar10 --data-dir DIR`` with only the JPEG container in DIR (the shared copy's layout, made here):
    the command says on stderr which it read, trains on 3 x 32 x 32 images, and writes its usual record."""
    from test_data import write_cifar10_jpeg

    write_cifar10_jpeg(tmp_path, n_train=30, n_test=10)
    out_json = tmp_path / f"{command}.json"
    assert main([command, "--dataset", "cifar10", "--data-dir", str(tmp_path), "--clients", "2", "--epochs", "1",
                 "--no-progress", *extra, "--json", str(out_json)]) == 0
    err = capsys.readouterr().err
    assert "cifar10: read from" in err and "JPEG copy" in err
    payload = check_record(out_json, command)
    assert payload["arguments"]["dataset"] == "cifar10"
    rows = payload["results"]["runs"][0]["rows"]
    assert rows and all(0.0 <= r["accuracy"] <= 1.0 for r in rows)
    if command == "pfnm":   # the matched network reads 3-channel 32 x 32 images: conv1 holds 3 x 5 x 5 per channel
        pfnm_row = next(r for r in rows if r["method"] == "pfnm")
        assert pfnm_row["parameters"] > 62_006 // 2


def test_the_deterministic_clients_train_with_sgd_on_request_and_svi_refuses_it(tmp_path, capsys):
    out_json = tmp_path / "sgd.json"
    assert main(["pfnm", *TINY, "--methods", "pfnm", "--optimizer", "sgd", "--momentum", "0.9", "--no-amsgrad",
                 "--json", str(out_json)]) == 0
    training = check_record(out_json, "pfnm")["settings"]["training"]
    assert (training["optimizer"], training["momentum"]) == ("sgd", 0.9)
    assert exit_code(["pfnm", *TINY, "--momentum", "0.9"]) == 2
    assert "--momentum: SGD's momentum; expected None with optimizer='adam'" in capsys.readouterr().err
    # PFNM's reference schedule runs AMSGrad: its default gives way to --optimizer sgd, --amsgrad given does not
    out_default = tmp_path / "sgd-default.json"
    assert main(["pfnm", *TINY, "--methods", "pfnm", "--optimizer", "sgd", "--json", str(out_default)]) == 0
    assert check_record(out_default, "pfnm")["settings"]["training"]["amsgrad"] is False
    assert exit_code(["pfnm", *TINY, "--optimizer", "sgd", "--amsgrad"]) == 2
    assert "--amsgrad: the AMSGrad variant of Adam; expected False with optimizer='sgd'" in capsys.readouterr().err
    assert exit_code(["fuse", *TINY, "--optimizer", "sgd"]) == 2
    assert "optimizer: the variational clients' SVI runs Adam" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["pfnm", "fuse"])
def test_the_clients_train_through_random_crops_on_request(tmp_path, command):
    out_json = tmp_path / "crops.json"
    methods = ["--methods", "pfnm"] if command == "pfnm" else ["--rule", "eaa"]
    assert main([command, *TINY, *methods, "--augment", "crop", "--json", str(out_json)]) == 0
    payload = check_record(out_json, command)
    assert payload["settings"]["training"]["augment"] == "crop"
    plain = tmp_path / "plain.json"
    assert main([command, *TINY, *methods, "--json", str(plain)]) == 0
    rows = lambda path: [r["accuracy"] for r in check_record(path, command)["results"]["runs"][0]["rows"]]
    assert rows(out_json) != rows(plain)
