"""Likelihoods everywhere: federated regression on scikit-learn's bundled diabetes data with a Gaussian and a
Student-t likelihood (each noise scale learned), every fusion rule, predictive intervals and their coverage; in
process and on the command line. A classification run is unchanged (the golden tests)."""

import json
import math

import numpy as np
import pyro.distributions as dist
import pytest
import scipy.optimize
import scipy.stats
import torch
from torch.testing import assert_close

from bnpfed.cli import main
from bnpfed.clients import BayesianClient, Gaussian, StudentT
from bnpfed.combine import available_rules
from bnpfed.data import load_dataset
from bnpfed.federated import (BayesianConfig, FedAvgFederation, FusionConfig, FusionFederation,
                              MatchedFusionFederation, NetworkConfig, PartitionConfig, TrainingConfig)
from bnpfed.metrics import regression_report, regression_scores
from bnpfed.models import NOISE_SITE, BayesianNetwork, mlp, only_linear_weights


@pytest.fixture(scope="module")
def diabetes():
    return load_dataset("diabetes")


def test_the_diabetes_data_is_a_standardised_regression_with_no_download(diabetes):
    assert diabetes.task == "regression" and diabetes.num_classes == 1 and diabetes.input_shape == (10,)
    assert (len(diabetes.x_train), len(diabetes.x_test)) == (331, 111)
    assert diabetes.y_train.dtype == torch.float32
    assert_close(diabetes.x_train.mean(0), torch.zeros(10), atol=1e-5, rtol=0)
    assert_close(diabetes.x_train.std(0, unbiased=False), torch.ones(10), atol=1e-4, rtol=0)
    assert abs(float(diabetes.y_train.mean())) < 1e-5 and abs(float(diabetes.y_train.std(unbiased=False)) - 1) < 1e-4
    raw = load_dataset("diabetes", standardize=False)
    assert 25 <= float(raw.y_train.min()) and float(raw.y_train.max()) <= 346   # scikit-learn's target range


# ------------------------------------------------------------ predictive intervals of a mixture


def _mixture(kind):
    locs, scales = torch.tensor([[0.0, 1.0, -2.0], [0.5, 1.5, -1.0]]), torch.tensor([[1.0, 0.5, 2.0],
                                                                                      [0.8, 0.7, 1.0]])
    if kind == "normal":
        return [dist.Normal(locs[s], scales[s]) for s in range(2)], locs, scales, None
    return [dist.StudentT(4.0, locs[s], scales[s]).to_event(1) for s in range(2)], locs, scales, 4.0


@pytest.mark.parametrize("kind", ["normal", "student-t"])
def test_the_central_interval_and_density_of_a_mixture_are_scipys(kind):
    observations, locs, scales, df = _mixture(kind)
    y = torch.tensor([0.3, 2.0, -6.0])
    scores = regression_scores(observations, y, level=0.9)
    law = (lambda m, s: scipy.stats.norm(m, s)) if df is None else (lambda m, s: scipy.stats.t(df, m, s))
    for i in range(3):
        parts = [law(float(locs[s, i]), float(scales[s, i])) for s in range(2)]

        def cdf(v):
            return sum(p.cdf(v) for p in parts) / 2

        for p, bound in ((0.05, "lower"), (0.95, "upper")):
            expected = scipy.optimize.brentq(lambda v: cdf(v) - p, -100, 100, xtol=1e-12)
            assert float(scores[bound][i]) == pytest.approx(expected, abs=1e-8)
        assert float(scores["pit"][i]) == pytest.approx(cdf(float(y[i])), abs=1e-12)
        assert float(scores["log_density"][i]) == pytest.approx(
            math.log(sum(p.pdf(float(y[i])) for p in parts) / 2), abs=1e-9)
        assert float(scores["mean"][i]) == pytest.approx(float(locs[:, i].mean()), abs=1e-7)


def test_targets_drawn_from_the_predictive_are_covered_at_its_level():
    observations, locs, scales, _ = _mixture("student-t")
    g = torch.Generator().manual_seed(0)
    n = 20000
    which = torch.randint(0, 2, (n,), generator=g)
    column = torch.randint(0, 3, (n,), generator=g)
    draws = torch.distributions.StudentT(4.0).sample((n,)) * scales[which, column] + locs[which, column]
    many = [dist.StudentT(4.0, locs[s][column], scales[s][column]) for s in range(2)]
    report = regression_report(many, draws, level=0.9)
    # a binomial share of 20000: standard error 0.0021; 4 of them
    assert abs(report["coverage"] - 0.9) < 4 * math.sqrt(0.9 * 0.1 / n)


# ------------------------------------------------------------ likelihoods with a learned noise scale


def test_a_learned_noise_scale_is_a_latent_site_whose_posterior_finds_the_noise():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 3, generator=g)
    y = x @ torch.tensor([1.0, -0.5, 0.25]) + 0.3 * torch.randn(400, generator=g)
    torch.manual_seed(0)
    client = BayesianClient(mlp(3, [], 1), only_linear_weights(), likelihood=Gaussian(scale=None))
    assert client.bnn.hyper_sites == (NOISE_SITE,) and client.bnn.latent_sites[-1] == NOISE_SITE
    client.fit(x, y, epochs=150, batch_size=100, lr=0.02, seed=0)
    noise = math.exp(client.posterior()[NOISE_SITE].loc.item())
    # the noise's standard deviation is 0.3; the residuals of 400 examples estimate it to about 4 %
    assert noise == pytest.approx(0.3, rel=0.15)
    prediction = client.predict(x[:3], num_samples=200, seed=0)
    assert_close(prediction.mean, x[:3] @ torch.tensor([1.0, -0.5, 0.25]), atol=0.1, rtol=0)


def test_the_student_t_likelihood_is_scipys_and_its_predictive_has_the_mixtures_moments():
    bnn = BayesianNetwork(mlp(2, [], 1), only_linear_weights(), likelihood=StudentT(3.0, scale=0.5))
    output, y = torch.tensor([[0.2], [-1.0]]), torch.tensor([0.0, 1.0])
    assert bnn.likelihood.log_likelihood(output, y).item() == pytest.approx(
        scipy.stats.t.logpdf([0.0, 1.0], 3.0, [0.2, -1.0], 0.5).sum(), abs=1e-5)
    draws = [dist.StudentT(5.0, torch.tensor([0.0, 1.0]), 0.5), dist.StudentT(5.0, torch.tensor([1.0, 1.0]), 0.5)]
    from bnpfed.models import predictive_of
    moments = predictive_of(draws)
    assert_close(moments.mean, torch.tensor([0.5, 1.0]))
    assert_close(moments.variance, 0.25 * 5 / 3 + torch.tensor([0.25, 0.0]))


# ------------------------------------------------------------ federated regression


@pytest.mark.parametrize("likelihood", ["gaussian", "student-t"])
def test_every_rule_fuses_a_federated_regression_with_calibrated_intervals(diabetes, likelihood):
    parts = PartitionConfig(clients=3).split(diabetes.y_train.numpy(), seed=0)
    for rule in available_rules():
        federation = FusionFederation(diabetes, parts, network=NetworkConfig(hidden=(16,)),
                                      training=TrainingConfig(epochs=5), bayesian=BayesianConfig(likelihood=likelihood),
                                      fusion=FusionConfig(rule=rule), seed=0)
        records = federation.run(3)
        metrics = records[-1].metrics
        assert {"rmse", "nll", "coverage", "interval_width"} <= set(metrics) and "accuracy" not in metrics
        # measured: RMSE 0.70-0.71 (the targets' sd is 1), coverage 0.86-0.94 of the 111 test targets
        assert metrics["rmse"] < 0.8, rule
        assert 0.75 <= metrics["coverage"] <= 1.0, rule
        assert NOISE_SITE in federation.global_posterior     # the noise scale fused as any site, in log space


def test_a_regression_is_refused_where_it_cannot_run(diabetes):
    parts = PartitionConfig(clients=2).split(diabetes.y_train.numpy(), seed=0)
    common = dict(network=NetworkConfig(hidden=(8,)), training=TrainingConfig(epochs=1), seed=0)
    with pytest.raises(ValueError, match="dataset: 'diabetes' is a regression; FedAvgFederation runs classification"):
        FedAvgFederation(diabetes, parts, **common)
    with pytest.raises(ValueError, match="is a regression; MatchedFusionFederation"):
        MatchedFusionFederation(diabetes, parts, bayesian=BayesianConfig(likelihood="gaussian"),
                                fusion=FusionConfig(align="match"), **common)
    with pytest.raises(ValueError, match="likelihood: a regression's clients are variational with a likelihood of"):
        FusionFederation(diabetes, parts, bayesian=BayesianConfig(), fusion=FusionConfig(), **common)
    with pytest.raises(ValueError, match="likelihood: expected a classification likelihood"):
        FusionFederation(load_dataset("digits"), parts, bayesian=BayesianConfig(likelihood="gaussian"),
                         fusion=FusionConfig(), **common)
    with pytest.raises(ValueError, match="partition: 'dirichlet' .* expected 'iid'"):
        PartitionConfig(clients=2, partition="dirichlet").split(diabetes.y_train.numpy(), seed=0)


def test_bnpfed_fuse_runs_a_federated_regression_with_either_likelihood(tmp_path, capsys):
    for likelihood in ("gaussian", "student-t"):
        out = tmp_path / f"{likelihood}.json"
        assert main(["fuse", "--dataset", "diabetes", "--likelihood", likelihood, "--no-fedavg", "--rule", "all",
                     "--clients", "3", "--rounds", "2", "--epochs", "2", "--hidden", "8", "--no-progress", "--json",
                     str(out)]) == 0
        rows = json.loads(out.read_text())["results"]["runs"][0]["rows"]
        assert [r["method"] for r in rows] == list(available_rules())
        assert all(0 < r["rmse"] < 1.2 and 0.5 < r["coverage"] <= 1 and r["accuracy"] is None for r in rows)
        assert "coverage" in capsys.readouterr().out
    assert main(["fuse", "--dataset", "diabetes", "--likelihood", "gaussian", "--no-progress"]) == 2
    assert "pass --no-fedavg" in capsys.readouterr().err
    assert main(["fuse", "--dataset", "diabetes", "--no-fedavg", "--no-progress"]) == 2
    assert "--likelihood: a regression's clients" in capsys.readouterr().err


def test_a_classifications_rows_keep_their_fields(digits):
    from bnpfed.federated import ExperimentConfig, run_experiment

    result = run_experiment(digits, partition=PartitionConfig(clients=2), network=NetworkConfig(hidden=(8,)),
                            training=TrainingConfig(epochs=1),
                            config=ExperimentConfig(methods=("fusion:rule=gaa",), rounds=1))
    row = result.as_dict()["rows"][0]
    assert "rmse" not in row and "coverage" not in row and "accuracy" in row
    assert np.isfinite(row["accuracy"])


def test_a_federated_regression_on_flower_trains_as_in_process_and_scores_the_whole_test_split(diabetes):
    pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")
    from flower_harness import CLIENTS, assert_same_as_in_process

    from bnpfed.flower.client import app as client_app
    from bnpfed.flower.local import LocalGrid
    from bnpfed.flower.server import run_federation

    for likelihood in ("gaussian", "student-t"):
        # weights drawn whole (local reparameterisation draws each example's pre-activations: a shard's differ)
        config = {"method": "fusion", "rule": "gaa", "dataset": "diabetes", "likelihood": likelihood, "rounds": 2,
                  "epochs": 2, "hidden": "8", "local-reparameterization": False}
        result = run_federation(LocalGrid(client_app, CLIENTS), config)
        reference = assert_same_as_in_process(result, config)
        # the shards' example-weighted means are the whole split's scores (the same draws: one seed per round)
        for flower, local in zip(result.history, reference.history):
            for key in ("rmse", "nll", "coverage", "interval_width"):
                assert flower[key] == pytest.approx(local.metrics[key], rel=1e-5), key


def test_flower_refuses_a_regression_it_cannot_run():
    pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")
    from flower_harness import assert_refused_before_any_node_is_asked

    assert_refused_before_any_node_is_asked({"method": "fusion", "dataset": "diabetes"},
                                            "likelihood: a regression's clients are variational")
    assert_refused_before_any_node_is_asked({"method": "pfnm", "dataset": "diabetes", "likelihood": "gaussian"},
                                            "method: 'diabetes' is a regression")
