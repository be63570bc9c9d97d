"""A client is a Pyro program: a PyroModule with PyroSample priors, or a model function with its guide, fitted,
read as (loc, variance) per latent site in the guide's unconstrained space, written back, and fused."""

import functools

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import (AutoDelta, AutoDiagonalNormal, AutoIAFNormal, AutoLowRankMultivariateNormal,
                                  AutoMultivariateNormal, AutoNormal)
from pyro.nn import PyroModule, PyroParam, PyroSample
from torch import nn
from torch.distributions import constraints
from torch.testing import assert_close

from bnpfed.clients import BayesianClient, MeanFieldGuide
from bnpfed.combine import available_rules, fuse_sites
from bnpfed.models import Gaussian, IIDPrior, mlp


class Net(PyroModule):
    """The issue's network, as a Pyro user writes it: 64 -> 32 -> 10, a per-layer scale with a HalfNormal
    hyper-prior on the first layer, fixed Normal priors on the other weights."""

    def __init__(self):
        super().__init__()
        self.tau = PyroSample(dist.HalfNormal(torch.tensor(1.0)))
        self.fc1 = PyroModule[nn.Linear](64, 32)
        self.fc1.weight = PyroSample(lambda m: dist.Normal(0.0, self.tau).expand([32, 64]).to_event(2))
        self.fc1.bias = PyroSample(dist.Normal(0.0, 1.0).expand([32]).to_event(1))
        self.fc2 = PyroModule[nn.Linear](32, 10)
        self.fc2.weight = PyroSample(dist.Normal(0.0, 1.0).expand([10, 32]).to_event(2))
        self.fc2.bias = PyroSample(dist.Normal(0.0, 1.0).expand([10]).to_event(1))

    def forward(self, x, y=None):
        logits = self.fc2(torch.relu(self.fc1(x)))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


def flat(digits):
    return (digits.x_train.reshape(len(digits.x_train), -1), digits.y_train,
            digits.x_test.reshape(len(digits.x_test), -1), digits.y_test)


def accuracy(probs, y):
    return (probs.argmax(-1) == y).float().mean().item()


# ------------------------------------------------------------ a linear model whose posterior is known in closed form

SIGMA = 0.5


def regression(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0]):
        return pyro.sample("obs", dist.Normal(x @ w, SIGMA), obs=y)


def linear_data(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + SIGMA * torch.randn(n, generator=g)
    return x, y


def exact_mean_field(x, y):
    """The mean-field Gaussian optimum of the conjugate linear model: the exact posterior N(m, P^-1) has precision
    P = I + X'X / sigma^2 and mean m = P^-1 X'y / sigma^2; the KL(q || p)-optimal factorised Gaussian keeps the mean
    m and takes the variances 1 / diag(P)."""
    precision = torch.eye(3, dtype=torch.float64) + x.double().T @ x.double() / SIGMA**2
    mean = torch.linalg.solve(precision, x.double().T @ y.double() / SIGMA**2)
    return mean.float(), (1.0 / precision.diagonal()).float()


@pytest.mark.parametrize("guide", ["AutoNormal", "AutoDiagonalNormal"])
def test_a_model_function_with_an_autoguide_reaches_the_closed_form_mean_field_posterior(guide):
    x, y = linear_data()
    kind = {"AutoNormal": AutoNormal, "AutoDiagonalNormal": AutoDiagonalNormal}[guide]
    client = BayesianClient(regression, guide=kind(regression, init_scale=0.1))
    # mini-batches of 10 of the 40 examples: the client scales each batch's likelihood by 4
    client.fit(x, y, epochs=800, batch_size=10, lr=0.005, seed=0)
    mean, variance = exact_mean_field(x, y)
    posterior = client.posterior()
    assert list(posterior) == ["w"]
    # tolerances: the last steps' Monte Carlo noise (one draw per step at lr 0.005; the posterior sd is 0.08),
    # measured 0.006 on the means and 14 % on the variances for both guides
    assert_close(posterior["w"].loc, mean, atol=0.02, rtol=0)
    assert_close(posterior["w"].variance, variance, rtol=0.3, atol=0)


def test_a_program_client_scales_a_batch_to_its_dataset_and_predicts_the_gaussian_mixture():
    x, y = linear_data()
    client = BayesianClient(regression, guide=AutoNormal(regression))
    client.fit(x, y, epochs=1, batch_size=40, seed=0)
    client.load_posterior({"w": (torch.tensor([1.0, 0.0, 0.0]), torch.full((3,), 0.04))})
    full = client.loss(x, y)                                        # -ELBO / n on the whole data
    with torch.no_grad():
        halves = [client.loss(x[i:i + 20], y[i:i + 20], dataset_size=40) for i in (0, 20)]
    # the two halves, each standing for all 40 examples, average to the whole (up to their Monte Carlo draws)
    assert abs((halves[0] + halves[1]).item() / 2 - full.item()) < 0.1 * abs(full.item())
    prediction = client.predict(x[:5], num_samples=2000, seed=0)
    # the predictive of w ~ N((1, 0, 0), 0.04 I): mean x_1, variance sigma^2 + 0.04 |x|^2
    assert_close(prediction.mean, x[:5, 0], atol=0.03, rtol=0)
    assert_close(prediction.variance, SIGMA**2 + 0.04 * x[:5].square().sum(-1), rtol=0.1, atol=0)


def test_the_posterior_goes_back_into_every_kind_of_guide_exactly():
    x, y = linear_data()
    posterior = {"w": (torch.tensor([0.3, -0.2, 0.1]), torch.tensor([0.01, 0.02, 0.03]))}
    for guide in (AutoNormal(regression), AutoDiagonalNormal(regression),
                  MeanFieldGuide({"w": torch.zeros(3)}, init_scale=0.1), SiteGuide()):
        client = BayesianClient(regression, guide=guide).fit(x, y, epochs=1, batch_size=40, seed=0)
        client.load_posterior(posterior)
        back = client.posterior()
        assert_close(back["w"].loc, posterior["w"][0])
        assert_close(back["w"].variance, posterior["w"][1])
        with pytest.raises(ValueError, match=r"posterior\['w'\] variance"):
            client.load_posterior({"w": (torch.zeros(3), torch.tensor([0.1, 0.0, 0.1]))})
        with pytest.raises(ValueError, match="posterior"):
            client.load_posterior({"v": posterior["w"]})


class SiteGuide(PyroModule):
    """A guide written by hand: one Normal per site, its scale a positive PyroParam."""

    def __init__(self):
        super().__init__()
        self.loc = PyroParam(torch.zeros(3))
        self.scale = PyroParam(torch.full((3,), 0.1), constraint=constraints.positive)

    def forward(self, x, y=None):
        pyro.sample("w", dist.Normal(self.loc, self.scale).to_event(1))


# ------------------------------------------------------------ refused by name, before any training


@pytest.mark.parametrize("kind", [AutoMultivariateNormal, AutoLowRankMultivariateNormal, AutoIAFNormal, AutoDelta])
def test_a_guide_that_is_not_mean_field_gaussian_is_refused_by_name(kind):
    guide = kind(regression, hidden_dim=[4]) if kind is AutoIAFNormal else kind(regression)
    with pytest.raises(ValueError, match=f"guide: .*got {kind.__name__}"):
        BayesianClient(regression, guide=guide)


def test_a_handwritten_guide_with_a_site_that_is_no_normal_is_refused_before_training():
    class LaplaceGuide(SiteGuide):
        def forward(self, x, y=None):
            pyro.sample("w", dist.Laplace(self.loc, self.scale).to_event(1))

    x, y = linear_data()
    client = BayesianClient(regression, guide=LaplaceGuide())
    with pytest.raises(ValueError, match="guide: .*LaplaceGuide, which draws site 'w' from .*Laplace"):
        client.fit(x, y, epochs=1, seed=0)
    assert client.losses_ == [] and torch.equal(client.guide.loc, torch.zeros(3))


def test_a_normal_on_a_constrained_site_must_be_in_the_unconstrained_space():
    def scaled(x, y=None):
        tau = pyro.sample("tau", dist.HalfNormal(1.0))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(0.0, tau), obs=y)

    class Wrong(PyroModule):
        def __init__(self):
            super().__init__()
            self.loc = PyroParam(torch.tensor(1.0))

        def forward(self, x, y=None):
            pyro.sample("tau", dist.Normal(self.loc, 0.1))

    with pytest.raises(ValueError, match="site 'tau' from a Normal, but the site's support"):
        BayesianClient(scaled, guide=Wrong()).fit(torch.zeros(4, 1), torch.randn(4), epochs=1, seed=0)


def test_programs_that_a_client_cannot_read_are_refused_with_the_reason():
    x, y = linear_data(8)

    def two_observed(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(x @ w, 1.0), obs=y)
            pyro.sample("again", dist.Normal(x @ w, 1.0), obs=y)

    def per_example(x, y=None):
        with pyro.plate("data", x.shape[0]):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("obs", dist.Normal(z, 1.0), obs=y)

    def subsampled(x, y=None):
        w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        with pyro.plate("data", 1000, subsample=torch.arange(x.shape[0])):
            pyro.sample("obs", dist.Normal(x @ w, 1.0), obs=y)

    for model, message in ((two_observed, "one observed site"), (per_example, r"\['z'\], whose shapes follow"),
                           (subsampled, "scales a batch to the dataset itself")):
        with pytest.raises(ValueError, match=message):
            BayesianClient(model, guide=AutoNormal(model)).fit(x, y, epochs=1, seed=0)
    with pytest.raises(ValueError, match="prior: expected a Prior object for the network Sequential"):
        BayesianClient(mlp(3, [4], 2))
    with pytest.raises(ValueError, match="likelihood: a Pyro program's observed site is its likelihood"):
        BayesianClient(regression, likelihood=object())
    with pytest.raises(ValueError, match="guide: expected a guide module"):
        BayesianClient(regression, guide=lambda x, y=None: None)
    with pytest.raises(ValueError, match="posterior: the guide AutoNormal is set up on the client's first batch"):
        BayesianClient(regression).posterior()


# ------------------------------------------------------------ the issue's network


def test_clients_of_one_program_are_isolated_and_leave_the_users_objects_and_the_global_store_alone(digits):
    x, y, _, _ = flat(digits)
    pyro.clear_param_store()
    torch.manual_seed(0)
    model = Net()
    guide = AutoNormal(model)
    held = guide.model
    a = BayesianClient(model, guide=guide).fit(x[:200], y[:200], epochs=2, seed=0)
    b = BayesianClient(model, guide=guide).fit(x[200:400], y[200:400], epochs=2, seed=0)
    assert len(pyro.get_param_store()) == 0
    assert guide.prototype_trace is None and guide.model is held    # the user's guide never ran, still has its model
    # the hyper-prior is the copy's own site (its PyroSample function points at the copy, not at the user's module)
    assert set(a.posterior()) == {"tau", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert not torch.equal(a.posterior()["fc1.weight"].loc, b.posterior()["fc1.weight"].loc)
    b.load_posterior(a.posterior())
    assert_close(b.posterior()["tau"].loc, a.posterior()["tau"].loc)


def test_three_program_clients_fuse_under_every_rule_into_a_model_that_predicts(digits):
    x, y, x_test, y_test = flat(digits)
    parts = torch.randperm(len(x), generator=torch.Generator().manual_seed(0)).chunk(3)
    clients = []
    for j, part in enumerate(parts):
        model = Net()
        # one rate for all (scale_lr=lr): one shot, weight by weight, the clients' units are aligned only while
        # their posteriors stay narrow around the shared start; at the default ten-times rate their scales reach the
        # prior's size within these 30 epochs, the clients drift apart (alone 0.52-0.57) and one-shot fusion is at
        # chance but for conflation (0.27; measured), which is what issue 51's clients at their optimum change
        clients.append(BayesianClient(model, guide=AutoNormal(model)).fit(x[part], y[part], epochs=30,
                                                                          batch_size=32, lr=1e-2, scale_lr=1e-2,
                                                                          seed=j))
    server = clients[0]
    for rule in available_rules():
        fused = fuse_sites([c.posterior() for c in clients], rule, torch.full((3,), 1 / 3), num_samples=10,
                           generator=torch.Generator().manual_seed(0))
        assert "tau" in fused                         # the hyper-parameter fused as any site, in log space
        server.load_posterior(fused)
        assert_close(server.posterior()["tau"].loc, fused["tau"].loc)
        # measured one shot from the shared initialisation: 0.56 (eaa) to 0.83 (conflation); chance is 0.1
        assert accuracy(server.predict_proba(x_test, num_samples=10, seed=0), y_test) > 0.45, rule


@pytest.mark.slow
def test_the_issues_program_runs_as_written_and_learns_the_hyper_scale_plain_pyro_svi_learns(digits):
    x, y, x_test, y_test = flat(digits)
    model = Net()
    client = BayesianClient(model, guide=AutoNormal(model))
    client.fit(x, y, epochs=60, seed=0); posterior = client.posterior()   # noqa: E702 (the issue's line)
    assert "tau" in posterior
    # a program's guide trains at one rate for all by default, as Pyro's SVI trains it (measured 0.93 before 0.2)
    assert accuracy(client.predict_proba(x_test, seed=0), y_test) > 0.8
    # plain Pyro SVI on the same model and data: the same guide, Adam at the client's default rate 1e-3 for every
    # parameter, as many steps (full batches; the client's are mini-batches of 64 scaled to the dataset)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    reference, reference_guide = Net(), None
    reference_guide = AutoNormal(reference)
    rates = pyro.optim.Adam({"lr": 1e-3})
    svi = SVI(reference, reference_guide, rates, Trace_ELBO())
    for _ in range(60 * -(-len(x) // 64)):
        svi.step(x, y)
    tau = posterior["tau"].loc.exp().item()               # the median of tau, exp of its unconstrained mean
    reference_tau = pyro.param("AutoNormal.locs.tau").exp().item()
    pyro.clear_param_store()
    # measured before 0.2: 0.304 against 0.314
    assert abs(tau - reference_tau) <= 0.25 * reference_tau


@pytest.mark.parametrize("guide", [None, AutoNormal, AutoDiagonalNormal])
def test_a_network_with_a_prior_object_takes_pyros_autoguides_and_reaches_the_closed_form_posterior(guide):
    """Linear regression as a network (weights and bias Bayesian, N(0, 1), Gaussian noise 0.5): every guide reaches
    the mean-field optimum of the conjugate model, the bias a weight on a constant feature."""
    x, y = linear_data()
    client = BayesianClient(mlp(3, [], 1), IIDPrior(), likelihood=Gaussian(scale=SIGMA), init_scale=0.1) \
        if guide is None else BayesianClient(mlp(3, [], 1), IIDPrior(), likelihood=Gaussian(scale=SIGMA),
                                             guide=functools.partial(guide, init_scale=0.1))
    # one rate for all: at the default ten times lr the scales' last iterate jitters by Adam's step (the bias's
    # variance 55 % off the closed form after these 800 epochs; measured), and this test is about the guides
    client.fit(x, y, epochs=800, batch_size=10, lr=0.005, scale_lr=0.005, seed=0)
    features = torch.cat([x, torch.ones(len(x), 1)], 1)
    precision = torch.eye(4, dtype=torch.float64) + features.double().T @ features.double() / SIGMA**2
    mean = torch.linalg.solve(precision, features.double().T @ y.double() / SIGMA**2).float()
    variance = (1.0 / precision.diagonal()).float()
    posterior = client.posterior()
    loc = torch.cat([posterior["1.weight"].loc.reshape(-1), posterior["1.bias"].loc.reshape(-1)])
    var = torch.cat([posterior["1.weight"].variance.reshape(-1), posterior["1.bias"].variance.reshape(-1)])
    # the tolerances of the model-function test above (the same data, steps and rate)
    assert_close(loc, mean, atol=0.02, rtol=0)
    assert_close(var, variance, rtol=0.3, atol=0)


def test_the_default_guide_reads_a_hyper_prior_that_a_pyrosample_function_closes_over():
    """Without guide=, the client copies the program itself: the copy's fc1.weight prior must draw the copy's tau
    (a function closing over the original module would draw the original's, outside the copy's sites)."""
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    client = BayesianClient(Net()).prepare(x, y)
    assert sorted(client.posterior()) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "tau"]
    model = Net()
    given = BayesianClient(model, guide=AutoNormal(model)).prepare(x, y)
    for site, g in given.posterior().items():   # the same program, the same initial guide either way
        assert torch.equal(g.loc, client.posterior()[site].loc) and torch.equal(g.variance,
                                                                              client.posterior()[site].variance)


def test_prepare_checks_its_arguments_and_sets_the_guide_up_without_training():
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    client = BayesianClient(Net())
    with pytest.raises(ValueError, match="posterior: the guide AutoNormal is set up on the client's first batch"):
        client.posterior()
    with pytest.raises(ValueError, match=r"y: expected a tensor of shape \(8, ...\) matching x"):
        client.prepare(x, y[:3])
    assert client.prepare(x, y) is client and client.losses_ == []
    before = client.posterior()
    client.prepare(x, y)   # set up already: nothing changes
    assert all(torch.equal(g.loc, client.posterior()[s].loc) for s, g in before.items())
