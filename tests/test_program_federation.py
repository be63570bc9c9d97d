"""A Pyro user's own program in the federation: BayesianConfig(program=factory) makes every client (and the server's
model) the program, fused site by site by every rule, hyper-parameters included; one round is the hand-written loop
of the guide, bit for bit; later rounds start from the fused posterior against the program's own prior; what does
not apply to a program is refused by name before anything trains."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample
from torch import nn

from bnpfed.clients import BayesianClient
from bnpfed.combine import available_rules, fuse_sites
from bnpfed.data import load_dataset
from bnpfed.experimental import ExperimentalOptions
from bnpfed.federated import (BayesianConfig, ExperimentConfig, FusionConfig, FusionFederation,
                              MatchedFusionFederation, NetworkConfig, PartitionConfig, TrainingConfig,
                              client_weights, run_experiment)
from bnpfed.seeding import Stream, derive_seed


class Net(PyroModule):
    """The issue's network as a Pyro user writes it (64 -> 32 -> 10, a per-layer scale with a HalfNormal
    hyper-prior on the first layer), flattening the digits' (B, 1, 8, 8) images itself."""

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
        logits = self.fc2(torch.relu(self.fc1(x.reshape(x.shape[0], -1))))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


SITES = ["tau", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
PROGRAM = BayesianConfig(program=Net)


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.fixture(scope="module")
def parts(digits):
    return PartitionConfig(clients=3).split(digits.y_train.numpy(), seed=0)


def federation(digits, parts, rule="conflation", epochs=10, bayesian=PROGRAM, **kwargs):
    return FusionFederation(digits, parts, network=kwargs.pop("network", NetworkConfig()),
                            training=TrainingConfig(epochs=epochs, lr=1e-2), bayesian=bayesian,
                            fusion=FusionConfig(rule=rule, **kwargs), seed=0)


@pytest.mark.parametrize("rule", available_rules())
def test_three_clients_of_the_issues_program_fuse_by_every_rule_into_a_model_that_predicts(digits, parts, rule):
    fed = federation(digits, parts, rule)
    record = fed.run_round()
    assert list(fed.global_posterior) == list(fed.clients[0].posterior()) and set(SITES) == set(fed.global_posterior)
    assert record.metrics["accuracy"] > 0.25, record.metrics   # chance: 0.1 (ten balanced classes)
    probs = fed.predict_proba(digits.x_test[:50])
    assert probs.shape == (50, 10) and torch.allclose(probs.sum(-1), torch.ones(50))


@pytest.mark.parametrize("rule", ["conflation", "gaa"])
def test_one_round_of_the_federation_is_the_hand_written_loop_bit_for_bit(digits, parts, rule):
    fed = federation(digits, parts, rule, epochs=2)
    fed.run_round()
    training = fed.training
    clients = []
    for k, (x, y) in enumerate(fed.client_data):   # the guide's loop, with the federation's seeds
        model = Net()
        clients.append(BayesianClient(model, guide=AutoNormal(model)).fit(
            x, y, epochs=training.epochs, batch_size=training.batch_size, lr=training.lr,
            amsgrad=training.amsgrad, seed=derive_seed(0, Stream.FIT, 1, k)))
    fused = fuse_sites([c.posterior() for c in clients], rule, client_weights(fed.sizes, "size"))
    assert list(fused) == list(fed.global_posterior)
    for site, g in fed.global_posterior.items():
        assert torch.equal(g.loc, fused[site].loc) and torch.equal(g.variance, fused[site].variance), site
    clients[0].load_posterior(fused)   # ... and the global model predicts as the guide's fused client does
    assert torch.equal(fed.global_model.predict_proba(digits.x_test, seed=5),
                       clients[0].predict_proba(digits.x_test, seed=5))


def test_a_later_round_starts_from_the_fused_posterior_against_the_programs_own_prior(digits, parts):
    fed = federation(digits, parts, "gaa", epochs=1)
    fed.run_round()
    after_one = {site: (g.loc.clone(), g.variance.clone()) for site, g in fed.global_posterior.items()}
    fed.run_round()
    x, y = fed.client_data[1]
    model = Net()
    fresh = BayesianClient(model, guide=AutoNormal(model)).prepare(x, y)   # the program's own prior
    fresh.load_posterior(after_one)
    fresh.fit(x, y, epochs=1, batch_size=fed.training.batch_size, lr=fed.training.lr,
              amsgrad=fed.training.amsgrad, seed=derive_seed(0, Stream.FIT, 2, 1))
    ours = fed.clients[1].posterior()
    for site, g in fresh.posterior().items():
        assert torch.equal(g.loc, ours[site].loc) and torch.equal(g.variance, ours[site].variance), site
    assert not torch.equal(after_one["fc1.weight"][0], ours["fc1.weight"].loc)   # it trained


def test_run_experiment_runs_the_program_by_every_rule_asked_and_records_it(digits):
    result = run_experiment(digits, partition=PartitionConfig(clients=3), training=TrainingConfig(epochs=10, lr=1e-2),
                            bayesian=PROGRAM, config=ExperimentConfig(methods=("fusion:rule=conflation",
                                                                               "fusion:rule=eaa")))
    rows = {row.method: row for row in result.rows}
    assert set(rows) == {"conflation", "eaa"} and all(r.accuracy > 0.25 for r in rows.values())
    assert result.settings["bayesian"]["program"].endswith("Net") and rows["conflation"].hidden == []


def regression_program(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(64), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0]):
        return pyro.sample("obs", dist.Normal(x.reshape(x.shape[0], -1) @ w, 1.0), obs=y)


@pytest.mark.parametrize("bayesian, network, fusion, error", [
    (PROGRAM, NetworkConfig(hidden=(32,)), {}, "hidden: a setting of the network that a Pyro program replaces"),
    (PROGRAM, NetworkConfig(arch="lenet"), {}, "arch: a setting of the network"),
    (PROGRAM, NetworkConfig(), {"own_init": True}, "own_init: a Pyro program's clients all start"),
    (PROGRAM, NetworkConfig(), {"align": "match"}, "align: matched fusion lines up"),
])
def test_what_does_not_apply_to_a_program_is_refused_by_name_before_training(digits, parts, bayesian, network,
                                                                              fusion, error, monkeypatch):
    monkeypatch.setattr(BayesianClient, "fit", lambda *a, **k: pytest.fail("trained before refusing"))
    with pytest.raises(ValueError, match=error):
        federation(digits, parts, bayesian=bayesian, network=network, **fusion)


@pytest.mark.parametrize("settings, error", [
    ({"prior": "all"}, "prior: a setting of a network's clients that a Pyro program says itself"),
    ({"prior_scale": 0.5}, "prior_scale: a setting of a network's clients"),
    ({"init_scale": 0.1}, "init_scale: "),
    ({"local_reparameterization": False}, "local_reparameterization: "),
    ({"client": "laplace"}, "client: "),
    ({"likelihood": "gaussian"}, "likelihood: "),
    ({"kl_weight": 0.5}, "kl_weight: tempers a network's ELBO"),
    ({"experimental": ExperimentalOptions(round_prior="posterior")}, "round_prior: 'posterior' makes"),
    ({"program": Net()}, "program: expected a registered program's name or a factory"),
    ({"program": "no-such-program"}, "program: expected one of"),
])
def test_a_config_refuses_the_settings_a_program_says_itself(settings, error):
    with pytest.raises(ValueError, match=error):
        BayesianConfig(**{"program": Net, **settings})


def test_a_program_is_refused_by_matched_fusion_and_by_the_other_methods(digits, parts):
    with pytest.raises(ValueError, match="bayesian.program: matched fusion"):
        MatchedFusionFederation(digits, parts, network=NetworkConfig(), training=TrainingConfig(epochs=1),
                                bayesian=PROGRAM, fusion=FusionConfig(align="match"), seed=0)
    with pytest.raises(ValueError, match="methods: a Pyro program's clients"):
        run_experiment(digits, bayesian=PROGRAM, config=ExperimentConfig(methods=("fusion:rule=gaa", "fedavg")))


def test_a_program_whose_observed_site_does_not_fit_the_task_is_refused_before_training(digits, parts,
                                                                                          monkeypatch):
    monkeypatch.setattr(BayesianClient, "fit", lambda *a, **k: pytest.fail("trained before refusing"))
    with pytest.raises(ValueError, match="program: a classification's clients need an observed site of a "
                                         "Categorical distribution; the program's 'obs' gives real values"):
        federation(digits, parts, bayesian=BayesianConfig(program=lambda: (regression_program,
                                                                           AutoNormal(regression_program))))


class WithOwnParameters(PyroModule):
    """A program with a deterministic parameter (the output bias, a plain nn.Parameter): averaged by the server as a
    network's deterministic parameters are, and equal on every client at the start (the factory under one stream)."""

    def __init__(self):
        super().__init__()
        self.fc = PyroModule[nn.Linear](64, 10)
        self.fc.weight = PyroSample(dist.Normal(0.0, 1.0).expand([10, 64]).to_event(2))

    def forward(self, x, y=None):
        logits = self.fc(x.reshape(x.shape[0], -1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


def test_a_programs_own_parameters_start_equal_and_are_averaged_with_the_sizes_weights(digits, parts):
    state = torch.random.get_rng_state()
    fed = federation(digits, parts, "gaa", epochs=2, bayesian=BayesianConfig(program=WithOwnParameters))
    assert torch.equal(torch.random.get_rng_state(), state)   # the factory ran under its own stream
    starts = [c.deterministic_state()["fc.bias"] for c in fed.clients]
    assert list(fed.global_deterministic) == ["fc.bias"] and all(torch.equal(s, starts[0]) for s in starts)
    assert torch.equal(fed.global_deterministic["fc.bias"], starts[0])
    fed.run_round()
    b = client_weights(fed.sizes, "size")
    expected = sum(float(b[k]) * fed.clients[k].deterministic_state()["fc.bias"] for k in range(3))
    torch.testing.assert_close(fed.global_deterministic["fc.bias"], expected, rtol=1e-6, atol=1e-7)
    assert not torch.equal(expected, starts[0])


class LinearRegression(PyroModule):
    """A Bayesian linear regression as a Pyro user writes it, its noise scale a latent site with a HalfNormal prior:
    the observed site is a Normal, so the federation predicts real values with intervals."""

    def __init__(self, features=10):
        super().__init__()
        self.sigma = PyroSample(dist.HalfNormal(torch.tensor(1.0)))
        self.linear = PyroModule[nn.Linear](features, 1)
        self.linear.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, features]).to_event(2))
        self.linear.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

    def forward(self, x, y=None):
        mean, sigma = self.linear(x)[:, 0], self.sigma   # sigma drawn outside the plate: one for the dataset
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, sigma), obs=y)
        return mean


def test_a_regression_program_is_federated_with_its_noise_scale_fused_and_its_intervals_scored():
    diabetes = load_dataset("diabetes")
    parts = PartitionConfig(clients=3).split(diabetes.y_train.numpy(), seed=0)
    fed = FusionFederation(diabetes, parts, network=NetworkConfig(), training=TrainingConfig(epochs=20, lr=2e-2),
                           bayesian=BayesianConfig(program=LinearRegression), fusion=FusionConfig(rule="gaa"), seed=0)
    metrics = fed.run(2)[-1].metrics
    assert {"rmse", "nll", "coverage", "interval_width"} <= set(metrics) and "accuracy" not in metrics
    assert "sigma" in fed.global_posterior   # the noise scale, fused in log space as any site
    assert metrics["rmse"] < 0.85 and 0.7 <= metrics["coverage"] <= 1.0, metrics   # targets standardised: sd 1
    for program, error in ((lambda: Net(), r"x: the program cannot run on inputs of shape \(10,\)"),
                           (lambda: (classifier, AutoNormal(classifier)),
                            "program: a regression's clients need an observed site of a Normal")):
        with pytest.raises(ValueError, match=error):
            FusionFederation(diabetes, parts, network=NetworkConfig(), training=TrainingConfig(epochs=1),
                             bayesian=BayesianConfig(program=program), fusion=FusionConfig(), seed=0)


def classifier(x, y=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(10, 3), 1.0).to_event(2))
    with pyro.plate("data", x.shape[0]):
        return pyro.sample("obs", dist.Categorical(logits=x @ w), obs=y)
