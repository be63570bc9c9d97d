"""The temperature of pooled heads (bnpfed.matching.pooled_heads: pool_nll, fit_temperature, PooledHeads'
temperature; pool_temperature="fit" in PFNM's and matched fusion's federations): each claim against an independent
computation, and the fit against data drawn from a tempered model."""

import math

import pytest
import torch
import torch.nn.functional as F

from bnpfed.data import load_dataset
from bnpfed.federated.clients import pool_nll_step
from bnpfed.federated.config import (BayesianConfig, FusionConfig, NetworkConfig, PartitionConfig, PFNMConfig,
                                     TrainingConfig)
from bnpfed.federated.matched_fusion import MatchedFusionFederation
from bnpfed.federated.methods import ExperimentConfig, run_experiment
from bnpfed.federated.partition import partition_dirichlet
from bnpfed.federated.pfnm import PFNMFederation
from bnpfed.matching import PooledHeads
from bnpfed.matching.pooled_heads import TEMPERATURES, fit_temperature, pool_nll, set_temperature
from bnpfed.seeding import Stream, derive_seed


def test_pool_nll_of_one_network_is_the_cross_entropy_at_each_temperature():
    g = torch.Generator().manual_seed(0)
    z, y = torch.randn(50, 4, generator=g, dtype=torch.float64) * 3, torch.randint(0, 4, (50,), generator=g)
    got = pool_nll(z, y)
    want = torch.stack([F.cross_entropy(z / t, y, reduction="sum") for t in TEMPERATURES])
    torch.testing.assert_close(got, want)


def test_pool_nll_of_draws_is_the_predictives_nll_written_out():
    g = torch.Generator().manual_seed(1)
    z, y = torch.randn(3, 20, 5, generator=g, dtype=torch.float64) * 2, torch.randint(0, 5, (20,), generator=g)
    temperatures = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    got = pool_nll(z, y, temperatures)
    for k, t in enumerate(temperatures):
        total = 0.0
        for n in range(20):
            p = sum(torch.softmax(z[s, n] / t, -1)[y[n]] for s in range(3)) / 3
            total -= math.log(float(p))
        assert float(got[k]) == pytest.approx(total, rel=1e-10)


def test_the_fit_recovers_the_temperature_labels_were_drawn_at():
    # labels drawn from softmax(z / 0.6): the summed NLL over "clients" (shards) is least at the grid point nearest
    # 0.6 or its neighbour (40,000 draws: the curve's minimum is sharp to well under one 8 % grid step)
    g = torch.Generator().manual_seed(2)
    z = torch.randn(40000, 10, generator=g, dtype=torch.float64) * 2
    y = torch.multinomial(torch.softmax(z / 0.6, -1), 1, generator=g)[:, 0]
    sums = [pool_nll(z[i:i + 10000], y[i:i + 10000]) for i in range(0, 40000, 10000)]
    fitted = fit_temperature(sums)
    nearest = int((TEMPERATURES - 0.6).abs().argmin())
    assert fitted in [float(TEMPERATURES[k]) for k in (nearest - 1, nearest, nearest + 1)]
    assert fit_temperature([pool_nll(z, y)]) == fitted           # the sum of the shards is the whole's


def test_pooled_heads_divide_the_pool_by_their_temperature():
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, generator=g)
    omega = torch.tensor([[0.5, 1.0, 0.2], [0.5, 0.0, 0.8]])
    h = torch.randn(6, 4, generator=g)
    plain, hot = PooledHeads(w, b, omega), PooledHeads(w, b, omega, temperature=2.5)
    torch.testing.assert_close(hot(h), plain(h) / 2.5)
    net = torch.nn.Sequential(torch.nn.Identity(), plain)
    set_temperature(net, 0.5)
    torch.testing.assert_close(net(h), hot(h) * 5.0)
    with pytest.raises(ValueError, match="temperature: expected a positive finite number"):
        PooledHeads(w, b, omega, temperature=0.0)


@pytest.fixture(scope="module")
def skewed():
    ds = load_dataset("digits")
    return ds, partition_dirichlet(ds.y_train.numpy(), 3, alpha=0.5, seed=0)


def test_a_pfnm_federation_fits_its_pools_temperature_on_the_clients_data(skewed):
    ds, parts = skewed
    options = dict(network=NetworkConfig(hidden=(16,)), training=TrainingConfig(epochs=3), seed=0)
    fitted = PFNMFederation(ds, parts, pfnm=PFNMConfig(heads="pooled", pool_temperature="fit"), **options)
    record = fitted.run_round()
    plain = PFNMFederation(ds, parts, pfnm=PFNMConfig(heads="pooled"), **options)
    plain.run_round()
    net = plain.global_network()
    want = fit_temperature([pool_nll(net(ds.x_train[p]), ds.y_train[p]) for p in parts])
    assert record.metrics["pool_temperature"] == want != 1.0
    x = ds.x_test[:40]
    with torch.no_grad():
        torch.testing.assert_close(fitted.global_network()(x), net(x) / want)
    assert plain.history[-1].metrics["pool_temperature"] == 1.0
    # the client step: the same sums, batch by batch
    torch.testing.assert_close(pool_nll_step(net, ds.x_train[parts[0]], ds.y_train[parts[0]], batch_size=7),
                               pool_nll(net(ds.x_train[parts[0]]), ds.y_train[parts[0]]))


def test_a_matched_fusion_federation_fits_its_pools_temperature_on_the_predictive(skewed):
    ds, parts = skewed
    fed = MatchedFusionFederation(ds, parts, network=NetworkConfig(hidden=(16,)), training=TrainingConfig(epochs=2),
                                  bayesian=BayesianConfig(),
                                  fusion=FusionConfig(align="match", heads="pooled", pool_temperature="fit"), seed=0)
    record = fed.run_round()
    t = record.metrics["pool_temperature"]
    draws = derive_seed(0, Stream.PREDICT, 1)
    fed.pooled.temperature = 1.0
    want = fit_temperature([pool_nll(fed.pooled.log_pools(ds.x_train[p], fed.predictive_samples, draws),
                                     ds.y_train[p]) for p in parts])
    fed.pooled.temperature = t
    assert t == want
    x = ds.x_test[:30]
    torch.testing.assert_close(fed.predict_proba(x), (fed.pooled.log_pools(
        x, fed.predictive_samples, derive_seed(0, Stream.PREDICT, 1)) / t).softmax(-1).mean(0))


def test_a_temperature_without_pooled_heads_is_refused(skewed):
    ds, parts = skewed
    with pytest.raises(ValueError, match="pool_temperature: expected a number > 0 or 'fit'"):
        PFNMConfig(heads="pooled", pool_temperature="hot")
    with pytest.raises(ValueError, match="pool_temperature: the temperature of pooled heads"):
        PFNMFederation(ds, parts, network=NetworkConfig(hidden=(8,)), training=TrainingConfig(epochs=1),
                       pfnm=PFNMConfig(pool_temperature=0.5, heads="fused"), seed=0)
    with pytest.raises(ValueError, match="pool_temperature: the temperature of pooled heads"):
        run_experiment(ds, partition=PartitionConfig(clients=3), network=NetworkConfig(hidden=(8,)),
                       training=TrainingConfig(epochs=1), pfnm=PFNMConfig(pool_temperature="fit", heads="fused"),
                       config=ExperimentConfig(methods=("pfnm",)))
    # a pooled method is what reads it
    result = run_experiment(ds, partition=PartitionConfig(clients=3, partition="dirichlet"),
                            network=NetworkConfig(hidden=(8,)), training=TrainingConfig(epochs=1),
                            pfnm=PFNMConfig(pool_temperature="fit", heads="fused"),
                            config=ExperimentConfig(methods=("pfnm", "pfnm:heads=pooled")))
    assert "at temperature" in result.row("pfnm-pooled").note and "temperature" not in result.row("pfnm").note
