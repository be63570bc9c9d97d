"""bnpfed.metrics against independent computations: scikit-learn, python loops, and small hand-worked examples."""

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, brier_score_loss, log_loss
from torch import nn

from bnpfed.metrics import (NLL_EPS, accuracy, brier_score, classification_report, count_parameters,
                            expected_calibration_error, nll)


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
