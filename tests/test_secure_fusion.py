"""Posterior fusion from sums over clients (bnpfed.combine.secure): the rules secure aggregation can compute are
the rules of bnpfed.combine, exactly, for any reference, with every client or only some."""

import numpy as np
import pytest
import torch

from bnpfed.combine import average_deterministic, fuse
from bnpfed.combine.secure import (SECURE_RULES, deterministic_from_sum, deterministic_statistic, fuse_sums,
                                  join_limbs, quantisation_bound, quantization_range, split_limbs, statistic_names,
                                  sum_statistics)


def overlapping_clients(seed: int, num_clients: int = 6, shape=(7, 5)):
    """Clients whose posteriors overlap (means within a few of their standard deviations of each other, variances
    spread over two orders of magnitude), unequal counts, and a reference that is none of them."""
    g = torch.Generator().manual_seed(seed)
    centre = torch.randn(shape, generator=g, dtype=torch.float64)
    sds = 0.05 * torch.exp(torch.randn((num_clients, *shape), generator=g, dtype=torch.float64))
    locs = centre + 2 * sds * torch.randn((num_clients, *shape), generator=g, dtype=torch.float64)
    counts = torch.randint(20, 2000, (num_clients,), generator=g).tolist()
    reference = (centre + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64),
                 (0.03 * torch.exp(torch.randn(shape, generator=g, dtype=torch.float64))) ** 2)
    return locs, sds.square(), counts, reference


def summed(rule, locs, variances, counts, reference, clients):
    total, largest = sum(counts), max(counts)
    sums = {}
    for k in clients:
        for name, value in sum_statistics(rule, locs[k], variances[k], *reference, weight=counts[k] / total,
                                          max_weight=largest / total).items():
            sums[name] = sums.get(name, 0) + value
    return sums


@pytest.mark.parametrize("rule", SECURE_RULES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fused_posterior_from_sums_is_the_rule_of_combine(rule, seed):
    locs, variances, counts, reference = overlapping_clients(seed)
    fused = fuse_sums(rule, summed(rule, locs, variances, counts, reference, range(len(counts))), *reference)
    expected = fuse(locs, variances, rule, weights=counts)
    torch.testing.assert_close(fused.loc, expected.loc, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused.variance, expected.variance, rtol=1e-11, atol=0)


@pytest.mark.parametrize("rule", SECURE_RULES)
def test_without_the_clients_that_dropped_out_it_is_the_rule_over_the_rest(rule):
    locs, variances, counts, reference = overlapping_clients(3)
    largest = int(np.argmax(counts))
    rest = [k for k in range(len(counts)) if k not in (largest, 1)]     # the largest client among those gone
    total = sum(counts)
    fused = fuse_sums(rule, summed(rule, locs, variances, counts, reference, rest), *reference,
                      weight_total=sum(counts[k] for k in rest) / total,
                      max_weight_ratio=max(counts) / max(counts[k] for k in rest))
    expected = fuse(locs[rest], variances[rest], rule, weights=[counts[k] for k in rest])
    torch.testing.assert_close(fused.loc, expected.loc, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused.variance, expected.variance, rtol=1e-11, atol=0)


def test_a_deterministic_parameter_is_the_weighted_average():
    g = torch.Generator().manual_seed(4)
    params, reference = torch.randn(4, 3, 2, generator=g, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    counts = [5, 50, 500, 7]
    total = sum(deterministic_statistic(params[k], reference, weight=counts[k] / sum(counts)) for k in range(4))
    torch.testing.assert_close(deterministic_from_sum(total, reference), average_deterministic(params, counts),
                               rtol=1e-12, atol=1e-12)


def test_statistics_are_order_one_in_reference_units_whatever_the_layer_scale():
    # the same posteriors at scale 1e-3 and at scale 1 give the same statistics: one clipping range suits both
    locs, variances, counts, reference = overlapping_clients(5)
    for rule in SECURE_RULES:
        at_one = summed(rule, locs, variances, counts, reference, range(len(counts)))
        small = summed(rule, 1e-3 * locs, 1e-6 * variances, counts, (1e-3 * reference[0], 1e-6 * reference[1]),
                       range(len(counts)))
        for name in statistic_names(rule):
            torch.testing.assert_close(small[name], at_one[name], rtol=1e-9, atol=1e-12)


def test_two_limbs_through_secaggs_rounding_sum_to_within_the_bound():
    # SecAgg+'s rounding (flwr.common.secure_aggregation.quantization) of K clients' values, as two limbs each,
    # summed and mapped back as Flower's server does: off by less than K (2c/Q)^2 / 2c plus float64 rounding, over
    # values spread across ten orders of magnitude; one limb alone is off by up to K * 2c / Q
    flwr_quantization = pytest.importorskip("flwr.common.secure_aggregation.quantization")
    num_clients, c = 10, 2.0 ** 16
    q = quantization_range(num_clients)
    assert q == 2 ** 28 and num_clients * q < 2 ** 32 <= 2 * num_clients * q
    rng = np.random.default_rng(0)
    values = rng.choice([-1, 1], size=(num_clients, 20_000)) * 10.0 ** rng.uniform(-6, 4, size=(num_clients, 20_000))
    np.random.seed(0)   # flwr's stochastic rounding draws from numpy's global generator

    def secure_sum(arrays):   # levels summed as integers, then Flower's dequantisation and offset
        levels = sum(flwr_quantization.quantize([a], c, q)[0].astype(np.int64) for a in arrays)
        return flwr_quantization.dequantize([levels], c, q)[0] - (num_clients - 1) * c

    limbs = [split_limbs(torch.as_tensor(v), c, q) for v in values]
    recovered = join_limbs(torch.as_tensor(secure_sum([h.numpy() for h, _ in limbs])),
                           torch.as_tensor(secure_sum([lo.numpy() for _, lo in limbs])), c, q).numpy()
    exact = values.sum(axis=0)
    bound = quantisation_bound(c, q, num_clients)
    rounding = 4 * np.finfo(np.float64).eps * np.abs(values).sum(axis=0).max()   # of the last additions
    assert np.abs(recovered - exact).max() < bound + rounding < 1e-10
    assert np.abs(secure_sum(list(values)) - exact).max() > 1e3 * (bound + rounding)   # one limb: ~1e-5
    hi, _ = limbs[0]
    assert torch.equal(hi, torch.as_tensor(flwr_quantization.dequantize(
        flwr_quantization.quantize([hi.numpy()], c, q), c, q)[0]))   # the first limb is quantised without loss


def test_bad_input_is_named():
    loc, var = torch.zeros(3), torch.ones(3)
    with pytest.raises(ValueError, match="rule: expected one of"):
        sum_statistics("pooling", loc, var, loc, var, weight=0.5, max_weight=0.5)
    with pytest.raises(ValueError, match=r"weight: expected a number in \(0, 1\]"):
        sum_statistics("eaa", loc, var, loc, var, weight=2.0, max_weight=2.0)
    with pytest.raises(ValueError, match="max_weight: expected at least weight"):
        sum_statistics("eaa", loc, var, loc, var, weight=0.5, max_weight=0.25)
    with pytest.raises(ValueError, match="expected variances > 0"):
        sum_statistics("eaa", loc, -var, loc, var, weight=0.5, max_weight=0.5)
    with pytest.raises(ValueError, match="reference_loc: expected the shape of loc"):
        sum_statistics("eaa", loc, var, torch.zeros(2), torch.ones(2), weight=0.5, max_weight=0.5)
    with pytest.raises(ValueError, match="sums: expected the statistics"):
        fuse_sums("eaa", {"loc": loc}, loc, var)
    with pytest.raises(ValueError, match="num_clients: expected an int >= 2"):
        quantization_range(1)
