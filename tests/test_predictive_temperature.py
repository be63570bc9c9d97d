"""The temperature of matched fusion's fused posterior predictive (FusionConfig(temperature=...), the tempered
Categorical likelihood, posterior_nll_step): the likelihood against its closed form, the clients' NLL sums against the
predictive's own NLL at each temperature, the fit against the least summed NLL found by hand, and the refusals."""

import copy
import json
import math
import pickle

import pytest
import torch
import torch.nn.functional as F

from bnpfed.cli import main
from bnpfed.data import load_dataset
from bnpfed.federated.clients import posterior_nll_step
from bnpfed.federated.config import BayesianConfig, FusionConfig, NetworkConfig, PartitionConfig, TrainingConfig
from bnpfed.federated.fusion import FusionFederation
from bnpfed.federated.matched_fusion import MatchedFusionFederation, tempered
from bnpfed.federated.methods import ExperimentConfig, run_experiment
from bnpfed.clients import BayesianClient
from bnpfed.matching.pooled_heads import TEMPERATURES
from bnpfed.models import Categorical, Gaussian, mlp, only_linear_weights
from bnpfed.saved import read_global, save_global
from bnpfed.seeding import Stream, derive_seed


def test_the_tempered_categorical_is_the_softmax_of_the_logits_over_t():
    g = torch.Generator().manual_seed(0)
    f, y = 3 * torch.randn(30, 4, generator=g, dtype=torch.float64), torch.randint(0, 4, (30,), generator=g)
    for t in (0.3, 1.0, 2.5):
        like = Categorical(temperature=t)
        closed = sum(math.log(math.exp(f[n, y[n]] / t) / sum(math.exp(v / t) for v in f[n].tolist()))
                     for n in range(30))
        assert float(like.log_likelihood(f, y)) == pytest.approx(closed, rel=1e-12)
        assert float(like.distribution(f).log_prob(y).sum()) == pytest.approx(closed, rel=1e-12)
        draws = torch.stack([f, -f, 0.5 * f])
        want = sum(F.softmax(d / t, -1) for d in draws) / 3
        torch.testing.assert_close(like.predictive(draws), want)
    assert repr(Categorical(temperature=0.5)) == "Categorical(temperature=0.5)" and repr(Categorical()) == \
        "Categorical()"
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="temperature"):
            Categorical(temperature=bad)
    old = Categorical(num_classes=3)
    del old.__dict__["temperature"]          # a likelihood pickled before the temperature existed
    assert pickle.loads(pickle.dumps(old)).temperature == 1.0


@pytest.fixture(scope="module")
def federations():
    """Matched conflation of three digits clients (2 epochs: an under-confident global posterior), at temperature 1
    and with the temperature fitted."""
    ds = load_dataset("digits")
    parts = PartitionConfig(clients=3).split(ds.y_train.numpy(), seed=0)

    def run(temperature):
        fed = MatchedFusionFederation(ds, parts, network=NetworkConfig(hidden=(16,)),
                                      training=TrainingConfig(epochs=2), bayesian=BayesianConfig(),
                                      fusion=FusionConfig(align="match", temperature=temperature), seed=0)
        fed.run_round()
        return fed

    return ds, run(1.0), run("fit"), run(0.5)


def test_a_clients_nll_sums_are_the_tempered_predictives_nll(federations):
    ds, plain, _, _ = federations
    x, y = plain.client_data[1]
    sums = posterior_nll_step(plain.global_model, x, y, num_samples=4, seed=7, batch_size=50)
    for k in (0, 20, 30, 45, 60):
        client = tempered(copy.deepcopy(plain.global_model), float(TEMPERATURES[k]))
        probs = torch.cat([client.predict_proba(x[i:i + 50], num_samples=4, seed=7) for i in range(0, len(x), 50)])
        nll = -probs.double()[torch.arange(len(y)), y].log().sum()
        assert float(sums[k]) == pytest.approx(float(nll), rel=1e-5), k


def test_the_fitted_temperature_is_the_least_summed_nll_of_the_clients_and_tempers_the_predictive(federations):
    ds, plain, fitted, halved = federations
    draws = derive_seed(0, Stream.PREDICT, 1)
    # the same clients and match: only the predictive's temperature differs
    torch.testing.assert_close(fitted.match.locs["1.weight"], plain.match.locs["1.weight"])
    total = sum(posterior_nll_step(plain.global_model, *plain.client_data[j], plain.predictive_samples, draws)
                for j in range(3))
    best = float(TEMPERATURES[int(total.argmin())])
    record = fitted.history[-1].metrics
    assert record["temperature"] == best and fitted.global_model.bnn.likelihood.temperature == best
    assert best < 1                           # the fused posterior is under-confident on its clients' data
    assert "temperature" not in plain.history[-1].metrics
    x = ds.x_test
    expected = tempered(copy.deepcopy(plain.global_model), best).predict_proba(x, plain.predictive_samples, draws)
    torch.testing.assert_close(fitted.predict_proba(x), expected)
    assert record["nll"] < plain.history[-1].metrics["nll"]        # on the test split too
    assert halved.global_model.bnn.likelihood.temperature == 0.5 and halved.history[-1].metrics["temperature"] == 0.5


def test_a_tempered_global_model_saves_and_loads_with_its_temperature(federations, tmp_path):
    ds, _, fitted, _ = federations
    path = save_global(tmp_path / "g.pt", fitted.global_model, method="match-conflation")
    saved = read_global(path)
    assert saved.client.bnn.likelihood.temperature == fitted.global_model.bnn.likelihood.temperature
    torch.testing.assert_close(saved.client.predict_proba(ds.x_test, 4, 1),
                               fitted.global_model.predict_proba(ds.x_test, 4, 1))


def test_a_temperature_where_it_does_not_apply_is_refused():
    ds = load_dataset("digits")
    parts = PartitionConfig(clients=3).split(ds.y_train.numpy(), seed=0)
    with pytest.raises(ValueError, match="temperature: the predictive temperature of matched fusion.*align='none'"):
        FusionConfig(temperature="fit")
    with pytest.raises(ValueError, match="temperature: the fused output layer's.*pool_temperature"):
        FusionConfig(align="match", heads="pooled", temperature=0.5)
    with pytest.raises(ValueError, match="temperature: expected a number > 0 or 'fit'"):
        FusionConfig(align="match", temperature="auto")
    with pytest.raises(ValueError, match="fusion.temperature: .*weight-wise"):
        FusionFederation(ds, parts, network=NetworkConfig(hidden=(16,)), training=TrainingConfig(epochs=1),
                         bayesian=BayesianConfig(), fusion=FusionConfig(align="match", temperature="fit"), seed=0)
    with pytest.raises(ValueError, match="fusion.temperature: .*without a match row of fused heads"):
        run_experiment(ds, partition=PartitionConfig(clients=3), network=NetworkConfig(hidden=(16,)),
                       fusion=FusionConfig(align="match", temperature="fit"),
                       config=ExperimentConfig(methods=("pfnm", "fusion:rule=conflation",
                                                        "match:rule=conflation:heads=pooled"), seed=0))
    client = BayesianClient(mlp(4, [3], 1), only_linear_weights(), likelihood=Gaussian(scale=1.0))
    with pytest.raises(ValueError, match="client: expected a classifier"):
        tempered(client, 0.5)


def test_an_experiments_weight_wise_rows_keep_their_own_predictive(capsys):
    """With a temperature for the match-<rule> rows, the weight-wise rows of the same experiment are as without it,
    and bnpfed fuse takes --temperature (refused where it does not apply)."""
    ds = load_dataset("digits")
    kwargs = dict(partition=PartitionConfig(clients=3), network=NetworkConfig(hidden=(16,)),
                  training=TrainingConfig(epochs=1), config=ExperimentConfig(methods=("fusion:rule=conflation",
                                                                                     "match:rule=conflation"), seed=0))
    plain = {r.method: r for r in run_experiment(ds, fusion=FusionConfig(align="match", own_init=True),
                                                 **kwargs).rows}
    fitted = {r.method: r for r in run_experiment(ds, fusion=FusionConfig(align="match", own_init=True,
                                                                          temperature="fit"), **kwargs).rows}
    assert fitted["conflation"].accuracy == plain["conflation"].accuracy
    assert fitted["conflation"].nll == plain["conflation"].nll
    assert fitted["match-conflation"].nll != plain["match-conflation"].nll
    assert main(["fuse", "--temperature", "fit"]) == 2
    assert "--temperature: the predictive temperature of the match-RULE rows; expected it only with --align match" \
        in capsys.readouterr().err
    assert main(["fuse", "--align", "match", "--heads", "pooled", "--temperature", "0.5"]) == 2
    assert "with --heads pooled every row pools its heads" in capsys.readouterr().err


def test_a_laplace_predictives_temperature_divides_every_draws_logits():
    """The linearised predictive at temperature T is the mean over its draws of softmax(logits / T), its draws those
    of sample_outputs (the same seed, the same draws); at 1 it is the untempered predictive bit for bit."""
    pytest.importorskip("laplace")
    from bnpfed.clients import LaplaceClient

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(60, 5, generator=g), torch.randint(0, 3, (60,), generator=g)
    client = LaplaceClient(mlp(5, [8], 3))
    client.fit(x, y, epochs=3, batch_size=16, lr=1e-2, seed=0)
    draws = client.sample_outputs(x, num_samples=6, seed=3)
    assert draws.shape == (6, 60, 3)
    plain = client.predict_proba(x, num_samples=6, seed=3)
    torch.testing.assert_close(plain, draws.softmax(-1).mean(0))
    for t in (0.4, 2.0):
        held = LaplaceClient.holding(client.net, client.posterior(), client.prior, temperature=t)
        torch.testing.assert_close(held.predict_proba(x, num_samples=6, seed=3), (draws / t).softmax(-1).mean(0))
        assert tempered(copy.deepcopy(held), 1.0).predict_proba(x, 6, 3).equal(plain)
    with pytest.raises(ValueError, match="temperature: expected a positive"):
        LaplaceClient.holding(client.net, client.posterior(), client.prior, temperature=0)
    with pytest.raises(ValueError, match="temperature"):
        tempered(client, -1.0)


def test_the_fitted_temperature_of_fused_laplace_clients_is_their_least_summed_nll(tmp_path):
    """Matched conflation of Laplace clients (evidence prior, an under-confident linearised predictive): the fitted
    temperature is the least summed NLL of the global model's draws on the clients' data, found by hand; the saved
    global model keeps it; bnpfed fuse takes --client laplace --temperature fit."""
    pytest.importorskip("laplace")
    ds = load_dataset("digits")
    parts = PartitionConfig(clients=3).split(ds.y_train.numpy(), seed=0)

    def run(temperature):
        fed = MatchedFusionFederation(ds, parts, network=NetworkConfig(hidden=(16,)),
                                      training=TrainingConfig(epochs=2), bayesian=BayesianConfig(client="laplace"),
                                      fusion=FusionConfig(align="match", temperature=temperature), seed=0)
        fed.run_round()
        return fed

    plain, fitted = run(1.0), run("fit")
    draws = derive_seed(0, Stream.PREDICT, 1)
    total = torch.zeros(len(TEMPERATURES), dtype=torch.float64)
    for j in range(3):
        x, y = plain.client_data[j]
        logits = plain.global_model.sample_outputs(x, plain.predictive_samples, draws).double()
        total += torch.stack([-(logits / float(t)).softmax(-1).mean(0)[torch.arange(len(y)), y].log().sum()
                              for t in TEMPERATURES])
    best = float(TEMPERATURES[int(total.argmin())])
    assert fitted.history[-1].metrics["temperature"] == best == fitted.global_model.temperature
    assert best < 1 and fitted.history[-1].metrics["nll"] < plain.history[-1].metrics["nll"]
    assert fitted.history[-1].metrics["accuracy"] == pytest.approx(plain.history[-1].metrics["accuracy"], abs=0.01)
    torch.testing.assert_close(fitted.predict_proba(ds.x_test), tempered(copy.deepcopy(plain.global_model), best)
                               .predict_proba(ds.x_test, plain.predictive_samples, draws))
    saved = read_global(save_global(tmp_path / "g.pt", fitted.global_model, method="match-conflation"))
    assert saved.kind == "laplace" and saved.client.temperature == best
    torch.testing.assert_close(saved.client.predict_proba(ds.x_test, 4, 1), fitted.global_model.predict_proba(
        ds.x_test, 4, 1))
    out = tmp_path / "fuse.json"
    assert main(["fuse", "--align", "match", "--client", "laplace", "--temperature", "fit", "--clients", "3",
                 "--epochs", "1", "--rounds", "1", "--rule", "conflation", "--no-fedavg", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]["runs"][0]["rows"]
    (row,) = [r for r in rows if r["method"] == "match-conflation"]
    assert 0 < row["history"][-1]["temperature"] < 1
