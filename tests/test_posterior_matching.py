"""Matched posterior fusion (issue "matching Bayesian neurons"): the server matches the hidden units of independently
initialised Bayesian clients, then fuses every global unit's members with a rule of bnpfed.combine."""

import math

import pytest
import torch
from torch import nn

from bnpfed.combine import fuse
from bnpfed.data import load_dataset
from bnpfed.federated.config import (FUSION_TRAINING, BayesianConfig, FusionConfig, NetworkConfig, PartitionConfig,
                                     TrainingConfig)
from bnpfed.federated.matched_fusion import MatchedFusionFederation
from bnpfed.federated.methods import ExperimentConfig, available_methods, method_options, run_experiment
from bnpfed.matching.bayesian_layer import match_bayesian_layer
from bnpfed.matching.permutation import client_slice, derive_spec, network_from_state
from bnpfed.matching.posteriors import MIN_VARIANCE, client_posterior, fuse_members, match_posteriors
from bnpfed.experimental import ExperimentalOptions

RULES = ("eaa", "gaa", "log_variance", "conflation")
#: tiny noise and a wide prior: copies of one unit merge, distinct units stay apart
EXACT = dict(hyperparameters="fixed", tau2=1e-10, sigma0_2=1.0, gamma0=1.0)


def bayesian_net(seed, conv=False):
    g = torch.manual_seed(seed)
    if conv:
        net = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(12, 5),
                            nn.ReLU(), nn.Linear(5, 3))
    else:
        net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    locs = {k: v.detach().double() for k, v in net.state_dict().items()}
    variances = {k: (torch.rand(v.shape, generator=g, dtype=torch.float64) * 1e-3 + 1e-4)
                 for k, v in locs.items() if k.endswith("weight")}
    return net, locs, variances


def permuted_copies(net, locs, variances, J, input_shape, seed=0):
    spec = derive_spec(net, input_shape)
    g = torch.Generator().manual_seed(seed)
    clients = []
    for j in range(J):   # client 0 holds the network as it is, the others permuted
        sizes = {name: int(locs[spec.group(name).axes[0].param].shape[0]) for name in spec.group_names}
        perm = {name: torch.randperm(n, generator=g) if j else torch.arange(n) for name, n in sizes.items()}
        clients.append((client_slice(spec, locs, perm), client_slice(spec, variances, perm)))
    return spec, clients


@pytest.mark.parametrize("conv", [False, True])
@pytest.mark.parametrize("rule", RULES)
def test_permuted_copies_of_one_bayesian_network_fuse_back_to_it(rule, conv):
    """Exactness: J copies of one Bayesian network with permuted units come back: the means exactly, the variances
    as each rule's formula gives for J identical inputs (eaa, log_variance: unchanged; gaa: times sum_j b_j^2;
    conflation: times b_max / sum_j b_j)."""
    net, locs, variances = bayesian_net(0, conv)
    input_shape = (1, 6, 6) if conv else (4,)
    J, counts = 3, torch.tensor([[4.0, 1.0, 2.0], [1.0, 3.0, 2.0], [3.0, 3.0, 1.0]], dtype=torch.float64)
    spec, clients = permuted_copies(net, locs, variances, J, input_shape)
    match = match_posteriors(clients, counts, spec, rule=rule, template=net, seed=0, **EXACT)
    assert match.widths == {g.name: int(locs[g.axes[0].param].shape[0]) for g in spec.groups}
    for key, value in locs.items():
        torch.testing.assert_close(match.locs[key], value, atol=1e-12, rtol=0)
    b_hidden = counts.sum(1) / counts.sum()               # member weights on a unit's own coordinates
    b_out = counts / counts.sum(0)                        # class shares on the output coordinates, (J, C)
    factor = {"eaa": lambda b: torch.ones_like(b[0]), "log_variance": lambda b: torch.ones_like(b[0]),
              "gaa": lambda b: (b * b).sum(0),
              "conflation": lambda b: b.max(0).values / b.sum(0)}[rule]
    out_w = spec.params_of_kind("output_weight")[0]
    for key, value in variances.items():
        expected = value * (factor(b_out)[:, None] if key == out_w else factor(b_hidden[:, None]))
        torch.testing.assert_close(match.variances[key], expected, rtol=1e-10, atol=0)
    x = torch.randn(5, *input_shape)
    torch.testing.assert_close(match.network().float()(x), net(x), atol=1e-5, rtol=0)


def test_pooling_fuses_copies_back_up_to_its_monte_carlo_error():
    """Pooling moment-matches draws: identical members give their own Gaussian within a few standard errors."""
    net, locs, variances = bayesian_net(1)
    spec, clients = permuted_copies(net, locs, variances, 2, (4,))
    match = match_posteriors(clients, None, spec, rule="pooling", template=net, seed=0, num_samples=20000, **EXACT)
    for key, value in variances.items():
        se = (value / 20000).sqrt()
        assert ((match.locs[key] - locs[key]).abs() < 5 * se).all()
        # the unbiased variance of n draws has relative standard error sqrt(2 / (n - 1))
        assert ((match.variances[key] / value - 1).abs() < 5 * math.sqrt(2 / 19999)).all()


def test_conflation_with_the_atom_prior_is_the_models_conjugate_posterior_of_the_atom():
    """Conflation (equal weights) of a global unit's members' N(v_jl, u_jl + tau2), with the atom prior N(mu0,
    sigma0_2) as one more factor, is the matcher's posterior of the atom, N(g / P, 1 / P)."""
    g = torch.Generator().manual_seed(0)
    J, D = 4, 6
    atoms = torch.randn(3, D, generator=g, dtype=torch.float64)
    means, variances = [], []
    for j in range(J):
        u = torch.rand(3, D, generator=g, dtype=torch.float64) * 0.02 + 0.001
        means.append(atoms + (u + 0.01).sqrt() * torch.randn(3, D, generator=g, dtype=torch.float64))
        variances.append(u)
    hyper = dict(tau2=0.01, sigma0_2=2.0, gamma0=3.0, mu0=0.5)
    r = match_bayesian_layer(means, variances, hyperparameters="fixed", seed=0, **hyper)
    for i in range(r.num_atoms):
        rows = [(j, l) for j in range(J) for l, a in enumerate(r.assignments[j].tolist()) if a == i]
        locs = torch.stack([means[j][l] for j, l in rows] + [torch.full((D,), 0.5, dtype=torch.float64)])
        var = torch.stack([variances[j][l] + hyper["tau2"] for j, l in rows] +
                          [torch.full((D,), 2.0, dtype=torch.float64)])
        fused = fuse(locs, var, "conflation")
        torch.testing.assert_close(fused.loc, torch.as_tensor(r.global_atoms[i], dtype=torch.float64))
        torch.testing.assert_close(fused.variance, 1 / torch.as_tensor(r.posterior_precision[i],
                                                                         dtype=torch.float64))


def distinct_clients(J=3):
    """J Bayesian MLPs of different weights (nothing in common: under EXACT every unit stays alone)."""
    nets, clients = [], []
    for j in range(J):
        net, locs, variances = bayesian_net(10 + j)
        nets.append(net)
        clients.append((locs, variances))
    return nets, clients


@pytest.mark.parametrize("rule", RULES)
def test_a_unit_only_one_client_has_speaks_with_that_clients_share(rule):
    """Coverage: when no unit is shared, the global posterior-mean network computes the clients' logits averaged
    class by class with the class shares (the deterministic average construction), and client j's slice is client
    j's own network (with the global output bias)."""
    nets, clients = distinct_clients()
    counts = torch.tensor([[5.0, 1.0, 0.0], [1.0, 1.0, 4.0], [2.0, 6.0, 1.0]], dtype=torch.float64)
    match = match_posteriors(clients, counts, rule=rule, template=nets[0], seed=0, **EXACT)
    assert match.widths == {"0": 18, "2": 15}
    shares = counts / counts.sum(0)
    x = torch.randn(7, 4, dtype=torch.float64)
    expected = sum(shares[j] * nets[j].double()(x) for j in range(3))
    torch.testing.assert_close(match.network()(x), expected, atol=1e-10, rtol=0)
    for j in range(3):   # the slice: the client's own units, with the global output bias
        locs, variances = match.client_slice(j)
        own = nets[j].double()(x) - nets[j][4].bias.double() + match.locs["4.bias"]
        torch.testing.assert_close(network_from_state(nets[0], locs)(x), own, atol=1e-10, rtol=0)
        for key, value in clients[j][1].items():
            torch.testing.assert_close(variances[key], value)


def test_a_global_unit_lacking_an_input_some_members_have_is_scaled_by_their_coverage():
    """Two members of a unit, one holding an input the other lacks (a structural zero): the rule fuses the member
    that holds it and the result is scaled by its share of the members' weight."""
    loc, var = fuse_members(torch.tensor([[1.0, 2.0], [3.0, 0.0]]), torch.tensor([[1.0, 4.0], [1.0, 1.0]]),
                            torch.tensor([[3.0, 3.0], [1.0, 0.0]]), torch.tensor([4.0, 4.0]), "gaa",
                            bayesian=torch.tensor([True, True]))
    # coordinate 0: both members, b = (3/4, 1/4); coordinate 1: member 0 alone (its value 2, variance 4), coverage 3/4
    torch.testing.assert_close(loc, torch.tensor([0.75 * 1 + 0.25 * 3, 0.75 * 2.0], dtype=torch.float64))
    torch.testing.assert_close(var, torch.tensor([0.75 ** 2 + 0.25 ** 2, 0.75 ** 2 * 4.0], dtype=torch.float64))


def test_deterministic_coordinates_are_averaged_and_carry_no_variance():
    loc, var = fuse_members(torch.tensor([[1.0, 2.0], [3.0, 6.0]]), torch.tensor([[1.0, 0.0], [1.0, 0.0]]),
                            torch.tensor([[1.0, 1.0], [3.0, 3.0]]), None, "conflation",
                            bayesian=torch.tensor([True, False]))
    assert loc[1].item() == pytest.approx(5.0) and var[1].item() == 0.0


@pytest.mark.parametrize("change, message", [
    (lambda c: c[1][1].__setitem__("0.weight", -c[1][1]["0.weight"]), r"clients\[1\]: variances\['0.weight'\] must be"),
    (lambda c: c[1][1].__setitem__("0.weight", c[1][1]["0.weight"][:2]), r"clients\[1\]: variances\['0.weight'\] has "
     r"shape \(2, 4\)"),
    (lambda c: c[2][1].pop("2.weight"),
     r"clients\[2\]: expected the Bayesian sites .* of client 0, got \['0.weight', '4.weight'\]"),
    (lambda c: c.__setitem__(0, "net"), r"clients\[0\]: expected a BayesianClient or a \(locs, variances\) pair"),
])
def test_bad_clients_are_named(change, message):
    nets, clients = distinct_clients()
    clients = [(dict(l), dict(v)) for l, v in clients]
    change(clients)
    with pytest.raises(ValueError, match=message):
        match_posteriors(clients, rule="eaa", template=nets[0], **EXACT)


def test_an_unknown_rule_and_an_empty_client_list_are_refused():
    nets, clients = distinct_clients()
    with pytest.raises(ValueError, match="rule"):
        match_posteriors(clients, rule="median", template=nets[0], **EXACT)
    with pytest.raises(ValueError, match="clients: expected a non-empty sequence"):
        match_posteriors([], rule="eaa", template=nets[0], **EXACT)


def test_batch_norm_statistics_are_no_posterior_to_fuse():
    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.Linear(3, 2))
    locs = {k: v.detach().double() for k, v in net.state_dict().items()}
    variances = {"0.weight": torch.full((3, 4), 1e-3, dtype=torch.float64)}
    with pytest.raises(ValueError, match="spec: batch-norm running statistics"):
        match_posteriors([(locs, variances)] * 2, rule="eaa", template=net, **EXACT)


# ------------------------------------------------------------------------------------------------ federation


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def run_rounds(ds, rounds=2, seed=0, rule="conflation", round_prior=None, later_rounds="rematch"):
    parts = PartitionConfig(clients=3).split(ds.y_train.numpy(), seed=0)
    federation = MatchedFusionFederation(ds, parts, network=NetworkConfig(hidden=(16,)),
                                         training=TrainingConfig(epochs=2, lr=1e-2),
                                         bayesian=BayesianConfig(
                                             experimental=ExperimentalOptions(round_prior=round_prior)),
                                         fusion=FusionConfig(rule=rule, align="match", experimental=ExperimentalOptions(
                                             later_rounds=later_rounds)),
                                         seed=seed)
    records, matches = [], []
    for _ in range(rounds):
        records.append(federation.run_round())
        matches.append((federation.match, list(federation.matched)))
    federation.matches = matches
    return federation, records


@pytest.mark.parametrize("round_prior", [None, "posterior"])
def test_a_matched_fusion_federation_is_reproducible_and_its_clients_start_from_their_slices(digits, round_prior):
    """Round 2: every client starts from its slice of the global posterior, under the configured prior N(0, 1) by
    default (its data is in the slice once and not multiplied in again) or, with ``round_prior="posterior"``, with
    the slice as its prior too; the same seed gives the same numbers."""
    a, records = run_rounds(digits, round_prior=round_prior)
    b, again = run_rounds(digits, round_prior=round_prior)
    assert [r.metrics["accuracy"] for r in records] == [r.metrics["accuracy"] for r in again]
    for key in a.match.locs:
        assert torch.equal(a.match.locs[key], b.match.locs[key])
    assert records[-1].metrics["hidden"] == list(a.match.widths.values())
    assert records[-1].metrics["accuracy"] > 0.5
    first, matched = a.matches[0]
    for j, client in enumerate(a.clients):
        prior = client.bnn.prior_distributions()
        assert set(prior) == set(a.match.variances)
        locs, variances = first.client_slice(matched.index(j))
        for site, distribution in prior.items():
            if round_prior == "posterior":   # the slice, value for value
                expected_mean, expected_variance = locs[site], variances[site]
            else:                            # the configured N(0, 1), at the slice's widths
                expected_mean, expected_variance = torch.zeros_like(locs[site]), torch.ones_like(variances[site])
            torch.testing.assert_close(distribution.mean, expected_mean.to(distribution.mean.dtype), rtol=1e-6,
                                       atol=0)
            torch.testing.assert_close(distribution.variance, expected_variance.to(distribution.variance.dtype),
                                       rtol=1e-5, atol=0)
    if round_prior is None:   # the two priors give two different round-2 posteriors from the same round 1
        c, _ = run_rounds(digits, round_prior="posterior")
        assert torch.equal(a.matches[0][0].locs["1.weight"], c.matches[0][0].locs["1.weight"])
        assert not torch.equal(a.match.locs["1.weight"], c.match.locs["1.weight"])


def test_fixed_later_rounds_give_every_client_the_whole_global_posterior_and_fuse_it_unit_by_unit(digits):
    """``later_rounds="fixed"``: from round 2 every client trains the whole global posterior of the last round, the
    assignment is the identity (no unit re-paired, the width kept), and each global unit's input weights are the
    conflation of the clients' copies of it with their sizes as weights (``bnpfed.combine.fuse``, computed here)."""
    from bnpfed.combine import fuse

    fed, records = run_rounds(digits, rounds=3, later_rounds="fixed")
    first = fed.matches[0][0]
    L = first.widths["1"]
    for match, matched in fed.matches[1:]:
        assert match.widths == first.widths and records[-1].metrics["hidden"] == [L]
        assert all(torch.equal(a, torch.arange(L)) for a in match.assignments["1"])
    pairs = [client_posterior(c) for c in fed.clients]
    assert all(locs["1.weight"].shape[0] == L for locs, _ in pairs)   # the whole global network, every client
    expected = fuse(torch.stack([locs["1.weight"] for locs, _ in pairs]).double(),
                    torch.stack([v["1.weight"] for _, v in pairs]).double(), "conflation",
                    torch.tensor(fed.sizes, dtype=torch.float64))
    torch.testing.assert_close(fed.match.locs["1.weight"], expected.loc, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(fed.match.variances["1.weight"], expected.variance, rtol=1e-9, atol=1e-20)
    # re-matched rounds start each client from its slice instead, and the second match is free to re-pair
    rematched, _ = run_rounds(digits, rounds=2)
    assert torch.equal(rematched.matches[0][0].locs["1.weight"], first.locs["1.weight"])
    assert not torch.equal(rematched.match.locs["1.weight"], fed.matches[1][0].locs["1.weight"])


def test_fixed_later_rounds_are_refused_where_they_do_not_apply():
    with pytest.raises(ValueError, match="later_rounds: matched fusion's rounds after the first"):
        FusionConfig(experimental=ExperimentalOptions(later_rounds="fixed"))
    with pytest.raises(ValueError, match="later_rounds: rule 'pvi' keeps each client's factor in its own units"):
        FusionConfig(rule="pvi", align="match", experimental=ExperimentalOptions(later_rounds="fixed"))
    # "auto": PVI re-matches, every other rule keeps the assignment
    assert FusionConfig(rule="pvi", align="match").rounds_after_first() == "rematch"
    assert FusionConfig(align="match").rounds_after_first() == "fixed"
    with pytest.raises(ValueError, match=r"later_rounds: expected one of \['auto', 'rematch', 'fixed'\]"):
        FusionConfig(align="match", experimental=ExperimentalOptions(later_rounds="frozen"))


def test_a_round_prior_is_refused_where_it_does_not_apply(digits):
    parts = PartitionConfig(clients=3).split(digits.y_train.numpy(), seed=0)
    with pytest.raises(ValueError, match="round_prior: rule 'pvi' trains every client against its cavity"):
        MatchedFusionFederation(digits, parts, network=NetworkConfig(hidden=(16,)), training=TrainingConfig(),
                                bayesian=BayesianConfig(experimental=ExperimentalOptions(round_prior="prior")),
                                fusion=FusionConfig(rule="pvi", align="match"), seed=0)
    with pytest.raises(ValueError, match="round_prior: a setting of the variational clients' SVI"):
        BayesianConfig(client="laplace", experimental=ExperimentalOptions(round_prior="posterior"))
    with pytest.raises(ValueError, match=r"round_prior: expected one of \['prior', 'posterior'\]"):
        BayesianConfig(experimental=ExperimentalOptions(round_prior="slice"))


def test_matched_fusion_is_one_method_whose_rule_is_an_option_of_every_rule():
    for rule in ("eaa", "gaa", "log_variance", "pooling", "conflation"):
        assert rule in method_options("match")["rule"].values() and rule in method_options("fusion")["rule"].values()
    assert "ensemble-bayesian" in available_methods() and "match" in available_methods()


def test_an_experiment_gives_the_rows_of_the_issue_table(digits):
    ood = 1.0 - digits.x_test      # inverted digits
    result = run_experiment(digits, partition=PartitionConfig(clients=3), network=NetworkConfig(hidden=(16,)),
                            training=FUSION_TRAINING, fusion=FusionConfig(own_init=True),
                            config=ExperimentConfig(methods=("ensemble-bayesian", "pfnm", "fusion:rule=eaa",
                                                             "match:rule=eaa"), ece_bins=100), ood=ood)
    names = [r.method for r in result.rows]
    assert names == ["ensemble", "pfnm", "eaa", "match-eaa"]
    for row in result.rows:
        for metric in ("accuracy", "nll", "ece", "ece15", "brier", "auroc_max_prob", "auroc_entropy"):
            assert math.isfinite(getattr(row, metric)), (row.method, metric)
        assert row.width == sum(row.hidden) > 0


def test_weight_wise_fusion_from_own_inits_reuses_the_experiments_bayesian_clients_without_changing_them(digits):
    """The one-shot baseline (each client from its own init) gives the same numbers whether its round-1 clients are
    trained anew or taken from the experiment, and later rounds leave the experiment's clients as they were."""
    from bnpfed.federated.fusion import FusionFederation
    from bnpfed.federated.methods import Experiment

    kwargs = dict(partition=PartitionConfig(clients=3), network=NetworkConfig(hidden=(16,)), training=FUSION_TRAINING,
                  fusion=FusionConfig(rule="gaa", own_init=True))
    experiment = Experiment(digits, **kwargs)
    clients = experiment.bayesian_clients()
    before = [c.posterior()["1.weight"].loc.clone() for c in clients]
    common = dict(network=experiment.network, training=experiment.training, bayesian=experiment.bayesian,
                  fusion=experiment.fusion, seed=0)
    fresh = FusionFederation(digits, experiment.parts, **common)
    reused = FusionFederation(digits, experiment.parts, initial_clients=clients, **common)
    for _ in range(2):
        a, b = fresh.run_round(), reused.run_round()
        # to rounding: the reused posterior passes through the guide's scale parameterisation once more
        assert a.metrics["accuracy"] == b.metrics["accuracy"] and a.metrics["nll"] == pytest.approx(b.metrics["nll"],
                                                                                                  rel=1e-7)
    assert all(torch.equal(c.posterior()["1.weight"].loc, w) for c, w in zip(clients, before))


@pytest.mark.parametrize("rule", RULES)
def test_fuse_members_is_the_rule_coordinate_by_coordinate_over_the_members_holding_it_then_the_coverage(rule):
    """Independent computation, coordinate by coordinate: the members that hold coordinate d (weight > 0) fused by one
    bnpfed.combine.fuse call with their (m_d,) weights (a deterministic coordinate: their weighted mean), mean times
    kappa_d = sum_j b_jd / reference_d and variance times kappa_d^2; a coordinate nobody holds is 0 (variance
    MIN_VARIANCE if Bayesian)."""
    g = torch.Generator().manual_seed(1)
    m, D = 4, 30
    locs = torch.randn(m, D, generator=g, dtype=torch.float64)
    variances = torch.rand(m, D, generator=g, dtype=torch.float64) + 0.01
    weights = torch.randint(0, 3, (m, D), generator=g).double()          # 0: the member lacks the coordinate
    weights[:, :10] = torch.tensor([3.0, 1.0, 2.0, 5.0])[:, None]         # a block of one pattern
    weights[:, 10] = 0.0                                                  # a coordinate nobody holds
    reference = weights.sum(0) + torch.rand(D, generator=g, dtype=torch.float64)
    bayesian = torch.rand(D, generator=g) > 0.2
    bayesian[10] = True
    variances[:, ~bayesian] = 0.0
    variances[weights == 0] = 0.0                                          # not held: never read
    loc, var = fuse_members(locs, variances, weights, reference, rule, bayesian=bayesian)
    for d in range(D):
        held = weights[:, d] > 0
        if not held.any():
            assert loc[d] == 0 and var[d] == (MIN_VARIANCE if bayesian[d] else 0.0)
            continue
        kappa = weights[held, d].sum() / reference[d]
        if bayesian[d]:
            one = fuse(locs[held, d], variances[held, d], rule, weights[held, d])
            assert float(loc[d]) == pytest.approx(float(kappa * one.loc), rel=1e-12, abs=1e-15)
            assert float(var[d]) == pytest.approx(float(kappa ** 2 * one.variance), rel=1e-12, abs=1e-15)
        else:
            b = weights[held, d] / weights[held, d].sum()
            assert float(loc[d]) == pytest.approx(float(kappa * (b * locs[held, d]).sum()), rel=1e-12, abs=1e-15)
            assert var[d] == 0

def test_bayesian_clients_match_without_a_template_their_own_network_is_used(digits):
    """The docstring's path: BayesianClients and no template= (their Bayesian network holds Pyro modules, which
    derive_spec does not read: the plain network it was built from is the template)."""
    from bnpfed.federated.clients import bayesian_client, initial_network

    clients = [bayesian_client(initial_network(NetworkConfig(hidden=(6,)), (1, 8, 8), 10, seed=0, client=j),
                               BayesianConfig()) for j in range(2)]
    match = match_posteriors(clients, None, rule="eaa", seed=0)
    assert list(match.widths) == ["1"] and 6 <= match.widths["1"] <= 12
    assert type(match.template) is nn.Sequential and match.network()(digits.x_test[:3]).shape == (3, 10)


# ------------------------------------------------------------------------------------------------ the atom posterior


def test_the_atom_posterior_rule_is_the_models_conjugate_posterior_of_every_matched_unit_by_hand():
    """rule="atom-posterior": each global unit of each group is N(g / P, 1 / P) with P = 1/sigma0_2 + sum_j s_jd /
    (u_jd + tau2) and g = mu0/sigma0_2 + sum_j s_jd v_jd / (u_jd + tau2) over its members (s the class share on the
    output coordinates, 1 elsewhere), computed here from the members' own numbers; the global network scales the
    output coordinates by the coverage (the members' share of the class), as every rule's."""
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    torch.manual_seed(3)
    clients = []
    for j in range(3):   # three noisy, permuted copies of one network, with their own posterior variances
        g = torch.Generator().manual_seed(20 + j)
        base = {k: v.detach().double() for k, v in net.state_dict().items()}
        noisy = {k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in base.items()}
        u = {k: torch.rand(v.shape, generator=g, dtype=torch.float64) * 0.01 + 1e-3 for k, v in base.items()
             if k.endswith("weight")}
        perm = {"0": torch.randperm(6, generator=g)}
        spec = derive_spec(net, (4,))
        clients.append((client_slice(spec, noisy, perm), client_slice(spec, u, perm)))
    counts = torch.tensor([[30, 10, 5], [10, 30, 10], [5, 10, 30]], dtype=torch.float64)
    hyper = dict(hyperparameters="fixed", tau2=0.004, sigma0_2=0.5, gamma0=2.0, mu0=0.0, bias_mu0=0.0)
    match = match_posteriors(clients, counts, rule="atom-posterior", template=net, seed=0, **hyper)
    shares = counts / counts.sum(0)
    (assign,) = match.assignments.values()
    for i in range(match.widths["0"]):
        members = [(j, l) for j in range(3) for l, a in enumerate(assign[j].tolist()) if a == i]
        P_in = torch.full((4,), 1 / 0.5, dtype=torch.float64)
        g_in = torch.zeros(4, dtype=torch.float64)
        P_b, g_b = torch.tensor(1 / 0.5, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
        P_out = torch.full((3,), 1 / 0.5, dtype=torch.float64)
        g_out = torch.zeros(3, dtype=torch.float64)
        for j, l in members:
            v, u = clients[j]
            w = 1 / (u["0.weight"][l] + 0.004)
            P_in, g_in = P_in + w, g_in + w * v["0.weight"][l]
            P_b, g_b = P_b + 1 / 0.004, g_b + v["0.bias"][l] / 0.004      # deterministic: noise tau2 only
            w = shares[j] / (u["2.weight"][:, l] + 0.004)
            P_out, g_out = P_out + w, g_out + w * v["2.weight"][:, l]
        kappa = sum(shares[j] for j, _ in members)      # the members' share of each class (all clients': 1)
        torch.testing.assert_close(match.unit_locs["0.weight"][i], g_in / P_in)
        torch.testing.assert_close(match.unit_variances["0.weight"][i], 1 / P_in)
        torch.testing.assert_close(match.unit_locs["0.bias"][i], g_b / P_b)
        torch.testing.assert_close(match.unit_locs["2.weight"][:, i], g_out / P_out)
        torch.testing.assert_close(match.unit_variances["2.weight"][:, i], 1 / P_out)
        # the global network: a unit's own coordinates as they are (every member holds them), its outgoing weights
        # scaled by the coverage
        torch.testing.assert_close(match.locs["0.weight"][i], g_in / P_in)
        torch.testing.assert_close(match.locs["2.weight"][:, i], kappa * g_out / P_out)
        torch.testing.assert_close(match.variances["2.weight"][:, i], kappa ** 2 / P_out)
    # the output bias has no atom: each class's share-weighted average (deterministic here)
    torch.testing.assert_close(match.locs["2.bias"], (shares * torch.stack([c[0]["2.bias"] for c in clients])).sum(0)
                               / shares.sum(0))


def test_the_atom_posterior_rule_is_a_matched_method_and_needs_matching():
    assert "atom-posterior" in method_options("match")["rule"].values()
    assert "atom-posterior" not in method_options("fusion")["rule"].values()
    assert FusionConfig(rule="atom-posterior", align="match").rule == "atom-posterior"
    with pytest.raises(ValueError, match="rule: 'atom-posterior' fuses matched units"):
        FusionConfig(rule="atom-posterior")


# ------------------------------------------------------------------------------------------------ PVI


def _pvi_clients():
    """Two noisy permuted copies of one Bayesian MLP (4-6-3), their weights Bayesian, with their own variances."""
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    torch.manual_seed(5)
    spec = derive_spec(net, (4,))
    clients = []
    for j in range(2):
        g = torch.Generator().manual_seed(40 + j)
        base = {k: v.detach().double() for k, v in net.state_dict().items()}
        noisy = {k: v + 0.01 * torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in base.items()}
        u = {k: torch.rand(v.shape, generator=g, dtype=torch.float64) * 1e-3 + 1e-4 for k, v in base.items()
             if k.endswith("weight")}
        perm = {"0": torch.randperm(6, generator=g) if j else torch.arange(6)}
        clients.append((client_slice(spec, noisy, perm), client_slice(spec, u, perm)))
    return net, spec, clients


PVI_FIXED = dict(hyperparameters="fixed", tau2=1e-3, sigma0_2=1.0, gamma0=1.0)


def test_a_cavity_is_the_posterior_divided_by_the_factor_and_the_factor_the_posterior_over_the_cavity():
    from bnpfed.matching.posteriors import cavity, pvi_factor

    _, _, clients = _pvi_clients()
    q, c = clients
    factor = pvi_factor(q, c, prior_variance=2.0)
    for k in q[1]:   # natural parameters: precisions and precision-means subtract
        torch.testing.assert_close(factor[0][k], 1 / q[1][k] - 1 / c[1][k])
        torch.testing.assert_close(factor[1][k], q[0][k] / q[1][k] - c[0][k] / c[1][k])
    prior = pvi_factor(q, None, prior_variance=2.0)
    torch.testing.assert_close(prior[0]["0.weight"], 1 / q[1]["0.weight"] - 0.5)
    # dividing q by the factor of q over c gives c back (here every cavity precision is above the prior's)
    (means, variances), improper = cavity(q, factor, prior_variance=2.0)
    assert improper == 0
    for k in q[1]:
        torch.testing.assert_close(means[k], c[0][k])
        torch.testing.assert_close(variances[k], c[1][k])
    # a cavity wider than the prior is the prior there, and counted
    (means, variances), improper = cavity(q, factor, prior_variance=1e-9)
    assert improper == sum(v.numel() for v in q[1].values())
    assert torch.allclose(variances["0.weight"], torch.full_like(variances["0.weight"], 1e-9))


def test_pvi_fuses_the_prior_once_times_the_members_factors():
    """Round 1 (every cavity the prior): a unit of two members has precision lambda_0 + sum_j (1/u_j - lambda_0),
    i.e. the members' product with the prior counted once; conflation counts it twice."""
    net, spec, clients = _pvi_clients()
    pvi = match_posteriors(clients, rule="pvi", template=net, seed=0, prior_variance=0.5, **PVI_FIXED)
    assert pvi.widths == {"0": 6} and pvi.improper == 0
    (a0, a1) = pvi.assignments["0"]
    for l in range(6):
        i = int(a0[l])
        l1 = int((a1 == i).nonzero())
        u0, u1 = clients[0][1]["0.weight"][l], clients[1][1]["0.weight"][l1]
        v0, v1 = clients[0][0]["0.weight"][l], clients[1][0]["0.weight"][l1]
        lam = 2.0 + (1 / u0 - 2.0) + (1 / u1 - 2.0)
        torch.testing.assert_close(pvi.unit_variances["0.weight"][i], 1 / lam)
        torch.testing.assert_close(pvi.unit_locs["0.weight"][i], (v0 / u0 + v1 / u1) / lam)


def test_under_pvi_a_round_in_which_no_client_learns_leaves_the_global_posterior_as_it_was():
    """If every client's new posterior is just its slice (it learned nothing new), its new factor is its old one and
    the fused posterior is unchanged; fusing the slices by conflation instead would count the data twice (the
    precision of every two-member unit doubles)."""
    from bnpfed.matching.posteriors import cavity, pvi_factor

    net, spec, clients = _pvi_clients()
    first = match_posteriors(clients, rule="pvi", template=net, seed=0, prior_variance=0.5, **PVI_FIXED)
    factors = [pvi_factor(q, None, 0.5) for q in clients]
    slices = [first.client_slice(j) for j in range(2)]
    cavities = [cavity(s, f, 0.5)[0] for s, f in zip(slices, factors)]
    new_factors = [pvi_factor(s, c, 0.5) for s, c in zip(slices, cavities)]
    for f, g in zip(factors, new_factors):
        for k in f[0]:
            torch.testing.assert_close(g[0][k], f[0][k], rtol=1e-6, atol=1e-3)
    again = match_posteriors(slices, rule="pvi", template=net, seed=0, prior_variance=0.5, factors=new_factors,
                             **PVI_FIXED)
    for k in first.variances:
        torch.testing.assert_close(again.unit_variances[k], first.unit_variances[k], rtol=1e-6, atol=0)
        torch.testing.assert_close(again.unit_locs[k], first.unit_locs[k], rtol=1e-6, atol=1e-9)
    conflated = match_posteriors(slices, rule="conflation", template=net, seed=0, **PVI_FIXED)
    ratio = first.unit_variances["0.weight"] / conflated.unit_variances["0.weight"]
    torch.testing.assert_close(ratio, torch.full_like(ratio, 2.0), rtol=1e-6, atol=0)


def test_pvi_rounds_train_against_the_cavity_and_are_reproducible(digits):
    parts = PartitionConfig(clients=3).split(digits.y_train.numpy(), seed=0)

    def run():
        fed = MatchedFusionFederation(digits, parts, network=NetworkConfig(hidden=(16,)),
                                      training=TrainingConfig(epochs=2, lr=1e-2), bayesian=BayesianConfig(),
                                      fusion=FusionConfig(rule="pvi", align="match"), seed=0)
        return fed, fed.run(rounds=3)

    fed, records = run()
    _, again = run()
    assert [r.metrics["accuracy"] for r in records] == [r.metrics["accuracy"] for r in again]
    assert fed.method == "match-pvi" and fed.pvi.damping is None   # the harmonic schedule
    assert [fed.pvi.step(j) for j in range(3)] == [1 / 3] * 3   # the third update of every factor
    assert {"cavity_at_prior", "improper"} <= set(records[-1].metrics)
    assert records[-1].metrics["accuracy"] > 0.5
    # the next round's client j trains against its cavity: its slice of the global posterior over its factor
    from bnpfed.matching.posteriors import cavity

    j = 1
    expected, _ = cavity(fed.match.client_slice(fed.matched.index(j)), fed.pvi.factors[j], 1.0)
    fed.run_round()
    prior = fed.clients[j].bnn.prior
    for site in ("1.weight", "3.weight"):
        d = prior.site_distribution(site, None)
        torch.testing.assert_close(d.base_dist.loc.double(), expected[0][site], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(d.base_dist.scale.double() ** 2, expected[1][site], rtol=1e-5, atol=1e-9)


def test_pvi_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="fraction: rule 'pvi' keeps every client's factor"):
        FusionConfig(rule="pvi", align="match", fraction=0.5)
    with pytest.raises(ValueError, match="rule: 'pvi' fuses matched units"):
        FusionConfig(rule="pvi")
    with pytest.raises(ValueError, match="pvi_damping: expected a number in"):
        FusionConfig(rule="pvi", align="match", experimental=ExperimentalOptions(pvi_damping=0.0))
    ds = load_dataset("digits")
    parts = PartitionConfig(clients=2).split(ds.y_train.numpy(), seed=0)
    for bayesian in (BayesianConfig(prior_variance="empirical-bayes"), BayesianConfig(client="laplace")):
        with pytest.raises(ValueError, match="fusion.rule: 'pvi' trains variational clients"):
            MatchedFusionFederation(ds, parts, network=NetworkConfig(hidden=(8,)), training=TrainingConfig(epochs=1),
                                    bayesian=bayesian, fusion=FusionConfig(rule="pvi", align="match"), seed=0)
    net, spec, clients = _pvi_clients()
    with pytest.raises(ValueError, match="factors: expected only with rule='pvi'"):
        match_posteriors(clients, rule="conflation", template=net, factors=[None, None], **PVI_FIXED)
    with pytest.raises(ValueError, match="prior_variance: the clients' prior of rule='pvi'"):
        match_posteriors(clients, rule="conflation", template=net, prior_variance=2.0, **PVI_FIXED)


def test_where_the_matchers_empirical_bayes_starts_reaches_every_group_of_matched_fusion():
    """``starts``: the even split alone by default, both starts (the likelier kept) on request, as
    :func:`~bnpfed.matching.match_bayesian_layer` takes it; :class:`FusionConfig` checks and carries it."""
    from bnpfed.federated import FusionConfig

    net, locs, variances = bayesian_net(1, False)
    spec, clients = permuted_copies(net, locs, variances, 3, (4,))
    counts = torch.ones(3, 3, dtype=torch.float64)
    default = match_posteriors(clients, counts, spec, template=net, seed=0)
    both = match_posteriors(clients, counts, spec, template=net, seed=0, starts="both")
    assert all(not r.starts for r in default.layer_results.values())
    assert all([s["start"] for s in r.starts] == ["small-noise", "even-split"] for r in both.layer_results.values())
    assert FusionConfig().starts == "even-split"
    assert FusionConfig(align="match", experimental=ExperimentalOptions(starts="both")).starts == "both"
    with pytest.raises(ValueError, match="starts: expected one of"):
        FusionConfig(align="match", experimental=ExperimentalOptions(starts="even"))


def test_the_matchers_device_reaches_every_group_of_matched_fusion():
    """``device`` (torch on the CPU here, the code a GPU runs) gives matched fusion the numpy path's assignments and
    fused posteriors, on the posteriors and on the means; it is the default matchers' option, refused with a given
    ``layer_fn``; :class:`FusionConfig` checks and carries it as ``matcher_device``."""
    from bnpfed.federated import FusionConfig
    from bnpfed.matching import match_bayesian_layer

    net, locs, variances = bayesian_net(1, False)
    spec, clients = permuted_copies(net, locs, variances, 3, (4,))
    counts = torch.ones(3, 3, dtype=torch.float64)
    for match_on in ("posteriors", "means"):
        numpy = match_posteriors(clients, counts, spec, template=net, seed=0, match_on=match_on)
        on_torch = match_posteriors(clients, counts, spec, template=net, seed=0, match_on=match_on, device="cpu")
        for g, r in numpy.layer_results.items():
            assert [a.tolist() for a in r.assignments] == [a.tolist() for a in on_torch.layer_results[g].assignments]
        for name, loc in numpy.locs.items():
            torch.testing.assert_close(on_torch.locs[name], loc, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="device: the default matchers' option"):
        match_posteriors(clients, counts, spec, template=net, layer_fn=match_bayesian_layer, device="cpu")
    assert FusionConfig(align="match", matcher_device="cpu").matcher_device == "cpu"
    with pytest.raises(ValueError, match="matcher_device: expected"):
        FusionConfig(align="match", matcher_device="gpu")


def _gaussian_pvi_rounds(damping: float, rounds: int, error: float):
    """PVI's server bookkeeping (:class:`~bnpfed.federated.PVIFactors`) on a conjugate toy: J = 4 clients, one site
    of 5 coordinates, client j's likelihood exactly ``N(w; m_j, s_j)`` per coordinate, so its exact reply to a cavity
    ``c`` is ``c * l_j`` and its exact factor ``l_j``. In round 1 every client replies ``p * l_j * e_j``, ``e_j`` an
    error of precision ``error`` and precision-mean ``error`` (a client short of its optimum); after it the replies
    are exact. Returns, per round, the global posterior's natural parameters minus the exact ones,
    ``(precision error, precision-mean error)`` summed over the coordinates."""
    from bnpfed.federated import PVIFactors

    J, v0 = 4, 2.0
    g = torch.Generator().manual_seed(3)
    lam = [torch.rand(5, generator=g, dtype=torch.float64) * 3 + 0.5 for _ in range(J)]
    eta = [torch.randn(5, generator=g, dtype=torch.float64) * lam[j] for j in range(J)]
    exact = (1 / v0 + sum(lam), sum(eta))
    pvi = PVIFactors(v0, damping)

    def as_posterior(precision, precision_mean):
        return {"w": precision_mean / precision}, {"w": 1 / precision}

    replies = [as_posterior(1 / v0 + lam[j] + error, eta[j] + error) for j in range(J)]
    errors = []
    for r in range(1, rounds + 1):
        if r > 1:   # each client from its cavity (its slice is the whole global posterior: nothing to match)
            replies = []
            for j in range(J):
                means, variances = pvi.cavity(j, as_posterior(*global_))
                m, v = means["w"], variances["w"]
                replies.append(as_posterior(1 / v + lam[j], m / v + eta[j]))
            assert pvi.improper == 0   # every cavity proper: the toy is exact
        factors = pvi.update(list(range(J)), replies)
        global_ = (1 / v0 + sum(f[0]["w"] for f in factors), sum(f[1]["w"] for f in factors))
        errors.append(tuple(float((a - b).sum()) for a, b in zip(global_, exact)))
    return errors


@pytest.mark.parametrize("damping", [0.1, 0.3, 0.5, 1.0, None])
def test_pvi_damping_leaves_one_minus_damping_to_the_r_minus_1_of_a_round_1_error_after_r_rounds(damping):
    """Round 1's factors are undamped; from round 2 on each factor moves ``damping`` of the way to its new value, so on
    a conjugate (Gaussian) likelihood, where every later reply is exact, a round-1 error is
    ``(1 - damping) ** (R - 1)`` of itself after R rounds: closed form, to float64 rounding. Undamped (1) PVI is
    exact from round 2. The harmonic schedule (``damping=None``: the k-th update moves 1/k of the way) leaves
    ``prod_{k=2..R} (1 - 1/k) = 1 / R``."""
    J, n, error, rounds = 4, 5, 0.3, 8
    errors = _gaussian_pvi_rounds(damping, rounds, error)
    for r, (d_lam, d_eta) in enumerate(errors, start=1):
        left = 1 / r if damping is None else (1 - damping) ** (r - 1)
        assert d_lam == pytest.approx(left * J * n * error, rel=1e-9, abs=1e-9)
        assert d_eta == pytest.approx(left * J * n * error, rel=1e-9, abs=1e-9)
    assert errors[0][0] == pytest.approx(J * n * error)   # the error is there to decay
