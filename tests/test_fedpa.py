"""FedPA (examples/fedpa.py, Al-Shedivat et al., ICLR 2021), a federated method of the literature written as a user
would, in one file: its dynamic-programming delta is the explicit inverse; on Gaussian client posteriors its fixed
point is the product-of-Gaussians mode where FedAvg's is the average of the client modes; it runs in process, in
run_experiment, through ``bnpfed pfnm --plugin examples.fedpa``, and on Flower (in-process grid bit for bit, one
simulation)."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from registries import restored_registries

from bnpfed.cli import main
from bnpfed.data import load_dataset
from bnpfed.federated import (ClientTask, MethodFederation, NetworkConfig, PartitionConfig, ServerTask, TrainingConfig,
                              initial_network)

ROOT = Path(__file__).resolve().parents[1]
MODULE = "examples.fedpa"
SGD = TrainingConfig(epochs=3, optimizer="sgd", lr=0.05)


@pytest.fixture
def fedpa():
    """The example imported afresh, as a plugin would be (it registers ``"fedpa"``); undone afterwards."""
    sys.modules.pop(MODULE, None)
    with restored_registries([MODULE]):
        yield importlib.import_module(MODULE)


# ------------------------------------------------------------------------------------------------ the math


def explicit_delta(samples: torch.Tensor, theta: torch.Tensor, rho: float) -> torch.Tensor:
    """``Sigma_hat^{-1} (theta - x_bar)`` with the d x d shrinkage covariance formed and solved."""
    l, d = samples.shape
    if l == 1:
        sigma = torch.eye(d, dtype=samples.dtype)
    else:
        shrink = 1 / (1 + (l - 1) * rho)
        sigma = shrink * torch.eye(d, dtype=samples.dtype) + (1 - shrink) * torch.cov(samples.T)
    return torch.linalg.solve(sigma, theta - samples.mean(0))


@pytest.mark.parametrize("l", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("rho", [0.0, 0.3, 1.0, 4.0])
def test_the_dynamic_programs_delta_is_the_explicit_inverse(fedpa, l, rho):
    g = torch.Generator().manual_seed(l * 10 + int(rho * 10))
    d = 7
    samples = torch.randn(l, d, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3.0, d, dtype=torch.float64)
    theta = torch.randn(d, generator=g, dtype=torch.float64)
    torch.testing.assert_close(fedpa.posterior_delta(samples, theta, rho), explicit_delta(samples, theta, rho),
                               rtol=1e-10, atol=1e-10)


def test_with_no_shrinkage_the_delta_is_fedavgs_theta_minus_the_samples_mean(fedpa):
    samples, theta = torch.randn(4, 5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    torch.testing.assert_close(fedpa.posterior_delta(samples, theta, 0.0), theta - samples.mean(0), rtol=0,
                               atol=1e-12)


def test_the_delta_keeps_thetas_dtype_and_names_bad_arguments(fedpa):
    assert fedpa.posterior_delta(torch.randn(3, 4), torch.randn(4), 1.0).dtype == torch.float32
    with pytest.raises(ValueError, match="rho: expected a finite number >= 0"):
        fedpa.posterior_delta(torch.randn(3, 4), torch.randn(4), -1.0)
    with pytest.raises(ValueError, match=r"theta: expected a tensor of shape \(4,\)"):
        fedpa.posterior_delta(torch.randn(3, 4), torch.randn(5), 1.0)


def affine(delta, d):
    """``delta`` (affine in theta: ``Sigma^{-1} (theta - x_bar)``) as ``theta -> A theta + c``, from d + 1 calls."""
    c = delta(torch.zeros(d, dtype=torch.float64))
    a = torch.stack([delta(e) - c for e in torch.eye(d, dtype=torch.float64)], dim=1)
    return lambda theta: a @ theta + c


def server_fixed_point(fedpa, method, deltas, weights, theta, rounds):
    """Iterate FedPA's server step from ``theta`` with each client's delta ``deltas[k](theta)``."""
    state, kept = {"w": theta}, {}
    deltas = [affine(delta, len(theta)) for delta in deltas]
    for t in range(1, rounds + 1):
        updates = [{"w": delta(state["w"])} for delta in deltas]
        out = method.server_step(ServerTask(state=state, server_state=kept, updates=updates, weights=weights,
                                            sizes=[1] * len(weights), clients=list(range(len(weights))), round=t,
                                            seed=0))
        state, kept = out.state, out.server_state
    return state["w"]


def gaussian_clients(d=3, num=3, samples=100, seed=0):
    """Client posteriors N(mu_k, Sigma_k), anisotropic and each stretched along its own axes, and ``samples`` draws
    from each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(num):
        mu = 2 * torch.randn(d, generator=g, dtype=torch.float64)
        q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        sigma = q @ torch.diag(torch.tensor([0.05, 1.0, 4.0], dtype=torch.float64)[:d]) @ q.T
        draws = mu + torch.randn(samples, d, generator=g, dtype=torch.float64) @ torch.linalg.cholesky(sigma).T
        out.append((mu, sigma, draws))
    return out


def product_mode(means, covariances, weights):
    precision = sum(b * torch.linalg.inv(s) for b, s in zip(weights, covariances))
    return torch.linalg.solve(precision, sum(b * torch.linalg.solve(s, m) for b, m, s in zip(weights, means,
                                                                                            covariances)))


def test_on_gaussian_client_posteriors_fedpas_fixed_point_is_the_product_mode_and_fedavgs_the_average(fedpa):
    """Clients whose samples are fixed: FedPA's server iterations converge to the mode of the product of the
    Gaussians the clients estimate (their samples' mean and shrinkage covariance), FedAvg's (rho 0, identity
    covariance) to the weighted average of their means; with many samples of each true posterior the first is the
    true posteriors' product mode."""
    clients, weights = gaussian_clients(), [0.2, 0.3, 0.5]
    theta = torch.zeros(3, dtype=torch.float64)
    rho = 1.0
    estimated = []
    for _, _, draws in clients:
        l = len(draws)
        shrink = 1 / (1 + (l - 1) * rho)
        covariance = shrink * torch.eye(3, dtype=torch.float64) + (1 - shrink) * torch.cov(draws.T)
        estimated.append((draws.mean(0), covariance))
    expected = product_mode([m for m, _ in estimated], [s for _, s in estimated], weights)
    # the server's step size against the largest curvature of the global quadratic, with momentum
    hessian = sum(b * torch.linalg.inv(s) for b, (_, s) in zip(weights, estimated))
    step = float(1 / torch.linalg.eigvalsh(hessian).max())
    method = fedpa.FedPA(rho=rho, server_lr=step, server_momentum=0.5)
    deltas = [lambda th, x=draws: fedpa.posterior_delta(x, th, rho) for _, _, draws in clients]
    found = server_fixed_point(fedpa, method, deltas, weights, theta, rounds=2000)
    torch.testing.assert_close(found, expected, rtol=0, atol=1e-9)

    averaging = fedpa.FedPA(rho=0.0, server_lr=1.0, server_momentum=0.0)   # FedAvg: one step to its fixed point
    deltas = [lambda th, x=draws: fedpa.posterior_delta(x, th, 0.0) for _, _, draws in clients]
    fedavg = server_fixed_point(fedpa, averaging, deltas, weights, theta, rounds=3)
    torch.testing.assert_close(fedavg, sum(b * x.mean(0) for b, (_, _, x) in zip(weights, clients)), rtol=0,
                               atol=1e-12)

    truth = product_mode([mu for mu, _, _ in clients], [s for _, s, _ in clients], weights)
    assert float((found - truth).norm()) < 0.15 * float((fedavg - truth).norm())


def test_the_server_step_is_sgd_with_momentum_on_the_weighted_average_delta(fedpa):
    method = fedpa.FedPA(server_lr=0.3, server_momentum=0.9)
    theta, m = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.25])
    updates = [{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([0.0, 4.0])}]
    out = method.server_step(ServerTask(state={"w": theta}, server_state={"momentum/w": m}, updates=updates,
                                        weights=[0.25, 0.75], sizes=[1, 3], clients=[0, 1], round=2, seed=0))
    delta = torch.tensor([0.25, 3.0])
    torch.testing.assert_close(out.server_state["momentum/w"], 0.9 * m + delta)
    torch.testing.assert_close(out.state["w"], theta - 0.3 * (0.9 * m + delta))
    assert out.metrics["delta_norm"] == pytest.approx(float(delta.norm()))


# ------------------------------------------------------------------------------------------------ the client


@pytest.fixture(scope="module")
def digits_parts():
    ds = load_dataset("digits")
    return ds, PartitionConfig(clients=3, partition="dirichlet", alpha=0.5).split(ds.y_train.numpy(), seed=1)


def task_of(ds, training, network=NetworkConfig(hidden=(8,))):
    net = initial_network(network, ds.input_shape, ds.num_classes, seed=0)
    return ClientTask(network=net, state=net.state_dict(), x=ds.x_train[:64], y=ds.y_train[:64], training=training,
                      seed=0, round=1, client=0)


@pytest.mark.parametrize("training, message", [
    (TrainingConfig(epochs=3), r"training.optimizer: FedPA's posterior samples are averages of SGD's iterates; "
                               r"expected 'sgd', got 'adam'"),
    (TrainingConfig(epochs=1, optimizer="sgd"), r"training.epochs: FedPA burns in for 1 epoch\(s\), then draws one "
                                                r"sample per epoch; expected more than 1 epochs in round 1, got 1"),
    (TrainingConfig(epochs=3, optimizer="sgd", augment="crop"), r"training.augment: .* expected 'none'"),
])
def test_a_client_refuses_training_settings_it_cannot_honour_before_it_trains(fedpa, digits_parts, training, message):
    with pytest.raises(ValueError, match=message):
        fedpa.FedPA().client_step(task_of(digits_parts[0], training))


def test_a_network_with_batch_norm_is_refused_before_round_one(fedpa, digits_parts):
    ds, parts = digits_parts
    with pytest.raises(ValueError, match=r"network: FedPA's posterior is over the network's parameters; expected an "
                                         r"architecture without buffers \(batch norm\), got \['bn1.running_mean'"):
        MethodFederation(ds, parts, method="fedpa", network=NetworkConfig(arch="simple-cnn-bn"), training=SGD,
                         seed=0)


@pytest.mark.parametrize("kwargs, message", [({"burn_in": -1}, "burn_in"), ({"rho": float("nan")}, "rho"),
                                             ({"server_lr": 0}, "server_lr"), ({"server_momentum": 1.0},
                                                                               "server_momentum")])
def test_fedpas_settings_are_checked(fedpa, kwargs, message):
    with pytest.raises(ValueError, match=f"{message}: expected"):
        fedpa.FedPA(**kwargs)


def test_a_clients_update_is_a_delta_per_parameter_from_its_samples(fedpa, digits_parts):
    update = fedpa.FedPA(burn_in=1).client_step(task_of(digits_parts[0], TrainingConfig(epochs=4, optimizer="sgd",
                                                                                         lr=0.05)))
    assert sorted(update.update) == ["1.bias", "1.weight", "3.bias", "3.weight"]
    assert update.metrics["samples"] == 3 and update.metrics["train_loss"] > 0


# ------------------------------------------------------------------------------------------------ where it runs


def test_the_examples_own_usage_runs(fedpa):
    import doctest

    failures, tried = doctest.testmod(fedpa, optionflags=doctest.ELLIPSIS)
    assert tried >= 3 and failures == 0


def test_in_process_fedpa_learns_and_its_rounds_are_seeded(fedpa, digits_parts):
    ds, parts = digits_parts
    runs = [MethodFederation(ds, parts, method="fedpa", network=NetworkConfig(hidden=(32,)), training=SGD, seed=0,
                             fraction=0.67) for _ in range(2)]
    for federation in runs:
        federation.run(3)
    accuracy = [r.metrics["accuracy"] for r in runs[0].history]
    assert accuracy[0] < accuracy[-1] and accuracy[-1] > 0.5
    for key, value in runs[0].global_state.items():
        assert torch.equal(value, runs[1].global_state[key]), key


def test_bnpfed_pfnm_runs_fedpa_from_the_plugin_beside_fedavg(tmp_path):
    out = tmp_path / "out.json"
    sys.modules.pop(MODULE, None)
    with restored_registries([MODULE]):
        assert main(["pfnm", "--plugin", MODULE, "--methods", "fedpa,fedavg", "--optimizer", "sgd", "--lr", "0.05",
                     "--epochs", "3", "--round-epochs", "3", "--rounds", "2", "--clients", "3", "--hidden", "16",
                     "--no-progress", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    rows = {r["method"]: r for r in record["results"]["runs"][0]["rows"]}
    assert sorted(rows) == ["fedavg", "fedpa"] and rows["fedpa"]["rounds"] == 2
    assert 0.2 < rows["fedpa"]["accuracy"] <= 1 and rows["fedpa"]["hidden"] == [16]
    assert record["arguments"]["plugin"] == [MODULE]


FLOWER = {"method": "fedpa", "plugins": MODULE, "optimizer": "sgd", "lr": 0.05, "epochs": 3, "rounds": 2,
          "hidden": "16"}


def test_on_flower_fedpa_is_the_in_process_federation_bit_for_bit(fedpa):
    pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")
    from flower_harness import CLIENTS, FRACTION, assert_same_as_in_process

    from bnpfed.flower.client import app as client_app
    from bnpfed.flower.local import LocalGrid
    from bnpfed.flower.server import run_federation

    config = {**FLOWER, **FRACTION}
    result = run_federation(LocalGrid(client_app, CLIENTS), config)
    reference = assert_same_as_in_process(result, config)
    assert [r["delta_norm"] for r in result.history] == [r.metrics["delta_norm"] for r in reference.history]


def test_bnpfed_flower_sim_plugin_makes_the_module_the_runs_plugins(tmp_path):
    pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")
    out = tmp_path / "sim.json"
    sys.modules.pop(MODULE, None)
    with restored_registries([MODULE]):
        assert main(["flower", "sim", "--local", "--plugin", MODULE, "--run-config",
                     'method="fedpa" optimizer="sgd" lr=0.05 epochs=2 rounds=1 hidden="8"', "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["settings"]["run"]["plugins"] == MODULE and record["settings"]["run"]["method"] == "fedpa"


@pytest.mark.slow
def test_a_flower_simulation_of_fedpa_gives_the_in_process_global_model(monkeypatch):
    """The simulated SuperNodes (Ray workers, other processes) import the example from the run config's plugins."""
    pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")
    from flower_harness import FRACTION, assert_same_as_in_process, simulate

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    config = {**FLOWER, **FRACTION}
    sys.modules.pop(MODULE, None)
    with restored_registries([MODULE]):
        results = simulate({"fedpa": config})
        assert_same_as_in_process(results["fedpa"], config)


@pytest.mark.slow
def test_a_superlink_and_three_supernodes_on_loopback_run_fedpa_from_the_plugins_key(tmp_path, monkeypatch):
    """Real processes: the ServerApp and every ClientApp message (a fresh process on a SuperNode) import the
    example from the run config's plugins; the global model is the in-process one."""
    pytest.importorskip("flwr", reason="Flower is not installed (pip install 'bnpfed[flower]')")
    from flower_harness import FRACTION, assert_same_model, assert_same_rounds, in_process, loopback

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    config = {**FLOWER, **FRACTION}
    sys.modules.pop(MODULE, None)
    with restored_registries([MODULE]):
        with loopback(tmp_path) as deployment:
            for name, summary, arrays in deployment.run({"fedpa": config}):
                reference = in_process(config)
                assert_same_rounds(summary["results"]["rounds"], reference)
                assert_same_model(arrays, reference)
