"""SVI clients: training, seeding, isolation from each other and from Pyro's global store, posterior read/write."""

import math

import pyro
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from bnpfed.data import load_dataset
from bnpfed.inference import BayesianClient, DeterministicClient, MeanFieldGuide
from bnpfed.models import IIDPrior, LeNet, mlp, only_linear_weights


def blobs(n=200, seed=0):
    """Two well separated Gaussian blobs in 2-D, at (-3, -3) and (3, 3)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 2, generator=g) + 3.0 * (2 * y[:, None] - 1)
    return x, y


def accuracy(probs, y):
    return (probs.argmax(-1) == y).float().mean().item()


def posteriors_equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1], b[k][1]) for k in a)


# ---------------------------------------------------------------- training


@pytest.mark.parametrize("local_reparameterization", [False, True])
def test_svi_reduces_the_loss_and_separates_blobs(local_reparameterization):
    x, y = blobs()
    client = BayesianClient(mlp(2, [16], 2), IIDPrior(), local_reparameterization=local_reparameterization)
    client.fit(x, y, epochs=30, batch_size=50, lr=0.05, seed=0)
    assert len(client.losses_) == 30
    assert client.losses_[-1] < 0.5 * client.losses_[0]
    x_test, y_test = blobs(seed=1)
    assert accuracy(client.predict_proba(x_test, num_samples=10, seed=0), y_test) >= 0.95


def test_bayesian_lenet_with_the_paper_preset_learns_digits():
    ds = load_dataset("digits")
    client = BayesianClient(LeNet(image_size=8), only_linear_weights(), local_reparameterization=True)
    client.fit(ds.x_train[:300], ds.y_train[:300], epochs=8, batch_size=50, lr=0.01, seed=0)
    assert client.losses_[-1] < client.losses_[0]
    assert accuracy(client.predict_proba(ds.x_test, seed=0), ds.y_test) > 0.6  # chance is 0.1


def test_loss_is_negative_elbo_divided_by_the_local_dataset_size():
    """With near-zero posterior variance the one-sample estimate is (KL + n/B * NLL(batch)) / n in closed form."""
    x, y = blobs(n=40)
    client = BayesianClient(mlp(2, [4], 2), IIDPrior())
    locs = {name: torch.randn(loc.shape) for name, (loc, _) in client.posterior().items()}
    variance = 1e-10
    client.load_posterior({name: (loc, torch.full_like(loc, variance)) for name, loc in locs.items()})
    net = mlp(2, [4], 2)
    net.load_state_dict(locs)
    # KL(N(mu, v) || N(0, 1)) summed over all weights
    kl = sum(0.5 * (variance + loc.pow(2) - 1 - math.log(variance)).sum() for loc in locs.values())
    with torch.no_grad():
        for batch, n in [(40, 40), (10, 40), (10, 1000)]:
            nll = F.cross_entropy(net(x[:batch]), y[:batch], reduction="sum")
            expected = (kl + n / batch * nll) / n
            assert_close(client.loss(x[:batch], y[:batch], dataset_size=n), expected, rtol=1e-4, atol=0)


def test_same_seed_same_posterior_and_the_global_rng_is_untouched():
    x, y = blobs(n=60)
    net = mlp(2, [8], 2)

    def train(seed):
        return BayesianClient(net, IIDPrior(), local_reparameterization=True).fit(
            x, y, epochs=2, batch_size=16, lr=0.01, seed=seed
        )

    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    a = train(seed=7)
    assert torch.equal(torch.rand(3), expected_draw)
    b, c = train(seed=7), train(seed=8)
    assert posteriors_equal(a.posterior(), b.posterior())
    assert not posteriors_equal(a.posterior(), c.posterior())
    assert torch.equal(a.predict_proba(x, seed=1), b.predict_proba(x, seed=1))


# ---------------------------------------------------------------- isolation


def test_clients_never_change_pyros_global_param_store():
    pyro.clear_param_store()
    sentinel = pyro.param("sentinel", torch.ones(2))
    x, y = blobs(n=40)
    x_img = x.repeat(1, 32).reshape(40, 1, 8, 8)
    clients = [BayesianClient(LeNet(image_size=8), only_linear_weights()) for _ in range(2)]
    for seed, client in enumerate(clients):
        client.fit(x_img, y, epochs=1, batch_size=20, lr=0.01, seed=seed)
        client.predict_proba(x_img, num_samples=2)
    store = pyro.get_param_store()
    assert list(store.keys()) == ["sentinel"]
    assert store["sentinel"] is sentinel and torch.equal(sentinel, torch.ones(2))
    assert pyro.settings.get("module_local_params") is False
    pyro.clear_param_store()


def test_training_one_client_leaves_another_unchanged():
    x, y = blobs(n=40)
    x_img = x.repeat(1, 32).reshape(40, 1, 8, 8)
    net = LeNet(image_size=8)
    a, b = BayesianClient(net, only_linear_weights()), BayesianClient(net, only_linear_weights())
    assert posteriors_equal(a.posterior(), b.posterior())  # same starting point
    b_posterior, b_state = b.posterior(), b.deterministic_state()
    a_state = a.deterministic_state()
    a.fit(x_img, y, epochs=2, batch_size=20, lr=0.01, seed=0)
    assert posteriors_equal(b.posterior(), b_posterior)
    assert all(torch.equal(b.deterministic_state()[k], v) for k, v in b_state.items())
    assert not posteriors_equal(a.posterior(), b_posterior)
    assert not all(torch.equal(a.deterministic_state()[k], v) for k, v in a_state.items())
    assert all(torch.equal(p, net.state_dict()[k]) for k, p in b_state.items())  # nor the user's network


# ---------------------------------------------------------------- reading and writing the posterior


def random_posterior(client, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(loc.shape, generator=g), torch.exp(torch.empty(loc.shape).uniform_(-12, 3, generator=g)))
        for name, (loc, _) in client.posterior().items()
    }


def test_posterior_reports_every_bayesian_site_with_init_values():
    net = LeNet(image_size=8)
    client = BayesianClient(net, only_linear_weights(), init_scale=0.05)
    posterior = client.posterior()
    assert list(posterior) == ["fc1.weight", "fc2.weight", "fc3.weight"]
    for name, (loc, variance) in posterior.items():
        assert torch.equal(loc, net.state_dict()[name])
        assert_close(variance, torch.full_like(loc, 0.05**2))
    assert set(client.deterministic_state()) == {n for n, _ in net.named_parameters()} - set(posterior)


def test_load_posterior_round_trips():
    client = BayesianClient(mlp(3, [5], 2), IIDPrior())
    given = random_posterior(client)  # variances from 6e-6 to 20
    client.load_posterior(given)
    for name, (loc, variance) in client.posterior().items():
        assert_close(loc, given[name][0], rtol=0, atol=0)
        assert_close(variance, given[name][1], rtol=1e-5, atol=0)


def test_load_posterior_writes_into_the_guides_parameters_in_place():
    client = BayesianClient(mlp(3, [5], 2), IIDPrior())
    params = [id(p) for p in client.guide.parameters()]
    client.load_posterior(random_posterior(client))
    assert [id(p) for p in client.guide.parameters()] == params


def test_guide_samples_follow_the_loaded_posterior():
    client = BayesianClient(mlp(3, [5], 2), IIDPrior())
    given = {name: (loc, var.clamp(1e-3, 4.0)) for name, (loc, var) in random_posterior(client, seed=1).items()}
    client.load_posterior(given)
    n = 2000
    with torch.no_grad(), pyro.poutine.seed(rng_seed=0):
        draws = [client.guide() for _ in range(n)]
    for name, (loc, variance) in given.items():
        samples = torch.stack([d[name] for d in draws])
        # 5 standard errors of the mean and of the (Gaussian) variance estimate
        assert ((samples.mean(0) - loc).abs() <= 5 * (variance / n).sqrt()).all()
        assert ((samples.var(0) - variance).abs() <= 5 * math.sqrt(2 / n) * variance).all()


def test_predictions_use_the_loaded_posterior():
    """With (almost) zero variance, every draw is the loaded mean: predictions are the plain network's."""
    net = LeNet(image_size=8)
    client = BayesianClient(net, only_linear_weights(), local_reparameterization=True)
    given = random_posterior(client, seed=2)
    client.load_posterior({name: (loc * 0.1, torch.full_like(loc, 1e-12)) for name, (loc, _) in given.items()})
    reference = LeNet(image_size=8)
    reference.load_state_dict(net.state_dict() | {name: loc * 0.1 for name, (loc, _) in given.items()})
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        assert_close(client.predict_proba(x, num_samples=3), reference(x).softmax(-1), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "corrupt,match",
    [
        (lambda p: p.pop("3.weight"), "3.weight"),
        (lambda p: p.update({"9.weight": p["1.weight"]}), "9.weight"),
        (lambda p: p.update({"1.bias": (torch.zeros(6), torch.ones(6))}), "1.bias"),
        (lambda p: p["3.bias"][0].__setitem__(0, float("nan")), "3.bias"),
        (lambda p: p["1.weight"][1].__setitem__((0, 0), 0.0), "1.weight"),
        (lambda p: p["1.weight"][1].__setitem__((0, 0), -1.0), "1.weight"),
        (lambda p: p["3.bias"][1].__setitem__(0, float("inf")), "3.bias"),
        (lambda p: p.update({"3.bias": torch.zeros(2)}), "3.bias"),
    ],
    ids=["missing", "extra", "shape", "nan", "zero-variance", "negative-variance", "inf", "not-a-pair"],
)
def test_bad_posterior_is_an_error_naming_the_site_and_changes_nothing(corrupt, match):
    client = BayesianClient(mlp(3, [5], 2), IIDPrior())
    before = client.posterior()
    posterior = random_posterior(client)
    corrupt(posterior)
    with pytest.raises(ValueError, match=match.replace(".", r"\.")):
        client.load_posterior(posterior)
    assert posteriors_equal(client.posterior(), before)


def test_deterministic_state_round_trips_and_is_validated():
    client = BayesianClient(LeNet(image_size=8), only_linear_weights())
    state = {name: torch.randn(v.shape) for name, v in client.deterministic_state().items()}
    client.load_deterministic(state)
    assert all(torch.equal(client.deterministic_state()[k], v) for k, v in state.items())
    with pytest.raises(ValueError, match="conv1.bias"):
        client.load_deterministic({k: v for k, v in state.items() if k != "conv1.bias"})
    with pytest.raises(ValueError, match="fc1.bias"):
        client.load_deterministic(state | {"fc1.bias": torch.zeros(3)})
    with pytest.raises(ValueError, match="fc1.weight"):  # Bayesian, so not part of the deterministic state
        client.load_deterministic(state | {"fc1.weight": torch.zeros(120, 64)})


def test_predict_proba_is_normalised_and_seedable():
    x, y = blobs(n=30)
    client = BayesianClient(mlp(2, [8], 2), IIDPrior(), init_scale=1.0)
    probs = client.predict_proba(x, num_samples=5, seed=0)
    assert probs.shape == (30, 2)
    assert_close(probs.sum(-1), torch.ones(30))
    assert torch.equal(client.predict_proba(x, num_samples=5, seed=0), probs)
    assert not torch.equal(client.predict_proba(x, num_samples=5, seed=1), probs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(epochs=0), "epochs"),
        (dict(batch_size=0), "batch_size"),
        (dict(lr=-1.0), "lr"),
        (dict(seed=None), "seed"),
        (dict(y=torch.zeros(40)), "y"),
        (dict(y=torch.zeros(39, dtype=torch.long)), "y"),
    ],
)
def test_fit_rejects_bad_arguments(kwargs, match):
    x, y = blobs(n=40)
    args = dict(x=x, y=y) | kwargs
    for client in (BayesianClient(mlp(2, [], 2), IIDPrior()), DeterministicClient(mlp(2, [], 2))):
        with pytest.raises(ValueError, match=match):
            client.fit(**args)


def test_guide_and_client_reject_bad_construction():
    with pytest.raises(ValueError, match="init_scale"):
        BayesianClient(mlp(2, [], 2), IIDPrior(), init_scale=0.0)
    with pytest.raises(ValueError, match="init_locs"):  # a prior that makes nothing Bayesian
        MeanFieldGuide({})


# ---------------------------------------------------------------- the deterministic baseline


def test_deterministic_client_learns_blobs_reproducibly_without_touching_the_net():
    x, y = blobs()
    net = mlp(2, [16], 2)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    a = DeterministicClient(net).fit(x, y, epochs=10, batch_size=50, lr=0.05, seed=0)
    b = DeterministicClient(net).fit(x, y, epochs=10, batch_size=50, lr=0.05, seed=0)
    assert a.losses_[-1] < 0.5 * a.losses_[0]
    x_test, y_test = blobs(seed=1)
    assert accuracy(a.predict_proba(x_test), y_test) >= 0.95
    assert all(torch.equal(a.state()[k], v) for k, v in b.state().items())
    assert all(torch.equal(net.state_dict()[k], v) for k, v in before.items())


def test_deterministic_state_load_round_trip_and_validation():
    client = DeterministicClient(mlp(2, [4], 3))
    state = {k: torch.randn(v.shape) for k, v in client.state().items()}
    client.load_state(state)
    assert all(torch.equal(client.state()[k], v) for k, v in state.items())
    x = torch.randn(5, 2)
    assert_close(client.predict_proba(x).sum(-1), torch.ones(5))
    with pytest.raises(ValueError, match="3.weight"):
        client.load_state(state | {"3.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="1.bias"):
        client.load_state(state | {"1.bias": torch.full((4,), float("nan"))})
