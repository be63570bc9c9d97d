"""Record the outputs of today's matchers, network drivers and federations on fixed seeds, before the refactor of
issue "One matcher, one network driver" (run once, at the commit that adds this file):

    .venv/bin/python tests/golden/record.py

It writes ``tests/golden/before_refactor.pt``: the inputs (neurons, posteriors, client states) and the outputs
(assignments, atoms, hyper-parameters, global states, metrics). ``tests/test_golden.py`` recomputes every output
with the refactored code and compares. The script imports names the refactor removes (``match_networks``), so it
is kept in the history, not in the tree.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyro.distributions as dist
import torch

torch.set_num_threads(1)

from bnpfed.data import load_dataset  # noqa: E402
from bnpfed.federated.clients import bayesian_client, fit_bayesian, initial_network, train_network  # noqa: E402
from bnpfed.federated.config import (BayesianConfig, ExperimentConfig, FusionConfig, NetworkConfig,  # noqa: E402
                                     PartitionConfig, TrainingConfig)
from bnpfed.federated.methods import run_experiment  # noqa: E402
from bnpfed.federated.partition import class_counts  # noqa: E402
from bnpfed.inference import REFERENCE_CONSTANTS, match_bayesian_layer, match_layer  # noqa: E402
from bnpfed.inference.multilayer import linear_layers, match_networks  # noqa: E402
from bnpfed.inference.permutation import align_to_group, derive_spec, match_by_spec, match_group  # noqa: E402
from bnpfed.inference.posterior_matching import client_posterior, match_posteriors  # noqa: E402
from bnpfed.models import sample_federated_layer  # noqa: E402

OUT = Path(__file__).with_name("before_refactor.pt")


def fingerprint(t):
    """A tensor as itself when small, else its shape, sum, sum of squares and every 97th entry (first 300)."""
    t = torch.as_tensor(t).detach().double()
    if t.numel() <= 2000:
        return t.clone()
    flat = t.reshape(-1)
    return {"shape": tuple(t.shape), "sum": float(flat.sum()), "sumsq": float((flat * flat).sum()),
            "entries": flat[::97][:300].clone()}


def states(d) -> dict:
    return {k: fingerprint(v) for k, v in d.items()}


def layer_result(r) -> dict:
    return {"assignments": [a.clone() for a in r.assignments], "atoms": fingerprint(r.global_atoms),
            "precision": fingerprint(r.posterior_precision), "objective": list(r.objective),
            "hyperparameters": {k: (v.clone() if torch.is_tensor(v) else v) for k, v in r.hyperparameters.items()},
            "estimated": tuple(r.estimated), "converged": r.converged, "sweeps_run": r.sweeps_run}


def spec_result(m) -> dict:
    return {"state": states(m.state),
            "assignments": {g: [a.clone() for a in v] for g, v in m.assignments.items()},
            "layers": {g: layer_result(r) for g, r in m.layer_results.items()}}


def inputs() -> dict:
    """Everything the matchers are given: sampled layers, trained client networks, Bayesian posteriors."""
    data = {}
    layer = sample_federated_layer(6, 30, seed=1, gamma0=12.0, sigma2=0.3)
    data["sampled"] = [v.double().clone() for v in layer.neurons]
    g = torch.Generator().manual_seed(3)
    data["sampled_precisions"] = torch.cat([torch.ones(6, 24, dtype=torch.float64),
                                            torch.rand(6, 6, generator=g, dtype=torch.float64)], 1)
    data["sampled_precisions"][0, 27] = 0.0
    hetero = sample_federated_layer(5, 20, seed=2, gamma0=8.0, sigma2=0.01,
                                    neuron_variance=dist.Gamma(2.0, 100.0).expand([20]))
    means = [v.double().clone() for v in hetero.neurons]
    variances = [u.double().clone() for u in hetero.variances]
    for u in variances:       # the last four coordinates deterministic (posterior variance 0), as biases
        u[:, 16:] = 0.0
    data["hetero_means"], data["hetero_variances"] = means, variances
    data["hetero_precisions"] = torch.cat([torch.ones(5, 14, dtype=torch.float64),
                                           torch.rand(5, 6, generator=g, dtype=torch.float64)], 1)

    ds = load_dataset("digits", standardize=False)
    parts = PartitionConfig(clients=3, partition="dirichlet", alpha=0.5).split(ds.y_train.numpy(), seed=0)
    counts = class_counts(ds.y_train.numpy(), parts, 10)
    data["class_counts"] = torch.as_tensor(counts, dtype=torch.float64)
    training = TrainingConfig(epochs=8)
    mlps, cnns, posteriors = [], [], []
    for j, idx in enumerate(parts):
        x, y = ds.x_train[idx], ds.y_train[idx]
        net = initial_network(NetworkConfig(hidden=(24, 16)), ds.input_shape, 10, seed=0, client=j)
        mlps.append({k: v.detach().clone() for k, v in train_network(net, x, y, training, seed=0, round=1,
                                                                      client=j).state_dict().items()})
        cnn = initial_network(NetworkConfig(arch="simple-cnn-bn"), ds.input_shape, 10, seed=0, client=j)
        cnns.append({k: v.detach().clone() for k, v in train_network(cnn, x, y, TrainingConfig(epochs=3), seed=0,
                                                                      round=1, client=j).state_dict().items()})
        bnet = initial_network(NetworkConfig(hidden=(20,)), ds.input_shape, 10, seed=0, client=j)
        client = bayesian_client(bnet, BayesianConfig())
        fit_bayesian(client, x, y, TrainingConfig(epochs=4), seed=0, round=1, index=j)
        locs, var = client_posterior(client)
        posteriors.append(({k: v.clone() for k, v in locs.items()}, {k: v.clone() for k, v in var.items()}))
    data["mlps"], data["cnns"], data["posteriors"] = mlps, cnns, posteriors
    data["sizes"] = [int(len(p)) for p in parts]
    return data


def outputs(data: dict) -> dict:
    out = {}
    V, s = data["sampled"], data["sampled_precisions"]
    out["layer_eb"] = layer_result(match_layer(V, seed=0))
    out["layer_eb_scaled"] = layer_result(match_layer(V, precisions=s, seed=0))
    out["layer_eb_partial"] = layer_result(match_layer(V, precisions=s, gamma0=5.0,
                                                       mu0=torch.cat([torch.zeros(10), torch.full((20,), np.nan)]),
                                                       seed=1))
    out["layer_eb_gram"] = layer_result(match_layer(V, precisions=s, seed=2, cross_products="gram"))
    fixed = dict(sigma2=0.3, sigma0_2=1.0, gamma0=12.0, hyperparameters="fixed")
    out["layer_reference"] = layer_result(match_layer(V, seed=0, **{**fixed, **REFERENCE_CONSTANTS}))
    out["layer_fixed_marginal"] = layer_result(match_layer(V, precisions=s, seed=0, objective="marginal",
                                                           cross_products="direct", **fixed))
    warm = out["layer_fixed_marginal"]["assignments"]
    out["layer_fixed_warm"] = layer_result(match_layer(V, precisions=s, seed=4, objective="marginal",
                                                       init_assignments=warm, sweeps=3, **fixed))
    M, U, t = data["hetero_means"], data["hetero_variances"], data["hetero_precisions"]
    out["bayes_eb"] = layer_result(match_bayesian_layer(M, U, seed=0))
    out["bayes_eb_scaled"] = layer_result(match_bayesian_layer(M, U, precisions=t, seed=0))
    out["bayes_fixed"] = layer_result(match_bayesian_layer(M, U, precisions=t, tau2=0.01, sigma0_2=1.0, gamma0=8.0,
                                                           hyperparameters="fixed", seed=0))

    counts = data["class_counts"]
    mlp_layers = [linear_layers(_module(s, data)) for s in data["mlps"]]
    ref = dict(sigma2=0.3, sigma0_2=1.0, gamma0=3.0, **REFERENCE_CONSTANTS)
    out["topdown_reference"] = _network(match_networks(mlp_layers, counts, seed=5, direction="top-down", **ref))
    out["topdown_eb"] = _network(match_networks(mlp_layers, counts, seed=5, direction="top-down"))
    out["spec_mlp_eb"] = spec_result(match_by_spec(data["mlps"], counts, template=_module(data["mlps"][0], data),
                                                   seed=6))
    out["spec_mlp_posterior_mean"] = spec_result(match_by_spec(
        data["mlps"], counts, template=_module(data["mlps"][0], data), seed=6, global_weights="posterior-mean"))
    cnn_template = initial_network(NetworkConfig(arch="simple-cnn-bn"), (1, 8, 8), 10, seed=0)
    out["spec_cnn_eb"] = spec_result(match_by_spec(data["cnns"], counts, template=cnn_template, input_shape=(1, 8, 8),
                                                   seed=7))
    spec = derive_spec(cnn_template, (1, 8, 8))
    first = match_group(data["cnns"], spec, spec.group_names[0], counts, seed=8)
    out["group_cnn"] = {"group": layer_result(first.result), "atoms": fingerprint(first.atoms),
                        "aligned": [states(align_to_group(s, spec, first, j))
                                    for j, s in enumerate(data["cnns"])]}
    template = initial_network(NetworkConfig(hidden=(20,)), (1, 8, 8), 10, seed=0)
    for rule in ("eaa", "gaa", "log_variance", "pooling", "conflation"):
        m = match_posteriors(data["posteriors"], counts, rule=rule, sizes=data["sizes"], template=template, seed=9)
        out[f"posterior_{rule}"] = {"locs": states(m.locs), "variances": states(m.variances),
                                    "unit_locs": states(m.unit_locs), "unit_variances": states(m.unit_variances),
                                    "assignments": {g: [a.clone() for a in v] for g, v in m.assignments.items()},
                                    "layers": {g: layer_result(r) for g, r in m.layer_results.items()}}
    m = match_posteriors(data["posteriors"], counts, rule="conflation", template=template, seed=9,
                         hyperparameters="fixed", tau2=0.01, sigma0_2=1.0, gamma0=3.0)
    out["posterior_fixed"] = {"locs": states(m.locs), "variances": states(m.variances),
                              "assignments": {g: [a.clone() for a in v] for g, v in m.assignments.items()}}
    out["experiment"] = experiment_rows()
    return out


def experiment_rows() -> list[dict]:
    ds = load_dataset("digits", standardize=False)
    methods = ("local", "ensemble", "fedavg", "kmeans", "pfnm", "pfnm-rounds", "fedma", "conflation",
               "match-conflation", "match-pooling", "ensemble-bayesian")
    result = run_experiment(ds, partition=PartitionConfig(clients=3, partition="dirichlet"),
                            network=NetworkConfig(hidden=(16,)), training=TrainingConfig(epochs=3),
                            config=ExperimentConfig(methods=methods, rounds=2, seed=0))
    keep = ("method", "accuracy", "nll", "ece", "brier", "hidden", "parameters", "mean_sigma")
    return [{k: v for k, v in asdict(row).items() if k in keep} for row in result.rows]


def _module(state, data):
    net = initial_network(NetworkConfig(hidden=(24, 16)), (1, 8, 8), 10, seed=0)
    net.load_state_dict(state)
    return net


def _network(m) -> dict:
    return {"layers": [(fingerprint(w), fingerprint(b)) for w, b in m.layers],
            "assignments": [[a.clone() for a in v] for v in m.assignments],
            "layers_results": [layer_result(r) for r in m.layer_results]}


if __name__ == "__main__":
    data = inputs()
    torch.save({"inputs": data, "outputs": outputs(copy.deepcopy(data))}, OUT)
    print("wrote", OUT, OUT.stat().st_size, "bytes", file=sys.stderr)
