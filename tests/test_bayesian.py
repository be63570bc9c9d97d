"""Bayesian networks as Pyro programs: priors, the model's sites, local reparameterisation, prediction."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.nn import PyroModule
from torch import nn
from torch.testing import assert_close

from bnpfed.models import (
    BayesianNetwork,
    Categorical,
    Gaussian,
    IIDPrior,
    LayerwisePrior,
    LeNet,
    LocalReparameterizedLinear,
    linear_weights,
    local_reparameterization,
    mlp,
    only_linear_weights,
)
from bnpfed.seeding import seeded

LENET_PARAMS = [
    "conv1.weight",
    "conv1.bias",
    "conv2.weight",
    "conv2.bias",
    "fc1.weight",
    "fc1.bias",
    "fc2.weight",
    "fc2.bias",
    "fc3.weight",
    "fc3.bias",
]


def weight_sites(bnn, x):
    """The model trace's weight sites: name -> (prior distribution, sampled value)."""
    trace = poutine.trace(bnn.model).get_trace(x)
    return {name: (site["fn"], site["value"]) for name, site in trace.nodes.items() if name in bnn.bayesian_sites}


def base(fn):
    while isinstance(fn, torch.distributions.Independent):
        fn = fn.base_dist
    return fn


# ---------------------------------------------------------------- networks


@pytest.mark.parametrize("in_channels,image_size,flat", [(1, 28, 400), (1, 8, 64), (3, 32, 576), (1, 4, 16)])
def test_lenet_runs_on_mnist_digits_and_cifar_sizes(in_channels, image_size, flat):
    net = LeNet(in_channels=in_channels, image_size=image_size, num_classes=7)
    assert net.fc1.in_features == flat
    assert net(torch.zeros(3, in_channels, image_size, image_size)).shape == (3, 7)
    assert [name for name, _ in net.named_parameters()] == LENET_PARAMS


def test_mlp_flattens_and_alternates_linear_relu():
    net = mlp(64, [16, 8], 10)
    assert [type(m) for m in net] == [nn.Flatten, nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear]
    assert net(torch.zeros(5, 1, 8, 8)).shape == (5, 10)
    assert mlp(4, [], 3)(torch.zeros(2, 4)).shape == (2, 3)


@pytest.mark.parametrize("bad", [dict(in_features=0), dict(hidden=[4, -1]), dict(out_features=2.0)])
def test_mlp_rejects_bad_sizes_naming_the_argument(bad):
    kwargs = dict(in_features=4, hidden=[4], out_features=2) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        mlp(**kwargs)


# ---------------------------------------------------------------- priors


def test_iid_prior_by_default_makes_every_parameter_a_sample_site():
    net = mlp(4, [3], 2)
    bnn = BayesianNetwork(net, IIDPrior())
    names = [name for name, _ in net.named_parameters()]
    assert list(bnn.bayesian_sites) == names
    assert bnn.deterministic_params == ()
    assert list(bnn.parameters()) == []
    sites = weight_sites(bnn, torch.zeros(2, 4))
    assert set(sites) == set(names)
    for name, param in net.named_parameters():
        fn, value = sites[name]
        assert value.shape == param.shape
        assert fn.event_shape == param.shape and fn.batch_shape == ()


def test_paper_preset_on_lenet_makes_exactly_the_three_fc_weight_matrices_bayesian():
    bnn = BayesianNetwork(LeNet(image_size=8), only_linear_weights())
    assert bnn.bayesian_sites == ("fc1.weight", "fc2.weight", "fc3.weight")
    assert set(bnn.deterministic_params) == set(LENET_PARAMS) - set(bnn.bayesian_sites)
    assert {name for name, _ in bnn.named_parameters()} == {"net." + n for n in bnn.deterministic_params}
    assert set(weight_sites(bnn, torch.zeros(2, 1, 8, 8))) == set(bnn.bayesian_sites)


def test_hide_and_expose_select_parameters():
    net = LeNet(image_size=8)
    assert BayesianNetwork(net, IIDPrior(hide=["*.bias"])).bayesian_sites == tuple(
        n for n in LENET_PARAMS if n.endswith("weight")
    )
    assert BayesianNetwork(net, IIDPrior(expose=[nn.Conv2d], hide=["conv2.*"])).bayesian_sites == (
        "conv1.weight",
        "conv1.bias",
    )


def test_layerwise_prior_gives_each_site_its_first_matching_distribution():
    prior = LayerwisePrior(
        {
            "fc3.*": dist.Normal(0.0, 0.1),
            linear_weights: dist.Normal(1.0, 2.0),
            nn.Conv2d: None,
            "conv1.*": dist.Normal(5.0, 5.0),  # shadowed by nn.Conv2d above, but it matches, so it is legal
        }
    )
    bnn = BayesianNetwork(LeNet(image_size=8), prior)
    assert bnn.bayesian_sites == ("fc1.weight", "fc2.weight", "fc3.weight", "fc3.bias")
    sites = weight_sites(bnn, torch.zeros(1, 1, 8, 8))
    expected = {"fc1.weight": (1.0, 2.0), "fc2.weight": (1.0, 2.0), "fc3.weight": (0.0, 0.1), "fc3.bias": (0.0, 0.1)}
    for name, (loc, scale) in expected.items():
        normal = base(sites[name][0])
        assert isinstance(normal, dist.Normal)
        assert_close(normal.loc, torch.full_like(normal.loc, loc))
        assert_close(normal.scale, torch.full_like(normal.scale, scale))


@pytest.mark.parametrize(
    "make_prior,match",
    [
        (lambda: IIDPrior(expose=["fc9.*"]), "fc9"),
        (lambda: IIDPrior(hide=[nn.LSTM]), "LSTM"),
        (lambda: LayerwisePrior({"fc1.weight": dist.Normal(0.0, 1.0), "nope": None}), "nope"),
    ],
)
def test_selector_that_matches_nothing_is_an_error_naming_it(make_prior, match):
    with pytest.raises(ValueError, match=match):
        BayesianNetwork(LeNet(image_size=8), make_prior())


def test_bad_prior_arguments_are_errors_naming_the_argument():
    with pytest.raises(ValueError, match="distribution"):
        IIDPrior(dist.Normal(torch.zeros(2), 1.0).to_event(1))
    with pytest.raises(ValueError, match="expose"):
        IIDPrior(expose=[3])
    with pytest.raises(ValueError, match="hide"):
        IIDPrior(hide="*.bias")  # a single pattern, not a list of them
    with pytest.raises(ValueError, match="rules"):
        LayerwisePrior({"fc1.weight": "normal"})
    with pytest.raises(ValueError, match="fc1.weight"):  # batch shape (5,) does not fit (120, 64)
        BayesianNetwork(LeNet(image_size=8), LayerwisePrior({"fc1.weight": dist.Normal(torch.zeros(5), 1.0)}))
    with pytest.raises(ValueError, match="likelihood"):
        BayesianNetwork(mlp(2, [], 2), IIDPrior(), likelihood="gaussian")
    with pytest.raises(ValueError, match="prior"):
        BayesianNetwork(mlp(2, [], 2), dist.Normal(0.0, 1.0))


def test_users_network_is_not_mutated():
    net = LeNet(image_size=8)
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    bnn = BayesianNetwork(net, IIDPrior())
    poutine.trace(bnn.model).get_trace(torch.randn(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    assert type(net) is LeNet and not isinstance(net, PyroModule)
    assert all(type(m).__module__.startswith("torch") for m in net.children())
    after = dict(net.named_parameters())
    assert list(after) == list(before)
    for name, value in before.items():
        assert isinstance(after[name], nn.Parameter) and torch.equal(after[name], value)
    # the guide's starting point is the network's initialisation
    assert all(torch.equal(bnn.init_values[name], before[name]) for name in bnn.bayesian_sites)


# ---------------------------------------------------------------- the model


@pytest.mark.parametrize(
    "prior,mean,variance",
    [
        (dist.Normal(0.0, 1.0), 0.0, 1.0),
        (dist.Normal(0.5, 0.2), 0.5, 0.04),
        (dist.Laplace(-1.0, 0.5), -1.0, 0.5),
    ],
)
def test_prior_samples_have_the_priors_mean_and_variance(prior, mean, variance):
    bnn = BayesianNetwork(mlp(64, [64], 10), IIDPrior(prior))
    x = torch.zeros(1, 64)
    with pyro.poutine.seed(rng_seed=0):
        draws = torch.cat([v.flatten() for _ in range(4) for _, v in weight_sites(bnn, x).values()])
    n = draws.numel()  # 4 x 4810 independent entries
    # 5 standard errors; the variance's standard error sqrt((m4 - v^2) / n) is below sqrt(5 v^2 / n) for these priors
    assert abs(draws.mean().item() - mean) < 5 * math.sqrt(variance / n)
    assert abs(draws.var().item() - variance) < 5 * math.sqrt(5 * variance**2 / n)


@pytest.mark.parametrize("batch,dataset_size,scale", [(8, 100, 12.5), (8, None, 1.0), (4, 4, 1.0)])
def test_model_has_categorical_y_site_scaled_to_the_local_dataset(batch, dataset_size, scale):
    bnn = BayesianNetwork(mlp(3, [5], 4), only_linear_weights())
    x, y = torch.randn(batch, 3), torch.randint(0, 4, (batch,))
    trace = poutine.trace(bnn.model).get_trace(x, y, dataset_size=dataset_size)
    site = trace.nodes["y"]
    assert site["is_observed"] and torch.equal(site["value"], y)
    assert isinstance(site["fn"], dist.Categorical) and site["fn"].batch_shape == (batch,)
    assert site["scale"] == scale
    # weights are outside the data plate: sampled once per batch, not scaled
    assert all(trace.nodes[name]["scale"] == 1.0 for name in bnn.bayesian_sites)
    trace.compute_log_prob()
    logits = trace.nodes["_RETURN"]["value"]
    assert_close(site["log_prob_sum"], -scale * nn.functional.cross_entropy(logits, y, reduction="sum"))


def test_model_rejects_bad_arguments():
    bnn = BayesianNetwork(mlp(3, [], 2), IIDPrior())
    x = torch.randn(5, 3)
    with pytest.raises(ValueError, match="dataset_size"):
        bnn.model(x, torch.zeros(5, dtype=torch.long), dataset_size=4)
    with pytest.raises(ValueError, match="y"):
        bnn.model(x, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="x"):
        bnn.model(torch.zeros(0, 3))


# ---------------------------------------------------------------- local reparameterisation


def gaussian_guide(posterior):
    def guide(*args, **kwargs):
        for name, (loc, variance) in posterior.items():
            pyro.sample(name, dist.Normal(loc, variance.sqrt()).to_event(loc.dim()))

    return guide


@pytest.mark.parametrize("bayesian_bias", [True, False])
def test_local_reparameterisation_matches_weight_sampling_moments(bayesian_bias):
    """Pre-activations b = x W^T + c have mean x mu^T + E[c] and variance x^2 (sigma2)^T + Var[c] either way."""
    g = torch.Generator().manual_seed(0)
    layer = nn.Linear(3, 2)
    x = torch.tensor([[1.0, -2.0, 0.5]])
    posterior = {"weight": (torch.randn(2, 3, generator=g), 0.1 + torch.rand(2, 3, generator=g))}
    if bayesian_bias:
        posterior["bias"] = (torch.randn(2, generator=g), 0.1 + torch.rand(2, generator=g))
    prior = IIDPrior() if bayesian_bias else only_linear_weights()
    guide = gaussian_guide(posterior)
    w_loc, w_var = posterior["weight"]
    b_loc, b_var = posterior.get("bias", (layer.bias.detach(), torch.zeros(2)))
    mean = x @ w_loc.T + b_loc
    variance = x.pow(2) @ w_var.T + b_var

    n = 4000
    sampled = BayesianNetwork(layer, prior)
    local = BayesianNetwork(layer, prior, local_reparameterization=True)
    with torch.no_grad(), pyro.poutine.seed(rng_seed=1):
        by_weights = torch.cat([sampled.sample_output(x, guide) for _ in range(n)])  # a new W per row
        by_activations = local.sample_output(x.expand(n, 3), guide)  # one W draw, noise per row
    for draws in (by_weights, by_activations):
        # 5 standard errors of the mean and (Gaussian) variance estimates
        assert_close(draws.mean(0), mean[0], atol=(5 * (variance[0] / n).sqrt()).max().item(), rtol=0)
        assert_close(draws.var(0), variance[0], rtol=5 * math.sqrt(2 / n), atol=0)
    # the trick is really in effect: identical inputs get different pre-activations within one draw
    with torch.no_grad():
        assert torch.unique(local.sample_output(x.expand(10, 3), guide)[:, 0]).numel() == 10
        assert torch.unique(sampled.sample_output(x.expand(10, 3), guide)[:, 0]).numel() == 1


def test_local_reparameterisation_leaves_other_layers_alone():
    """Non-Gaussian weights and deterministic weights fall back to plain F.linear."""
    x = torch.randn(4, 3)
    for prior in (IIDPrior(dist.Laplace(0.0, 1.0)), IIDPrior(hide=["weight"])):
        bnn = BayesianNetwork(nn.Linear(3, 2), prior, local_reparameterization=True)
        with pyro.poutine.seed(rng_seed=0), local_reparameterization():
            trace = poutine.trace(bnn.output).get_trace(x)
        weight = trace.nodes["weight"]["value"] if "weight" in trace.nodes else bnn.net.weight
        bias = trace.nodes["bias"]["value"] if "bias" in trace.nodes else bnn.net.bias
        assert_close(trace.nodes["_RETURN"]["value"], x @ weight.T + bias)


def test_local_reparameterisation_handler_restores_linear():
    layer = nn.Linear(3, 2)
    with local_reparameterization():
        pass
    x = torch.randn(2, 3)
    assert_close(layer(x), x @ layer.weight.T + layer.bias)


# ---------------------------------------------------------------- prediction


def test_predict_averages_the_softmax_of_num_samples_draws():
    bnn = BayesianNetwork(mlp(2, [8], 3), IIDPrior())
    x = torch.randn(6, 2)
    probs = bnn.predict(x, num_samples=7, seed=3)
    assert probs.shape == (6, 3)
    assert_close(probs.sum(-1), torch.ones(6))
    # the same draws, by hand: seed 3, then seven weight samples from the prior
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(3)
        by_hand = torch.stack([bnn.sample_output(x).softmax(-1) for _ in range(7)]).mean(0)
    assert_close(probs, by_hand)
    assert torch.equal(bnn.predict(x, num_samples=7, seed=3), probs)


def test_averaging_more_samples_makes_predictions_agree_across_seeds():
    bnn = BayesianNetwork(mlp(2, [8], 3), IIDPrior())
    x = torch.randn(20, 2)
    spread = {
        s: torch.stack([bnn.predict(x, num_samples=s, seed=seed) for seed in range(4)]).std(0).mean().item()
        for s in (1, 200)
    }
    assert spread[1] > 0.05  # one prior draw: predictions depend on the seed
    assert spread[200] < spread[1] / 5  # roughly 1/sqrt(200) of it
    with pytest.raises(ValueError, match="num_samples"):
        bnn.predict(x, num_samples=0)


# ---------------------------------------------------------------- likelihood objects


def test_gaussian_likelihood_observes_y_around_the_output_and_mixes_the_draws():
    bnn = BayesianNetwork(mlp(3, [5], 1), IIDPrior(), likelihood=Gaussian(scale=0.3))
    x, y = torch.randn(6, 3), torch.randn(6)
    trace = poutine.trace(bnn.model).get_trace(x, y, dataset_size=12)
    site = trace.nodes["y"]
    assert isinstance(site["fn"], dist.Normal) and site["scale"] == 2.0
    output = trace.nodes["_RETURN"]["value"]
    assert_close(site["fn"].loc, output[:, 0])
    assert_close(site["fn"].scale, torch.full((6,), 0.3))
    predictive = bnn.predict(x, num_samples=5, seed=1)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(1)
        draws = torch.stack([bnn.sample_output(x)[:, 0] for _ in range(5)])
    assert_close(predictive.mean, draws.mean(0))
    assert_close(predictive.variance, 0.09 + draws.var(0, unbiased=False))
    with pytest.raises(ValueError, match=r"y: expected a tensor of shape \(6,\)"):
        bnn.model(x, torch.randn(6, 2))


@pytest.mark.parametrize(
    "likelihood,y,match",
    [
        (Categorical(), torch.tensor([0.0, 1.0]), "integer class labels"),
        (Categorical(), torch.tensor([0, 3]), r"in 0 \.\. 2 \(the network has 3 outputs\), got labels from 0 to 3"),
        (Categorical(num_classes=4), torch.tensor([0, 1]),
         r"likelihood: expected a network with 4 outputs for Categorical\(num_classes=4\), got one with 3"),
        (Gaussian(), torch.tensor([0, 1]), "floating-point"),
        (Gaussian(), torch.tensor([0.0, float("nan")]), "NaN"),
        (Gaussian(), torch.zeros(2, 3), r"shape \(2,\)"),
    ],
)
def test_likelihoods_name_bad_targets(likelihood, y, match):
    with pytest.raises(ValueError, match=match):
        likelihood.check_targets(y, 2, output=torch.zeros(1, 3 if isinstance(likelihood, Categorical) else 1))


def test_bad_likelihood_arguments_are_errors_naming_them():
    with pytest.raises(ValueError, match="scale"):
        Gaussian(scale=0.0)
    with pytest.raises(ValueError, match="num_classes"):
        Categorical(num_classes=0)


# ---------------------------------------------------------------- priors read on every run


def test_prior_update_before_building_a_network_is_checked_against_it():
    prior = only_linear_weights()
    prior.update_({"1.weight": (torch.zeros(3, 4), torch.full((3, 4), 0.25))})
    bnn = BayesianNetwork(mlp(4, [3], 2), prior)
    normal = base(bnn.prior_distributions()["1.weight"])
    assert_close(normal.scale, torch.full((3, 4), 0.5))
    assert torch.equal(base(bnn.prior_distributions()["3.weight"]).scale, torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"prior: expected a posterior .* of its parameter's shape \(5, 4\) for "
                                         r"'1.weight', got shape \(3, 4\)"):
        BayesianNetwork(mlp(4, [5], 2), prior)
    with pytest.raises(ValueError, match="1.weight"):
        BayesianNetwork(mlp(4, [3], 2), IIDPrior(expose=["3.*"]).update_({"1.weight": (torch.zeros(1), torch.ones(1))}))


def test_a_prior_shared_by_two_networks_is_updated_for_both():
    prior = only_linear_weights()
    a, b = BayesianNetwork(mlp(4, [3], 2), prior), BayesianNetwork(mlp(4, [3], 2), prior)
    prior.update_({"3.weight": (torch.ones(2, 3), torch.ones(2, 3))})
    for bnn in (a, b):
        assert torch.equal(base(bnn.prior_distributions()["3.weight"]).loc, torch.ones(2, 3))


# ---------------------------------------------------------------- the same network as plain torch


@pytest.mark.parametrize("make,prior,shape", [
    (lambda: LeNet(image_size=8), only_linear_weights(), (1, 8, 8)),
    (lambda: nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.BatchNorm1d(4), nn.Linear(4, 2)),
     IIDPrior(hide=["2.*"]), (3,)),
])
def test_output_at_is_the_conditioned_pyro_program(make, prior, shape):
    bnn = BayesianNetwork(make(), prior)
    x = torch.randn(5, *shape)
    values = {name: torch.randn(v.shape) for name, v in bnn.init_values.items()}
    # deterministic parameters changed after construction, in place and by replacement, are seen
    with torch.no_grad():
        next(bnn.net.parameters()).add_(1.0)
    module_name, _, attr = bnn.deterministic_params[-1].rpartition(".")
    module = bnn.net.get_submodule(module_name)
    with pyro.settings.context(module_local_params=True):
        setattr(module, attr, nn.Parameter(torch.randn(getattr(module, attr).shape)))
    for mode in ("eval", "train"):
        getattr(bnn, mode)()
        with seeded(0):
            expected = poutine.condition(bnn.output, data=values)(x)
        with seeded(0):
            assert_close(bnn.output_at(x, values), expected)


def test_module_level_local_reparameterisation_draws_what_the_handler_draws():
    layer = nn.Linear(3, 2)
    loc, var = torch.randn(2, 3), torch.rand(2, 3)
    x = torch.randn(4, 3)
    bnn = BayesianNetwork(layer, IIDPrior(hide=["bias"]), local_reparameterization=True)
    guide = gaussian_guide({"weight": (loc, var)})
    with seeded(0):
        expected = bnn.sample_output(x, guide)  # draws the weight, then the pre-activations
    with seeded(0):
        weight = loc + torch.randn(2, 3) * var.sqrt()
        assert_close(bnn.output_at(x, {"weight": weight}, {"weight": (loc, var)}), expected)
    assert_close(bnn.output_at(x, {"weight": weight}), x @ weight.T + bnn.net.bias)  # no moments: plain layer
    with pytest.raises(ValueError, match="Linear"):
        LocalReparameterizedLinear.convert_(nn.Conv2d(1, 1, 1))


def test_models_use_the_one_seeded_of_bnpfed_seeding():
    import bnpfed.models.bayesian
    import bnpfed.seeding

    assert bnpfed.models.bayesian.seeded is bnpfed.seeding.seeded
