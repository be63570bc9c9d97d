"""The clients' own output layers on PFNM's global body, pooled log-linearly with class-share weights
(bnpfed.matching.pooled_heads): each claim of its docstring against an independent computation."""

import math

import pytest
import torch
from torch import nn

from bnpfed.data import load_dataset
from bnpfed.federated.config import NetworkConfig, PartitionConfig, PFNMConfig, TrainingConfig
from bnpfed.federated.methods import ExperimentConfig, run_experiment
from bnpfed.federated.partition import partition_dirichlet
from bnpfed.federated.pfnm import PFNMFederation
from bnpfed.matching import (PooledHeads, client_heads, derive_spec, match_by_spec, pool_log_probabilities,
                             pooled_network, unit_activity)
from bnpfed.matching.pooled_heads import pooling_weights
from bnpfed.metrics import count_parameters
from bnpfed.saved import load_global, save_global

from user_networks import UserCNN


def _mlps(J, seed, sizes=(6, 5, 4)):
    g = torch.Generator().manual_seed(seed)
    nets = []
    for _ in range(J):
        net = nn.Sequential(nn.Linear(sizes[0], sizes[1]), nn.ReLU(), nn.Linear(sizes[1], sizes[2])).double()
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        nets.append(net)
    return nets


def _pooled_by_hand(nets, counts, x):
    """log p(k|x) up to a constant: sum_j omega_jk log softmax_k(net_j(x)), omega_jk = n_jk / sum_j' n_j'k, written
    out client by client and class by class."""
    J, C = counts.shape
    out = torch.zeros(x.shape[0], C, dtype=torch.float64)
    for k in range(C):
        total = float(counts[:, k].sum())
        for j, net in enumerate(nets):
            w = float(counts[j, k]) / total if total > 0 else 1.0 / J
            out[:, k] += w * torch.log(torch.softmax(net(x), -1)[:, k])
    return out


def test_pool_of_unmerged_clients_is_their_class_share_log_linear_pool():
    # noise far below the distance between random units: nothing merges, every global unit is one client's unit
    nets = _mlps(3, 0)
    counts = torch.tensor([[5.0, 1.0, 0.0, 2.0], [1.0, 7.0, 3.0, 2.0], [0.0, 2.0, 9.0, 2.0]])
    match = match_by_spec(nets, counts, sigma2=1e-8, sigma0_2=10.0, gamma0=1.0, hyperparameters="fixed",
                          global_weights="average", seed=0)
    assert match.hidden_sizes == [15]
    x = torch.randn(50, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        got = pooled_network(match, nets)(x)
        want = _pooled_by_hand(nets, counts, x)
    # equal up to a term common to the classes: the same distribution
    torch.testing.assert_close(got.softmax(-1), want.softmax(-1), rtol=0, atol=1e-10)
    torch.testing.assert_close(got - got.mean(-1, keepdim=True), want - want.mean(-1, keepdim=True), rtol=0,
                               atol=1e-10)


def test_equal_class_shares_give_the_averaged_global_networks_predictions():
    # the docstring's claim: omega_jk = 1/J for every class, so the pool is the averaged logits up to a constant,
    # and the global network (members' average, the output layer averaged over every client) is that average
    nets = _mlps(4, 2, sizes=(6, 8, 3))
    counts = torch.full((4, 3), 10.0)
    match = match_by_spec(nets, counts, seed=0)        # empirical Bayes: units merge
    assert match.hidden_sizes[0] < 32
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        pooled = pooled_network(match, nets)(x).softmax(-1)
        averaged = match.network()(x).softmax(-1)
    torch.testing.assert_close(pooled, averaged.to(pooled.dtype), rtol=0, atol=1e-6)


def test_heads_sit_at_the_global_units_the_clients_units_were_matched_to():
    nets = _mlps(3, 4, sizes=(6, 5, 4))
    counts = torch.tensor([[5.0, 1.0, 0.0, 2.0], [1.0, 7.0, 3.0, 2.0], [0.0, 2.0, 9.0, 2.0]])
    match = match_by_spec(nets, counts, seed=0)
    W, b = client_heads(match, nets)
    L = match.hidden_sizes[0]
    assert W.shape == (3, 4, L) and b.shape == (3, 4)
    for j, net in enumerate(nets):
        a = match.assignments["0"][j]
        torch.testing.assert_close(W[j][:, a], net[2].weight.detach())
        others = torch.ones(L, dtype=torch.bool)
        others[a] = False
        assert (W[j][:, others] == 0).all()
        torch.testing.assert_close(b[j], net[2].bias.detach())


def test_inactive_units_left_out_as_the_match_left_them_out():
    nets = _mlps(3, 5, sizes=(6, 5, 4))
    with torch.no_grad():          # unit 1 of client 0 dead on every input: very negative bias
        nets[0][0].bias[1] = -100.0
    x = torch.rand(200, 6, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    activity = [unit_activity(n, x, derive_spec(n, (6,))) for n in nets]
    kept = torch.nonzero(activity[0]["0"] > 0).flatten()
    assert 1 not in kept.tolist()
    counts = torch.tensor([[5.0, 1.0, 0.0, 2.0], [1.0, 7.0, 3.0, 2.0], [0.0, 2.0, 9.0, 2.0]])
    match = match_by_spec(nets, counts, sigma2=1e-8, sigma0_2=10.0, gamma0=1.0, hyperparameters="fixed",
                          global_weights="average", seed=0, activity=activity)
    assert match.kept_units[0]["0"].tolist() == kept.tolist()
    W, _ = client_heads(match, nets)
    torch.testing.assert_close(W[0][:, match.assignments["0"][0]], nets[0][2].weight.detach()[:, kept])
    with torch.no_grad():   # the clients compute the same without their inactive units: their pool, by hand
        got = pooled_network(match, nets)(x)
        want = _pooled_by_hand(nets, counts, x)
    torch.testing.assert_close(got.softmax(-1), want.softmax(-1), rtol=0, atol=1e-10)


def test_pool_log_probabilities_and_weights_by_hand():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 5, 4, generator=g, dtype=torch.float64) * 4
    counts = torch.tensor([[2.0, 0.0, 1.0, 0.0], [1.0, 3.0, 1.0, 0.0], [1.0, 1.0, 2.0, 0.0]])
    omega = pooling_weights(counts / counts.sum(0).clamp_min(1))
    # a class no client holds: every client weighted 1/J, not 0
    torch.testing.assert_close(omega[:, 3], torch.full((3,), 1 / 3, dtype=torch.float64))
    torch.testing.assert_close(omega[:, :3].sum(0), torch.ones(3, dtype=torch.float64))
    pooled = pool_log_probabilities(logits, omega)
    for n in range(5):
        for k in range(4):
            want = sum(float(omega[j, k]) * (float(logits[j, n, k]) - math.log(sum(math.exp(float(v))
                                                                                    for v in logits[j, n])))
                       for j in range(3))
            assert abs(float(pooled[n, k]) - want) < 1e-12
    # each client's term is at most 0: a pooled log-probability never exceeds 0
    assert (pooled <= 0).all()


def test_pooled_heads_layer_matches_the_pure_function():
    g = torch.Generator().manual_seed(8)
    W, b = torch.randn(3, 4, 6, generator=g), torch.randn(3, 4, generator=g)
    omega = pooling_weights(torch.full((3, 4), 1 / 3))
    layer = PooledHeads(W, b, omega)
    h = torch.randn(10, 6, generator=g)
    torch.testing.assert_close(layer(h), pool_log_probabilities(torch.einsum("nl,jcl->jnc", h, W) + b[:, None],
                                                                omega))
    assert count_parameters(layer) == 3 * 4 * 6 + 3 * 4
    assert "heads=3" in repr(layer)


def test_bad_input_is_refused_naming_the_argument():
    nets = _mlps(3, 9)
    counts = torch.tensor([[5.0, 1.0, 0.0, 2.0], [1.0, 7.0, 3.0, 2.0], [0.0, 2.0, 9.0, 2.0]])
    match = match_by_spec(nets, counts, seed=0)
    with pytest.raises(ValueError, match="client_states: expected the 3 clients"):
        client_heads(match, nets[:2])
    with pytest.raises(ValueError, match="class_shares: expected every held class's shares to sum to 1"):
        pooling_weights(counts)
    with pytest.raises(ValueError, match="class_shares: expected a \\(J, C\\) array"):
        pooling_weights(torch.tensor([-1.0, 1.0]))
    with pytest.raises(ValueError, match="weight, bias, pool_weights"):
        PooledHeads(torch.zeros(3, 4, 5), torch.zeros(3, 5), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="weights: expected \\(J, C\\)"):
        pool_log_probabilities(torch.zeros(3, 2, 4), torch.zeros(2, 4))


def test_an_output_layer_reading_a_flatten_of_channels_is_refused():
    # conv -> flatten -> output: the output layer reads 16 columns per matched channel
    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(3 * 4 * 4, 4)) for _ in range(2)]
    match = match_by_spec(nets, torch.ones(2, 4), input_shape=(1, 8, 8), seed=0)
    with pytest.raises(ValueError, match="Flatten"):
        client_heads(match, nets)


def test_a_users_cnn_with_batch_norm_gets_pooled_heads_and_saves():
    ds = load_dataset("digits", standardize=False)
    x = ds.x_train[:300].reshape(-1, 1, 8, 8)
    torch.manual_seed(0)
    nets = [UserCNN().eval() for _ in range(3)]
    counts = torch.stack([torch.bincount(ds.y_train[i::3][:100], minlength=10) for i in range(3)]).double()
    match = match_by_spec(nets, counts, input_shape=(1, 8, 8), seed=0)
    net = pooled_network(match, nets)
    assert isinstance(net.head[3], PooledHeads) and net.head[3].heads == 3
    with torch.no_grad():
        out = net(x)
    assert out.shape == (300, 10) and torch.isfinite(out).all()


def test_saved_pooled_network_loads_and_predicts_the_same(tmp_path):
    nets = _mlps(3, 10)
    counts = torch.tensor([[5.0, 1.0, 0.0, 2.0], [1.0, 7.0, 3.0, 2.0], [0.0, 2.0, 9.0, 2.0]])
    match = match_by_spec(nets, counts, seed=0)
    net = pooled_network(match, nets)
    path = save_global(tmp_path / "g.pt", net, method="pfnm-pooled", spec=match.spec, widths=match.widths)
    x = torch.randn(7, 6, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(load_global(path)(x), net(x))


def test_pfnm_pooled_method_row_beside_pfnm():
    ds = load_dataset("digits", standardize=False)
    result = run_experiment(ds, partition=PartitionConfig(clients=3, partition="dirichlet"),
                            network=NetworkConfig(hidden=(16,)), training=TrainingConfig(epochs=2),
                            config=ExperimentConfig(methods=("pfnm:heads=fused", "pfnm:heads=pooled"), seed=0))
    pfnm, pooled = result.rows
    assert pooled.method == "pfnm-pooled" and pooled.hidden == pfnm.hidden
    L, C, J = pfnm.hidden[0], 10, 3
    # J output layers instead of one
    assert pooled.parameters == pfnm.parameters + (J - 1) * C * (L + 1)
    assert 0.0 <= pooled.accuracy <= 1.0 and "pooled" in pooled.note


def _body_features(net, x, layer):
    seen = {}

    def hook(module, inputs, output):   # returns None: the layer's output stays as it is
        seen["h"] = inputs[0]

    handle = dict(net.named_modules())[layer].register_forward_hook(hook)
    with torch.no_grad():
        logits = net(x)
    handle.remove()
    return seen["h"].double(), logits.double()


@pytest.mark.parametrize("layerwise", [0, 1])
def test_federation_heads_are_the_states_its_output_layer_was_averaged_from(layerwise):
    # the averaged output layer is sum_j omega_jk (W_j h + b_j): the heads' class-share average must give the
    # global network's logits, so the heads are the very output layers the last match averaged (FedMA: as the
    # clients retrained them before the last group)
    ds = load_dataset("digits", standardize=False)
    parts = partition_dirichlet(ds.y_train.numpy(), 3, alpha=0.5, seed=0)
    fed = PFNMFederation(ds, parts, network=NetworkConfig(hidden=(16, 12)), training=TrainingConfig(epochs=2),
                         pfnm=PFNMConfig(layerwise_retrain=layerwise), seed=0)
    with pytest.raises(ValueError, match="no round has run yet"):
        fed.pooled_network()
    fed.run_round()
    match = fed.match
    W, b = client_heads(match, fed.matched_states)
    net = match.network().eval()
    out_layer = match.spec.params_of_kind("output_weight")[0].rpartition(".")[0]
    h, logits = _body_features(net, ds.x_test[:40], out_layer)
    omega = torch.as_tensor(match.class_shares, dtype=torch.float64)
    averaged = (omega[:, None, :] * (torch.einsum("nl,jcl->jnc", h, W) + b[:, None])).sum(0)
    torch.testing.assert_close(averaged, logits, rtol=0, atol=1e-4)
    pooled = fed.pooled_network()
    assert isinstance(dict(pooled.named_modules())[out_layer], PooledHeads)


def test_fedma_pooled_row_has_fedmas_body():
    ds = load_dataset("digits", standardize=False)
    result = run_experiment(ds, partition=PartitionConfig(clients=3, partition="dirichlet"),
                            network=NetworkConfig(hidden=(16,)), training=TrainingConfig(epochs=2),
                            pfnm=PFNMConfig(layerwise_retrain=1),
                            config=ExperimentConfig(methods=("fedma:heads=fused", "fedma:heads=pooled"), seed=0))
    fedma, pooled = result.rows
    assert pooled.method == "fedma-pooled" and pooled.hidden == fedma.hidden
    assert pooled.parameters == fedma.parameters + 2 * 10 * (fedma.hidden[0] + 1)


def test_a_pooled_config_and_a_pooled_method_giving_one_row_name_twice_are_refused():
    ds = load_dataset("digits", standardize=False)
    with pytest.raises(ValueError, match="'pfnm' and 'pfnm:heads=pooled' both give the row 'pfnm-pooled'"):
        run_experiment(ds, pfnm=PFNMConfig(heads="pooled"),
                       config=ExperimentConfig(methods=("pfnm", "pfnm:heads=pooled")))
    result = run_experiment(ds, partition=PartitionConfig(clients=3), network=NetworkConfig(hidden=(8,)),
                            training=TrainingConfig(epochs=1), pfnm=PFNMConfig(heads="pooled"),
                            config=ExperimentConfig(methods=("pfnm",)))
    assert [r.method for r in result.rows] == ["pfnm-pooled"]


def test_a_parameter_budget_holds_the_pooled_rows_j_output_layers():
    """Beside a fused ``pfnm`` row under one budget, ``pfnm-pooled`` is matched with its J output layers priced and
    ``fedma-pooled``'s budget split holds them: both pooled rows meet a budget their own-size networks exceed."""
    ds = load_dataset("digits", standardize=False)

    def rows(pfnm, methods):
        return {r.method: r for r in run_experiment(
            ds, partition=PartitionConfig(clients=3, partition="dirichlet"), network=NetworkConfig(hidden=(16,)),
            training=TrainingConfig(epochs=2), pfnm=pfnm, config=ExperimentConfig(methods=methods, seed=0)).rows}

    own = rows(PFNMConfig(heads="fused"), ("pfnm", "pfnm:heads=pooled"))
    budget = (own["pfnm"].parameters + own["pfnm-pooled"].parameters) // 2
    limited = rows(PFNMConfig(max_params=budget, heads="fused"), ("pfnm", "pfnm:heads=pooled"))
    assert limited["pfnm"].parameters == own["pfnm"].parameters          # one output layer: the budget does not bind
    assert own["pfnm-pooled"].parameters > budget >= limited["pfnm-pooled"].parameters
    assert "J output layers priced" in limited["pfnm-pooled"].note
    fedma = rows(PFNMConfig(layerwise_retrain=1, max_params=budget, heads="fused"), ("fedma", "fedma:heads=pooled"))
    assert fedma["fedma-pooled"].parameters <= budget and fedma["fedma"].parameters <= budget
    assert fedma["fedma-pooled"].hidden[0] < fedma["fedma"].hidden[0]


# ------------------------------------------------------------------------------------------------ heads="auto"


def test_the_homogeneity_test_is_pearsons_chi_squared_without_continuity_correction():
    import numpy as np
    from scipy.stats import chi2_contingency

    from bnpfed.matching import homogeneity_p_value

    rng = np.random.default_rng(0)
    for J, C in ((2, 2), (3, 10), (10, 10)):
        counts = rng.integers(1, 60, size=(J, C))
        assert homogeneity_p_value(counts) == pytest.approx(chi2_contingency(counts, correction=False).pvalue,
                                                            rel=1e-9, abs=1e-300)
    # a class nobody holds and a client with nothing are left out (their expected counts are 0)
    table = [[5, 0, 3], [4, 0, 6], [0, 0, 0]]
    assert homogeneity_p_value(table) == pytest.approx(
        chi2_contingency([[5, 3], [4, 6]], correction=False).pvalue, rel=1e-9)
    assert homogeneity_p_value([[3, 4, 5]]) == 1.0 and homogeneity_p_value([[3], [4]]) == 1.0
    with pytest.raises(ValueError, match="class_counts: expected a"):
        homogeneity_p_value([[1, -1], [2, 2]])


def test_auto_heads_are_pooled_under_label_skew_and_fused_on_a_random_split():
    from bnpfed.federated.partition import class_counts
    from bnpfed.matching import chosen_heads

    y = load_dataset("digits", standardize=False).y_train.numpy()
    for seed in range(5):
        for J in (3, 10):
            iid = class_counts(y, PartitionConfig(clients=J).split(y, seed), 10)
            skewed = class_counts(y, PartitionConfig(clients=J, partition="dirichlet").split(y, seed), 10)
            assert chosen_heads("auto", iid) == "fused" and chosen_heads("auto", skewed) == "pooled"
            assert chosen_heads("fused", skewed) == "fused" and chosen_heads("pooled", iid) == "pooled"
    with pytest.raises(ValueError, match="heads: expected one of"):
        chosen_heads("mixed", iid)


def test_auto_heads_in_the_configs_follow_a_temperature_that_was_asked_for():
    from bnpfed.federated.config import FusionConfig

    equal, skewed = [[50, 50], [50, 50]], [[90, 10], [10, 90]]
    assert PFNMConfig().heads == "auto" and FusionConfig().heads == "auto"
    assert PFNMConfig().with_heads(skewed).heads == "pooled" and PFNMConfig().with_heads(equal).heads == "fused"
    assert PFNMConfig(pool_temperature="fit").with_heads(equal).heads == "pooled"
    assert PFNMConfig(heads="fused").with_heads(skewed).heads == "fused"
    assert FusionConfig().with_heads(skewed).heads == "fused"                 # weight by weight: nothing to pool
    assert FusionConfig(align="match").with_heads(skewed).heads == "pooled"
    assert FusionConfig(align="match", temperature=2.0).with_heads(skewed).heads == "fused"
    assert FusionConfig(align="match", pool_temperature=2.0).with_heads(equal).heads == "pooled"
    with pytest.raises(ValueError, match="temperature, pool_temperature: .* expected one of them 1"):
        FusionConfig(align="match", temperature=2.0, pool_temperature=2.0)


def test_the_default_pfnm_row_is_the_pooled_one_under_label_skew_and_the_fused_one_on_a_random_split():
    ds = load_dataset("digits", standardize=False)

    def rows(partition, methods, pfnm=PFNMConfig()):
        result = run_experiment(ds, partition=PartitionConfig(clients=3, partition=partition),
                                network=NetworkConfig(hidden=(16,)), training=TrainingConfig(epochs=2), pfnm=pfnm,
                                config=ExperimentConfig(methods=methods, seed=0))
        return {r.method: r for r in result.rows}, result.settings

    def same(a, b):
        return [a.accuracy, a.nll, a.parameters, a.hidden] == [b.accuracy, b.nll, b.parameters, b.hidden]

    skewed, settings = rows("dirichlet", ("pfnm", "pfnm:heads=pooled"))
    assert same(skewed["pfnm"], skewed["pfnm-pooled"]) and settings["pfnm"]["heads"] == "pooled"
    assert "heads auto: the clients' class shares differ" in skewed["pfnm"].note
    iid, settings = rows("iid", ("pfnm",))
    fused, _ = rows("iid", ("pfnm",), PFNMConfig(heads="fused"))
    assert same(iid["pfnm"], fused["pfnm"]) and iid["pfnm"].note == fused["pfnm"].note
    assert settings["pfnm"]["heads"] == "fused"   # what "auto" chose, in the record
