"""Claims of Ozer et al. (2022) about posterior fusion rules, checked on bnpfed.combine."""

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats
from torch.testing import assert_close

from bnpfed.combine import rules as combine
from bnpfed.combine import (GaussianPosterior, available_rules, average_deterministic, conflation, fuse, fuse_sites,
                            register_rule)

DETERMINISTIC_RULES = ["eaa", "gaa", "log_variance", "conflation"]
BUILT_IN_RULES = DETERMINISTIC_RULES + ["pooling"]


def mixture_moments(mus, variances, weights):
    """Mean, variance and fourth central moment of the mixture sum_k b_k N(mu_k, sigma_k^2), in float64."""
    mus, variances, b = (np.asarray(x, dtype=np.float64) for x in (mus, variances, weights))
    b = b / b.sum()
    mean = np.sum(b * mus)
    variance = np.sum(b * (variances + mus ** 2)) - mean ** 2
    d = mus - mean
    fourth = np.sum(b * (d ** 4 + 6 * d ** 2 * variances + 3 * variances ** 2))
    return mean, variance, fourth


# ----------------------------------------------------------------------------------------------------------------
# Figure 2 of the paper: two clients, b = (1/2, 1/2)

FIGURE_2 = [
    # (mu_1, var_1), (mu_2, var_2): {rule: (fused mean, fused variance)}
    ((1.0, 1.0), (1.0, 1.0), {"eaa": (1, 1), "gaa": (1, 0.5), "log_variance": (1, 1), "conflation": (1, 0.5),
                              "pooling": (1, 1)}),
    ((1.0, 1.0), (1.0, 4.0), {"eaa": (1, 2.5), "gaa": (1, 1.25), "log_variance": (1, 2), "conflation": (1, 0.8),
                              "pooling": (1, 2.5)}),
    ((1.0, 1.0), (5.0, 1.0), {"eaa": (3, 1), "gaa": (3, 0.5), "log_variance": (3, 1), "conflation": (3, 0.5),
                              "pooling": (3, 5)}),
    ((1.0, 1.0), (5.0, 4.0), {"eaa": (3, 2.5), "gaa": (3, 1.25), "log_variance": (3, 2),
                              "conflation": (1.8, 0.8), "pooling": (3, 6.5)}),
]


@pytest.mark.parametrize("rule", DETERMINISTIC_RULES)
@pytest.mark.parametrize("client_1, client_2, expected", FIGURE_2)
def test_figure_2_two_client_fusions(client_1, client_2, expected, rule):
    locs = torch.tensor([[client_1[0]], [client_2[0]]], dtype=torch.float64)
    variances = torch.tensor([[client_1[1]], [client_2[1]]], dtype=torch.float64)
    loc, variance = fuse(locs, variances, rule, weights=[0.5, 0.5])
    want_loc, want_variance = expected[rule]
    assert_close(loc, torch.tensor([want_loc], dtype=torch.float64), rtol=0, atol=1e-12)
    assert_close(variance, torch.tensor([want_variance], dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("client_1, client_2, expected", FIGURE_2)
def test_figure_2_pooling_tends_to_the_mixture_moments(client_1, client_2, expected):
    num_samples = 1_000_000
    locs = torch.tensor([[client_1[0]], [client_2[0]]], dtype=torch.float64)
    variances = torch.tensor([[client_1[1]], [client_2[1]]], dtype=torch.float64)
    loc, variance = fuse(locs, variances, "pooling", num_samples=num_samples,
                         generator=torch.Generator().manual_seed(0))
    want_loc, want_variance = expected["pooling"]
    _, mixture_variance, fourth = mixture_moments([client_1[0], client_2[0]], [client_1[1], client_2[1]], [1, 1])
    assert mixture_variance == pytest.approx(want_variance)  # the table's pooling column is the mixture
    # Standard errors of an i.i.d. sample of the mixture: sqrt(var / N) for the mean and sqrt((mu_4 - var^2) / N)
    # for the sample variance. Pooling draws exactly N/2 from each client (stratified), which removes the
    # between-client noise, so these are upper bounds; 5 of them is a z = 5 tolerance.
    se_loc = math.sqrt(mixture_variance / num_samples)
    se_variance = math.sqrt((fourth - mixture_variance ** 2) / num_samples)
    assert_close(loc, torch.tensor([float(want_loc)], dtype=torch.float64), rtol=0, atol=5 * se_loc)
    assert_close(variance, torch.tensor([float(want_variance)], dtype=torch.float64), rtol=0, atol=5 * se_variance)


# ----------------------------------------------------------------------------------------------------------------
# Properties of the rules


@pytest.mark.parametrize("rule", BUILT_IN_RULES)
def test_every_rule_returns_a_single_client_unchanged(rule):
    generator = torch.Generator().manual_seed(1)
    locs = torch.randn(1, 4, 3, generator=generator, dtype=torch.float64)
    variances = torch.rand(1, 4, 3, generator=generator, dtype=torch.float64) + 0.5
    num_samples = 200_000
    loc, variance = fuse(locs, variances, rule, num_samples=num_samples, generator=generator)
    if rule == "pooling":
        # sample mean and variance of N draws from N(mu, sigma^2): standard errors sigma / sqrt(N) and
        # sigma^2 sqrt(2 / (N - 1)); tolerance 5 standard errors, the largest sigma^2 being < 1.5
        atol_loc, atol_variance = 5 * math.sqrt(1.5 / num_samples), 5 * 1.5 * math.sqrt(2 / num_samples)
    else:
        atol_loc = atol_variance = 1e-12
    assert_close(loc, locs[0], rtol=0, atol=atol_loc)
    assert_close(variance, variances[0], rtol=0, atol=atol_variance)


def test_conflation_is_invariant_to_rescaling_the_weights():
    generator = torch.Generator().manual_seed(2)
    locs = torch.randn(4, 5, generator=generator, dtype=torch.float64)
    variances = torch.rand(4, 5, generator=generator, dtype=torch.float64) + 0.1
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    # the rule itself, on weights that do not sum to 1: b_max / sum_k b_k / sigma_k^2 is homogeneous of degree 0
    normalised = conflation(locs, variances, weights / weights.sum())
    for scale in (1e-3, 1.0, 37.0):
        rescaled = conflation(locs, variances, scale * weights)
        assert_close(rescaled[0], normalised[0], rtol=1e-12, atol=0)
        assert_close(rescaled[1], normalised[1], rtol=1e-12, atol=0)
    assert_close(fuse(locs, variances, "conflation", weights=1000 * weights).variance, normalised[1],
                 rtol=1e-12, atol=0)


@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [1.0, 2.0, 5.0], [0.0, 3.0, 1.0]])
def test_agreeing_clients_keep_their_variance_under_eaa_and_log_variance(weights):
    mu, sigma2 = torch.tensor([0.3, -2.0], dtype=torch.float64), torch.tensor([0.7, 3.0], dtype=torch.float64)
    locs, variances = mu.expand(3, 2), sigma2.expand(3, 2)
    for rule in ("eaa", "log_variance"):
        loc, variance = fuse(locs, variances, rule, weights=weights)
        assert_close(loc, mu, rtol=1e-12, atol=1e-12)
        assert_close(variance, sigma2, rtol=1e-12, atol=0)


@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [1.0, 2.0, 5.0], [0.0, 3.0, 1.0]])
def test_gaa_shrinks_variance_by_sum_of_squared_weights_when_clients_agree(weights):
    b = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    mu, sigma2 = torch.tensor([0.3, -2.0], dtype=torch.float64), torch.tensor([0.7, 3.0], dtype=torch.float64)
    loc, variance = fuse(mu.expand(3, 2), sigma2.expand(3, 2), "gaa", weights=weights)
    assert_close(loc, mu, rtol=1e-12, atol=1e-12)
    assert_close(variance, b.square().sum() * sigma2, rtol=1e-12, atol=0)


@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [1.0, 2.0, 5.0], [0.0, 3.0, 1.0]])
def test_conflation_shrinks_variance_by_b_max_when_clients_agree(weights):
    b = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    mu, sigma2 = torch.tensor([0.3, -2.0], dtype=torch.float64), torch.tensor([0.7, 3.0], dtype=torch.float64)
    loc, variance = fuse(mu.expand(3, 2), sigma2.expand(3, 2), "conflation", weights=weights)
    assert_close(loc, mu, rtol=1e-12, atol=1e-12)
    assert_close(variance, b.max() * sigma2, rtol=1e-12, atol=0)


@pytest.mark.parametrize("seed", range(5))
def test_variance_ordering_conflation_le_log_variance_le_eaa(seed):
    # eaa is the weighted arithmetic mean of the variances, log_variance the geometric mean, and conflation
    # b_max times the harmonic mean (b_max <= 1): AM >= GM >= HM.
    generator = torch.Generator().manual_seed(seed)
    num_clients = 2 + seed
    locs = torch.randn(num_clients, 1000, generator=generator, dtype=torch.float64)
    variances = torch.exp(3 * torch.randn(num_clients, 1000, generator=generator, dtype=torch.float64))
    weights = torch.rand(num_clients, generator=generator, dtype=torch.float64)
    v_conflation = fuse(locs, variances, "conflation", weights).variance
    v_log_variance = fuse(locs, variances, "log_variance", weights).variance
    v_eaa = fuse(locs, variances, "eaa", weights).variance
    slack = 1 + 1e-12  # rounding only
    assert (v_conflation <= v_log_variance * slack).all()
    assert (v_log_variance <= v_eaa * slack).all()
    assert (v_conflation < v_eaa).all()  # strict: b_max < 1 with two or more clients of positive weight


def test_pooling_converges_to_the_mixture_moments_at_rate_one_over_sqrt_n():
    mus, sigma2s, weights = [-1.0, 0.5, 3.0], [0.5, 2.0, 1.0], [0.2, 0.3, 0.5]
    mean, variance, _ = mixture_moments(mus, sigma2s, weights)
    # Pooling draws b_k N values from client k (stratified), so sqrt(N) x the standard error tends to
    #   sqrt(sum_k b_k sigma_k^2)                             for the pooled mean,
    #   sqrt(sum_k b_k (4 d_k^2 sigma_k^2 + 2 sigma_k^4))     for the pooled variance, d_k = mu_k - mean
    # (the variance of (x - mean)^2 within each client). The RMS over 192 repeats estimates these to about 5%;
    # c = 1.25 x them is the stated constant in error <= c / sqrt(N).
    b, mu, sigma2 = (np.array(x) for x in (weights, mus, sigma2s))
    d = mu - mean
    c_loc = 1.25 * math.sqrt(np.sum(b * sigma2))
    c_variance = 1.25 * math.sqrt(np.sum(b * (4 * d ** 2 * sigma2 + 2 * sigma2 ** 2)))
    repeats = 64  # independent copies of one weight, fused at once; times 3 seeds
    locs = torch.tensor(mus, dtype=torch.float64)[:, None].expand(3, repeats)
    variances = torch.tensor(sigma2s, dtype=torch.float64)[:, None].expand(3, repeats)
    rms_error = {}
    for num_samples in (10 ** 3, 10 ** 5):
        loc_errors, variance_errors = [], []
        for seed in range(3):
            loc, var = fuse(locs, variances, "pooling", weights, num_samples=num_samples,
                            generator=torch.Generator().manual_seed(seed))
            loc_errors.append(loc - mean)
            variance_errors.append(var - variance)
        rms_loc = torch.cat(loc_errors).square().mean().sqrt().item()
        rms_variance = torch.cat(variance_errors).square().mean().sqrt().item()
        assert rms_loc <= c_loc / math.sqrt(num_samples)
        assert rms_variance <= c_variance / math.sqrt(num_samples)
        rms_error[num_samples] = (rms_loc, rms_variance)
    # 100 times the samples: the error shrinks about 10 times (not at all if the estimate were biased)
    for small, large in zip(rms_error[10 ** 3], rms_error[10 ** 5]):
        assert 5 < small / large < 20


def test_pooling_with_the_same_generator_seed_gives_the_same_result():
    locs = torch.tensor([[0.0, 1.0], [2.0, -1.0]])
    variances = torch.tensor([[1.0, 0.5], [2.0, 0.1]])

    def pooled(seed):
        return fuse(locs, variances, "pooling", num_samples=500, generator=torch.Generator().manual_seed(seed))

    first, again, other = pooled(7), pooled(7), pooled(8)
    assert torch.equal(first.loc, again.loc) and torch.equal(first.variance, again.variance)
    assert not torch.equal(first.loc, other.loc)


@pytest.fixture
def recorded_draws(monkeypatch):
    """Every tensor torch.randn returns during the test, in order."""
    recorded = []
    randn = torch.randn

    def recording_randn(*args, **kwargs):
        draws = randn(*args, **kwargs)
        recorded.append(draws)
        return draws

    monkeypatch.setattr(torch, "randn", recording_randn)
    return recorded


def test_pooling_draws_floor_b_k_n_values_from_each_client(recorded_draws):
    # data set sizes 700 and 300: b = (0.7, 0.3), which float32 rounds to 0.69999999 and 0.30000001
    fuse(torch.zeros(2, 5), torch.ones(2, 5), "pooling", weights=[700, 300], num_samples=10)
    assert [draws.shape for draws in recorded_draws] == [(7, 5), (3, 5)]


def test_pooling_in_chunks_equals_the_statistics_of_the_concatenated_sample(monkeypatch, recorded_draws):
    # Force chunks of a few draws; record every draw and compare with numpy on the whole pooled sample.
    monkeypatch.setattr(combine, "POOLING_CHUNK_ELEMENTS", 20)
    recorded = recorded_draws
    locs = torch.tensor([[0.0, 1.0, 2.0], [5.0, -1.0, 0.0]], dtype=torch.float64)
    scales = torch.tensor([[1.0, 0.5, 2.0], [0.1, 3.0, 1.0]], dtype=torch.float64)
    loc, variance = fuse(locs, scales.square(), "pooling", weights=[1, 3], num_samples=41,
                         generator=torch.Generator().manual_seed(3))
    assert all(draws.numel() <= 20 for draws in recorded)
    counts = np.cumsum([draws.shape[0] for draws in recorded])
    assert counts[-1] == 10 + 30  # floor(41/4) + floor(3 * 41/4)
    client = (np.concatenate([[0], counts[:-1]]) >= 10).astype(int)  # the first 10 draws are client 0's
    sample = np.concatenate([(locs[k] + scales[k] * draws).numpy() for k, draws in zip(client, recorded)])
    assert_close(loc, torch.from_numpy(sample.mean(axis=0)), rtol=0, atol=1e-12)
    assert_close(variance, torch.from_numpy(sample.var(axis=0, ddof=1)), rtol=1e-12, atol=1e-12)


def test_conflation_stays_finite_and_exact_for_a_thousand_sharp_clients_in_float32():
    num_clients, sigma2 = 1000, math.exp(-10)
    generator = torch.Generator().manual_seed(4)
    locs = torch.randn(num_clients, 8, generator=generator)
    variances = torch.full((num_clients, 8), sigma2)
    variances[:, 1] *= torch.exp(torch.randn(num_clients, generator=generator))  # and some spread
    weights = torch.randint(50, 500, (num_clients,), generator=generator).float()
    assert torch.prod(variances[:12, 0]) == 0  # the published code's product of variances underflows here
    loc, variance = fuse(locs, variances, "conflation", weights)
    assert loc.dtype == variance.dtype == torch.float32
    assert torch.isfinite(loc).all() and (variance > 0).all()
    # closed form in float64 on the same float32 inputs
    b = weights.double() / weights.double().sum()
    precision = b[:, None] / variances.double()
    want_loc = (precision * locs.double()).sum(0) / precision.sum(0)
    want_variance = b.max() / precision.sum(0)
    assert_close(loc.double(), want_loc, rtol=0, atol=1e-6)
    assert_close(variance.double(), want_variance, rtol=1e-5, atol=0)


@pytest.mark.parametrize("mus, sigma2s, weights", [
    ([1.0, 5.0], [1.0, 4.0], [0.5, 0.5]),
    ([-2.0, 0.5], [0.3, 2.0], [0.8, 0.2]),
    ([0.0, 1.0, 3.0], [1.0, 0.25, 4.0], [2.0, 1.0, 5.0]),
])
def test_conflation_matches_brute_force_integration_of_the_tempered_product(mus, sigma2s, weights):
    # prod_k q_k(w)^(b_k / b_max), normalised numerically on a fine grid: no Gaussian algebra involved
    mus, sds, b = np.array(mus), np.sqrt(sigma2s), np.array(weights) / np.sum(weights)
    grid = np.linspace(np.min(mus - 12 * sds), np.max(mus + 12 * sds), 40_001)
    log_density = sum(b_k / b.max() * stats.norm.logpdf(grid, mu, sd) for b_k, mu, sd in zip(b, mus, sds))
    density = np.exp(log_density - log_density.max())
    density /= integrate.simpson(density, x=grid)
    mean = integrate.simpson(grid * density, x=grid)
    variance = integrate.simpson((grid - mean) ** 2 * density, x=grid)
    loc, var = fuse(torch.tensor(mus)[:, None], torch.tensor(sigma2s, dtype=torch.float64)[:, None], "conflation",
                    weights)
    assert_close(loc, torch.tensor([mean]), rtol=0, atol=1e-8)
    assert_close(var, torch.tensor([variance]), rtol=1e-8, atol=0)


# ----------------------------------------------------------------------------------------------------------------
# Inputs, outputs, registry


@pytest.mark.parametrize("rule", BUILT_IN_RULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_posterior_has_the_client_shape_and_dtype(rule, dtype):
    locs, variances = torch.zeros(3, 4, 2, dtype=dtype), torch.ones(3, 4, 2, dtype=dtype)
    fused = fuse(locs, variances, rule, generator=torch.Generator().manual_seed(0))
    assert isinstance(fused, GaussianPosterior)
    assert fused.loc.shape == fused.variance.shape == (4, 2)
    assert fused.loc.dtype == fused.variance.dtype == dtype


@pytest.mark.parametrize("rule", DETERMINISTIC_RULES)
def test_arrays_and_lists_of_client_tensors_fuse_like_a_stacked_tensor(rule):
    generator = torch.Generator().manual_seed(5)
    locs = torch.randn(3, 4, generator=generator, dtype=torch.float64)
    variances = torch.rand(3, 4, generator=generator, dtype=torch.float64) + 0.1
    stacked = fuse(locs, variances, rule, weights=[1, 2, 3])
    for as_input in (lambda x: x.numpy(), lambda x: list(x), lambda x: [row.numpy() for row in x]):
        other = fuse(as_input(locs), as_input(variances), rule, weights=np.array([1, 2, 3]))
        assert_close(other.loc, stacked.loc, rtol=0, atol=0)
        assert_close(other.variance, stacked.variance, rtol=0, atol=0)


@pytest.fixture
def scratch_registry(monkeypatch):
    """A copy of the rule registry that the test may change."""
    monkeypatch.setattr(combine, "_RULES", dict(combine._RULES))
    monkeypatch.setattr(combine, "_PER_COORDINATE", set(combine._PER_COORDINATE))


def test_a_registered_rule_is_used_by_name_everywhere(scratch_registry):
    def most_confident_client(locs, variances, weights, *, num_samples, generator):
        best = variances.argmin(dim=0, keepdim=True)
        return locs.gather(0, best)[0], variances.gather(0, best)[0]

    register_rule("most_confident", most_confident_client)
    assert "most_confident" in available_rules()
    assert set(BUILT_IN_RULES) <= set(available_rules())
    locs = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    variances = torch.tensor([[0.5, 2.0], [1.0, 0.1]])
    loc, variance = fuse(locs, variances, "most_confident")
    assert_close(loc, torch.tensor([1.0, 4.0]), rtol=0, atol=0)
    assert_close(variance, torch.tensor([0.5, 0.1]), rtol=0, atol=0)
    sites = [{"w": (locs[k], variances[k])} for k in range(2)]
    assert_close(fuse_sites(sites, "most_confident")["w"].loc, loc, rtol=0, atol=0)


def test_registering_an_existing_name_needs_overwrite(scratch_registry):
    with pytest.raises(ValueError, match="name: expected a rule name not registered yet, got 'eaa'"):
        register_rule("eaa", combine.gaa)
    register_rule("eaa", combine.gaa, overwrite=True)
    assert_close(fuse(torch.ones(2, 1), torch.ones(2, 1), "eaa").variance, torch.tensor([0.5]), rtol=0, atol=0)


def test_a_rule_returning_the_wrong_shape_is_reported_by_name(scratch_registry):
    register_rule("broken", lambda locs, variances, weights, **_: (locs, variances))
    with pytest.raises(ValueError, match="broken"):
        fuse(torch.zeros(2, 3), torch.ones(2, 3), "broken")


ONES = torch.ones(2, 3)
BAD_INPUTS = [
    # (kwargs for fuse, the argument the message must name)
    ({"locs": torch.zeros(2, 3), "variances": torch.ones(2, 4)}, "variances"),
    ({"locs": [torch.zeros(3), torch.zeros(4)], "variances": ONES}, "locs"),
    ({"locs": ONES, "variances": [torch.ones(3), torch.ones(2)]}, "variances"),
    ({"locs": torch.zeros(0, 3), "variances": torch.ones(0, 3)}, "locs"),
    ({"locs": torch.tensor(1.0), "variances": torch.tensor(1.0)}, "locs"),
    ({"locs": torch.tensor([[0.0, math.nan, 0.0], [0.0, 0.0, 0.0]]), "variances": ONES}, "locs"),
    ({"locs": ONES, "variances": torch.tensor([[1.0, 1.0, math.inf], [1.0, 1.0, 1.0]])}, "variances"),
    ({"locs": ONES, "variances": torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])}, "variances"),
    ({"locs": ONES, "variances": -ONES}, "variances"),
    ({"weights": [1.0, -1.0]}, "weights"),
    ({"weights": [0.0, 0.0]}, "weights"),
    ({"weights": [1.0, 2.0, 3.0]}, "weights"),
    ({"weights": [1.0, math.nan]}, "weights"),
    ({"weights": [[1.0, 1.0]]}, "weights"),
    ({"rule": "fedavg"}, "rule"),
    ({"rule": "pooling", "num_samples": 0}, "num_samples"),
    ({"rule": "pooling", "num_samples": 2.5}, "num_samples"),
    ({"rule": "pooling", "locs": torch.zeros(3, 2), "variances": torch.ones(3, 2), "num_samples": 2},
     "num_samples"),  # floor(N / 3) = 0 draws from every client
]


@pytest.mark.parametrize("kwargs, argument", BAD_INPUTS)
def test_bad_input_raises_value_error_naming_the_argument(kwargs, argument):
    kwargs = {"locs": ONES, "variances": ONES, "rule": "eaa", **kwargs}
    with pytest.raises(ValueError, match=rf"\b{argument}\b"):
        fuse(**kwargs)


def test_unknown_rule_message_lists_the_known_rules():
    with pytest.raises(ValueError) as error:
        fuse(ONES, ONES, "fedavg")
    assert all(name in str(error.value) for name in BUILT_IN_RULES)


# ----------------------------------------------------------------------------------------------------------------
# Whole networks


def client_sites(seed):
    generator = torch.Generator().manual_seed(seed)
    return {
        "fc1.weight": (torch.randn(4, 3, generator=generator), torch.rand(4, 3, generator=generator) + 0.1),
        "fc2.weight": (torch.randn(2, 4, generator=generator), torch.rand(2, 4, generator=generator) + 0.1),
    }


@pytest.mark.parametrize("rule", BUILT_IN_RULES)
def test_fuse_sites_fuses_every_site_like_fuse(rule):
    sites, weights = [client_sites(seed) for seed in range(3)], [10, 20, 70]
    fused = fuse_sites(sites, rule, weights, generator=torch.Generator().manual_seed(0))
    assert list(fused) == ["fc1.weight", "fc2.weight"]
    generator = torch.Generator().manual_seed(0)
    for name in fused:
        locs = torch.stack([client[name][0] for client in sites])
        variances = torch.stack([client[name][1] for client in sites])
        expected = fuse(locs, variances, rule, weights, generator=generator)
        assert_close(fused[name].loc, expected.loc, rtol=0, atol=0)
        assert_close(fused[name].variance, expected.variance, rtol=0, atol=0)


def test_fuse_sites_names_the_site_and_client_that_do_not_match():
    sites = [client_sites(seed) for seed in range(3)]
    del sites[1]["fc2.weight"]
    with pytest.raises(ValueError, match=r"client 1.*'fc2\.weight'"):
        fuse_sites(sites, "eaa")
    sites = [client_sites(seed) for seed in range(3)]
    sites[2]["fc1.weight"] = (torch.zeros(4, 2), torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"'fc1\.weight'.*client 2"):
        fuse_sites(sites, "eaa")
    sites = [client_sites(seed) for seed in range(3)]
    sites[0]["fc1.weight"] = (torch.zeros(4, 3), torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"'fc1\.weight'.*variances"):
        fuse_sites(sites, "eaa")
    with pytest.raises(ValueError, match="sites"):
        fuse_sites([], "eaa")


def test_average_deterministic_is_the_normalised_weighted_mean():
    params = [torch.tensor([1.0, 2.0]), torch.tensor([5.0, -2.0])]
    assert_close(average_deterministic(params, weights=[1, 3]), torch.tensor([4.0, -1.0]), rtol=0, atol=1e-6)
    assert_close(average_deterministic(torch.stack(params)), torch.tensor([3.0, 0.0]), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="params_list"):
        average_deterministic([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(ValueError, match="params_list"):
        average_deterministic([torch.zeros(2), torch.tensor([0.0, math.nan])])
    with pytest.raises(ValueError, match="weights"):
        average_deterministic(params, weights=[1, -1])


def test_log_variance_of_1000_identical_variances_is_that_variance():
    """The logs are accumulated in float64: in float32 1000 identical variances came back 0.99996 times themselves."""
    variances = torch.full((1000, 257), 1e-4, dtype=torch.float32)
    fused = fuse(torch.zeros(1000, 257), variances, "log_variance")
    assert fused.variance.dtype == torch.float32
    # float32 accumulation is 6.5e-5 off here; what is left is the float32 rounding of the weights b_k = 1/1000
    torch.testing.assert_close(fused.variance, torch.full((257,), 1e-4), rtol=2e-6, atol=0.0)


# ---------------------------------------------------------------- the fusion rules on large layers
# bnpfed.combine works through large layers in column blocks (BLOCK_ELEMENTS) for the throughput this experiment's
# benchmark asks of it; these check the blocked paths against closed forms.


def test_every_deterministic_rule_gives_its_closed_form_in_column_blocks(monkeypatch):
    g = torch.Generator().manual_seed(0)
    locs = torch.randn(5, 7, 13, generator=g, dtype=torch.float64)
    variances = torch.exp(2 * torch.randn(5, 7, 13, generator=g, dtype=torch.float64))
    b = torch.tensor([1.0, 2.0, 3.0, 0.0, 4.0], dtype=torch.float64) / 10
    precision = b[:, None, None] / variances
    closed_forms = {
        "eaa": ((b[:, None, None] * locs).sum(0), (b[:, None, None] * variances).sum(0)),
        "gaa": ((b[:, None, None] * locs).sum(0), (b[:, None, None] ** 2 * variances).sum(0)),
        "log_variance": ((b[:, None, None] * locs).sum(0), torch.exp((b[:, None, None] * variances.log()).sum(0))),
        "conflation": ((precision * locs).sum(0) / precision.sum(0), b.max() / precision.sum(0)),
    }
    monkeypatch.setattr(combine, "BLOCK_ELEMENTS", 5 * 8)  # blocks of 8 of the 91 columns, the last one of 3
    for rule, (loc, variance) in closed_forms.items():
        fused = fuse(locs, variances, rule, 10 * b)
        assert_close(fused.loc, loc, rtol=1e-12, atol=1e-12)
        assert_close(fused.variance, variance, rtol=1e-12, atol=0)


def test_conflation_of_subnormal_variances_falls_back_to_log_precisions_and_stays_accurate():
    locs = torch.tensor([[1.0, -2.0], [3.0, 0.5], [-1.0, 4.0]])
    variances = torch.tensor([[1e-40, 2e-41], [3e-40, 1e-40], [1.0, 5e-41]])  # 1 / variance overflows float32
    loc, variance = fuse(locs, variances, "conflation")
    precision = 1 / variances.double()
    assert_close(loc.double(), (precision * locs.double()).sum(0) / precision.sum(0), rtol=1e-4, atol=0)
    assert_close(variance.double(), (1 / 3) / (precision / 3).sum(0), rtol=1e-4, atol=0)
    with pytest.raises(ValueError, match=r"locs: expected finite values, got nan at index \(1, 0\)"):
        fuse(torch.tensor([[0.0, 0.0], [math.nan, 0.0], [0.0, 0.0]]), variances, "conflation")


# ---------------------------------------------------------------------------------------------- per-coordinate weights


@pytest.mark.parametrize("rule", BUILT_IN_RULES)
def test_per_coordinate_weights_fuse_each_coordinate_with_its_own_column(rule):
    """Weights (K, *shape): every coordinate is fused as one fuse call with that coordinate's (K,) weights would fuse
    it (a client with weight 0 on a coordinate has no say there); pooling, a rule of whole-client weights, is called
    once per pattern of weights and matches the per-column calls draw for draw when the patterns are the columns."""
    g = torch.Generator().manual_seed(11)
    locs = torch.randn(3, 2, 3, generator=g, dtype=torch.float64)
    variances = torch.rand(3, 2, 3, generator=g, dtype=torch.float64) + 0.1
    weights = torch.tensor([[[1.0, 0.0, 2.0], [1.0, 1.0, 0.5]], [[3.0, 1.0, 0.0], [1.0, 2.0, 0.5]],
                            [[0.0, 4.0, 1.0], [1.0, 0.0, 0.5]]], dtype=torch.float64)
    fused = fuse(locs, variances, rule, weights, num_samples=4000, generator=torch.Generator().manual_seed(0))
    for idx in np.ndindex(2, 3):
        one = fuse(locs[(slice(None), *idx)], variances[(slice(None), *idx)], rule, weights[(slice(None), *idx)],
                   num_samples=4000, generator=torch.Generator().manual_seed(0)) if rule != "pooling" else None
        if one is None:   # pooling: equal columns share one call; check against the mixture moments instead
            b = weights[(slice(None), *idx)] / weights[(slice(None), *idx)].sum()
            mu, var = locs[(slice(None), *idx)], variances[(slice(None), *idx)]
            mean = (b * mu).sum()
            assert float(fused.loc[idx]) == pytest.approx(float(mean), abs=0.15)
            assert float(fused.variance[idx]) == pytest.approx(float((b * (var + mu ** 2)).sum() - mean ** 2),
                                                               rel=0.25)
            continue
        assert_close(fused.loc[idx], one.loc, rtol=1e-12, atol=1e-14)
        assert_close(fused.variance[idx], one.variance, rtol=1e-12, atol=1e-14)


def test_conflation_with_per_coordinate_weights_is_the_weighted_product_of_the_holders_densities():
    """Closed form by hand: client 2 holds only the first coordinate; on the second, conflation of clients 0 and 1
    with weights 1 and 3 is precision 1/1 * 1/3 + 1/2 * 3/3 over b_max = 3/4 (weights normalised: 1/4, 3/4)."""
    locs = torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, 0.0]], dtype=torch.float64)
    variances = torch.tensor([[1.0, 1.0], [2.0, 2.0], [4.0, 1.0]], dtype=torch.float64)
    weights = torch.tensor([[1.0, 1.0], [1.0, 3.0], [2.0, 0.0]], dtype=torch.float64)
    fused = fuse(locs, variances, "conflation", weights)
    lam = torch.tensor([0.25 / 1.0, 0.75 / 2.0])           # second coordinate: b_k / sigma_k^2 of clients 0, 1
    assert float(fused.loc[1]) == pytest.approx(float((lam * torch.tensor([1.0, 3.0])).sum() / lam.sum()))
    assert float(fused.variance[1]) == pytest.approx(0.75 / float(lam.sum()))
    lam0 = torch.tensor([0.25 / 1.0, 0.25 / 2.0, 0.5 / 4.0])
    assert float(fused.variance[0]) == pytest.approx(0.5 / float(lam0.sum()))


@pytest.mark.parametrize("weights, match", [
    (torch.tensor([[1.0, 0.0], [1.0, 0.0]]), r"weights: expected a positive sum over the clients at coordinate \(1,\)"),
    (torch.ones(2, 3), r"weights: expected shape \(2,\) or \(2, 2\)"),
    (torch.tensor([[1.0, -1.0], [1.0, 2.0]]), "weights: expected non-negative numbers"),
])
def test_bad_per_coordinate_weights_are_refused_naming_them(weights, match):
    with pytest.raises(ValueError, match=match):
        fuse(torch.zeros(2, 2), torch.ones(2, 2), "eaa", weights)


def test_average_deterministic_takes_per_coordinate_weights():
    params = torch.tensor([[1.0, 2.0], [3.0, 6.0]], dtype=torch.float64)
    out = average_deterministic(params, torch.tensor([[1.0, 0.0], [1.0, 2.0]]))
    assert_close(out, torch.tensor([2.0, 6.0], dtype=torch.float64), rtol=0, atol=0)
