"""A global network of the size a user asks for (bnpfed.matching.size): ``max_width`` and ``max_params`` met inside
the Beta-Bernoulli model, by the IBP mass, never by truncating; the result is the model's own match at the lowered
gamma0, and what the limit cost is said."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from bnpfed.federated.config import PFNMConfig
from bnpfed.matching import derive_spec, match_by_spec
from bnpfed.matching.size import BISECTIONS, BRACKET, SizeLimitError, fit_size, minimum_widths, parameter_count
from bnpfed.metrics import count_parameters
from bnpfed.models import mlp

J, D_IN, C = 4, 8, 3


def federation(hidden=(20,), pool=50, noise=0.05, seed=0):
    """J MLPs whose first hidden layer holds ``hidden[0]`` of ``pool`` shared units each (a random subset, plus
    noise): the model's own global width is far above one client's, so a limit between the two binds."""
    g = torch.Generator().manual_seed(seed)
    w_pool, b_pool = torch.randn(pool, D_IN, generator=g), 0.1 * torch.randn(pool, generator=g)
    nets = []
    for _ in range(J):
        net = mlp(D_IN, list(hidden), C)
        linears = [m for m in net if isinstance(m, nn.Linear)]
        pick = torch.randperm(pool, generator=g)[:hidden[0]]
        with torch.no_grad():
            linears[0].weight.copy_(w_pool[pick] + noise * torch.randn(hidden[0], D_IN, generator=g))
            linears[0].bias.copy_(b_pool[pick])
            for layer in linears[1:]:
                layer.weight.copy_(0.3 * torch.randn(layer.weight.shape, generator=g))
                layer.bias.zero_()
        nets.append(net)
    return nets


def valid_assignment(match, nets):
    """Every client unit belongs to exactly one global unit: no unit dropped, none of a client's two in one."""
    for group, labels in match.assignments.items():
        for j, ids in enumerate(labels):
            assert len(set(ids.tolist())) == ids.numel()
            assert int(ids.max()) < match.widths[group]
    return True


def test_max_width_is_met_by_the_ibp_mass_and_the_result_is_the_model_at_that_mass():
    nets = federation()
    own = match_by_spec(nets, seed=0)
    assert own.widths["1"] > 30   # the model's own width is over the limit below
    capped = match_by_spec(nets, seed=0, max_width=30)
    assert capped.widths["1"] <= 30 and valid_assignment(capped, nets)
    search = capped.size_searches["1"]
    assert search.binding and search.own == own.widths["1"] and search.size == capped.widths["1"]
    gamma_own, gamma = own.hyperparameters["1"]["gamma0"], capped.hyperparameters["1"]["gamma0"]
    assert gamma == pytest.approx(gamma_own * math.exp(-search.strength), rel=1e-12)
    assert any("max_width['1'] = 30" in n for n in capped.layer_results["1"].notes)
    # independent: the same model with that gamma0 given (the other hyper-parameters estimated) is the same match
    direct = match_by_spec(nets, seed=0, gamma0=gamma)
    assert direct.widths == capped.widths
    for a, b in zip(direct.assignments["1"], capped.assignments["1"]):
        assert torch.equal(a, b)
    # not truncation: the limited network's units are unions of the model's own (its members' averages)
    assert capped.parameters == count_parameters(capped.network())


def test_a_weaker_search_step_stays_over_the_limit():
    """The strength kept is the weakest found that fits: the strongest one tried that did not fit is weaker, and its
    match is over the limit."""
    nets = federation()
    search = match_by_spec(nets, seed=0, max_width=30).size_searches["1"]
    over = [t for t, size in search.trace if size > 30]
    assert over and max(over) < search.strength
    assert all(size <= 30 for t, size in search.trace if t >= search.strength)


def test_limits_that_do_not_bind_change_nothing():
    nets = federation(hidden=(20, 6))
    own = match_by_spec(nets, seed=0)
    for kwargs in (dict(max_width=1000), dict(max_width=[None, 500]), dict(max_params=10 ** 9),
                   dict(max_params=own.parameters), dict(max_width=own.widths)):
        limited = match_by_spec(nets, seed=0, **kwargs)
        assert limited.widths == own.widths
        for key, value in own.state.items():
            assert torch.equal(value, limited.state[key]), (kwargs, key)
        assert all(not s.binding for s in limited.size_searches.values())


def test_max_params_prices_every_unit_by_its_parameters():
    """max_params multiplies group g's gamma0 by exp(-lambda D_g), D_g the parameters a unit of g owns (incoming
    weights at the matched width below, bias; the last group's output weights too): checked per group against the
    model's own gamma0, with D_g counted here by hand; and sum_g L_g D_g + the output bias is the network's count (the
    price on the units is the price on the parameters)."""
    nets = federation(hidden=(20, 12))
    own = match_by_spec(nets, seed=0)
    ensemble = sum(count_parameters(n) for n in nets)
    assert own.parameters > 0.8 * ensemble
    limit = int(0.8 * ensemble)
    limited = match_by_spec(nets, seed=0, max_params=limit)
    assert limited.parameters <= limit and limited.parameters == count_parameters(limited.network())
    assert valid_assignment(limited, nets)
    t = limited.size_searches["parameters"].strength
    assert t > 0
    w1, w2 = limited.widths["1"], limited.widths["3"]
    dims = {"1": D_IN + 1, "3": w1 + 1 + C}                 # D_3 at this run's width below
    assert w1 * dims["1"] + w2 * dims["3"] + C == limited.parameters
    d_max = max(D_IN + 1, own.widths["1"] + 1 + C)           # at the model's own match
    for g in ("1", "3"):
        expected = own.hyperparameters[g]["gamma0"] * math.exp(-t * dims[g] / d_max)
        assert limited.hyperparameters[g]["gamma0"] == pytest.approx(expected, rel=1e-12), g


def test_ensemble_limit_is_the_clients_parameters_together():
    nets = federation(hidden=(20, 12))
    ensemble = sum(count_parameters(n) for n in nets)
    a = match_by_spec(nets, seed=0, max_params="ensemble")
    b = match_by_spec(nets, seed=0, max_params=ensemble)
    assert a.size_searches["parameters"].limit == ensemble and a.widths == b.widths


def test_parameter_count_of_a_conv_net_is_the_built_networks():
    def net(c1, c2, h):
        return nn.Sequential(nn.Conv2d(1, c1, 3), nn.BatchNorm2d(c1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(c1, c2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(c2 * 2 * 2, h), nn.ReLU(),
                             nn.Linear(h, 5))
    small = net(3, 4, 6)
    spec = derive_spec(small, (1, 10, 10))
    shapes = {k: tuple(v.shape) for k, v in small.state_dict().items()}
    names = [n for n, _ in small.named_parameters()]
    for widths in ((3, 4, 6), (7, 2, 11), (1, 9, 30)):
        by_group = dict(zip(spec.group_names, widths))
        assert parameter_count(spec, shapes, names, by_group) == count_parameters(net(*widths))


def test_limits_below_what_any_assignment_allows_are_refused_before_matching():
    nets = federation(hidden=(20, 12))

    def no_work(*args, **kwargs):
        raise AssertionError("matched before the limits were checked")

    with pytest.raises(ValueError, match=r"max_width\['1'\]: expected at least 20 \(client 0 has 20 units"):
        match_by_spec(nets, seed=0, max_width=19, layer_fn=no_work)
    floor = parameter_count(derive_spec(nets[0], (D_IN,)), {k: tuple(v.shape) for k, v in nets[0].state_dict().items()},
                            [n for n, _ in nets[0].named_parameters()], {"1": 20, "3": 12})
    with pytest.raises(ValueError, match=rf"max_params: expected at least {floor} "):
        match_by_spec(nets, seed=0, max_params=floor - 1, layer_fn=no_work)
    for bad, message in ((0, "max_width\\['1'\\]: expected an int >= 1"), (2.5, "max_width\\['1'\\]: expected")):
        with pytest.raises(ValueError, match=message):
            match_by_spec(nets, seed=0, max_width=bad, layer_fn=no_work)
    with pytest.raises(ValueError, match="max_params: expected a positive int, 'ensemble' or None, got 'big'"):
        match_by_spec(nets, seed=0, max_params="big", layer_fn=no_work)
    with pytest.raises(ValueError, match="max_width: expected a scalar, one value per group"):
        match_by_spec(nets, seed=0, max_width=[30], layer_fn=no_work)
    spec = derive_spec(nets[0], (D_IN,))
    with pytest.raises(ValueError, match="max_params: expected a template network"):
        match_by_spec([n.state_dict() for n in nets], spec=spec, seed=0, max_params=10 ** 6, layer_fn=no_work)
    assert minimum_widths([{"a": 3, "b": 5}, {"a": 4, "b": 1}]) == {"a": 4, "b": 5}


def test_a_matcher_without_an_ibp_mass_cannot_take_a_limit():
    from bnpfed.baselines.averaging import kmeans_layer
    nets = federation()
    with pytest.raises(ValueError, match="max_width: applies to a Beta-Bernoulli matcher"):
        match_by_spec(nets, seed=0, max_width=30, layer_fn=kmeans_layer(25))


def test_fit_size_keeps_the_weakest_strength_found_that_fits():
    def size(t):
        return int(100 * math.exp(-t / 50))

    result, search = fit_size(lambda t: t, size, 40, "limit")
    assert size(result) <= 40 and search.size == size(result) and search.strength == result
    assert search.trace[0] == (0.0, 100) and search.own == 100 and search.binding
    weaker = [t for t, s in search.trace if s > 40]
    assert size(max(weaker)) > 40
    assert search.size == 40 or result - max(weaker) <= (BRACKET[3] - BRACKET[2]) / 2 ** BISECTIONS
    result, search = fit_size(lambda t: t, lambda t: int(1000 * math.exp(-t / 50)) // 7, 40, "limit")
    gap = result - max(t for t, s in search.trace if s > 40)
    assert search.size == 40 or gap <= (BRACKET[3] - BRACKET[2]) / 2 ** BISECTIONS
    with pytest.raises(ValueError, match="limit: expected a limit the matcher can meet, got 0"):
        fit_size(lambda t: t, lambda t: 5, 0, "limit")
    result, search = fit_size(lambda t: t, size, 100, "limit")
    assert result == 0.0 and not search.binding and "not binding" in search.note()


def test_a_best_effort_limit_the_matcher_cannot_meet_keeps_the_smallest_match_found_and_says_so():
    """FedMA's default budget: a width no strength reaches gives the smallest match run (not the last), noted."""
    def size(t):   # shrinks to 17 by t = 8, then grows again a little: the smallest is not at the strongest
        return 17 if 8 <= t < 100 else 18 if t >= 100 else 30

    with pytest.raises(ValueError, match="limit: expected a limit the matcher can meet, got 16"):
        fit_size(lambda t: t, size, 16, "limit")
    result, search = fit_size(lambda t: t, size, 16, "limit", best_effort=True)
    assert size(result) == search.size == 17 and not search.met and search.binding
    assert search.strength == result == min(t for t, s in search.trace if s == 17)
    assert [t for t, _ in search.trace] == [0.0, *BRACKET]   # the bracket only: no bisection without a fit
    assert "not met (best effort)" in search.note() and "has 17 against the model's own 30" in search.note()
    result, search = fit_size(lambda t: t, size, 20, "limit", best_effort=True)
    assert search.met and search.size <= 20   # a limit it can meet: the same search as without best effort


def test_pfnm_config_checks_and_passes_the_limits():
    assert PFNMConfig(max_width=(None, 30)).matcher_kwargs()["max_width"] == (None, 30)
    assert PFNMConfig(max_params="ensemble").matcher_kwargs()["max_params"] == "ensemble"
    assert "max_width" not in PFNMConfig().matcher_kwargs()
    with pytest.raises(ValueError, match=r"max_width\[1\]: expected an int >= 1"):
        PFNMConfig(max_width=(30, 0))
    with pytest.raises(ValueError, match="max_params: expected one of"):
        PFNMConfig(max_params="half")
    assert PFNMConfig(max_params=1000, layerwise_retrain=2).max_params == 1000   # FedMA splits it into widths


def test_the_default_budget_is_the_ensembles_for_fedma_and_the_models_own_for_pfnm():
    """``max_params="auto"``: FedMA's layer-wise scheme at the ensemble's size (measured: 0.2-0.4 points below its own
    size at 5-8x fewer parameters), PFNM at the model's own (a one-shot budget costs it 10-70 points on LeNet)."""
    assert PFNMConfig().max_params == "auto" and PFNMConfig().parameter_limit is None
    assert "max_params" not in PFNMConfig().matcher_kwargs()
    assert PFNMConfig(layerwise_retrain=2).parameter_limit == "ensemble"
    assert PFNMConfig(layerwise_retrain=2, max_params=None).parameter_limit is None
    assert PFNMConfig(layerwise_retrain=2, max_params=5000).parameter_limit == 5000
    assert PFNMConfig(max_params="ensemble").parameter_limit == "ensemble"
    assert PFNMConfig().best_effort_budget and not PFNMConfig(max_params="ensemble").best_effort_budget


def test_limits_from_a_later_round_leave_the_rounds_before_at_the_models_own_size():
    """``limit_from_round``: PFNM's step matches at the model's own size before it and under the limits from it on;
    it needs a limit to start, and FedMA's layer-wise rounds (a budget split into widths every round) refuse it."""
    later = PFNMConfig(max_params="ensemble", max_width=40, limit_from_round=2)
    first = later.in_round(1)
    assert (first.max_params, first.max_width, first.limit_from_round) == (None, None, 1)
    assert later.in_round(2) is later and later.in_round(9) is later
    assert PFNMConfig(max_params=5000).in_round(1).max_params == 5000   # default: every round
    with pytest.raises(ValueError, match="limit_from_round: expected 1 unless max_width or max_params sets a limit"):
        PFNMConfig(limit_from_round=2)
    with pytest.raises(ValueError, match="limit_from_round: expected 1 with layerwise_retrain"):
        PFNMConfig(max_params="ensemble", layerwise_retrain=2, limit_from_round=2)
    with pytest.raises(ValueError, match="limit_from_round: expected an int >= 1"):
        PFNMConfig(max_params="ensemble", limit_from_round=0)
    with pytest.raises(ValueError, match="round: expected an int >= 1"):
        later.in_round(0)


def test_a_best_effort_budget_no_strength_meets_keeps_the_smallest_match_and_an_explicit_one_is_refused():
    """Units the model will not merge at any price (fixed noise 1e-8: two distinct units are exp(-10^7) apart, far
    below the bracket's exp(-512) on gamma0): ``best_effort=True`` keeps the smallest match found and says it missed;
    without it the budget is refused. ``best_effort`` without a budget is an error, not a no-op."""
    nets = federation()
    fixed = dict(hyperparameters="fixed", sigma2=1e-8, sigma0_2=1.0, gamma0=1.0)
    own = match_by_spec(nets, seed=0, **fixed)
    floor = parameter_count(derive_spec(nets[0], (D_IN,)), {k: tuple(v.shape) for k, v in nets[0].state_dict().items()},
                            [n for n, _ in nets[0].named_parameters()], {"1": 20})
    limit = (floor + own.parameters) // 2
    kept = match_by_spec(nets, seed=0, max_params=limit, best_effort=True, **fixed)
    search = kept.size_searches["parameters"]
    assert not search.met and search.size == kept.parameters > limit and valid_assignment(kept, nets)
    assert search.size == min(size for _, size in search.trace)
    with pytest.raises(SizeLimitError, match="max_params: expected a limit the matcher can meet"):
        match_by_spec(nets, seed=0, max_params=limit, **fixed)
    with pytest.raises(ValueError, match="best_effort: applies to a max_params budget only"):
        match_by_spec(nets, seed=0, best_effort=True, **fixed)
    # below what any assignment allows (a client sent the whole global network holds more than the budget): kept,
    # and missed, with best effort; refused before any matching without it
    below = match_by_spec(nets, seed=0, max_params=floor - 1, best_effort=True)
    assert not below.size_searches["parameters"].met and below.parameters >= floor
    with pytest.raises(SizeLimitError, match="max_params: expected at least"):
        match_by_spec(nets, seed=0, max_params=floor - 1)


def test_a_budget_no_match_meets_is_refused_in_round_one_and_met_as_far_as_the_matcher_can_in_later_rounds():
    """A round after the first keeps the smallest match found and says so (``met`` False) instead of ending the
    federation mid-way (its clients hold slices of the global network, which may merge no further); round 1 refuses
    it, as a one-shot match does. FedMA's budget split into widths follows the same rule."""
    from bnpfed.federated.server import fedma_width_limits, pfnm_step
    nets = federation()
    fixed = dict(hyperparameters="fixed", sigma2=1e-8, sigma0_2=1.0, gamma0=1.0)
    own = match_by_spec(nets, seed=0, **fixed)
    floor = parameter_count(derive_spec(nets[0], (D_IN,)), {k: tuple(v.shape) for k, v in nets[0].state_dict().items()},
                            [n for n, _ in nets[0].named_parameters()], {"1": 20})
    config = PFNMConfig(max_params=(floor + own.parameters) // 2, **fixed)
    counts = torch.ones(J, C)
    with pytest.raises(SizeLimitError, match="max_params: expected a limit the matcher can meet"):
        pfnm_step(nets, counts, config, seed=0, round=1)
    later = pfnm_step(nets, counts, config, seed=0, round=2)
    search = later.size_searches["parameters"]
    assert not search.met and search.size == later.parameters > config.max_params and valid_assignment(later, nets)
    assert [config.best_effort_in(r) for r in (1, 2, 7)] == [False, True, True]
    assert PFNMConfig(layerwise_retrain=1).best_effort_in(1)   # FedMA's default budget: in every round
    # FedMA: a budget the first group overdrew (every unit kept apart) limits the groups above to one client's width
    # in a later round, where round 1 refuses it
    nets = federation(hidden=(20, 12))
    spec, states = derive_spec(nets[0], (D_IN,)), [n.state_dict() for n in nets]
    budget = sum(count_parameters(n) for n in nets) // 2
    explicit = PFNMConfig(layerwise_retrain=1, max_params=budget)
    with pytest.raises(SizeLimitError, match="max_params: expected at least"):
        fedma_width_limits(explicit, spec, nets[0], states, budget, matched={"1": 20 * J},
                           best_effort=explicit.best_effort_in(1))
    kept = fedma_width_limits(explicit, spec, nets[0], states, budget, matched={"1": 20 * J},
                              best_effort=explicit.best_effort_in(2))
    assert kept.max_width == (20 * J, 12) and kept.max_params is None


def test_flower_run_config_reads_the_limits():
    from bnpfed.flower.config import parse_run_config
    assert parse_run_config({"max-params": "ensemble"}).pfnm.max_params == "ensemble"
    assert parse_run_config({"max-params": 5000}).pfnm.max_params == 5000
    assert parse_run_config({"max-params": "5000"}).pfnm.max_params == 5000
    assert parse_run_config({"max-width": "none,30"}).pfnm.max_width == (None, 30)
    with pytest.raises(ValueError, match="max-params: expected one of"):
        parse_run_config({"max-params": "half"})


def test_lenet_limited_to_its_ensembles_size_on_digits():
    """A trained conv net federation (LeNet on the bundled digits): max_params='ensemble' gives a global network
    no larger than the clients' together, every unit assigned."""
    from bnpfed.data import load_dataset
    from bnpfed.federated.clients import train_network
    from bnpfed.federated.config import TrainingConfig
    from bnpfed.models.networks import LeNet
    ds = load_dataset("digits")
    torch.manual_seed(0)
    x, y = ds.x_train.reshape(-1, 1, 8, 8), ds.y_train
    nets = []
    for j in range(3):
        torch.manual_seed(j)
        net = LeNet(in_channels=1, image_size=8, num_classes=10, conv1_padding=2)
        idx = torch.arange(j, len(y), 3)
        nets.append(train_network(net, x[idx], y[idx], TrainingConfig(epochs=3, batch_size=32, lr=0.01), seed=0,
                                  round=1, client=j))
    ensemble = sum(count_parameters(n) for n in nets)
    own = match_by_spec(nets, input_shape=(1, 8, 8), seed=0)
    limit = min(ensemble, int(0.7 * own.parameters))
    limited = match_by_spec(nets, input_shape=(1, 8, 8), seed=0, max_params=limit)
    assert limited.parameters <= limit < own.parameters and valid_assignment(limited, nets)
    assert np.isfinite(limited.network()(x[:4]).detach().numpy()).all()


def test_fedma_matches_one_group_within_its_max_width():
    """FedMA's one-group step takes the group's max_width as match_by_spec does (the same search: its match equals
    match_by_spec's for the first group)."""
    from bnpfed.matching import match_group
    nets = federation(hidden=(20, 12))
    spec = derive_spec(nets[0], (D_IN,))
    whole = match_by_spec(nets, seed=0, max_width=[30, None])
    first = match_group(nets, spec, "1", seed=0, max_width=[30, None])
    assert first.size == whole.widths["1"] <= 30 and first.size_search.binding
    for a, b in zip(first.assignments, whole.assignments["1"]):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"max_width\['1'\]: expected at least 20"):
        match_group(nets, spec, "1", seed=0, max_width=10)
    assert PFNMConfig(layerwise_retrain=2, max_width=(30, None)).matcher_kwargs()["max_width"] == (30, None)


def test_fedmas_default_budget_overdrawn_below_limits_the_groups_above_to_one_clients_width():
    """Under max_params="auto" (FedMA's default) a budget the groups below already overdrew is best effort: the
    groups above are limited to one client's width; an explicit budget is refused as before."""
    from bnpfed.federated.server import fedma_width_limits
    from bnpfed.matching.size import SizeLimitError
    nets = federation(hidden=(20, 12))
    spec = derive_spec(nets[0], (D_IN,))
    states = [n.state_dict() for n in nets]
    ensemble = sum(count_parameters(n) for n in nets)
    matched = {"1": 20 * len(nets)}   # the first layer kept every unit apart: the budget is spent
    auto = fedma_width_limits(PFNMConfig(layerwise_retrain=1), spec, nets[0], states, ensemble // 2, matched=matched)
    assert auto.max_width == (20 * len(nets), 12) and auto.max_params is None
    with pytest.raises(SizeLimitError, match="max_params: expected at least"):
        fedma_width_limits(PFNMConfig(layerwise_retrain=1, max_params=ensemble // 2), spec, nets[0], states,
                           ensemble // 2, matched=matched)


def test_pfnms_one_shot_step_keeps_its_own_size_in_an_experiment_that_also_runs_fedma():
    """``max_params="auto"`` is the ensemble's size for FedMA's layer-wise rounds only: PFNM's whole-network step
    (``pfnm_step``, an experiment's one-shot "pfnm" row) given the same config, FedMA's ``layerwise_retrain``
    included, matches at the model's own size, as with ``PFNMConfig()`` (a budget silently shrank it, or failed on
    CIFAR-10 where no match meets the ensemble's size)."""
    from bnpfed.data import load_dataset
    from bnpfed.federated.clients import train_network
    from bnpfed.federated.config import TrainingConfig
    from bnpfed.federated.server import pfnm_step
    from bnpfed.models.networks import LeNet
    ds = load_dataset("digits")
    x, y = ds.x_train.reshape(-1, 1, 8, 8), ds.y_train
    nets = []
    for j in range(3):
        torch.manual_seed(j)
        idx = torch.arange(j, len(y), 3)
        nets.append(train_network(LeNet(in_channels=1, image_size=8, num_classes=10, conv1_padding=2), x[idx], y[idx],
                                  TrainingConfig(epochs=2, batch_size=32, lr=0.01), seed=0, round=1, client=j))
    counts = torch.stack([torch.bincount(y[torch.arange(j, len(y), 3)], minlength=10) for j in range(3)])
    own = pfnm_step(nets, counts, PFNMConfig(), seed=0, round=1, input_shape=(1, 8, 8), template=nets[0])
    shared = pfnm_step(nets, counts, PFNMConfig(layerwise_retrain=2), seed=0, round=1, input_shape=(1, 8, 8),
                       template=nets[0])
    assert own.parameters > sum(count_parameters(n) for n in nets)   # above the ensemble's size: a budget would bind
    assert shared.widths == own.widths and not shared.size_searches
    assert all(torch.equal(shared.state[k], v) for k, v in own.state.items())
    explicit = pfnm_step(nets, counts, PFNMConfig(layerwise_retrain=2, max_params="ensemble"), seed=0, round=1,
                         input_shape=(1, 8, 8), template=nets[0])
    assert explicit.parameters <= sum(count_parameters(n) for n in nets) < own.parameters   # an explicit one holds


def test_pooled_heads_are_priced_as_the_j_output_layers_the_pooled_network_carries():
    """With ``heads="pooled"`` the global network carries every matched client's output layer
    (:func:`pooled_network`): ``parameter_count(..., heads=J)`` is that network's count, a ``max_params`` between
    the fused and the pooled network's own size binds and is met by the pooled network, and the last group's units
    are priced with their J output columns (D_g by hand)."""
    from bnpfed.matching import pooled_network
    from bnpfed.matching.size import head_parameters

    nets = federation(hidden=(20, 12))
    spec = derive_spec(nets[0], (D_IN,))
    shapes = {k: tuple(v.shape) for k, v in nets[0].state_dict().items()}
    names = [n for n, _ in nets[0].named_parameters()]
    own = match_by_spec(nets, seed=0)
    pooled_own = count_parameters(pooled_network(own, nets))
    assert parameter_count(spec, shapes, names, own.widths, heads=J) == pooled_own
    assert parameter_count(spec, shapes, names, own.widths) == own.parameters < pooled_own
    assert head_parameters(spec, shapes, "3") == C and head_parameters(spec, shapes, "1") == 0

    limit = (own.parameters + pooled_own) // 2      # the fused network fits, the pooled one does not
    fused_limit = match_by_spec(nets, seed=0, max_params=limit)
    assert fused_limit.widths == own.widths        # one output layer priced: the limit does not bind
    assert count_parameters(pooled_network(fused_limit, nets)) > limit
    limited = match_by_spec(nets, seed=0, max_params=limit, heads="pooled")
    assert valid_assignment(limited, nets)
    search = limited.size_searches["parameters"]
    pooled = count_parameters(pooled_network(limited, nets))
    assert search.binding and search.size == pooled <= limit
    t = search.strength
    w1 = limited.widths["1"]
    dims = {"1": D_IN + 1, "3": w1 + 1 + J * C}            # a unit of the last group owns J output columns
    d_max = max(D_IN + 1, own.widths["1"] + 1 + J * C)
    for g in ("1", "3"):
        expected = own.hyperparameters[g]["gamma0"] * math.exp(-t * dims[g] / d_max)
        assert limited.hyperparameters[g]["gamma0"] == pytest.approx(expected, rel=1e-12), g


def test_pooled_heads_pricing_is_checked_and_refused_where_it_prices_nothing():
    nets = federation(hidden=(20,))
    with pytest.raises(ValueError, match="heads: what max_params prices"):
        match_by_spec(nets, seed=0, heads="pooled")
    with pytest.raises(ValueError, match="heads"):
        match_by_spec(nets, seed=0, max_params="ensemble", heads="both")
    spec = derive_spec(nets[0], (D_IN,))
    shapes = {k: tuple(v.shape) for k, v in nets[0].state_dict().items()}
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="heads: expected the number of output layers"):
            parameter_count(spec, shapes, ["0.weight"], {"1": 20}, heads=bad)
    # the floor counts the heads too: one client's width with J output layers
    floor = parameter_count(spec, shapes, [n for n, _ in nets[0].named_parameters()], {"1": 20}, heads=J)
    with pytest.raises(SizeLimitError, match=rf"max_params: expected at least {floor} .*{J} output layers"):
        match_by_spec(nets, seed=0, max_params=floor - 1, heads="pooled")
    assert PFNMConfig(heads="pooled", max_params=500).matcher_kwargs()["heads"] == "pooled"
    assert "heads" not in PFNMConfig(heads="pooled").matcher_kwargs()
    assert "heads" not in PFNMConfig(max_params=500).matcher_kwargs()


def test_fedmas_budget_split_holds_the_pooled_heads():
    """FedMA's budget split (proportional_widths) with pooled heads leaves room for J output layers: the widths it
    gives, at the pooled count, fit the budget, and are narrower than the fused split's."""
    from bnpfed.federated.server import fedma_width_limits
    nets = federation(hidden=(20, 12))
    spec = derive_spec(nets[0], (D_IN,))
    states = [n.state_dict() for n in nets]
    shapes = {k: tuple(v.shape) for k, v in states[0].items()}
    names = [n for n, _ in nets[0].named_parameters()]
    ensemble = sum(count_parameters(n) for n in nets)
    fused = fedma_width_limits(PFNMConfig(layerwise_retrain=1), spec, nets[0], states, ensemble)
    pooled = fedma_width_limits(PFNMConfig(layerwise_retrain=1, heads="pooled"), spec, nets[0], states, ensemble)
    widths = dict(zip(spec.group_names, pooled.max_width))
    assert parameter_count(spec, shapes, names, widths, heads=J) <= ensemble
    assert pooled.max_width[1] < fused.max_width[1] and pooled.max_params is None
