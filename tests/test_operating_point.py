"""The operating point chosen on the clients' held-out data (bnpfed.federated.operating_point): the paired standard
error from summed counts against the per-example computation and a Monte Carlo estimate, the one-standard-error
rule on constructed curves, and the whole selection on trained networks."""

import numpy as np
import pytest

from bnpfed.federated.config import PFNM_NETWORK, PartitionConfig, PFNMConfig, TrainingConfig
from bnpfed.federated.methods import ExperimentConfig, run_experiment
from bnpfed.federated.operating_point import (co_correct_counts, one_standard_error_choice, paired_standard_errors,
                                              select_operating_point)


def _correlated(rng, n, K, flip=0.15):
    """``(n, K)`` 0/1: a shared per-example difficulty plus each candidate's own flips (overlapping mistakes)."""
    base = rng.random(n) < 0.8
    return (base[:, None] ^ (rng.random((n, K)) < flip)).astype(int)


def test_the_paired_standard_error_from_summed_counts_is_the_per_example_one():
    rng = np.random.default_rng(0)
    correct = _correlated(rng, 500, 5)
    counts = co_correct_counts(correct)
    for b in range(5):
        accuracy, se = paired_standard_errors(counts, 500, b)
        d = correct[:, [b]] - correct
        np.testing.assert_allclose(accuracy, correct.mean(0), rtol=0, atol=1e-15)
        np.testing.assert_allclose(se, d.std(0, ddof=1) / np.sqrt(500), rtol=1e-12, atol=1e-15)
        assert se[b] == 0


def test_the_clients_counts_add_up_to_the_pooled_counts():
    rng = np.random.default_rng(1)
    correct = _correlated(rng, 300, 4)
    pieces = np.split(correct, [70, 71, 200])   # one client with a single example
    assert (sum(co_correct_counts(p) for p in pieces) == co_correct_counts(correct)).all()


def test_the_standard_error_is_the_spread_of_the_difference_over_repeated_held_out_sets():
    """Monte Carlo: two candidates right on each example with joint probabilities p11 = 0.8, p10 = 0.06, p01 = 0.03,
    n = 400 examples, 4,000 held-out sets: the mean standard error is the standard deviation of the observed
    accuracy differences to within 5 percent (the estimate's own Monte Carlo error is about 1 percent)."""
    rng = np.random.default_rng(2)
    n, draws = 400, 4000
    cells = rng.choice(4, size=(draws, n), p=[0.8, 0.06, 0.03, 0.11])   # 11, 10, 01, 00
    a = np.isin(cells, (0, 1)).astype(int)
    b = np.isin(cells, (0, 2)).astype(int)
    differences, ses = [], []
    for i in range(draws):
        counts = co_correct_counts(np.stack([a[i], b[i]], 1))
        accuracy, se = paired_standard_errors(counts, n, 0)
        differences.append(accuracy[0] - accuracy[1])
        ses.append(se[1])
    exact = np.sqrt((0.06 + 0.03 - 0.03 ** 2) / n)   # sd of the mean of d in {-1, 0, 1}
    assert abs(np.std(differences) / exact - 1) < 0.05
    assert abs(np.mean(ses) / exact - 1) < 0.05


def _counts(accuracies, n, disagreement):
    """Counts of candidates that agree except on ``disagreement`` examples each, with the given accuracies."""
    K = len(accuracies)
    correct = np.zeros((n, K), dtype=int)
    common = int(min(accuracies) * n) - disagreement
    correct[:common] = 1
    for k, a in enumerate(accuracies):
        extra = int(round(a * n)) - common
        rows = np.random.default_rng(k).choice(np.arange(common, n), size=extra, replace=False)
        correct[rows, k] = 1
    return co_correct_counts(correct), correct


def test_the_rule_picks_the_narrowest_candidate_within_one_standard_error_of_the_best():
    n = 2000
    counts, correct = _counts([0.960, 0.964, 0.968, 0.969, 0.970], n, disagreement=40)
    sizes = [100, 200, 300, 400, 500]
    accuracy, se = paired_standard_errors(counts, n, 4)
    within = [k for k in range(5) if accuracy[4] - accuracy[k] <= se[k]]
    assert within and within != [4]
    assert one_standard_error_choice(counts, n, sizes) == within[0]
    assert one_standard_error_choice(counts, n, sizes, tolerance=0) == 4          # the most accurate
    assert one_standard_error_choice(counts, n, sizes, tolerance=1e6) == 0        # the narrowest
    # sizes need not follow the candidates' order: the narrowest eligible wins
    assert one_standard_error_choice(counts, n, sizes[::-1], tolerance=1e6) == 4
    # a tie in accuracy: the smaller is the best, whatever the order
    tie = co_correct_counts(np.concatenate([correct[:, [3]], correct[:, [3]]], 1))
    assert one_standard_error_choice(tie, n, [50, 20], tolerance=0) == 1


def test_identical_candidates_have_no_uncertainty_between_them_and_the_smaller_wins():
    correct = np.random.default_rng(3).integers(0, 2, size=(100, 1))
    counts = co_correct_counts(np.repeat(correct, 3, 1))
    accuracy, se = paired_standard_errors(counts, 100, 0)
    assert (se == 0).all() and len(set(accuracy)) == 1
    assert one_standard_error_choice(counts, 100, [30, 10, 20]) == 1


@pytest.mark.parametrize("call, message", [
    (lambda: co_correct_counts(np.array([1, 0])), "correct: expected an \\(n, K\\) matrix"),
    (lambda: co_correct_counts(np.array([[2, 0]])), "correct: expected an \\(n, K\\) matrix of 0/1"),
    (lambda: paired_standard_errors(np.array([[3, 1], [2, 3]]), 5, 0), "counts: expected a symmetric"),
    (lambda: paired_standard_errors(np.array([[3.0]]), 5, 0), "counts: expected a symmetric"),
    (lambda: paired_standard_errors(np.array([[3, 4], [4, 5]]), 5, 0), "counts: expected C\\^T C of 5"),
    (lambda: paired_standard_errors(np.array([[6]]), 5, 0), "counts: expected C\\^T C of 5"),
    (lambda: paired_standard_errors(np.array([[1]]), 1, 0), "total: expected the number n >= 2"),
    (lambda: paired_standard_errors(np.array([[1]]), 5, 1), "reference: expected a candidate index in \\[0, 1\\)"),
    (lambda: one_standard_error_choice(np.array([[1]]), 5, [1, 2]), "sizes: expected 1 positive integers"),
    (lambda: one_standard_error_choice(np.array([[1]]), 5, [1], tolerance=-1), "tolerance: expected a number"),
])
def test_bad_counts_sizes_and_tolerances_are_refused_by_name(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("changes, message", [
    (dict(noise_factors=(0.5, 1.0)), "noise_factors: expected distinct factors other than 1"),
    (dict(noise_factors=(0.5, 0.5)), "noise_factors: expected distinct factors other than 1"),
    (dict(noise_factors=(0.5, -1.0)), "noise_factors"),
    (dict(tolerance=-0.5), "tolerance: expected a number of standard errors >= 0"),
])
def test_bad_operating_point_settings_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        ExperimentConfig(select="operating-point", **changes)


@pytest.mark.parametrize("select, changes", [
    ("none", dict(noise_factors=(0.5,))), ("federated", dict(tolerance=2.0)),
    ("operating-point", dict(grid_sigma2=(1.0,))),
    ("none", dict(holdout=0.2)), ("pooled-train", dict(holdout=0.2)), ("none", dict(grid_gamma0=(1.0,))),
])
def test_a_setting_of_another_selection_is_an_error_not_a_no_op(select, changes):
    name = next(iter(changes))
    with pytest.raises(ValueError, match=f"{name}: applies with select in .* only, got .* with select='{select}'"):
        ExperimentConfig(select=select, **changes)


def test_the_operating_point_needs_an_estimated_noise_to_scale(digits):
    validation = [(digits.x_train[:10], digits.y_train[:10])]
    with pytest.raises(ValueError, match="pfnm: expected an empirical-Bayes config"):
        select_operating_point([], None, validation, PFNMConfig(hyperparameters="fixed"), seed=0)
    with pytest.raises(ValueError, match="pfnm.sigma2: expected None"):
        select_operating_point([], None, validation, PFNMConfig(sigma2=0.1), seed=0)
    with pytest.raises(ValueError, match="validation: expected at least two held-out examples"):
        select_operating_point([], None, [(digits.x_train[:1], digits.y_train[:1])], PFNMConfig(), seed=0)


@pytest.fixture(scope="module")
def chosen(digits):
    return run_experiment(digits, partition=PartitionConfig(clients=4), network=PFNM_NETWORK,
                          training=TrainingConfig(epochs=5, amsgrad=True),
                          config=ExperimentConfig(methods=("pfnm",), select="operating-point",
                                                  noise_factors=(1.4, 0.65, 0.4)))


def test_on_trained_networks_the_row_is_the_narrowest_candidate_within_one_standard_error(chosen, digits):
    selection, row = chosen.selection, chosen.row("pfnm")
    curve = selection.curve
    assert [c["factor"] for c in curve] == [1.4, 1.0, 0.65, 0.4]
    estimate = curve[1]["sigma2"]
    for c in curve:   # every candidate's noise is its factor times the estimate
        np.testing.assert_allclose(c["sigma2"], [c["factor"] * s for s in estimate], rtol=1e-12)
    best = max(curve, key=lambda c: (c["validation"], -c["parameters"]))
    within = [c for c in curve if best["validation"] - c["validation"] <= c["se"] + 1e-12]
    pick = min(within, key=lambda c: (c["parameters"], -c["validation"]))
    assert [c["chosen"] for c in curve].count(True) == 1 and pick["chosen"]
    assert row.hidden == pick["hidden"] and row.parameters == pick["parameters"]
    assert row.accuracy == pytest.approx(pick["test"], abs=1e-12)
    assert selection.by == "operating-point" and selection.score == pick["validation"]
    # the row's own hyper-parameters are the candidate's noise
    assert row.hyperparameters[0]["sigma2"] == pytest.approx(pick["sigma2"][0], rel=1e-12)
    assert "sigma2" not in row.hyperparameters[0]["estimated"] or pick["factor"] == 1.0


def test_the_clients_train_on_what_they_did_not_hold_out(chosen, digits):
    assert sum(chosen.client_sizes) == pytest.approx(0.9 * len(digits.y_train), abs=4)


def test_the_same_seed_chooses_the_same_operating_point(chosen, digits):
    again = run_experiment(digits, partition=PartitionConfig(clients=4), network=PFNM_NETWORK,
                           training=TrainingConfig(epochs=5, amsgrad=True),
                           config=ExperimentConfig(methods=("pfnm",), select="operating-point",
                                                   noise_factors=(1.4, 0.65, 0.4)))
    assert again.selection.curve == chosen.selection.curve
    assert again.row("pfnm").accuracy == chosen.row("pfnm").accuracy
