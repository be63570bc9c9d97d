"""bnpfed.metrics' debiased calibration error and bootstrap intervals against direct computations: a python loop of
the estimator, its expectation in closed form, a brute-force bootstrap over the same resamples, and the exact
bootstrap distribution of a small test split (every resample enumerated)."""

import itertools
import math

import numpy as np
import pytest
import torch

from bnpfed.metrics import (INTERVAL_METRICS, accuracy, bootstrap_intervals, brier_score, debiased_calibration_error,
                            expected_calibration_error, nll, paired_bootstrap)


def predictions(seed, n=200, num_classes=4, temperature=1.0):
    """Dirichlet predictive distributions (no two confidences equal) and labels drawn from them, sharpened by
    ``1 / temperature`` so that the predictor is miscalibrated for temperature != 1."""
    rng = np.random.default_rng(seed)
    truth = rng.dirichlet(np.full(num_classes, 0.7), size=n)
    labels = np.array([rng.choice(num_classes, p=row) for row in truth])
    probs = truth ** (1 / temperature)
    return probs / probs.sum(1, keepdims=True), labels


def debiased_by_loop(probs, labels, n_bins):
    """Kumar et al.'s debiased L2 error written out: sort by confidence (ties by index), equal-mass bins by position,
    sum_b n_b / N [(a_b - s_b)^2 - a_b (1 - a_b) / (n_b - 1)], then sqrt(max(., 0))."""
    n = len(labels)
    m = min(n_bins, n // 2)
    conf = [max(p) for p in probs]
    correct = [int(np.argmax(p) == y) for p, y in zip(probs, labels)]
    order = sorted(range(n), key=lambda i: (conf[i], i))
    total = 0.0
    for b in range(m):
        members = [order[p] for p in range(n) if p * m // n == b]
        a = sum(correct[i] for i in members) / len(members)
        s = sum(conf[i] for i in members) / len(members)
        total += len(members) / n * ((a - s) ** 2 - a * (1 - a) / (len(members) - 1))
    return math.sqrt(max(total, 0.0))


@pytest.mark.parametrize("n, n_bins", [(200, 15), (37, 15), (9, 3), (5, 15), (2, 1)])
def test_debiased_calibration_error_equals_the_estimator_written_out(n, n_bins):
    probs, labels = predictions(n, n=n, temperature=0.5)
    assert debiased_calibration_error(probs, labels, n_bins) == pytest.approx(debiased_by_loop(probs, labels, n_bins),
                                                                             abs=1e-12)


def test_debiased_calibration_error_of_two_worked_bins():
    # bins {.6, .6} (both right) and {.8, .8} (both right): (.5 (.4^2 - 0) + .5 (.2^2 - 0))^(1/2) = sqrt(.1)
    probs = [[0.8, 0.2], [0.8, 0.2], [0.6, 0.4], [0.6, 0.4]]
    assert debiased_calibration_error(probs, [0, 0, 0, 0]) == pytest.approx(math.sqrt(0.1), abs=1e-12)
    # one of the .8 pair wrong: .5 * .16 + .5 * ((.5 - .8)^2 - .25 / 1) = 0: no detectable miscalibration
    assert debiased_calibration_error(probs, [0, 1, 0, 0]) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("q, s", [(0.9, 0.9), (0.7, 0.9), (0.95, 0.6)])
@pytest.mark.parametrize("n", [2, 5, 30])
def test_the_squared_estimate_is_unbiased_in_closed_form(q, s, n):
    """One bin of n examples, each predicted at confidence s and right with probability q: the squared estimate's
    expectation over the Binomial(n, q) count of right ones is exactly (q - s)^2, the true squared gap."""
    from bnpfed.metrics import _debiased_squared

    expectation = 0.0
    for k in range(n + 1):   # k right predictions: their order within the tied bin does not matter
        correct = torch.tensor([1.0] * k + [0.0] * (n - k), dtype=torch.float64)
        estimate = _debiased_squared(torch.ones(1, n, dtype=torch.float64), torch.full((n,), s, dtype=torch.float64),
                                     correct, n_bins=1)
        expectation += math.comb(n, k) * q ** k * (1 - q) ** (n - k) * float(estimate)
    assert expectation == pytest.approx((q - s) ** 2, abs=1e-12)


def test_a_calibrated_predictor_scores_near_zero_where_the_binned_ece_does_not():
    """Monte Carlo: labels drawn from the predictions themselves (calibrated); over 200 test splits of 300 examples
    the debiased squared error averages 0 within 4 standard errors, the 100-bin ECE sits far above 0."""
    squares, eces = [], []
    for seed in range(200):
        probs, labels = predictions(seed, n=300, num_classes=3)
        conf = probs.max(1)
        order = np.argsort(conf, kind="stable")
        correct = (probs.argmax(1) == labels).astype(float)
        from bnpfed.metrics import _debiased_squared
        squares.append(float(_debiased_squared(torch.ones(1, 300, dtype=torch.float64), torch.as_tensor(conf[order]),
                                               torch.as_tensor(correct[order]), 15)))
        eces.append(expected_calibration_error(probs, labels, 100))
    mean, se = np.mean(squares), np.std(squares, ddof=1) / np.sqrt(len(squares))
    # within bins the probabilities of being right differ a little, which the estimator does not model: a small bias
    assert abs(mean) < 4 * se + 2e-4
    assert np.mean(eces) > 0.1


def metrics_by_hand(probs, labels, ece_bins):
    return {"accuracy": accuracy(probs, labels), "nll": nll(probs, labels), "brier": brier_score(probs, labels),
            "ece": expected_calibration_error(probs, labels, ece_bins),
            "ece15": expected_calibration_error(probs, labels, 15),
            "ece_debiased": debiased_calibration_error(probs, labels)}


def brute_force(probs_list, labels, resamples, seed, ece_bins):
    """Every metric of every predictor on each resample, one resample at a time, by the single metrics."""
    n = len(labels)
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    return [{m: np.array([metrics_by_hand(p[i], labels[i], ece_bins)[m] for i in idx]) for m in INTERVAL_METRICS}
            for p in probs_list]


def test_bootstrap_intervals_equal_a_brute_force_bootstrap_over_the_same_resamples():
    probs, labels = predictions(1, n=60, temperature=0.6)
    got = bootstrap_intervals(probs, labels, resamples=150, seed=7, level=0.9, ece_bins=20)
    values = brute_force([probs], labels, 150, 7, 20)[0]
    for m in INTERVAL_METRICS:
        expected = np.quantile(values[m], [0.05, 0.95])
        assert got[m] == pytest.approx(tuple(expected), abs=1e-10), m


def test_paired_bootstrap_equals_a_brute_force_paired_bootstrap():
    probs_a, labels = predictions(2, n=50, temperature=0.5)
    probs_b, _ = predictions(2, n=50, temperature=1.3)   # the same truth, another temperature: same labels
    got = paired_bootstrap(probs_a, probs_b, labels, resamples=120, seed=3)
    values_a, values_b = brute_force([probs_a, probs_b], labels, 120, 3, 100)
    point_a, point_b = metrics_by_hand(probs_a, labels, 100), metrics_by_hand(probs_b, labels, 100)
    for m in INTERVAL_METRICS:
        low, high = np.quantile(values_a[m] - values_b[m], [0.025, 0.975])
        assert got[m]["difference"] == pytest.approx(point_a[m] - point_b[m], abs=1e-10), m
        assert (got[m]["low"], got[m]["high"]) == pytest.approx((low, high), abs=1e-10), m


def test_a_predictor_paired_with_itself_differs_by_exactly_zero():
    probs, labels = predictions(4, n=80)
    for m, d in paired_bootstrap(probs, probs, labels, resamples=50).items():
        assert d == {"difference": 0.0, "low": 0.0, "high": 0.0}, m


def test_the_interval_matches_the_exact_bootstrap_distribution_of_a_small_split():
    """N = 6: every one of the 6^6 equally likely resamples enumerated gives the exact bootstrap law of the mean NLL;
    the Monte Carlo interval of 20,000 resamples has its ends at that law's 2.5 % and 97.5 % points, to 1 % in
    probability (the Monte Carlo quantile's standard error is about 0.1 %)."""
    probs, labels = predictions(5, n=6, num_classes=3)
    losses = -np.log(probs[np.arange(6), labels])
    exact = np.sort(losses[np.array(list(itertools.product(range(6), repeat=6)))].mean(1))
    low, high = bootstrap_intervals(probs, labels, metrics=["nll"], resamples=20000, seed=11)["nll"]
    cdf_low = np.searchsorted(exact, low, side="right") / len(exact)
    cdf_high = np.searchsorted(exact, high, side="right") / len(exact)
    assert cdf_low == pytest.approx(0.025, abs=0.01)
    assert cdf_high == pytest.approx(0.975, abs=0.01)


def test_the_interval_holds_the_point_estimate_of_a_mean_and_narrows_with_more_examples():
    widths = []
    for n in (100, 1600):
        probs, labels = predictions(6, n=n)
        low, high = bootstrap_intervals(probs, labels, metrics=["accuracy"], seed=0)["accuracy"]
        assert low <= accuracy(probs, labels) <= high
        widths.append(high - low)
    assert widths[1] < widths[0] / 2.5   # the standard error falls as 1 / sqrt(N): 4 times here


def test_the_same_seed_gives_the_same_interval_and_another_seed_another():
    probs, labels = predictions(8, n=100)
    first = bootstrap_intervals(probs, labels, metrics=["nll"], seed=1, resamples=200)
    assert bootstrap_intervals(probs, labels, metrics=["nll"], seed=1, resamples=200) == first
    assert bootstrap_intervals(probs, labels, metrics=["nll"], seed=2, resamples=200) != first


@pytest.mark.parametrize("kwargs, message", [
    (dict(metrics=["accuracy", "auroc"]), "metrics: expected names from"),
    (dict(metrics="accuracy"), "metrics: expected a non-empty sequence"),
    (dict(resamples=1), "resamples"),
    (dict(level=1.0), "level"),
    (dict(seed=-1), "seed"),
    (dict(ece_bins=0), "ece_bins"),
])
def test_bad_bootstrap_arguments_are_named(kwargs, message):
    probs, labels = predictions(9, n=10)
    with pytest.raises(ValueError, match=message):
        bootstrap_intervals(probs, labels, **kwargs)


def test_bad_inputs_are_named():
    probs, labels = predictions(9, n=10)
    with pytest.raises(ValueError, match="probs_b: expected the shape of probs_a"):
        paired_bootstrap(probs, probs[:9], labels)
    with pytest.raises(ValueError, match="labels: expected shape"):
        paired_bootstrap(probs, probs, labels[:9])
    with pytest.raises(ValueError, match="at least 2 examples"):
        debiased_calibration_error(probs[:1], labels[:1])
    with pytest.raises(ValueError, match="at least 2 examples"):
        bootstrap_intervals(probs[:1], labels[:1])
    right = float(np.argmax(probs[0]) == labels[0])   # one example: every resample is that example
    assert bootstrap_intervals(probs[:1], labels[:1], metrics=["accuracy"]) == {"accuracy": (right, right)}
