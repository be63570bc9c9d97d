"""The alignment baselines: weight matching (Git Re-Basin) and OT fusion (Singh & Jaggi), through permutation specs."""

import itertools

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment
from torch import nn
from torch.testing import assert_close

from bnpfed.baselines.averaging import aligned_average, reference_client
from bnpfed.matching import client_slice, derive_spec, network_from_state
from bnpfed.baselines.alignment import apply_maps, ot_alignment, weight_matching, weight_matching_permutations
from bnpfed.models import LeNet, mlp, simple_cnn_bn

pytest.importorskip("ot", reason="POT is not installed (pip install 'bnpfed[ot]')")

NETWORKS = {"mlp": (lambda: mlp(12, [7, 5], 3), (12,)), "lenet": (lambda: LeNet(image_size=8), (1, 8, 8)),
            "simple-cnn-bn": (lambda: simple_cnn_bn(3, 8), (3, 8, 8))}


def network(kind, seed=0):
    make, shape = NETWORKS[kind]
    torch.manual_seed(seed)
    net = make()
    with torch.no_grad():  # batch-norm statistics that differ from the defaults, so that their permutation shows
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 1.5)
                m.weight.normal_()
    return net.eval(), shape


def permuted_copies(net, spec, J, seed=0):
    g = torch.Generator().manual_seed(seed)
    state = net.state_dict()
    out = []
    for _ in range(J):
        perms = {grp.name: torch.randperm(state[grp.axes[0].param].shape[grp.axes[0].dim] // grp.axes[0].block,
                                          generator=g) for grp in spec.groups}
        out.append(client_slice(spec, state, perms))
    return out


@pytest.mark.parametrize("kind", list(NETWORKS))
@pytest.mark.parametrize("method", ["weight-matching", "ot-fusion"])
def test_permuted_copies_of_one_network_are_restored_exactly(kind, method):
    """J permuted copies of one network: every copy aligned back onto the reference's order, so the fused network
    is the reference, and it computes what the original does."""
    net, shape = network(kind)
    spec = derive_spec(net, shape)
    copies = permuted_copies(net, spec, 4)
    nets = [network_from_state(net, c).eval() for c in copies]
    fused = aligned_average(nets, [50, 80, 30, 80], method=method, spec=spec)
    reference = copies[reference_client([50, 80, 30, 80])]
    for key, value in fused.state_dict().items():
        assert_close(value, reference[key], rtol=1e-6, atol=1e-6, msg=key)
    x = torch.randn(6, *shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(fused(x), net(x), rtol=1e-5, atol=1e-5)


def test_the_reference_is_the_client_with_the_most_examples():
    assert reference_client([5, 9, 9, 2]) == 1 and reference_client([3]) == 0


def inner_product(spec, ref, state, perm):
    """Git Re-Basin's objective: sum over the parameters of <theta_ref, P(theta)> (running statistics not scored)."""
    moved = client_slice(spec, state, perm)
    return sum(float((ref[k].double() * moved[k].double()).sum()) for k in ref
               if spec.kinds.get(k) not in ("running_mean", "running_var"))


def test_weight_matching_finds_the_best_permutation_of_one_hidden_layer_by_brute_force():
    """One hidden group: coordinate descent is one LSA, the global optimum of the inner product over all 5! = 120
    permutations."""
    spec_net = mlp(6, [5], 3)
    spec = derive_spec(spec_net, (6,))
    for seed in range(5):
        a, b = mlp(6, [5], 3).state_dict(), mlp(6, [5], 3).state_dict()
        (_, perm) = weight_matching_permutations([a, b], spec, seed=seed)
        best = max(itertools.permutations(range(5)),
                   key=lambda p: inner_product(spec, a, b, {"1": torch.tensor(p)}))
        assert perm["1"].tolist() == list(best)


def test_weight_matching_never_lowers_the_objective_and_beats_the_identity_on_two_groups():
    spec = derive_spec(mlp(8, [6, 5], 3), (8,))
    torch.manual_seed(0)
    a, b = mlp(8, [6, 5], 3).state_dict(), mlp(8, [6, 5], 3).state_dict()
    (_, perm) = weight_matching_permutations([a, b], spec, seed=0)
    identity = {"1": torch.arange(6), "3": torch.arange(5)}
    found = inner_product(spec, a, b, perm)
    assert found >= inner_product(spec, a, b, identity)
    # a fixed point: no single group's LSA improves on it (coordinate descent stopped for that reason)
    for name, n in (("1", 6), ("3", 5)):
        for p in itertools.permutations(range(n)) if n <= 5 else []:
            assert inner_product(spec, a, b, {**perm, name: torch.tensor(p)}) <= found + 1e-9


def test_weight_matching_refuses_other_widths():
    spec = derive_spec(mlp(4, [3], 2), (4,))
    with pytest.raises(ValueError, match=r"states\[1\]: expected group '1' at the reference's width 3"):
        weight_matching([mlp(4, [3], 2).state_dict(), mlp(4, [5], 2).state_dict()], spec)


@pytest.mark.parametrize("seed", range(4))
def test_the_exact_plan_with_uniform_marginals_and_equal_widths_is_the_lsa_permutation(seed):
    """With uniform marginals and equal widths the exact plan is 1/n times a permutation matrix, the assignment LSA
    finds on the same ground cost (Euclidean distances of the unit vectors), and OT fusion is hard alignment by it."""
    torch.manual_seed(seed)
    a, b = mlp(10, [6], 3), mlp(10, [6], 3)
    spec = derive_spec(a, (10,))
    aligned, plans = ot_alignment([a.state_dict(), b.state_dict()], spec, reference=0)
    T = plans[1]["1"]
    assert set(np.unique(np.round(T.numpy() * 6, 12))) <= {0.0, 1.0} and torch.allclose(
        T.sum(0), torch.full((6,), 1 / 6., dtype=torch.float64))
    rows = lambda s: torch.cat([s["1.weight"], s["1.bias"][:, None], s["3.weight"].T], 1).double()  # noqa: E731
    _, cols = linear_sum_assignment(torch.cdist(rows(b.state_dict()), rows(a.state_dict())).numpy())
    by_lsa = client_slice(spec, b.state_dict(), {"1": torch.as_tensor(np.argsort(cols))})
    for key, value in by_lsa.items():
        assert_close(aligned[1][key], value, rtol=0, atol=1e-12, msg=key)


def test_sinkhorn_plans_keep_the_marginals_and_approach_the_exact_plan_as_reg_falls():
    torch.manual_seed(0)
    a, b = mlp(10, [6], 3).state_dict(), mlp(10, [7], 3).state_dict()   # other widths: a transport, not a permutation
    spec = derive_spec(mlp(10, [6], 3), (10,))
    _, exact = ot_alignment([a, b], spec, solver="exact")
    gaps = []
    for reg in (0.1, 0.01, 0.002):
        aligned, plans = ot_alignment([a, b], spec, solver="sinkhorn", reg=reg)
        T = plans[1]["1"]
        assert_close(T.sum(1), torch.full((7,), 1 / 7, dtype=torch.float64), atol=1e-6, rtol=0)
        assert_close(T.sum(0), torch.full((6,), 1 / 6, dtype=torch.float64), atol=1e-6, rtol=0)
        gaps.append(float((T - exact[1]["1"]).abs().sum()))
        assert aligned[1]["1.weight"].shape == (6, 10) and aligned[1]["3.weight"].shape == (3, 6)
    assert gaps[0] > gaps[1] > gaps[2]


def test_apply_maps_with_a_transport_map_averages_the_units_blocks():
    """A map that sends two units to their mean: the blocks of a channel's columns after a Flatten move together."""
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4, 3))
    spec = derive_spec(net, (1, 4, 4))
    A = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    out = apply_maps(spec, net.state_dict(), {spec.group_names[0]: A})
    w = net.state_dict()["3.weight"]
    assert_close(out["3.weight"], 0.5 * (w[:, :4] + w[:, 4:]))
    assert_close(out["0.weight"], net.state_dict()["0.weight"].mean(0, keepdim=True))


def test_aligned_average_names_bad_arguments():
    nets = [mlp(4, [3], 2), mlp(4, [3], 2)]
    with pytest.raises(ValueError, match="method: expected 'weight-matching'"):
        aligned_average(nets, [1, 1], method="re-basin", input_shape=(4,))
    with pytest.raises(ValueError, match="reg: expected only with method='ot-fusion-sinkhorn'"):
        aligned_average(nets, [1, 1], method="ot-fusion", input_shape=(4,), reg=0.1)
    with pytest.raises(ValueError, match="sizes: expected one example count per network"):
        aligned_average(nets, [1], method="ot-fusion", input_shape=(4,))


# ------------------------------------------------------------------------------------------------ KL-fusion


def test_kl_costs_are_the_kl_divergences_of_diagonal_gaussians():
    from bnpfed.baselines.kl_fusion import kl_costs

    g = torch.Generator().manual_seed(0)
    m, v = torch.randn(4, 5, dtype=torch.float64, generator=g), torch.rand(4, 5, dtype=torch.float64, generator=g) + .1
    M, V = torch.randn(3, 5, dtype=torch.float64, generator=g), torch.rand(3, 5, dtype=torch.float64, generator=g) + .1
    p = torch.distributions.Normal(m[None], v[None].sqrt())
    q = torch.distributions.Normal(M[:, None], V[:, None].sqrt())
    assert_close(kl_costs(m, v, M, V), torch.distributions.kl_divergence(p, q).sum(-1), rtol=1e-12, atol=1e-12)


def test_the_kl_barycenter_is_the_mixtures_moments():
    """argmin_q sum_u w_u KL(p_u || q) over diagonal Gaussians: the closed form the step uses beats every nearby q."""
    from bnpfed.baselines.kl_fusion import kl_costs

    g = torch.Generator().manual_seed(1)
    m, v = torch.randn(5, 3, dtype=torch.float64, generator=g), torch.rand(5, 3, dtype=torch.float64, generator=g) + .1
    w = torch.rand(5, dtype=torch.float64, generator=g)
    w = w / w.sum()
    M = w @ m
    V = w @ (v + m * m) - M * M
    best = float(w @ kl_costs(m, v, M[None], V[None])[0])
    for _ in range(50):
        dM, dV = 0.05 * torch.randn(3, dtype=torch.float64, generator=g), 0.05 * torch.randn(3, dtype=torch.float64,
                                                                                               generator=g)
        other = float(w @ kl_costs(m, v, (M + dM)[None], (V * torch.exp(dV))[None])[0])
        assert other > best


def test_kl_fusion_restores_permuted_copies_of_one_bayesian_network():
    """Permuted copies of one posterior: each copy's units go back to the reference's, and the fused means are the
    network's (to the pooling rule's Monte Carlo error, 4 sd of a mean of 1000 draws)."""
    from bnpfed.baselines.kl_fusion import kl_fusion

    torch.manual_seed(0)
    net = mlp(6, [5, 4], 3)
    spec = derive_spec(net, (6,))
    state = {k: v.double() for k, v in net.state_dict().items()}
    variances = {k: torch.full_like(state[k], 1e-4) for k in ("1.weight", "3.weight", "5.weight")}
    copies = []
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        perm = {"1": torch.randperm(5, generator=g), "3": torch.randperm(4, generator=g)}
        copies.append((client_slice(spec, state, perm), client_slice(spec, variances, perm)))
    match = kl_fusion(copies, torch.ones(3, 3), template=net, seed=0)
    reference = copies[0][0]
    for key, value in match.locs.items():
        assert_close(value, reference[key], rtol=0, atol=4 * (1e-4 / 1000) ** 0.5, msg=key)
    for key, value in match.variances.items():  # one posterior thrice: the mixture is that posterior
        assert_close(value, variances[key], rtol=0.25, atol=0, msg=key)


def test_kl_fusion_refuses_clients_of_other_widths():
    from bnpfed.baselines.kl_fusion import kl_fusion

    a, b = mlp(4, [3], 2), mlp(4, [5], 2)
    pairs = [({k: v.double() for k, v in n.state_dict().items()},
              {"1.weight": torch.full_like(n.state_dict()["1.weight"], 0.01, dtype=torch.float64)}) for n in (a, b)]
    with pytest.raises(ValueError, match="clients: expected one width per group at every client for KL-fusion"):
        kl_fusion(pairs, template=a)


def test_the_baselines_run_as_methods_of_bnpfed_pfnm_and_bnpfed_fuse(tmp_path, capsys):
    import json

    from bnpfed.cli import main

    out = tmp_path / "p.json"
    assert main(["pfnm", "--clients", "3", "--epochs", "2", "--hidden", "16", "--no-progress", "--methods",
                 "pfnm,weight-matching,ot-fusion,ot-fusion-sinkhorn", "--json", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]["runs"][0]["rows"]}
    for method in ("weight-matching", "ot-fusion", "ot-fusion-sinkhorn"):
        assert rows[method]["accuracy"] > 0.5 and rows[method]["hidden"] == [16], method  # the reference's width
    assert main(["fuse", "--clients", "3", "--rounds", "1", "--epochs", "1", "--hidden", "16", "--align", "match",
                 "--rule", "eaa", "--no-fedavg", "--no-progress", "--baselines", "kl-fusion,weight-matching",
                 "--json", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]["runs"][0]["rows"]}
    assert rows["kl-fusion"]["width"] == 16 and rows["kl-fusion"]["accuracy"] > 0.3 and "weight-matching" in rows
    assert main(["fuse", "--baselines", "kl-fusion"]) == 2
    assert "--baselines: expected only with --align match" in capsys.readouterr().err
