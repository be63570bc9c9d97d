"""Inactive units reported by the clients and left out of matching: a unit dead on a client's data contributes
nothing, so the client's network without it computes the same; matching then never sees it."""

import pytest
import torch
from torch import nn

from bnpfed.matching import derive_spec, match_by_spec
from bnpfed.matching.activity import drop_units, inactive_units, kept_units, unit_activity


def _mlp_with_dead_units(seed=0):
    g = torch.Generator().manual_seed(seed)
    net = nn.Sequential(nn.Flatten(), nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 3))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        net[1].bias[[2, 5]] = -100.0     # never above 0 on inputs of this size: dead
        net[3].bias[1] = -100.0
    return net


def _cnn_with_dead_channels():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 5, 3),
                        nn.ReLU(), nn.Flatten(), nn.Linear(5 * 2 * 2, 6), nn.ReLU(), nn.Linear(6, 3))
    with torch.no_grad():
        net[1].bias[3] = -100.0          # batch-norm shift: channel 3 of conv 0 never fires
        net[4].bias[0] = -100.0
        net[7].bias[4] = -100.0
    return net.eval()


def test_activity_is_each_units_largest_output_on_the_clients_data():
    net = _mlp_with_dead_units()
    x = torch.randn(50, 6)
    spec = derive_spec(net, (6,))
    a = unit_activity(net, x, spec, batch_size=7)
    h1 = torch.relu(net[1](x))
    h2 = torch.relu(net[3](h1))
    assert torch.allclose(a["1"], h1.amax(0).double())
    assert torch.allclose(a["3"], h2.amax(0).double())
    dead = inactive_units(a)
    assert dead["1"].nonzero().flatten().tolist() == [2, 5]
    assert dead["3"].nonzero().flatten().tolist() == [1]


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_a_network_without_its_inactive_units_computes_the_same_on_that_data(kind):
    net = _mlp_with_dead_units() if kind == "mlp" else _cnn_with_dead_channels()
    shape = (6,) if kind == "mlp" else (1, 10, 10)
    x = torch.randn(40, *shape)
    spec = derive_spec(net, shape)
    kept = kept_units(unit_activity(net, x, spec), spec)
    small = drop_units(net, spec, kept).eval()
    forced = {"mlp": {"1": [2, 5], "3": [1]}, "cnn": {"0": [3], "4": [0], "7": [4]}}[kind]
    for g, units in forced.items():
        assert not set(units) & set(kept[g].tolist())
    with torch.no_grad():
        assert torch.allclose(small(x), net.eval()(x), atol=1e-6, rtol=0)
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in net.parameters())


def test_matching_leaves_the_reported_inactive_units_out():
    nets = [_mlp_with_dead_units(seed) for seed in range(3)]
    x = torch.randn(30, 6)
    spec = derive_spec(nets[0], (6,))
    reports = [unit_activity(n, x, spec) for n in nets]
    counts = [[5, 3, 2], [2, 5, 3], [3, 2, 5]]
    match = match_by_spec(nets, counts, spec, seed=0, activity=reports)
    kept = [kept_units(r, spec) for r in reports]
    direct = match_by_spec([drop_units(n, spec, k) for n, k in zip(nets, kept)], counts, spec, seed=0)
    assert match.widths == direct.widths
    for g in match.assignments:
        for a, b, k in zip(match.assignments[g], direct.assignments[g], kept):
            assert torch.equal(a, b)
            assert a.numel() == k[g].numel() <= {"1": 6, "3": 4}[g]
    for k, v in match.state.items():
        assert torch.equal(v, direct.state[k])
    assert [{g: t.tolist() for g, t in k.items()} for k in match.kept_units] == \
        [{g: t.tolist() for g, t in k.items()} for k in kept]
    # a warm start is given over every unit and follows the drop
    again = match_by_spec(nets, counts, spec, seed=0, activity=reports,
                          warm_start={g: [torch.arange(8 if g == "1" else 5)] * 3 for g in ("1", "3")},
                          hyperparameters="fixed", sigma2=1.0, sigma0_2=1.0, gamma0=1.0)
    assert [a.numel() for a in again.assignments["1"]] == [k["1"].numel() for k in kept]


def test_a_bad_activity_report_is_refused_before_any_work():
    nets = [_mlp_with_dead_units(seed) for seed in range(2)]
    spec = derive_spec(nets[0], (6,))
    report = unit_activity(nets[0], torch.randn(5, 6), spec)
    with pytest.raises(ValueError, match="activity: expected None or one report per client"):
        match_by_spec(nets, None, spec, activity=[report])
    with pytest.raises(ValueError, match=r"activity\[1\]\['1'\]: expected 8 activities"):
        match_by_spec(nets, None, spec, activity=[report, {"1": torch.ones(7).double(), "3": torch.ones(5).double()}])
    with pytest.raises(ValueError, match=r"activity\[0\]: expected a mapping with one"):
        match_by_spec(nets, None, spec, activity=[{"1": report["1"]}, report])
    with pytest.raises(ValueError, match="inputs: expected a tensor"):
        unit_activity(nets[0], [1.0, 2.0], spec)


def test_a_flower_client_sends_its_activity_as_metrics_and_the_server_reads_it_back():
    pytest.importorskip("flwr")
    from bnpfed.flower.records import ReplyError, activity_metrics, read_activity

    net = _mlp_with_dead_units()
    spec = derive_spec(net, (6,))
    report = unit_activity(net, torch.randn(20, 6), spec)
    back = read_activity(activity_metrics(report), spec.group_names)
    assert all(torch.equal(back[g], report[g]) for g in spec.group_names)
    with pytest.raises(ReplyError, match="'activity:3': expected a list of the units' activities"):
        read_activity({"activity:1": [1.0, 0.0]}, spec.group_names)
    with pytest.raises(ReplyError, match="'activity:1'"):
        read_activity({"activity:1": [1.0, -1.0], "activity:3": [0.0]}, spec.group_names)


def _experiment(select: str, inactive: str):
    from bnpfed.data import load_dataset
    from bnpfed.experimental import ExperimentalOptions
    from bnpfed.federated import ExperimentConfig, PartitionConfig, PFNMConfig, TrainingConfig
    from bnpfed.federated.experiment import Experiment

    return Experiment(load_dataset("digits"), partition=PartitionConfig(clients=3),
                      training=TrainingConfig(epochs=1), pfnm=PFNMConfig(experimental=ExperimentalOptions(
                          inactive=inactive)), config=ExperimentConfig(methods=("pfnm",), select=select, seed=0))


def _nets_with_a_unit_that_fires_on_held_out_inputs_only(experiment):
    """Per client an MLP 64-8-10 whose unit 0 fires on some of its held-out inputs and on none of its training
    inputs (a random direction whose largest value over the held-out split exceeds that over the training split,
    the bias set between the two), every other unit from a random draw."""
    g = torch.Generator().manual_seed(3)
    nets = []
    for (x, _), held in zip(experiment.client_data, experiment.validation_parts):
        x_held = experiment.dataset.x_train[torch.as_tensor(held)]
        net = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10))
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            while True:
                w = torch.randn(64, generator=g)
                train_max, held_max = float((x.flatten(1) @ w).max()), float((x_held.flatten(1) @ w).max())
                if held_max > train_max + 1e-3:
                    break
            net[1].weight[0] = w
            net[1].bias[0] = -(train_max + held_max) / 2
        nets.append(net)
    return nets


@pytest.mark.parametrize("select", ["federated", "operating-point"])
def test_a_unit_is_left_out_only_if_inactive_on_the_clients_held_out_inputs_too(select, monkeypatch):
    """Under ``inactive="drop"`` a client's report is its units' largest activity over its training and its
    held-out inputs (a unit silent on its training data that fires on held-out data is kept); under
    ``"drop-train"`` over its training inputs alone (the rule before issue 53), which leaves that unit out."""
    from bnpfed.federated import unit_activity_step

    reports = {}
    for inactive in ("drop", "drop-train", "keep"):
        experiment = _experiment(select, inactive)
        nets = _nets_with_a_unit_that_fires_on_held_out_inputs_only(experiment)
        monkeypatch.setattr(experiment, "local_models", lambda shared=None, nets=nets: nets)
        reports[inactive] = experiment.activity()
        assert all(len(h) for h in experiment.validation_parts)
    assert reports["keep"] is None
    shape = experiment.input_shape
    spec = derive_spec(nets[0], shape)
    for j, ((x, _), held) in enumerate(zip(experiment.client_data, experiment.validation_parts)):
        train = unit_activity_step(nets[j], x, shape)
        other = unit_activity_step(nets[j], experiment.dataset.x_train[torch.as_tensor(held)], shape)
        assert torch.equal(reports["drop-train"][j]["1"], train["1"])
        assert torch.equal(reports["drop"][j]["1"], torch.maximum(train["1"], other["1"]))
        assert train["1"][0] == 0 < other["1"][0]
        assert 0 in kept_units(reports["drop"][j], spec)["1"].tolist()
        assert 0 not in kept_units(reports["drop-train"][j], spec)["1"].tolist()


def test_without_a_held_out_split_drop_reads_the_training_inputs():
    experiment = _experiment("none", "drop")
    assert all(len(h) == 0 for h in experiment.validation_parts)
    nets = [nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10)) for _ in range(3)]
    experiment.local_models = lambda shared=None: nets
    for net, report, (x, _) in zip(nets, experiment.activity(), experiment.client_data):
        assert torch.equal(report["1"], unit_activity(net, x, derive_spec(net, experiment.input_shape))["1"])
