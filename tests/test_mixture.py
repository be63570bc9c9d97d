"""Components of any model: the component matcher, the Pyro Gaussian mixture and the federated mixture built on them
(issue "The neuron model is the program", part 2)."""

import json
import math

import numpy as np
import pyro
import pytest
import torch
from scipy import stats

from bnpfed.cli import main
from bnpfed.federated import MixtureConfig, fuse_mixtures, run_mixture_experiment
from bnpfed.matching import match_bayesian_layer, match_components, match_layer
from bnpfed.models import GaussianMixture, fit_gaussian_mixture, gaussian_mixture


def test_the_mixture_density_is_scipy_s():
    g = torch.Generator().manual_seed(0)
    mix = GaussianMixture(torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64), torch.randn(3, 2, generator=g,
                          dtype=torch.float64), torch.rand(3, 2, generator=g, dtype=torch.float64) + 0.5)
    x = torch.randn(7, 2, generator=g, dtype=torch.float64)
    expected = np.log(sum(float(w) * stats.multivariate_normal.pdf(x.numpy(), m.numpy(), np.diag(s.numpy() ** 2))
                          for w, m, s in zip(mix.weights, mix.locs, mix.scales)))
    np.testing.assert_allclose(mix.log_prob(x).numpy(), expected, rtol=1e-10)


def test_the_fit_recovers_a_mixture_drawn_from_the_pyro_program():
    """Data drawn from gaussian_mixture with its parameters conditioned; the MAP fit finds them (means within 0.15,
    weights within 0.05, scales within 15 %: 600 points)."""
    truth = {"weights": torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64),
             "locs": torch.tensor([[-5.0, 0.0], [0.0, 5.0], [5.0, 0.0]], dtype=torch.float64),
             "scales": torch.tensor([[1.0, 0.5], [0.7, 0.7], [0.5, 1.0]], dtype=torch.float64)}
    placeholder = torch.zeros(600, 2, dtype=torch.float64)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        trace = pyro.poutine.trace(pyro.poutine.condition(pyro.poutine.uncondition(gaussian_mixture), data=truth)
                                   ).get_trace(placeholder, 3)
    x = trace.nodes["x"]["value"]
    mix = fit_gaussian_mixture(x, 3, seed=0, steps=500)
    order = torch.argsort(mix.locs[:, 0])
    torch.testing.assert_close(mix.locs[order], truth["locs"], atol=0.15, rtol=0)
    torch.testing.assert_close(mix.weights[order], truth["weights"], atol=0.05, rtol=0)
    torch.testing.assert_close(mix.scales[order], truth["scales"], rtol=0.15, atol=0)


def test_components_with_variances_are_matched_as_bayesian_neurons_and_without_as_neurons():
    g = torch.Generator().manual_seed(2)
    means = [torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(3)]
    variances = [torch.full((3, 4), 0.01, dtype=torch.float64) for _ in range(3)]
    fixed = dict(sigma0_2=1.0, gamma0=2.0, hyperparameters="fixed", seed=0)
    a = match_components(means, variances, tau2=0.1, **fixed)
    b = match_bayesian_layer(means, variances, tau2=0.1, **fixed)
    assert a.objective == b.objective
    c = match_components(means, sigma2=0.1, **fixed)
    assert c.objective == match_layer(means, sigma2=0.1, **fixed).objective


def test_fused_components_are_the_moments_of_their_members_pooled():
    """A global component is the Gaussian of its members' points pooled: weight N_i / N, mean and variance the
    moments of the members' mixture (checked against sampled points: 200,000 of them)."""
    a = GaussianMixture(torch.tensor([0.25, 0.75], dtype=torch.float64),
                        torch.tensor([[0.0, 1.0], [20.0, 20.0]], dtype=torch.float64),
                        torch.tensor([[1.0, 2.0], [1.0, 1.0]], dtype=torch.float64))
    b = GaussianMixture(torch.tensor([1.0], dtype=torch.float64), torch.tensor([[0.3, 0.8]], dtype=torch.float64),
                        torch.tensor([[1.5, 1.0]], dtype=torch.float64))
    fused = fuse_mixtures([a, b], [400, 100], seed=0)
    assert fused.mixture.num_components == 2
    shared = next(i for i, m in enumerate(fused.members) if len(m) == 2)
    assert sorted(fused.members[shared]) == [(0, 0), (1, 0)]
    n = torch.tensor([100.0, 100.0])    # 400 * 0.25 and 100 * 1.0 points
    assert float(fused.mixture.weights[shared]) == pytest.approx(200 / 500)
    g = torch.Generator().manual_seed(3)
    points = torch.cat([a.locs[0] + a.scales[0] * torch.randn(100_000, 2, generator=g, dtype=torch.float64),
                        b.locs[0] + b.scales[0] * torch.randn(100_000, 2, generator=g, dtype=torch.float64)])
    assert n.sum() == 200
    torch.testing.assert_close(fused.mixture.locs[shared], points.mean(0), atol=0.02, rtol=0)
    torch.testing.assert_close(fused.mixture.scales[shared] ** 2, points.var(0), rtol=0.02, atol=0)


def test_the_federated_mixture_beats_each_client_s_own_on_held_out_digits():
    """The bundled digits (real data), three clients split by label: the federated mixture's held-out likelihood is
    well above each client's own mixture's, and the IBP gives it more components than one client has."""
    rows = {r.method: r for r in run_mixture_experiment(MixtureConfig(clients=3, components=4, dims=4, steps=60))}
    federated, own = rows["federated (matched)"], rows["client's own mixture"]
    assert federated.heldout_loglik > own.heldout_loglik + 0.3
    assert 4 < federated.components <= rows["union of the clients' mixtures"].components == 12
    assert all(math.isfinite(r.heldout_loglik) for r in rows.values())


def test_bnpfed_mixture_prints_and_writes_the_table(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert main(["mixture", "--clients", "2", "--components", "3", "--dims", "3", "--steps", "30", "--json",
                 str(out)]) == 0
    text = capsys.readouterr().out
    assert "federated (matched)" in text and "pooled data" in text
    record = json.loads(out.read_text())
    assert record["command"] == "mixture" and len(record["results"]["runs"][0]["rows"]) == 5
    assert main(["mixture", "--clients", "1"]) == 2
    assert "clients: expected an int >= 2" in capsys.readouterr().err


@pytest.mark.parametrize("call, match", [
    (lambda: fuse_mixtures([], []), "mixtures: expected a non-empty sequence"),
    (lambda: fuse_mixtures([GaussianMixture(torch.ones(1), torch.zeros(1, 2), torch.ones(1, 2))], [0]),
     "sizes: expected 1 positive numbers"),
    (lambda: GaussianMixture(torch.tensor([0.5, 0.6]), torch.zeros(2, 1), torch.ones(2, 1)), "summing to 1"),
    (lambda: fit_gaussian_mixture(torch.zeros(2, 1), 3, seed=0), "num_components: expected at most"),
    (lambda: MixtureConfig(alpha=0.0), "alpha: expected a positive finite number"),
])
def test_bad_input_is_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()
