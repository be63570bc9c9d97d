"""bnpfed.metrics against independent computations: scikit-learn, python loops, and small hand-worked examples."""

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, brier_score_loss, log_loss
from torch import nn

from bnpfed.metrics import (NLL_EPS, accuracy, brier_score, calibration_report, classification_report,
                            count_parameters, ece_noise_floor, expected_calibration_error, nll, ood_auroc, ood_scores)


def random_predictions(seed, n=500, num_classes=4):
    """Dirichlet-distributed predictive distributions and labels drawn partly from them (so accuracy is mixed)."""
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(num_classes, 0.7), size=n)
    labels = np.array([rng.choice(num_classes, p=row) for row in probs])
    return probs, labels


def ece_by_loop(probs, labels, n_bins):
    """ECE written out example by example: bins (b/M, (b+1)/M], sum_b |B_b|/N |acc(B_b) - conf(B_b)|."""
    total = 0.0
    for b in range(n_bins):
        lower, upper = b / n_bins, (b + 1) / n_bins
        members = [n for n in range(len(labels)) if lower < max(probs[n]) <= upper]
        if not members:
            continue
        acc = sum(int(np.argmax(probs[n]) == labels[n]) for n in members) / len(members)
        conf = sum(max(probs[n]) for n in members) / len(members)
        total += len(members) / len(labels) * abs(acc - conf)
    return total


# Four examples, two classes, worked by hand with n_bins = 5 (bin edges 0, .2, .4, .6, .8, 1):
#   conf .9 correct -> bin (.8, 1]; conf .7 wrong and .7 correct -> bin (.6, .8]; conf .55 wrong -> bin (.4, .6]
#   ECE   = (1 |1 - .9| + 2 |.5 - .7| + 1 |0 - .55|) / 4 = (.1 + .4 + .55) / 4 = .2625
#   Brier = ((.1^2 + .1^2) + (.7^2 + .7^2) + (.3^2 + .3^2) + (.55^2 + .55^2)) / 4 = (.02 + .98 + .18 + .605) / 4
HAND_PROBS = [[0.9, 0.1], [0.7, 0.3], [0.3, 0.7], [0.45, 0.55]]
HAND_LABELS = [0, 1, 1, 0]


def test_hand_worked_example():
    probs, labels = torch.tensor(HAND_PROBS, dtype=torch.float64), torch.tensor(HAND_LABELS)
    assert accuracy(probs, labels) == pytest.approx(0.5)
    assert nll(probs, labels) == pytest.approx(-(math.log(0.9) + math.log(0.3) + math.log(0.7) + math.log(0.45)) / 4)
    assert expected_calibration_error(probs, labels, n_bins=5) == pytest.approx(0.2625, abs=1e-12)
    assert brier_score(probs, labels) == pytest.approx(1.785 / 4, abs=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_accuracy_matches_scikit_learn(seed):
    probs, labels = random_predictions(seed)
    assert accuracy(torch.from_numpy(probs), torch.from_numpy(labels)) == pytest.approx(
        accuracy_score(labels, probs.argmax(axis=1)), abs=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_nll_matches_scikit_learn_log_loss(seed):
    probs, labels = random_predictions(seed)
    assert nll(probs, labels) == pytest.approx(log_loss(labels, probs, labels=range(4)), rel=1e-10)


def test_nll_clamps_only_a_zero_probability_at_eps():
    probs, labels = torch.tensor([[1.0, 0.0], [0.5, 0.5]], dtype=torch.float64), torch.tensor([1, 0])
    assert nll(probs, labels) == pytest.approx((-math.log(NLL_EPS) - math.log(0.5)) / 2)
    assert nll(probs, labels, eps=1e-3) == pytest.approx((-math.log(1e-3) - math.log(0.5)) / 2)
    assert nll(probs, labels, eps=0) == math.inf
    assert nll(probs, torch.tensor([0, 0]), eps=0.4) == pytest.approx(-math.log(0.5) / 2)  # 0.5 > eps: unclamped


@pytest.mark.parametrize("n_bins", [1, 5, 15, 100])
@pytest.mark.parametrize("seed", range(2))
def test_ece_matches_a_python_loop_over_examples(seed, n_bins):
    probs, labels = random_predictions(seed, n=300)
    assert expected_calibration_error(probs, labels, n_bins=n_bins) == pytest.approx(
        ece_by_loop(probs, labels, n_bins), abs=1e-12)


def test_ece_is_zero_when_accuracy_equals_confidence_in_every_bin():
    # 10 predictions at confidence .8 with 8 right, 5 at confidence .6 with 3 right
    probs = [[0.8, 0.2]] * 10 + [[0.4, 0.6]] * 5
    labels = [0] * 8 + [1] * 2 + [1] * 3 + [0] * 2
    assert expected_calibration_error(probs, labels, n_bins=10) == pytest.approx(0.0, abs=1e-12)
    assert expected_calibration_error(probs, [0] * 15, n_bins=10) > 0.1  # same confidences, other labels


def test_ece_of_confident_correct_predictions_is_zero_and_of_confident_wrong_ones_is_one():
    probs = torch.eye(3)
    assert expected_calibration_error(probs, torch.tensor([0, 1, 2])) == pytest.approx(0.0)
    assert expected_calibration_error(probs, torch.tensor([1, 2, 0])) == pytest.approx(1.0)


@pytest.mark.parametrize("seed", range(3))
def test_brier_score_matches_scikit_learn(seed):
    probs, labels = random_predictions(seed)
    expected = brier_score_loss(labels, probs, labels=range(4), scale_by_half=False)
    assert brier_score(probs, labels) == pytest.approx(expected, rel=1e-10)


def test_binary_brier_score_is_twice_the_usual_binary_one():
    probs, labels = random_predictions(5, num_classes=2)
    assert brier_score(probs, labels) == pytest.approx(2 * np.mean((probs[:, 1] - labels) ** 2), rel=1e-10)


def test_classification_report_collects_the_four_metrics():
    probs, labels = random_predictions(7)
    report = classification_report(probs, labels, n_bins=20)
    assert report == {
        "accuracy": accuracy(probs, labels),
        "nll": nll(probs, labels),
        "ece": expected_calibration_error(probs, labels, n_bins=20),
        "brier": brier_score(probs, labels),
    }
    assert all(isinstance(value, float) for value in report.values())


def test_float32_probabilities_from_softmax_are_accepted():
    logits = torch.randn(200, 10, generator=torch.Generator().manual_seed(0))
    probs, labels = logits.softmax(dim=1), torch.arange(200) % 10
    renormalised = probs.double() / probs.double().sum(dim=1, keepdim=True)  # float32 rows sum to 1 +- 1e-7
    expected = log_loss(labels.numpy(), renormalised.numpy(), labels=range(10))
    assert nll(probs, labels) == pytest.approx(expected, rel=1e-6)


def test_count_parameters_counts_each_scalar_once():
    assert count_parameters(nn.Linear(3, 4)) == 3 * 4 + 4
    shared = nn.Linear(5, 5)
    assert count_parameters(nn.Sequential(shared, nn.ReLU(), shared)) == 5 * 5 + 5
    assert count_parameters(nn.Sequential(nn.Conv2d(1, 2, 3, bias=False), nn.Flatten())) == 2 * 9
    with pytest.raises(TypeError, match="module"):
        count_parameters(torch.zeros(3))


GOOD_PROBS, GOOD_LABELS = [[0.2, 0.8], [0.6, 0.4]], [1, 0]
BAD_INPUTS = [
    # (probs, labels, the argument the message must name)
    ([0.2, 0.8], [1], "probs"),  # 1-D
    (np.zeros((0, 2)), np.zeros(0, dtype=int), "probs"),
    ([[0.2, 0.9], [0.6, 0.4]], GOOD_LABELS, "probs"),  # row sums to 1.1
    ([[-0.2, 1.2], [0.6, 0.4]], GOOD_LABELS, "probs"),
    ([[math.nan, 1.0], [0.6, 0.4]], GOOD_LABELS, "probs"),
    (GOOD_PROBS, [1, 2], "labels"),  # class 2 of 2
    (GOOD_PROBS, [1, -1], "labels"),
    (GOOD_PROBS, [1, 0, 1], "labels"),
    (GOOD_PROBS, [1.0, 0.0], "labels"),
]


@pytest.mark.parametrize("metric", [accuracy, nll, expected_calibration_error, brier_score, classification_report])
@pytest.mark.parametrize("probs, labels, argument", BAD_INPUTS)
def test_bad_input_raises_value_error_naming_the_argument(metric, probs, labels, argument):
    with pytest.raises(ValueError, match=rf"\b{argument}\b"):
        metric(probs, labels)


def test_bad_settings_raise_value_error_naming_the_argument():
    with pytest.raises(ValueError, match="n_bins"):
        expected_calibration_error(GOOD_PROBS, GOOD_LABELS, n_bins=0)
    with pytest.raises(ValueError, match="n_bins"):
        classification_report(GOOD_PROBS, GOOD_LABELS, n_bins=2.5)
    with pytest.raises(ValueError, match="eps"):
        nll(GOOD_PROBS, GOOD_LABELS, eps=-1e-3)


def test_ece_bins_are_closed_on_the_right():
    # confidence .5 belongs to (0, .5], not (.5, 1], with two bins: gaps |1 - .5| and |0 - 1|, one example each
    probs, labels = [[0.5, 0.5], [1.0, 0.0]], [0, 1]
    assert expected_calibration_error(probs, labels, n_bins=2) == pytest.approx((0.5 + 1.0) / 2)
    # with .5 in the upper bin instead it would be 2/2 |.5 - .75| = .25


# Four examples, two classes, worked by hand for 100 bins (width .01) and 15 bins (width 1/15); no confidence lies
# on a bin edge of either:
#   conf .905 right -> bin (.90, .91] of 100, (13/15, 14/15] = (.867, .933] of 15
#   conf .755 wrong -> bin (.75, .76] of 100, (11/15, 12/15] = (.733, .8] of 15
#   conf .785 right -> bin (.78, .79] of 100, (11/15, 12/15] of 15 (with .755)
#   conf .555 wrong -> bin (.55, .56] of 100, ( 8/15,  9/15] = (.533, .6] of 15
#   ECE, 100 bins: every example alone in its bin: (|1 - .905| + |0 - .755| + |1 - .785| + |0 - .555|) / 4
#                  = (.095 + .755 + .215 + .555) / 4 = 1.62 / 4 = .405
#   ECE, 15 bins:  (.095 + 2 |.5 - (.755 + .785) / 2| + .555) / 4 = (.095 + .54 + .555) / 4 = 1.19 / 4 = .2975
CALIBRATION_PROBS = [[0.905, 0.095], [0.755, 0.245], [0.215, 0.785], [0.555, 0.445]]
CALIBRATION_LABELS = [0, 1, 1, 1]


def test_ece_with_100_bins_on_a_hand_worked_example():
    assert expected_calibration_error(CALIBRATION_PROBS, CALIBRATION_LABELS, n_bins=100) == pytest.approx(
        0.405, abs=1e-12)
    assert expected_calibration_error(CALIBRATION_PROBS, CALIBRATION_LABELS, n_bins=15) == pytest.approx(
        0.2975, abs=1e-12)


def test_calibration_report_has_exactly_the_cli_keys():
    report = calibration_report(CALIBRATION_PROBS, CALIBRATION_LABELS)
    assert list(report) == ["accuracy", "nll", "ece", "ece15", "brier"]
    assert all(isinstance(value, float) for value in report.values())
    assert report["accuracy"] == pytest.approx(0.5)
    assert report["ece"] == pytest.approx(0.405, abs=1e-12)  # 100 bins
    assert report["ece15"] == pytest.approx(0.2975, abs=1e-12)
    assert report["nll"] == pytest.approx(-(math.log(0.905) + math.log(0.245) + math.log(0.785) + math.log(0.445)) / 4)
    # Brier by hand: 2 (.095^2 + .755^2 + .215^2 + .555^2) / 4
    assert report["brier"] == pytest.approx(2 * (0.095**2 + 0.755**2 + 0.215**2 + 0.555**2) / 4, abs=1e-12)


def test_calibration_report_agrees_with_the_single_metrics_and_leaves_classification_report_alone():
    probs, labels = random_predictions(8)
    assert calibration_report(probs, labels) == {
        "accuracy": accuracy(probs, labels),
        "nll": nll(probs, labels),
        "ece": expected_calibration_error(probs, labels, n_bins=100),
        "ece15": expected_calibration_error(probs, labels, n_bins=15),
        "brier": brier_score(probs, labels),
    }
    assert list(classification_report(probs, labels)) == ["accuracy", "nll", "ece", "brier"]
    assert classification_report(probs, labels)["ece"] == calibration_report(probs, labels)["ece15"]


def numpy_ood_scores(probs):
    """max_c p_nc and sum_c p_nc log p_nc (0 log 0 = 0), in numpy."""
    probs = np.asarray(probs, dtype=np.float64)
    p_log_p = np.where(probs > 0, probs * np.log(np.where(probs > 0, probs, 1.0)), 0.0)
    return {"max_prob": probs.max(axis=1), "neg_entropy": p_log_p.sum(axis=1)}


def auroc_by_pairs(scores_in, scores_out):
    """P(score_in > score_out) + P(score_in = score_out) / 2 over all (in, out) pairs."""
    diff = np.asarray(scores_in)[:, None] - np.asarray(scores_out)[None, :]
    return ((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size


def predictions_from_a_pool(seed, n):
    """Rows drawn from six distributions, so that scores tie often: two pairs share their maximum (.6, .5) but not
    their entropy, and each row repeats."""
    pool = np.array([[0.6, 0.4, 0.0], [0.6, 0.2, 0.2], [0.5, 0.5, 0.0], [0.5, 0.3, 0.2], [0.9, 0.05, 0.05],
                     [1 / 3, 1 / 3, 1 / 3]])
    return pool[np.random.default_rng(seed).integers(len(pool), size=n)]


@pytest.mark.parametrize("seed", range(3))
def test_ood_auroc_matches_a_pairwise_count(seed):
    rng = np.random.default_rng(seed)
    probs_in = rng.dirichlet(np.full(5, 0.3), size=150)  # peaked: mostly higher scores
    probs_out = rng.dirichlet(np.full(5, 2.0), size=120)
    expected_in, expected_out = numpy_ood_scores(probs_in), numpy_ood_scores(probs_out)
    result = ood_auroc(probs_in, probs_out)
    assert list(result) == ["auroc_max_prob", "auroc_entropy"]
    assert result["auroc_max_prob"] == pytest.approx(
        auroc_by_pairs(expected_in["max_prob"], expected_out["max_prob"]), abs=1e-12)
    assert result["auroc_entropy"] == pytest.approx(
        auroc_by_pairs(expected_in["neg_entropy"], expected_out["neg_entropy"]), abs=1e-12)
    assert 0.5 < result["auroc_max_prob"] < 1


@pytest.mark.parametrize("seed", range(3))
def test_ood_auroc_counts_ties_as_one_half(seed):
    probs_in, probs_out = predictions_from_a_pool(seed, 80), predictions_from_a_pool(seed + 100, 60)
    expected_in, expected_out = numpy_ood_scores(probs_in), numpy_ood_scores(probs_out)
    assert (expected_in["max_prob"][:, None] == expected_out["max_prob"][None, :]).any()  # ties do occur
    result = ood_auroc(torch.from_numpy(probs_in), torch.from_numpy(probs_out))
    assert result["auroc_max_prob"] == pytest.approx(
        auroc_by_pairs(expected_in["max_prob"], expected_out["max_prob"]), abs=1e-12)
    assert result["auroc_entropy"] == pytest.approx(
        auroc_by_pairs(expected_in["neg_entropy"], expected_out["neg_entropy"]), abs=1e-12)


def test_ood_auroc_of_perfectly_separated_scores_is_one():
    confident = torch.eye(4)[torch.arange(10) % 4]  # max 1, entropy 0
    unsure = torch.full((7, 4), 0.25)  # max 1/4, entropy log 4
    assert ood_auroc(confident, unsure) == {"auroc_max_prob": 1.0, "auroc_entropy": 1.0}
    assert ood_auroc(unsure, confident) == {"auroc_max_prob": 0.0, "auroc_entropy": 0.0}
    assert ood_auroc(unsure, unsure) == {"auroc_max_prob": 0.5, "auroc_entropy": 0.5}  # all tied


def test_ood_auroc_of_identically_distributed_inputs_is_about_one_half():
    # 2000 against 2000 draws of the same distribution: the AUROC's standard error is
    # sqrt((n_in + n_out + 1) / (12 n_in n_out)) ~ 0.009, so a tolerance of 0.04 is over 4 standard errors
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.full(10, 0.5), size=4000)
    result = ood_auroc(probs[:2000], probs[2000:])
    assert result["auroc_max_prob"] == pytest.approx(0.5, abs=0.04)
    assert result["auroc_entropy"] == pytest.approx(0.5, abs=0.04)


@pytest.mark.parametrize("num_classes", [1, 2, 10, 100])
def test_ood_scores_of_uniform_and_one_hot_distributions(num_classes):
    scores = ood_scores(torch.full((3, num_classes), 1 / num_classes))
    assert set(scores) == {"max_prob", "neg_entropy"}
    assert scores["max_prob"].shape == scores["neg_entropy"].shape == (3,)
    assert torch.allclose(scores["max_prob"], torch.full((3,), 1 / num_classes, dtype=torch.float64))
    # entropy of the uniform distribution is log C
    assert torch.allclose(scores["neg_entropy"], torch.full((3,), -math.log(num_classes), dtype=torch.float64),
                          atol=1e-6)
    one_hot = ood_scores(torch.eye(num_classes))  # 0 log 0 = 0: entropy 0, not NaN
    assert torch.equal(one_hot["neg_entropy"], torch.zeros(num_classes, dtype=torch.float64))
    assert torch.equal(one_hot["max_prob"], torch.ones(num_classes, dtype=torch.float64))


def test_ood_scores_match_numpy():
    probs, _ = random_predictions(9)
    probs[0] = [0.5, 0.5, 0.0, 0.0]
    scores, expected = ood_scores(probs), numpy_ood_scores(probs)
    for key in ("max_prob", "neg_entropy"):
        np.testing.assert_allclose(scores[key].numpy(), expected[key], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("probs, _labels, argument", [case for case in BAD_INPUTS if case[2] == "probs"])
def test_bad_ood_probabilities_raise_value_error_naming_the_argument(probs, _labels, argument):
    with pytest.raises(ValueError, match=r"\bprobs\b"):
        ood_scores(probs)
    with pytest.raises(ValueError, match=r"\bprobs_in\b"):
        ood_auroc(probs, GOOD_PROBS)
    with pytest.raises(ValueError, match=r"\bprobs_out\b"):
        ood_auroc(GOOD_PROBS, probs)


def test_ood_auroc_refuses_different_numbers_of_classes():
    with pytest.raises(ValueError, match=r"probs_in.*probs_out.*classes"):
        ood_auroc(GOOD_PROBS, [[0.2, 0.3, 0.5]])
    with pytest.raises(ValueError, match="probs_out"):
        ood_auroc(GOOD_PROBS, torch.tensor([[1, 0], [0, 1]]))  # integer dtype


# --- the noise floor of the ECE ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_poisson_binomial_law_matches_enumerating_every_outcome(seed):
    from itertools import product

    from bnpfed.metrics import _poisson_binomial_pmf
    p = np.random.default_rng(seed).uniform(0.05, 0.99, size=11)
    expected = np.zeros(12)
    for outcome in product((0, 1), repeat=11):
        o = np.array(outcome)
        expected[o.sum()] += np.prod(np.where(o == 1, p, 1 - p))
    np.testing.assert_allclose(_poisson_binomial_pmf(p), expected, rtol=1e-10, atol=1e-15)


def test_poisson_binomial_law_of_equal_trials_is_the_binomial_through_the_fft_products():
    from scipy.stats import binom

    from bnpfed.metrics import _poisson_binomial_pmf
    np.testing.assert_allclose(_poisson_binomial_pmf(np.full(300, 0.9)), binom.pmf(np.arange(301), 300, 0.9),
                               atol=1e-12)


def test_ece_floor_of_one_bin_is_de_moivres_mean_absolute_deviation_over_n():
    # n predictions at confidence p in one bin: E|S - np| of S ~ Binomial(n, p) is, by de Moivre's closed form,
    # 2 (1 - p)^(n - m) p^(m + 1) (m + 1) C(n, m + 1) with m = floor(np)
    n, p = 40, 0.855
    m = math.floor(n * p)
    mad = 2 * (1 - p) ** (n - m) * p ** (m + 1) * (m + 1) * math.comb(n, m + 1)
    probs = np.tile([p, 1 - p], (n, 1))
    assert ece_noise_floor(probs, n_bins=100) == pytest.approx(mad / n, rel=1e-10)


def test_ece_floor_is_the_mean_ece_of_labels_drawn_from_the_confidences():
    """Monte Carlo: each prediction right with probability its confidence; 400 draws, 4 standard errors."""
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.full(5, 0.4), size=2000)
    conf, pred = probs.max(axis=1), probs.argmax(axis=1)
    eces = []
    for _ in range(400):
        right = rng.random(conf.size) < conf
        labels = np.where(right, pred, (pred + 1) % 5)
        eces.append(expected_calibration_error(probs, labels, n_bins=100))
    floor = ece_noise_floor(probs, n_bins=100)
    assert abs(np.mean(eces) - floor) < 4 * np.std(eces) / math.sqrt(len(eces))
    assert floor > 0.02   # 2,000 examples in 100 bins: far from 0


def test_ece_floor_shrinks_with_fewer_bins_and_more_examples():
    probs = np.random.default_rng(1).dirichlet(np.full(4, 0.5), size=4000)
    assert ece_noise_floor(probs, 15) < ece_noise_floor(probs, 100)
    assert ece_noise_floor(probs, 100) < ece_noise_floor(probs[:1000], 100)


def test_ece_floor_of_certain_predictions_is_zero():
    assert ece_noise_floor([[1.0, 0.0], [0.0, 1.0]], n_bins=100) == 0.0


@pytest.mark.parametrize("probs, argument", [(b[0], b[2]) for b in BAD_INPUTS if b[2] == "probs"])
def test_ece_floor_refuses_bad_probabilities_by_name(probs, argument):
    with pytest.raises(ValueError, match=rf"\b{argument}\b"):
        ece_noise_floor(probs)
    with pytest.raises(ValueError, match="n_bins"):
        ece_noise_floor(GOOD_PROBS, n_bins=0)
