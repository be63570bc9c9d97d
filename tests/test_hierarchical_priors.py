"""Priors that are programs: hyper-parameters drawn in the prior are latent sites, learned, reported and fused (in
log space); a prior that draws random values outside Pyro's sample statements is refused, never cached."""

import json
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from bnpfed.clients import (BayesianClient, EmpiricalBayesPrior, HierarchicalPrior, IIDPrior, LayerwisePrior,
                            MeanFieldELBO, linear_weights, only_linear_weights)
from bnpfed.data import load_dataset
from bnpfed.federated import (BayesianConfig, FusionConfig, FusionFederation, MatchedFusionFederation, NetworkConfig,
                              PartitionConfig, TrainingConfig, pvi_prior_variance)
from bnpfed.matching import client_slice, derive_spec, match_posteriors
from bnpfed.models import BayesianNetwork, mlp
from bnpfed.seeding import seeded


class ScaleDrawnWithPyro(IIDPrior):
    """The issue's "obvious way": a prior object whose site distribution draws a per-layer scale."""

    def site_distribution(self, name, default):
        scale = pyro.sample(f"tau[{name}]", dist.HalfNormal(1.0))
        return dist.Normal(0.0, scale).expand(default.event_shape).to_event(len(default.event_shape))


class ScaleDrawnWithTorch(IIDPrior):
    """The same, with the scale drawn by the distribution's own sampler: no site a guide could learn."""

    def site_distribution(self, name, default):
        scale = dist.HalfNormal(1.0).sample()
        return dist.Normal(0.0, scale).expand(default.event_shape).to_event(len(default.event_shape))


def flat_digits():
    ds = load_dataset("digits")
    return ds.x_train.reshape(len(ds.x_train), -1), ds.y_train


def test_a_scale_the_prior_draws_with_pyro_sample_is_a_learned_latent_site_not_a_cached_draw():
    x, y = flat_digits()
    torch.manual_seed(0)
    client = BayesianClient(mlp(64, [32], 10), ScaleDrawnWithPyro(expose=[linear_weights]))
    assert client.bnn.hyper_sites == ("tau[1.weight]", "tau[3.weight]")
    assert not MeanFieldELBO.supports(client.bnn, client.guide)     # Pyro's ELBO, no closed form to cache into
    start = client.posterior()["tau[1.weight]"].loc.item()
    client.fit(x, y, epochs=5, batch_size=64, lr=1e-2, seed=0)
    posterior = client.posterior()
    assert set(posterior) == {"tau[1.weight]", "1.weight", "tau[3.weight]", "3.weight"}
    # the guide starts at the hyper-prior's mean, 0.80, and learns down towards the small first-layer weights
    assert math.exp(start) == pytest.approx(math.sqrt(2 / math.pi), rel=1e-6)
    assert posterior["tau[1.weight]"].loc.item() < start - 0.5


def test_a_prior_that_draws_random_values_outside_pyro_sample_is_refused_before_any_work():
    with pytest.raises(ValueError, match="prior: ScaleDrawnWithTorch gives site '1.weight' a different prior on every "
                                         "call .*draw a hyper-parameter with pyro.sample"):
        BayesianClient(mlp(4, [3], 2), ScaleDrawnWithTorch(expose=[linear_weights]))


def test_a_hierarchical_network_has_no_fixed_prior_distributions():
    bnn = BayesianNetwork(mlp(4, [3], 2), HierarchicalPrior())
    with pytest.raises(ValueError, match="draws hyper-parameters .* no fixed distributions"):
        bnn.prior_distributions()


def test_the_loss_of_a_hierarchical_prior_is_the_elbo_written_by_hand():
    """-ELBO = sum_layers E_q[log q(tau) - log p(tau)] + E_q(tau)[KL(q(w) || N(0, tau^2))] - E_q[log p(y | x, w)],
    estimated by hand with independent draws, against the client's loss (Pyro's ELBO on the program)."""
    torch.manual_seed(0)
    client = BayesianClient(mlp(3, [2], 2), HierarchicalPrior(dist.HalfNormal(0.5)))
    g = torch.Generator().manual_seed(1)
    posterior = {"1.weight_scale": (torch.tensor(-1.0), torch.tensor(0.2)),
                 "1.weight": (torch.randn(2, 3, generator=g), torch.full((2, 3), 0.05)),
                 "3.weight_scale": (torch.tensor(0.3), torch.tensor(0.1)),
                 "3.weight": (torch.randn(2, 2, generator=g), torch.full((2, 2), 0.02))}
    client.load_posterior(posterior)
    x, y = torch.randn(8, 3, generator=g), torch.randint(0, 2, (8,), generator=g)
    draws = 3000
    with torch.no_grad():
        ours = torch.stack([_loss(client, x, y, seed) for seed in range(draws)]) * len(x)
    net, biases = client.bnn.template(), client.deterministic_state()
    hand = []
    for _ in range(draws):
        total, weights = 0.0, dict(biases)
        for site in ("1.weight", "3.weight"):
            m, v = posterior[site + "_scale"]
            u = m + v.sqrt() * torch.randn((), generator=g)
            tau = u.exp()
            # log q(tau) = log N(u; m, v) - log |d tau / du| = log N(u; m, v) - u
            total += dist.Normal(m, v.sqrt()).log_prob(u) - u - dist.HalfNormal(0.5).log_prob(tau)
            mu, var = posterior[site]
            ratio = var / tau**2
            total += 0.5 * (ratio + mu**2 / tau**2 - 1 - ratio.log()).sum()
            weights[site] = mu + var.sqrt() * torch.randn(mu.shape, generator=g)
        logits = torch.func.functional_call(net, weights, (x,))
        hand.append(total + F.cross_entropy(logits, y, reduction="sum"))
    hand = torch.stack(hand)
    error = math.sqrt(ours.var().item() / draws + hand.var().item() / draws)
    assert abs(ours.mean().item() - hand.mean().item()) < 4 * error, (ours.mean(), hand.mean(), error)


def _loss(client, x, y, seed):
    with seeded(seed):
        return client.loss(x, y)


def test_each_layers_learned_scale_is_the_root_mean_square_of_its_weights():
    """With D entries the ELBO's terms in tau_s are -D log tau_s - sum_j E_q[w_sj^2] / (2 tau_s^2) + log p(tau_s),
    whose maximiser for large D is tau_s^2 = mean_j (mu_sj^2 + sigma_sj^2): the learned scale must be there."""
    x, y = flat_digits()
    torch.manual_seed(0)
    client = BayesianClient(mlp(64, [32], 10), HierarchicalPrior())
    client.fit(x, y, epochs=20, batch_size=64, lr=1e-2, scale_lr=0.1, seed=0)
    posterior = client.posterior()
    for site in ("1.weight", "3.weight"):
        rms = (posterior[site].loc.square() + posterior[site].variance).mean().sqrt().item()
        # tolerance: the scale's Monte Carlo gradient noise and its trailing the weights; measured within 2 %
        assert math.exp(posterior[site + "_scale"].loc.item()) == pytest.approx(rms, rel=0.15), site


def test_a_federation_learns_and_fuses_the_per_layer_scales_in_log_space():
    ds = load_dataset("digits")
    parts = PartitionConfig(clients=3).split(ds.y_train.numpy(), seed=0)
    federation = FusionFederation(ds, parts, network=NetworkConfig(hidden=(16,)), training=TrainingConfig(epochs=1),
                                  bayesian=BayesianConfig(prior=HierarchicalPrior()), fusion=FusionConfig(rule="eaa"),
                                  seed=0)
    record = federation.run_round()
    assert set(federation.global_posterior) == {"1.weight_scale", "1.weight", "3.weight_scale", "3.weight"}
    # the empirical arithmetic average of the clients' log-scale means (EAA fuses the Normals of log tau)
    b = torch.as_tensor(record.weights, dtype=torch.float32)
    logs = torch.stack([federation.clients[k].posterior()["1.weight_scale"].loc for k in record.sampled])
    assert_close(federation.global_posterior["1.weight_scale"].loc, (b * logs).sum())
    assert record.metrics["accuracy"] > 0.5


# ------------------------------------------------------------ PVI under any prior whose sites are Gaussian


def _pvi_federation(bayesian, digits, rounds=2):
    parts = PartitionConfig(clients=3).split(digits.y_train.numpy(), seed=0)
    federation = MatchedFusionFederation(digits, parts, network=NetworkConfig(hidden=(16,)),
                                         training=TrainingConfig(epochs=1, lr=1e-2), bayesian=bayesian,
                                         fusion=FusionConfig(rule="pvi", align="match"), seed=0)
    return federation, federation.run(rounds=rounds)


def test_pvi_under_the_standard_prior_given_as_an_object_is_pvi_under_the_named_prior_bit_for_bit(digits):
    named, named_records = _pvi_federation(BayesianConfig(), digits)
    standard = only_linear_weights(dist.Normal(0.0, 1.0))
    given, given_records = _pvi_federation(BayesianConfig(prior=standard), digits)
    assert given.pvi.prior_variance == {"1.weight": 1.0, "3.weight": 1.0}
    untimed = [[{k: v for k, v in r.metrics.items() if "seconds" not in k} for r in records]
               for records in (given_records, named_records)]
    assert untimed[0] == untimed[1]
    for site, p in named.match.variances.items():
        assert torch.equal(given.match.variances[site], p) and torch.equal(given.match.locs[site],
                                                                          named.match.locs[site])


def test_pvi_reads_one_prior_variance_per_site_and_refuses_a_prior_that_is_no_zero_mean_gaussian(digits):
    layerwise = LayerwisePrior({"1.weight": dist.Normal(0.0, 0.5), "3.weight": dist.Normal(0.0, 2.0)})
    federation, records = _pvi_federation(BayesianConfig(prior=layerwise), digits, rounds=1)
    assert federation.pvi.prior_variance == {"1.weight": 0.25, "3.weight": 4.0}
    assert records[0].metrics["accuracy"] > 0.3
    template = mlp(64, [16], 10)
    for prior, message in ((IIDPrior(dist.Normal(0.5, 1.0), expose=[linear_weights]), "N\\(0, v\\)"),
                           (IIDPrior(dist.Laplace(0.0, 1.0), expose=[linear_weights]), "N\\(0, v\\)"),
                           (HierarchicalPrior(), "fixed Gaussian sites"),
                           (EmpiricalBayesPrior(), "re-estimates")):
        with pytest.raises(ValueError, match=f"fusion.rule: 'pvi' .*{message}"):
            pvi_prior_variance(BayesianConfig(prior=prior), template)


def test_pvi_fuses_each_sites_own_prior_once_times_the_members_factors():
    """Round 1, a prior variance per site: a unit's coordinate of site s has precision
    1/v_s + sum_j (1/u_j - 1/v_s), the prior of its own site counted once."""
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
    variances = {"0.weight": 0.5, "2.weight": 2.0}
    pvi = match_posteriors(clients, rule="pvi", template=net, seed=0, prior_variance=variances,
                           hyperparameters="fixed", tau2=1e-3, sigma0_2=1.0, gamma0=1.0)
    (a0, a1) = pvi.assignments["0"]
    for l in range(6):
        i = int(a0[l])
        l1 = int((a1 == i).nonzero())
        for site, rows in (("0.weight", lambda t, k: t[k]), ("2.weight", lambda t, k: t[:, k])):
            u0, u1 = rows(clients[0][1][site], l), rows(clients[1][1][site], l1)
            lam0 = 1 / variances[site]
            assert_close(rows(pvi.unit_variances[site], i), 1 / (lam0 + (1 / u0 - lam0) + (1 / u1 - lam0)))


# ------------------------------------------------------------ a plugin for the command line and Flower

PLUGIN = "examples.hierarchical_prior"


def test_bnpfed_fuse_learns_the_scales_of_a_hierarchical_prior_from_the_plugin(tmp_path):
    from registries import restored_registries

    from bnpfed.cli import main

    out = tmp_path / "out.json"
    with restored_registries([PLUGIN]):
        assert main(["fuse", "--plugin", PLUGIN, "--prior", "hierarchical", "--prior-scale", "0.5", "--rule",
                     "gaa,eaa", "--clients", "2", "--epochs", "1", "--rounds", "1", "--hidden", "8", "--no-fedavg",
                     "--no-progress", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    rows = record["results"]["runs"][0]["rows"]
    assert [r["method"] for r in rows] == ["gaa", "eaa"] and all(r["accuracy"] > 0.3 for r in rows)
    assert record["settings"]["bayesian"]["prior"] == "hierarchical"


def test_the_flower_app_runs_a_hierarchical_prior_with_the_plugins_key_as_in_process():
    pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")
    from flower_harness import CLIENTS, FRACTION, assert_same_as_in_process
    from registries import restored_registries

    from bnpfed.flower.client import app as client_app
    from bnpfed.flower.local import LocalGrid
    from bnpfed.flower.server import run_federation

    config = {"method": "fusion", "rule": "gaa", "prior": "hierarchical", "plugins": PLUGIN, "rounds": 2,
              "epochs": 1, "hidden": "8", **FRACTION}
    with restored_registries([PLUGIN]):
        result = run_federation(LocalGrid(client_app, CLIENTS), config)
        assert result.settings.bayesian.prior == "hierarchical"
        assert_same_as_in_process(result, config)
