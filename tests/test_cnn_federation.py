"""PFNM and FedMA federations of convolutional networks (LeNet, FedMA's simple CNN with batch norm) on the bundled
digits: rounds that finish with finite numbers and a global network of the matched widths, permuted copies matched
back exactly through the federated path, and FedMA's layer-wise retraining touching only the layers above the matched
ones."""

import copy
import math

import numpy as np
import pytest
import torch

from bnpfed.data import load_dataset
from bnpfed.federated import pfnm as pfnm_module
from bnpfed.federated.clients import initial_network, train_network
from bnpfed.federated.config import NetworkConfig, PartitionConfig, PFNMConfig, TrainingConfig
from bnpfed.federated.methods import network_widths
from bnpfed.federated.pfnm import PFNMFederation
from bnpfed.federated.server import client_start, matched_parameters
from bnpfed.matching.permutation import client_slice, network_from_state, reestimate_batch_norm
from bnpfed.metrics import count_parameters
from bnpfed.experimental import ExperimentalOptions

TRAIN = TrainingConfig(epochs=1, round_epochs=1)
#: A matcher that merges only identical units: the clients' permuted copies come back as one network.
# every unit matched: a unit dead on one client's data may be alive on another's, and the copies are matched back
# unit for unit only when none is left out
EXACT = PFNMConfig(hyperparameters="fixed", sigma2=1e-8, sigma0_2=1.0, gamma0=1.0,
                   experimental=ExperimentalOptions(inactive="keep"))


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.fixture(scope="module")
def parts(digits):
    return PartitionConfig(clients=3).split(digits.y_train.numpy(), seed=0)


def federation(digits, parts, arch, pfnm=PFNMConfig(), **kwargs):
    return PFNMFederation(digits, parts, network=NetworkConfig(arch=arch), training=TRAIN, pfnm=pfnm, seed=0,
                          **kwargs)


@pytest.mark.parametrize("arch", ["lenet", "simple-cnn-bn"])
@pytest.mark.parametrize("rounds", [1, 2])
def test_pfnm_on_a_cnn_finishes_with_finite_metrics_and_a_network_of_the_matched_widths(digits, parts, arch, rounds):
    fed = federation(digits, parts, arch)
    records = fed.run(rounds)
    for r in records:
        assert all(math.isfinite(r.metrics[k]) for k in ("accuracy", "nll", "ece", "brier"))
        assert 0 <= r.metrics["accuracy"] <= 1 and r.metrics["server_seconds"] > 0
    net = fed.match.network()
    widths = records[-1].metrics["hidden"]
    assert network_widths(net, digits.input_shape) == widths == list(fed.match.widths.values())
    assert list(fed.match.widths) == ["conv1", "conv2", "fc1", "fc2"]
    assert widths[0] >= 6 and widths[1] >= 16    # at least one client's channels
    assert records[-1].metrics["parameters"] == count_parameters(net)
    assert net.fc1.in_features == widths[1] * (4 if arch == "lenet" else 1)   # the blocks of the flattened channels
    if arch == "simple-cnn-bn":   # re-estimated statistics: not the fresh 0 / 1, of the matched widths
        assert net.bn1.running_var.shape == (widths[0],) and not torch.allclose(net.bn1.running_var,
                                                                                 torch.ones(widths[0]))


def permuted_copies(net, spec, J, seed=0):
    g = torch.Generator().manual_seed(seed)
    state = net.state_dict()
    copies = []
    for _ in range(J):
        perms = {grp.name: torch.randperm(int(state[grp.axes[0].param].shape[grp.axes[0].dim] // grp.axes[0].block),
                                          generator=g) for grp in spec.groups}
        copies.append(network_from_state(net, client_slice(spec, state, perms)).eval())
    return copies


@pytest.mark.parametrize("arch", ["lenet", "simple-cnn-bn"])
def test_clients_holding_permuted_copies_of_one_cnn_are_matched_back_to_it_through_the_federated_path(digits, parts,
                                                                                                     arch):
    fed = federation(digits, parts, arch, pfnm=EXACT)
    x, y = fed.client_data[0]
    original = train_network(initial_network(fed.network, digits.input_shape, 10, seed=0, client=0), x, y, TRAIN,
                             seed=0, round=1, client=0)
    copies = permuted_copies(original, fed.spec, 3)
    fed.initial_models = copies
    fed.run_round()
    widths = network_widths(original, digits.input_shape)
    assert fed.match.hidden_sizes == widths
    expected = copy.deepcopy(original)
    if arch == "simple-cnn-bn":   # the federated path re-estimates the statistics from the clients' data: so do we
        expected = reestimate_batch_norm(expected, [[d[0][i:i + TRAIN.batch_size]
                                                     for i in range(0, len(d[0]), TRAIN.batch_size)]
                                                    for d in fed.client_data])
    with torch.no_grad():
        want = expected.eval()(digits.x_test)
        torch.testing.assert_close(fed.match.network().eval()(digits.x_test), want, atol=1e-5, rtol=1e-5)
        for j in range(3):   # every client's slice is its own copy again
            state, ids = client_start(fed.match, j)
            torch.testing.assert_close(network_from_state(fed.template, state).eval()(digits.x_test), want,
                                       atol=1e-5, rtol=1e-5)
    assert fed.history[0].metrics["accuracy"] == pytest.approx(
        float((want.argmax(-1) == digits.y_test).double().mean()), abs=1e-3)


@pytest.mark.parametrize("arch", ["lenet", "simple-cnn-bn"])
def test_fedma_retrains_only_the_layers_above_the_matched_ones(digits, parts, arch, monkeypatch):
    calls = []
    real = pfnm_module.train_network

    def recording(net, x, y, training, **kwargs):
        before = {k: v.clone() for k, v in net.state_dict().items()}
        after = real(net, x, y, training, **kwargs)
        calls.append((kwargs, before, {k: v.clone() for k, v in after.state_dict().items()}))
        return after

    monkeypatch.setattr(pfnm_module, "train_network", recording)
    fed = federation(digits, parts, arch, pfnm=PFNMConfig(layerwise_retrain=1))
    assert fed.method == "fedma-rounds"
    record = fed.run_round()
    names = fed.spec.group_names
    local, retrain = calls[:3], calls[3:]
    assert all("frozen" not in kwargs for kwargs, _, _ in local)       # round 1's local training: everything
    assert len(retrain) == 3 * (len(names) - 1)                       # every client after every group but the last
    for step, (kwargs, before, after) in enumerate(retrain):
        c = step // 3 + 1
        assert kwargs["epochs"] == 1 and kwargs["step"] == c
        frozen = set(kwargs["frozen"])
        assert frozen == set(matched_parameters(fed.spec, names[:c]))
        owned = {k for g in names[:c] for k in fed.spec.owned(g)}   # with their batch norms' running statistics
        for key in before:
            if key in owned:
                assert torch.equal(before[key], after[key]), (c, key)
        above = [k for k in fed.spec.owned(names[c]) if k in dict(fed.template.named_parameters())]
        assert any(not torch.equal(before[k], after[k]) for k in above), c
    # after the last group every client holds the same network: the global one
    assert record.metrics["hidden"] == fed.match.hidden_sizes and math.isfinite(record.metrics["accuracy"])
    assert list(fed.match.layer_results) == names


@pytest.mark.parametrize("inactive", ["keep", "drop"])
def test_fedma_with_communication_starts_each_client_from_its_slice(digits, parts, inactive):
    fed = federation(digits, parts, "simple-cnn-bn",
                     pfnm=PFNMConfig(layerwise_retrain=1, experimental=ExperimentalOptions(inactive=inactive)))
    first = fed.run_round()
    match = fed.match
    second = fed.run_round()
    assert fed.match is not match and all(math.isfinite(second.metrics[k]) for k in ("accuracy", "nll"))
    for j in range(3):
        _, ids = client_start(match, j)
        widths = [len(ids[g]) for g in fed.spec.group_names]
        if inactive == "keep":
            assert widths == [6, 16, 120, 84]   # each client's own widths
        else:   # less the units dead on its data (here in the fully connected layers)
            assert all(w <= full for w, full in zip(widths, [6, 16, 120, 84])) and widths != [6, 16, 120, 84]
        assert all(len(set(ids[g].tolist())) == len(ids[g]) <= n for g, n in zip(fed.spec.group_names,
                                                                                  match.hidden_sizes))
    assert len(first.metrics["hyperparameters"]) == 4


def test_the_one_shot_layer_wise_global_network_is_every_clients_final_network(digits, parts, monkeypatch):
    """After the last group is matched the clients' networks agree on every matched parameter."""
    seen = {}
    real = pfnm_module.align_to_group

    def recording(state, spec, match, j):
        out = real(state, spec, match, j)
        seen[match.group, j] = out
        return out

    monkeypatch.setattr(pfnm_module, "align_to_group", recording)
    fed = federation(digits, parts, "lenet", pfnm=PFNMConfig(layerwise_retrain=1))
    fed.run_round()
    last = fed.spec.group_names[-1]
    for key in fed.spec.kinds:
        assert all(torch.equal(seen[last, 0][key], seen[last, j][key]) for j in (1, 2)), key
        assert torch.equal(fed.match.state[key], seen[last, 0][key])
    assert np.isfinite(fed.history[0].metrics["nll"])


@pytest.mark.parametrize("arch", ["lenet", "lenet-paper", "simple-cnn", "simple-cnn-bn"])
@pytest.mark.parametrize("input_shape", [(1, 8, 8), (1, 28, 28), (3, 32, 32)], ids=["digits", "mnist", "cifar10"])
def test_every_cnn_is_matched_on_every_image_shape(arch, input_shape):
    from bnpfed.federated.server import pfnm_step

    nets = [initial_network(NetworkConfig(arch=arch), input_shape, 10, seed=0, client=j) for j in range(2)]
    match = pfnm_step(nets, None, EXACT, seed=0, round=1, input_shape=input_shape)
    with torch.no_grad():
        out = match.network().eval()(torch.zeros(2, *input_shape))
    assert out.shape == (2, 10) and len(match.hidden_sizes) == 4


@pytest.mark.parametrize("limit", ["ensemble", "auto", 25000])
def test_fedma_meets_a_parameter_budget_split_into_widths(digits, parts, limit):
    """FedMA matches one group at a time, so max_params becomes a max_width per group before each (fedma_width_limits:
    k times a client's width, the largest k that fits with the groups below at their matched widths); the global
    network is within the budget, every group at most its width limit. FedMA's default ("auto") is the ensemble's
    size."""
    from bnpfed.federated.server import fedma_width_limits
    fed = federation(digits, parts, "lenet", pfnm=PFNMConfig(layerwise_retrain=1, max_params=limit))
    record = fed.run_round()
    client = initial_network(NetworkConfig(arch="lenet"), digits.input_shape, digits.num_classes, seed=0)
    budget = 3 * count_parameters(client) if limit in ("ensemble", "auto") else limit
    assert record.metrics["parameters"] == count_parameters(fed.match.network()) <= budget
    assert fed.match.size_searches and set(fed.match.size_searches) <= set(fed.spec.group_names)
    for group, search in fed.match.size_searches.items():
        assert fed.match.widths[group] <= search.limit
    states = [client.state_dict()] * 3
    config = fedma_width_limits(PFNMConfig(layerwise_retrain=1, max_params=40000), fed.spec, client, states, 0)
    assert config.max_params is None and config.layerwise_retrain == 1
    caps = dict(zip(fed.spec.group_names, config.max_width))
    assert count_parameters(initial_network(NetworkConfig(arch="lenet"), digits.input_shape, digits.num_classes,
                                            seed=0)) < 40000
    given = fedma_width_limits(PFNMConfig(layerwise_retrain=1, max_params=40000, max_width=(6, None, None, 90)),
                               fed.spec, client, states, 0)
    assert given.max_width == (6, caps["conv2"], caps["fc1"], min(90, caps["fc2"]))
    assert fedma_width_limits(PFNMConfig(), fed.spec, client, states, 0) == PFNMConfig()
    unlimited = PFNMConfig(layerwise_retrain=1, max_params=None)   # the model's own size, asked for
    assert fedma_width_limits(unlimited, fed.spec, client, states, 0) is unlimited


def test_fedmas_ensemble_budget_is_the_clients_own_networks_in_every_round(digits, parts, monkeypatch):
    """Over rounds the clients hold slices of the global network; FedMA's default budget stays what the global
    network replaces, the clients' own networks together (a budget on the slices would shrink it round by round)."""
    seen = []
    real = pfnm_module.fedma_width_limits

    def recording(config, spec, template, states, ensemble, matched=None, **kwargs):
        seen.append(ensemble)
        return real(config, spec, template, states, ensemble, matched=matched, **kwargs)

    monkeypatch.setattr(pfnm_module, "fedma_width_limits", recording)
    fed = federation(digits, parts, "lenet", pfnm=PFNMConfig(layerwise_retrain=1))
    fed.run(rounds=2)
    client = initial_network(NetworkConfig(arch="lenet"), digits.input_shape, digits.num_classes, seed=0)
    assert seen == [3 * count_parameters(client)] * (2 * len(fed.spec.group_names))
    assert all(h.metrics["parameters"] <= 3 * count_parameters(client) for h in fed.history)


def test_fedmas_explicit_budget_is_refused_in_round_one_and_met_as_far_as_the_matcher_can_later(digits, parts,
                                                                                                 monkeypatch):
    """An explicit budget: FedMA's first round refuses what it cannot meet, every later round meets it as far as the
    matcher can (PFNMConfig.best_effort_in), for the budget's split into widths and for each group's match alike."""
    widths, groups = [], []
    real_widths, real_group = pfnm_module.fedma_width_limits, pfnm_module.fedma_group_step

    def recording_widths(*args, best_effort=None, **kwargs):
        widths.append(best_effort)
        return real_widths(*args, best_effort=best_effort, **kwargs)

    def recording_group(*args, best_effort=False, **kwargs):
        groups.append(best_effort)
        return real_group(*args, best_effort=best_effort, **kwargs)

    monkeypatch.setattr(pfnm_module, "fedma_width_limits", recording_widths)
    monkeypatch.setattr(pfnm_module, "fedma_group_step", recording_group)
    fed = federation(digits, parts, "lenet", pfnm=PFNMConfig(layerwise_retrain=1, max_params="ensemble"))
    fed.run(rounds=2)
    per_round = len(fed.spec.group_names)
    assert widths == groups == [False] * per_round + [True] * per_round


def test_pfnms_ensemble_budget_over_rounds_is_the_clients_own_networks_too(digits, parts):
    fed = federation(digits, parts, "lenet", pfnm=PFNMConfig(max_params="ensemble"))
    client = initial_network(NetworkConfig(arch="lenet"), digits.input_shape, digits.num_classes, seed=0)
    limits = []
    for _ in range(2):
        fed.run_round()
        limits.append(fed.match.size_searches["parameters"].limit)
        assert count_parameters(fed.match.network()) <= 3 * count_parameters(client)
    assert limits == [3 * count_parameters(client)] * 2


def test_pfnm_rounds_limited_from_round_two_keep_round_one_one_shot(digits, parts):
    """``limit_from_round=2``: round 1 is one-shot PFNM at the model's own size (a CNN's global network then larger
    than the clients' networks together), round 2 is held to the budget (here 45,000 parameters, two thirds of the
    clients' networks together); by default no round is limited."""
    fed = federation(digits, parts, "lenet", pfnm=PFNMConfig(max_params=45000, limit_from_round=2))
    client = initial_network(NetworkConfig(arch="lenet"), digits.input_shape, digits.num_classes, seed=0)
    fed.run_round()
    assert not fed.match.size_searches and count_parameters(fed.match.network()) > 3 * count_parameters(client)
    fed.run_round()
    search = fed.match.size_searches["parameters"]
    assert search.limit == 45000 and search.binding and search.met
    assert count_parameters(fed.match.network()) == search.size <= 45000
    own = federation(digits, parts, "lenet")   # the default: the model's own size in every round
    own.run(2)
    assert not own.match.size_searches


def test_pfnms_ensemble_budget_from_round_two_is_the_clients_own_networks(digits, parts):
    fed = federation(digits, parts, "lenet", pfnm=PFNMConfig(max_params="ensemble", limit_from_round=2))
    client = initial_network(NetworkConfig(arch="lenet"), digits.input_shape, digits.num_classes, seed=0)
    fed.run(2)
    assert fed.match.size_searches["parameters"].limit == 3 * count_parameters(client)
    assert count_parameters(fed.match.network()) <= 3 * count_parameters(client)


@pytest.mark.parametrize("arch", ["lenet", "simple-cnn-bn"])
def test_the_layer_after_a_flatten_is_matched_compact_with_the_dense_result(digits, monkeypatch, arch):
    """match_by_spec hands PFNM's matcher each client's fc units on the columns of the channels it holds
    (CompactRows: no (N, D) array of the layer), and the global network is the one the dense arrays give."""
    import bnpfed.matching.driver as driver
    from bnpfed.matching import match_by_spec, match_layer
    parts = PartitionConfig(clients=6).split(digits.y_train.numpy(), seed=1)
    nets = []
    for j, p in enumerate(parts):
        net = initial_network(NetworkConfig(arch=arch), digits.input_shape, digits.num_classes, seed=0, client=j)
        nets.append(train_network(net, digits.x_train[p], digits.y_train[p], TRAIN, seed=0, round=1, client=j))
    built = []
    make = driver.make_matcher
    monkeypatch.setattr(driver, "make_matcher", lambda *a, **k: built.append(make(*a, **k)) or built[-1])
    compact = match_by_spec(nets, input_shape=digits.input_shape, seed=0)
    assert [m.compact for m in built][-2] is True      # fc1, after the Flatten (conv2's channels re-indexed)
    built.clear()
    dense = match_by_spec(nets, input_shape=digits.input_shape, seed=0, layer_fn=lambda *a, **k: match_layer(*a, **k))
    assert not any(m.compact for m in built)
    assert compact.widths == dense.widths
    for name in compact.assignments:
        assert [a.tolist() for a in compact.assignments[name]] == [a.tolist() for a in dense.assignments[name]]
    for key, value in dense.state.items():
        torch.testing.assert_close(compact.state[key], value, rtol=1e-9, atol=1e-10)
