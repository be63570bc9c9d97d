"""Pre-trained models in, one global model out: bnpfed match, save_global / load_global, bnpfed evaluate."""

import json

import pytest
import torch
from torch.testing import assert_close

import bnpfed
from bnpfed.cli import main
from bnpfed.data import load_dataset
from bnpfed.federated.clients import initial_network, train_network
from bnpfed.federated.config import NetworkConfig, TrainingConfig
from bnpfed.federated.partition import class_counts
from bnpfed.matching import match_by_spec
from bnpfed.metrics import classification_report, count_parameters
from bnpfed.saved import read_global, save_global
from user_networks import UserCNN, UserMixingNet, make_resnet


def trained(make, digits, parts, epochs=3):
    nets = []
    for j, p in enumerate(parts):
        torch.manual_seed(j)
        nets.append(train_network(make(j), digits.x_train[p], digits.y_train[p], TrainingConfig(epochs=epochs),
                                  seed=0, round=1, client=j))
    return nets


def bnpfed_net(arch, digits):
    return lambda j: initial_network(NetworkConfig(arch=arch, hidden=(32,) if arch == "mlp" else None) if arch ==
                                     "mlp" else NetworkConfig(arch=arch), digits.input_shape, 10, seed=0, client=j)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, digits, parts):
    """Each kind's three local models saved the two ways a user has them: whole modules and state dicts."""
    root = tmp_path_factory.mktemp("models")
    kinds = {"mlp": bnpfed_net("mlp", digits), "lenet": bnpfed_net("lenet", digits), "user": lambda j: UserCNN(),
             "resnet": lambda j: make_resnet()}
    for kind, make in kinds.items():
        for j, net in enumerate(trained(make, digits, parts)):
            torch.save(net, root / f"{kind}{j}.pt")
            torch.save(net.state_dict(), root / f"{kind}{j}_state.pt")
    (root / "counts.json").write_text(json.dumps(class_counts(digits.y_train.numpy(), parts, 10).tolist()))
    return root


def files(folder, kind, state=False):
    return [str(folder / f"{kind}{j}{'_state' if state else ''}.pt") for j in range(3)]


@pytest.mark.parametrize("kind", ["mlp", "lenet", "user"])
def test_a_saved_global_network_loads_back_and_predicts_the_same(kind, folder, tmp_path, digits):
    nets = [torch.load(f, weights_only=False) for f in files(folder, kind)]
    match = match_by_spec(nets, torch.ones(3, 10), input_shape=digits.input_shape, seed=0)
    net = match.network().eval()
    path = save_global(tmp_path / "g.pt", net, method="pfnm", spec=match.spec, widths=match.widths,
                       hyperparameters=match.hyperparameters, class_shares=match.class_shares)
    loaded = bnpfed.load_global(path)
    with torch.no_grad():
        assert_close(loaded(digits.x_test), net(digits.x_test), rtol=0, atol=0)
    saved = read_global(path)
    assert saved.widths == match.widths and saved.spec == str(match.spec) and len(saved.class_shares) == 3
    raw = torch.load(path, weights_only=False)  # torch alone reads it: the module, or its state dict
    assert isinstance(raw["module"], torch.nn.Module) and set(raw["state_dict"]) == set(net.state_dict())


@pytest.mark.parametrize("kind, extra", [
    ("mlp", []),
    ("lenet", ["--input-shape", "1,8,8"]),  # a convolutional network's input shape is not in its weights
    ("user", ["--input-shape", "1,8,8"]),
    ("mlp-state", ["--arch", "mlp"]),
    ("lenet-state", ["--arch", "lenet", "--input-shape", "1,8,8"]),
    ("user-state", ["--module", "user_networks:make", "--input-shape", "1,8,8"]),
    ("resnet-state", ["--module", "user_networks:make_resnet", "--input-shape", "1,8,8"]),   # residual: derived
])
def test_bnpfed_match_writes_the_global_network_that_match_by_spec_builds(kind, extra, folder, tmp_path, digits,
                                                                         capsys):
    name, state = kind.split("-")[0], kind.endswith("-state")
    out = tmp_path / "global.pt"
    counts = str(folder / "counts.json")
    assert main(["match", "--heads", "fused", *files(folder, name, state), *extra, "--counts", counts, "--out",
                 str(out), "--json", str(tmp_path / "m.json")]) == 0
    text = capsys.readouterr().out
    assert f"wrote the global network to {out}" in text and "no --counts" not in text
    nets = [torch.load(f, weights_only=False) for f in files(folder, name)]
    expected = match_by_spec(nets, torch.tensor(json.loads((folder / "counts.json").read_text())),
                             input_shape=digits.input_shape, seed=0).network().eval()
    loaded = bnpfed.load_global(out)
    with torch.no_grad():
        assert_close(loaded(digits.x_test), expected(digits.x_test))
    record = json.loads((tmp_path / "m.json").read_text())
    assert record["command"] == "match" and record["results"]["runs"][0]["rows"]


@pytest.mark.parametrize("kind, extra", [("mlp", []), ("user-state", ["--module", "user_networks:make",
                                                                  "--input-shape", "1,8,8"])])
def test_bnpfed_match_heads_pooled_writes_the_matched_body_with_the_clients_pooled_heads(kind, extra, folder, tmp_path,
                                                                                       digits, capsys):
    from bnpfed.matching import pooled_network

    name, state = kind.split("-")[0], kind.endswith("-state")
    out = tmp_path / "pooled.pt"
    counts = torch.tensor(json.loads((folder / "counts.json").read_text()))
    assert main(["match", *files(folder, name, state), *extra, "--counts", str(folder / "counts.json"),
                 "--heads", "pooled", "--out", str(out)]) == 0
    assert "note: --heads pooled: the 3 clients' own output layers" in capsys.readouterr().out
    nets = [torch.load(f, weights_only=False) for f in files(folder, name)]
    match = match_by_spec(nets, counts, input_shape=digits.input_shape, seed=0)
    expected = pooled_network(match, nets)
    saved = read_global(out)
    assert saved.method == "pfnm-pooled" and count_parameters(saved.network) == count_parameters(expected)
    with torch.no_grad():
        assert_close(saved.network(digits.x_test), expected(digits.x_test))
    # a size limit prices the J output layers the pooled network carries: the saved network meets it
    pooled_own = count_parameters(expected)
    limit = (count_parameters(match.network()) + pooled_own) // 2
    assert pooled_own > limit
    assert main(["match", *files(folder, name, state), *extra, "--counts", str(folder / "counts.json"), "--heads",
                 "pooled", "--max-params", str(limit), "--out", str(tmp_path / "limited.pt")]) == 0
    limited = read_global(tmp_path / "limited.pt")
    assert count_parameters(limited.network) <= limit
    assert any(n.startswith("max_params") for n in limited.notes)


def test_bnpfed_match_takes_a_hand_written_spec_from_a_file(folder, tmp_path, capsys):
    """--spec FILE: the spec as JSON (PermutationSpec.to_dict), checked on the networks; here the ResNet's derived
    spec written out gives the derived matching, and a spec that misses an axis or is not JSON is refused by name."""
    from bnpfed.matching import PermutationSpec, derive_spec

    spec = derive_spec(make_resnet(), (1, 8, 8))
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec.to_dict()))
    common = [*files(folder, "resnet", True), "--module", "user_networks:make_resnet", "--input-shape", "1,8,8",
              "--counts", str(folder / "counts.json")]
    assert main(["match", *common, "--spec", str(path), "--show-spec", "--out", str(tmp_path / "a.pt")]) == 0
    assert str(spec) in capsys.readouterr().out
    assert main(["match", *common, "--out", str(tmp_path / "b.pt")]) == 0
    assert "batch norm(s): each global unit keeps the mean of its members' running statistics" in \
        capsys.readouterr().out
    x = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(bnpfed.load_global(tmp_path / "a.pt")(x), bnpfed.load_global(tmp_path / "b.pt")(x))
    broken = spec.to_dict()
    broken["groups"][0]["axes"] = [a for a in broken["groups"][0]["axes"] if a[0] != "layers.0.conv1.weight"]
    path.write_text(json.dumps(broken))
    assert main(["match", *common, "--spec", str(path), "--out", str(tmp_path / "c.pt")]) == 2
    assert "does not describe these networks" in capsys.readouterr().err
    path.write_text(json.dumps({"groups": [{"name": "x", "axes": [["conv.weight", "0"]]}], "kinds": {}}))
    assert main(["match", *common, "--spec", str(path), "--out", str(tmp_path / "c.pt")]) == 2
    assert "--spec.groups[0].axes[0]: expected [param, dim] or [param, dim, block]" in capsys.readouterr().err
    assert PermutationSpec.from_dict(spec.to_dict()) == spec


def test_bnpfed_match_without_counts_estimates_the_class_shares_and_says_so(folder, tmp_path, capsys, digits):
    from bnpfed.matching import derive_spec
    from bnpfed.matching.class_shares import estimate_class_shares

    assert main(["match", *files(folder, "mlp"), "--out", str(tmp_path / "g.pt")]) == 0
    assert "note: no --counts: each client's class shares estimated" in capsys.readouterr().out
    saved = read_global(tmp_path / "g.pt")
    assert saved.class_shares_estimated and any("no --counts" in n for n in saved.notes)
    nets = [torch.load(f, weights_only=False) for f in files(folder, "mlp")]
    estimated = estimate_class_shares(nets, derive_spec(nets[0], digits.input_shape))
    expected = match_by_spec(nets, estimated, input_shape=digits.input_shape, seed=0).network().eval()
    with torch.no_grad():
        assert_close(saved.network(digits.x_test), expected(digits.x_test))
    assert main(["match", *files(folder, "mlp"), "--counts", "uniform", "--out", str(tmp_path / "u.pt")]) == 0
    assert "--counts uniform: every client taken to hold every class equally" in capsys.readouterr().out
    assert not read_global(tmp_path / "u.pt").class_shares_estimated


def reports(nets, digits, parts, spec):
    """Every client's activity report on its own training data, as JSON (what --activity reads)."""
    from bnpfed.matching import unit_activity

    return [{g: a.tolist() for g, a in unit_activity(n, digits.x_train[p], spec).items()} for n, p in zip(nets, parts)]


@pytest.mark.parametrize("kind, extra", [("mlp", []), ("lenet", ["--input-shape", "1,8,8"])])
def test_bnpfed_match_with_the_clients_activity_reports_leaves_their_dead_units_out(kind, extra, folder, tmp_path,
                                                                                   digits, parts, capsys):
    """--activity: the units dead on their client's data join no global unit, exactly as match_by_spec with the
    same reports (PFNMConfig's inactive="drop", bnpfed pfnm's default); without it every unit is matched, and the
    result says so."""
    from bnpfed.matching import derive_spec, kept_units

    nets = [torch.load(f, weights_only=False) for f in files(folder, kind)]
    spec = derive_spec(nets[0], digits.input_shape)
    group = spec.group_names[0]
    with torch.no_grad():   # two units of client 0 made dead on every input: their outputs are 0 after the ReLU
        bias = next(v for k, v in nets[0].state_dict().items() if k.endswith("bias"))
        bias[[1, 4]] = -1e4
    model0 = tmp_path / "dead0.pt"
    torch.save(nets[0], model0)
    report = reports(nets, digits, parts, spec)
    assert report[0][group][1] == report[0][group][4] == 0
    (tmp_path / "activity.json").write_text(json.dumps(report))
    counts = torch.tensor(json.loads((folder / "counts.json").read_text()))
    models = [str(model0), *files(folder, kind)[1:]]
    argv = ["match", "--heads", "fused", *models, *extra, "--counts", str(folder / "counts.json")]
    assert main([*argv, "--activity", str(tmp_path / "activity.json"), "--out", str(tmp_path / "a.pt")]) == 0
    text = capsys.readouterr().out
    dead = sum(int((torch.tensor(v) == 0).sum()) for r in report for v in r.values())
    assert f"--activity: {dead} unit(s) dead on their client's data left out before matching" in text
    activity = [{g: torch.tensor(v, dtype=torch.float64) for g, v in r.items()} for r in report]
    expected = match_by_spec(nets, counts, input_shape=digits.input_shape, seed=0, activity=activity)
    assert expected.kept_units[0][group].numel() == kept_units(activity[0], spec)[group].numel() <= \
        nets[0].state_dict()[next(k for k in nets[0].state_dict() if k.endswith("bias"))].numel() - 2
    saved = read_global(tmp_path / "a.pt")
    assert saved.widths == expected.widths
    with torch.no_grad():
        assert_close(saved.network(digits.x_test), expected.network().eval()(digits.x_test))
    assert main([*argv, "--out", str(tmp_path / "b.pt")]) == 0
    assert "no --activity: every unit matched, dead ones included" in capsys.readouterr().out
    everything = match_by_spec(nets, counts, input_shape=digits.input_shape, seed=0)
    assert read_global(tmp_path / "b.pt").widths == everything.widths
    assert any(not torch.equal(a, b) for a, b in zip(everything.assignments[group], expected.assignments[group]))


@pytest.fixture
def bad(folder, tmp_path):
    (tmp_path / "text.pt").write_text("not a model")
    torch.save([1, 2], tmp_path / "list.pt")
    nan = torch.load(folder / "mlp0_state.pt")
    next(v for v in nan.values() if v.dim() == 2)[0, 0] = float("nan")
    torch.save(nan, tmp_path / "nan.pt")
    for j in range(3):
        torch.save(UserMixingNet(), tmp_path / f"mixing{j}.pt")
    (tmp_path / "counts_short.json").write_text(json.dumps([[1] * 10] * 2))
    good = {"1": [1.0] * 32}   # the MLP's one hidden group, "1" (its first Linear's index)
    for name, value in (("short", [good] * 2), ("groups", [{"x": [1.0] * 32}] * 3), ("units", [{"1": [1.0] * 31}] * 3),
                        ("negative", [{"1": [-1.0] * 32}] * 3), ("strings", [{"1": ["a"] * 32}] * 3)):
        (tmp_path / f"activity_{name}.json").write_text(json.dumps(value))
    (tmp_path / "activity_text.json").write_text("not json")
    (tmp_path / "counts_negative.json").write_text(json.dumps([[1] * 9 + [-1]] * 3))
    nine = torch.load(folder / "mlp0.pt", weights_only=False)   # one class fewer: its last output row dropped
    nine[-1] = torch.nn.Linear(nine[-1].in_features, 9)
    torch.save(nine, tmp_path / "nine.pt")
    tanh = torch.load(folder / "mlp0.pt", weights_only=False)   # the same weights behind another activation
    tanh[2] = torch.nn.Tanh()
    torch.save(tanh, tmp_path / "tanh.pt")
    return tmp_path


@pytest.mark.parametrize("argv, message", [
    (lambda f, b: [str(b / "text.pt"), *files(f, "mlp")[1:]], r"MODEL: .*text\.pt' is not a file torch\.save wrote"),
    (lambda f, b: [str(b / "list.pt"), *files(f, "mlp")[1:]], r"MODEL: expected a network .* got list"),
    (lambda f, b: [str(b / "missing.pt"), *files(f, "mlp")[1:]], r"MODEL: .*does not exist"),
    (lambda f, b: files(f, "mlp")[:1], r"MODEL: expected at least two"),
    (lambda f, b: [*files(f, "mlp")[:2], files(f, "lenet")[2]], r"MODEL: .* is another architecture"),
    (lambda f, b: [*files(f, "mlp")[:2], files(f, "mlp", True)[2]], r"MODEL: expected every file to hold the same"),
    (lambda f, b: [str(b / "nan.pt"), *files(f, "mlp", True)[1:], "--arch", "mlp"], r"MODEL: .* NaN"),
    (lambda f, b: [*files(f, "mlp"), "--arch", "mlp"], r"--arch: expected only with state-dict files"),
    (lambda f, b: files(f, "mlp", True), r"--arch: expected --arch or --module"),
    (lambda f, b: [*files(f, "lenet", True), "--arch", "lenet"], r"--input-shape: expected the shape of one input"),
    (lambda f, b: [*files(f, "mlp"), "--counts", str(b / "counts_short.json")], r"--counts: expected a 3 x 10 table"),
    (lambda f, b: [*files(f, "mlp"), "--counts", str(b / "counts_negative.json")], r"--counts: expected a 3 x 10"),
    (lambda f, b: [*files(f, "user", True), "--module", "user_networks:nothing", "--input-shape", "1,8,8"],
     r"--module: cannot import"),
    (lambda f, b: [*files(f, "mlp"), "--sigma2", "0.1,0.2"], r"--sigma2"),
    (lambda f, b: [*files(f, "mlp"), "--activity", str(b / "activity_short.json")],
     r"--activity: expected a JSON list of 3 reports .* got list of length 2"),
    (lambda f, b: [*files(f, "mlp"), "--activity", str(b / "activity_text.json")],
     r"--activity: expected a JSON file of 3 reports"),
    (lambda f, b: [*files(f, "mlp"), "--activity", str(b / "activity_groups.json")],
     r"--activity: activity\[0\]: expected a mapping with one \(L,\) tensor per group \['1'\].*groups of the spec: 1"),
    (lambda f, b: [*files(f, "mlp"), "--activity", str(b / "activity_units.json")],
     r"--activity: activity\[0\]\['1'\]: expected 32 activities"),
    (lambda f, b: [*files(f, "mlp"), "--activity", str(b / "activity_negative.json")],
     r"--activity: activity\[0\]\['1'\]: expected a 1-d tensor of finite activities >= 0"),
    (lambda f, b: [*files(f, "mlp"), "--activity", str(b / "activity_strings.json")],
     r"--activity: report 0 .* group '1': expected a list of numbers"),
    (lambda f, b: [str(b / f"mixing{j}.pt") for j in range(3)], r"MODEL: cannot match these networks: .*cumsum"),
    (lambda f, b: [*files(f, "mlp")[:2], str(b / "nine.pt")],
     r"MODEL: '.*nine\.pt' has 9 output classes \(3\.weight\) and '.*mlp0\.pt' 10; expected clients of one set"),
    (lambda f, b: [*files(f, "mlp")[:2], str(b / "tanh.pt")],
     r"MODEL: '.*tanh\.pt' is another architecture than .*: its module 2 is a Tanh, not a ReLU"),
    (lambda f, b: [*files(f, "lenet"), "--input-shape", "3,8,8"],
     r"--input-shape: expected the shape of an input net runs on, got \(3, 8, 8\), on which a forward pass failed "
     r"\(RuntimeError: Given groups=1"),
])
def test_bad_input_to_bnpfed_match_is_named_before_any_matching(argv, message, folder, bad, capsys, monkeypatch):
    import bnpfed.matching as inference

    called = []
    if message != "--sigma2":
        monkeypatch.setattr(inference, "match_by_spec", lambda *a, **k: called.append(1))
    assert main(["match", *argv(folder, bad), "--out", str(bad / "g.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bnpfed match: error: ") and err.count("\n") == 1, err
    import re
    assert re.search(message, err), err
    assert not called and not (bad / "g.pt").exists()


def test_bnpfed_evaluate_reports_the_loaded_networks_metrics(folder, tmp_path, digits, capsys):
    out = tmp_path / "g.pt"
    assert main(["match", *files(folder, "lenet"), "--input-shape", "1,8,8", "--out", str(out)]) == 0
    assert main(["evaluate", str(out), "--dataset", "digits", "--json", str(tmp_path / "e.json")]) == 0
    (row,) = json.loads((tmp_path / "e.json").read_text())["results"]["runs"][0]["rows"]
    with torch.no_grad():
        expected = classification_report(bnpfed.load_global(out)(digits.x_test).softmax(-1).double(),
                                         digits.y_test, n_bins=15)
    for key, value in expected.items():
        assert row[key] == pytest.approx(value, rel=1e-9), key
    assert main(["evaluate", str(folder / "counts.json"), "--dataset", "digits"]) == 2
    assert "MODEL:" in capsys.readouterr().err


def test_bnpfed_pfnm_save_global_writes_every_global_network_its_methods_built(tmp_path, capsys):
    out, folder = tmp_path / "pfnm.json", tmp_path / "globals"
    methods = ["pfnm", "kmeans", "fedavg-oneshot", "fedavg", "pfnm-rounds"]
    assert main(["pfnm", "--clients", "3", "--epochs", "1", "--round-epochs", "1", "--hidden", "16", "--rounds", "2",
                 "--no-progress", "--methods", ",".join(["local", *methods]), "--json", str(out),
                 "--save-global", str(folder)]) == 0
    assert f"wrote 5 global models to {folder}" in capsys.readouterr().out
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]["runs"][0]["rows"]}
    digits = load_dataset("digits", standardize=False)  # as bnpfed pfnm feeds them
    for method in methods:
        saved = read_global(folder / f"{method}.pt")
        assert saved.method == method
        with torch.no_grad():
            accuracy = float((saved.network(digits.x_test).argmax(-1) == digits.y_test).double().mean())
        assert accuracy == pytest.approx(rows[method]["accuracy"], abs=1e-9), method  # the network the row scored
        assert sum(p.numel() for p in saved.network.parameters()) == rows[method]["parameters"]
    assert read_global(folder / "pfnm.pt").widths and read_global(folder / "pfnm.pt").spec


def test_save_global_is_refused_where_no_network_is_kept(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["pfnm", "--width-sweep", "--save-global", str(tmp_path)]) == 2
    assert "--save-global: expected only without --width-sweep" in capsys.readouterr().err
    assert main(["pfnm", "--save-global", str(tmp_path / "file")]) == 2
    assert "--save-global: expected a folder" in capsys.readouterr().err


def test_bnpfed_evaluate_adds_the_ood_auroc_with_another_dataset(folder, tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    ood = tmp_path / "noise.npz"
    np.savez(ood, x_train=rng.random((20, 1, 8, 8)).astype(np.float32), y_train=np.arange(20) % 2,
             x_test=rng.random((30, 1, 8, 8)).astype(np.float32), y_test=np.arange(30) % 2)
    out = tmp_path / "g.pt"
    assert main(["match", *files(folder, "mlp"), "--out", str(out)]) == 0
    assert main(["evaluate", str(out), "--dataset", "digits", "--ood", f"npz:{ood}", "--json",
                 str(tmp_path / "e.json")]) == 0
    (row,) = json.loads((tmp_path / "e.json").read_text())["results"]["runs"][0]["rows"]
    assert 0.5 < row["auroc_max_prob"] <= 1 and 0.5 < row["auroc_entropy"] <= 1  # noise is told apart
    assert main(["evaluate", str(out), "--dataset", "digits", "--ood-data-dir", str(tmp_path)]) == 2


def test_bnpfed_match_reads_global_network_files_bnpfed_wrote(folder, tmp_path, digits):
    """Files of save_global (e.g. global networks of two federations) are networks to match like any other."""
    nets = [torch.load(f, weights_only=False) for f in files(folder, "mlp")]
    paths = [str(save_global(tmp_path / f"g{j}.pt", net, method="pfnm")) for j, net in enumerate(nets)]
    assert main(["match", *paths, "--counts", "uniform", "--out", str(tmp_path / "a.pt")]) == 0
    assert main(["match", *files(folder, "mlp"), "--counts", "uniform", "--out", str(tmp_path / "b.pt")]) == 0
    with torch.no_grad():
        assert torch.equal(bnpfed.load_global(tmp_path / "a.pt")(digits.x_test),
                           bnpfed.load_global(tmp_path / "b.pt")(digits.x_test))


def test_bnpfed_match_meets_a_parameter_budget_for_a_users_own_cnn(folder, tmp_path, capsys, digits):
    """A user's own conv net (not built by bnpfed), trained on the digits: --max-params ensemble gives a global
    network no larger than the three together, the match by_spec builds with that limit, and the note says what it
    cost."""
    nets = [torch.load(f, weights_only=False) for f in files(folder, "user")]
    ensemble = sum(count_parameters(n) for n in nets)
    own = match_by_spec(nets, torch.ones(3, 10), input_shape=digits.input_shape, seed=0)
    assert own.parameters > ensemble          # the model's own global network is larger than what it replaces
    out = tmp_path / "small.pt"
    assert main(["match", *files(folder, "user"), "--input-shape", "1,8,8", "--counts", "uniform",
                 "--max-params", "ensemble", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "note: max_params = " in text
    loaded = bnpfed.load_global(out)
    assert count_parameters(loaded) <= ensemble
    expected = match_by_spec(nets, torch.ones(3, 10), input_shape=digits.input_shape, seed=0,
                             max_params="ensemble").network().eval()
    with torch.no_grad():
        assert_close(loaded(digits.x_test), expected(digits.x_test))
    assert main(["match", *files(folder, "user"), "--input-shape", "1,8,8", "--max-width", "1",
                 "--out", str(tmp_path / "x.pt")]) == 2
    assert "--max-width" in capsys.readouterr().err


def test_bnpfed_match_on_the_matcher_device_writes_the_numpy_paths_network(folder, tmp_path, digits, capsys):
    """``--matcher-device cpu`` (torch on the CPU, the code a GPU runs) writes the network the numpy matcher builds;
    a device torch cannot use is refused, naming the flag."""
    counts = str(folder / "counts.json")
    for name, device in (("numpy.pt", []), ("torch.pt", ["--matcher-device", "cpu"])):
        assert main(["match", *files(folder, "lenet"), "--input-shape", "1,8,8", "--counts", counts,
                     "--out", str(tmp_path / name), *device]) == 0
    with torch.no_grad():
        assert_close(bnpfed.load_global(tmp_path / "torch.pt")(digits.x_test),
                     bnpfed.load_global(tmp_path / "numpy.pt")(digits.x_test), rtol=1e-5, atol=1e-6)
    capsys.readouterr()
    assert main(["match", *files(folder, "mlp"), "--matcher-device", "tpu", "--out", str(tmp_path / "x.pt")]) == 2
    assert "--matcher-device: expected 'cpu' or 'cuda[:N]'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ preprocessing


def test_a_model_saved_after_pfnm_on_raw_pixels_evaluates_to_the_runs_accuracy_with_the_defaults(tmp_path, capsys):
    """bnpfed pfnm trains on pixels in [0, 1]; its file says so, and bnpfed evaluate, told nothing, scores the model
    on the inputs it was trained on: the run's own accuracy and NLL. A flag that contradicts the file is refused."""
    run, folder = tmp_path / "pfnm.json", tmp_path / "globals"
    assert main(["pfnm", "--clients", "3", "--epochs", "1", "--hidden", "16", "--no-progress", "--methods", "pfnm",
                 "--json", str(run), "--save-global", str(folder)]) == 0
    (row,) = json.loads(run.read_text())["results"]["runs"][0]["rows"]
    saved = read_global(folder / "pfnm.pt")
    assert saved.inputs == load_dataset("digits", standardize=False).preprocessing()
    assert not saved.inputs.standardized and saved.inputs.classes == tuple("0123456789")
    capsys.readouterr()
    assert main(["evaluate", str(folder / "pfnm.pt"), "--json", str(tmp_path / "e.json")]) == 0
    out, err = capsys.readouterr()
    assert "not standardised" in out and "note" not in err
    (scored,) = json.loads((tmp_path / "e.json").read_text())["results"]["runs"][0]["rows"]
    assert scored["accuracy"] == pytest.approx(row["accuracy"], abs=1e-12)
    assert scored["nll"] == pytest.approx(row["nll"], rel=1e-9)
    assert main(["evaluate", str(folder / "pfnm.pt"), "--standardize"]) == 2
    assert "--standardize: expected it left out or as the file records" in capsys.readouterr().err
    assert main(["evaluate", str(folder / "pfnm.pt"), "--no-standardize"]) == 0   # what the file says: accepted


def test_a_file_that_records_no_preprocessing_is_scored_standardised_with_a_note(folder, tmp_path, capsys):
    out = tmp_path / "g.pt"
    assert main(["match", *files(folder, "mlp"), "--out", str(out)]) == 0   # plain modules: nothing to record
    assert read_global(out).inputs is None
    capsys.readouterr()
    assert main(["evaluate", str(out)]) == 0
    assert "does not record how its model's inputs were prepared" in capsys.readouterr().err
    assert main(["evaluate", str(out), "--no-standardize"]) == 0   # told: no note
    assert "note" not in capsys.readouterr().err


def test_evaluate_refuses_data_the_recorded_model_cannot_take_and_notes_another_dataset(tmp_path, capsys):
    import numpy as np

    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    digits = load_dataset("digits")
    path = save_global(tmp_path / "g.pt", net, method="pfnm", inputs=digits)
    rng = np.random.default_rng(0)
    for name, shape, classes in (("other", (1, 8, 8), 10), ("wide", (1, 6, 6), 10), ("three", (1, 8, 8), 3)):
        np.savez(tmp_path / f"{name}.npz", x_train=rng.random((30, *shape)).astype(np.float32),
                 y_train=np.arange(30) % classes, x_test=rng.random((20, *shape)).astype(np.float32),
                 y_test=np.arange(20) % classes)
    capsys.readouterr()
    assert main(["evaluate", str(path), "--dataset", f"npz:{tmp_path / 'other.npz'}"]) == 0
    err = capsys.readouterr().err
    assert "note: the model was trained on digits" in err and "prepared as the model's were" in err
    assert main(["evaluate", str(path), "--dataset", f"npz:{tmp_path / 'wide.npz'}"]) == 2
    assert "--dataset: expected data the model" in capsys.readouterr().err
    assert main(["evaluate", str(path), "--dataset", f"npz:{tmp_path / 'three.npz'}"]) == 2
    assert "3 classes, the model has 10" in capsys.readouterr().err


def test_load_global_refuses_a_dataset_prepared_otherwise_than_the_models_training_inputs(tmp_path):
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    raw = load_dataset("digits", standardize=False)
    path = save_global(tmp_path / "g.pt", net, method="pfnm", inputs=raw)
    assert bnpfed.load_global(path, dataset=raw) is not None
    with pytest.raises(ValueError, match=r"dataset: expected inputs prepared as the model's .*standardised with mean"):
        bnpfed.load_global(path, dataset=load_dataset("digits"))
    again = read_global(path).inputs.load()   # the dataset prepared the model's way
    assert torch.equal(again.x_test, raw.x_test) and again.preprocessing() == raw.preprocessing()
    standardised = save_global(tmp_path / "s.pt", net, method="pfnm", inputs=load_dataset("digits"))
    assert torch.equal(read_global(standardised).inputs.load().x_test, load_dataset("digits").x_test)
    with pytest.raises(ValueError, match="inputs: expected a bnpfed.data.Preprocessing"):
        save_global(tmp_path / "x.pt", net, method="pfnm", inputs="digits")


def test_bnpfed_match_carries_the_clients_recorded_preprocessing_and_refuses_clients_prepared_otherwise(
        folder, tmp_path, capsys):
    nets = [torch.load(f, weights_only=False) for f in files(folder, "mlp")]
    digits, raw = load_dataset("digits"), load_dataset("digits", standardize=False)
    paths = [str(save_global(tmp_path / f"c{j}.pt", net, method="local", inputs=digits)) for j, net in enumerate(nets)]
    assert main(["match", *paths, "--counts", "uniform", "--out", str(tmp_path / "g.pt")]) == 0
    assert read_global(tmp_path / "g.pt").inputs == digits.preprocessing()
    save_global(paths[1], nets[1], method="local", inputs=raw)
    capsys.readouterr()
    assert main(["match", *paths, "--counts", "uniform", "--out", str(tmp_path / "h.pt")]) == 2
    assert "expected clients whose inputs were prepared alike" in capsys.readouterr().err


def test_bnpfed_match_refuses_an_out_path_that_is_one_of_its_model_files(folder, tmp_path, capsys):
    import shutil

    paths = [shutil.copy(f, tmp_path) for f in files(folder, "mlp")]
    before = open(paths[1], "rb").read()
    assert main(["match", *paths, "--out", paths[1]]) == 2
    assert "--out: expected a path other than the MODEL files" in capsys.readouterr().err
    assert open(paths[1], "rb").read() == before



def test_bnpfed_match_warns_when_an_activity_report_has_a_group_dead_at_every_client(folder, tmp_path, capsys):
    (tmp_path / "dead.json").write_text(json.dumps([{"1": [0.0] * 32}] * 3))
    assert main(["match", *files(folder, "mlp"), "--activity", str(tmp_path / "dead.json"), "--counts", "uniform",
                 "--out", str(tmp_path / "g.pt")]) == 0
    out, err = capsys.readouterr()
    assert "warning: --activity: warning: group '1' is dead at every client" in err
    assert any("dead at every client" in n for n in read_global(tmp_path / "g.pt").notes)
    (tmp_path / "one.json").write_text(json.dumps([{"1": [0.0] * 32}] + [{"1": [1.0] * 32}] * 2))
    assert main(["match", *files(folder, "mlp"), "--activity", str(tmp_path / "one.json"), "--counts", "uniform",
                 "--out", str(tmp_path / "h.pt")]) == 0
    out, err = capsys.readouterr()
    assert "note: --activity: group '1' is dead at client(s) 0" in out and "warning" not in err


def test_match_by_spec_refuses_networks_of_another_kind_naming_the_module():
    relu = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 8), torch.nn.ReLU(), torch.nn.Linear(8, 10))
    tanh = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 8), torch.nn.Tanh(), torch.nn.Linear(8, 10))
    with pytest.raises(ValueError, match=r"client_nets\[1\]: expected a network of the first's kind, got one whose "
                                         r"module 2 is a Tanh, not a ReLU"):
        match_by_spec([relu, tanh], seed=0)


def test_bnpfed_match_pools_the_heads_by_default_when_the_counted_class_shares_differ(folder, tmp_path, capsys):
    """--heads auto (the default): the label-skewed clients' counts differ (pooled, as --heads pooled writes it);
    uniform counts agree (fused); without counts the estimated shares are not tested (fused, and the note says
    how to pool)."""
    counts = str(folder / "counts.json")
    assert main(["match", *files(folder, "mlp"), "--counts", counts, "--out", str(tmp_path / "auto.pt")]) == 0
    assert "--heads auto: pooled (the clients' class counts differ: chi-squared" in capsys.readouterr().out
    assert main(["match", *files(folder, "mlp"), "--counts", counts, "--heads", "pooled",
                 "--out", str(tmp_path / "pooled.pt")]) == 0
    auto, pooled = read_global(tmp_path / "auto.pt"), read_global(tmp_path / "pooled.pt")
    assert auto.method == pooled.method == "pfnm-pooled"
    for a, b in zip(auto.network.state_dict().values(), pooled.network.state_dict().values()):
        assert torch.equal(a, b)
    assert main(["match", *files(folder, "mlp"), "--counts", "uniform", "--out", str(tmp_path / "u.pt")]) == 0
    assert "--heads auto: fused (the clients' class counts agree" in capsys.readouterr().out
    assert read_global(tmp_path / "u.pt").method == "pfnm"
    assert main(["match", *files(folder, "mlp"), "--out", str(tmp_path / "e.pt")]) == 0
    assert "--heads auto: fused (without --counts the class shares are estimated" in capsys.readouterr().out
