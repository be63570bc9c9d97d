"""Does matching recover a layer drawn from its own model? Sample J clients' neurons from the Beta-Bernoulli process
(:func:`~bnpfed.models.sample_federated_layer`), match them (:func:`~bnpfed.matching.match_layer`), and compare
the found global atoms and assignments with the true ones.

Usage::

    >>> rows = match_recovery(RecoveryConfig(clients=4, dim=20, gamma0=5.0))
    >>> [(row.objective, round(row.sigma2, 3), row.true_atoms) for row in rows]
    [('map', 0.01, 17), ('map', 0.02, 17), ('marginal', 0.01, 17), ('empirical-bayes', 0.011, 17)]
    >>> [(row.found_atoms, row.adjusted_rand) for row in rows[2:]]     # the truth, found with and without it
    [(17, 1.0), (17, 1.0)]
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from bnpfed.matching.layer import match_layer
from bnpfed.models import sample_federated_layer
from bnpfed.validation import check_int, check_positive

__all__ = ["DEMO_BYTES", "RecoveryConfig", "RecoveryRow", "expected_bytes", "match_recovery"]

#: the most memory a sampled layer and its matching may be expected to take (bytes, 4 GiB)
DEMO_BYTES = 4 * 2 ** 30


def expected_bytes(clients: int, dim: int, gamma0: float) -> float:
    """What sampling and matching a layer is expected to hold, in bytes, before anything is drawn: under the IBP a
    client has Poisson(gamma0) neurons, so E[N] = J gamma0 neurons and E[L] = gamma0 H_J atoms (H_J the J-th harmonic
    number), each of D float64 coordinates; the matching keeps about four copies of them (the sample, the matcher's
    data, the atoms' sums, the result) and scores one client against every atom at a time, a (gamma0, E[L] + gamma0)
    matrix."""
    atoms = gamma0 * sum(1.0 / j for j in range(1, clients + 1))
    neurons = clients * gamma0
    return 8.0 * (4.0 * (neurons + atoms) * dim + gamma0 * (atoms + gamma0))


@dataclass(frozen=True)
class RecoveryConfig:
    """The layer to sample and how to match it.

    :param int clients: J, >= 1. Default 10.
    :param int dim: D, the dimension of a neuron, >= 1. Default 50.
    :param float gamma0: IBP mass of the sampled layer and of the matching, > 0. Default 20.
    :param float sigma2: the true local noise variance of the sampled neurons, > 0. Default 0.01.
    :param float sigma0_2: prior variance of the atoms, > 0. Default 1.
    :param int sweeps: matching sweeps after the greedy pass, >= 0. Default 5.
    :param int seed: seed of the sample and of the matching, >= 0. Default 0.
    """

    clients: int = 10
    dim: int = 50
    gamma0: float = 20.0
    sigma2: float = 0.01
    sigma0_2: float = 1.0
    sweeps: int = 5
    seed: int = 0

    def __post_init__(self):
        check_int(self.clients, "clients", low=1)
        check_int(self.dim, "dim", low=1)
        check_positive(self.gamma0, "gamma0")
        check_positive(self.sigma2, "sigma2")
        check_positive(self.sigma0_2, "sigma0_2")
        check_int(self.sweeps, "sweeps", low=0)
        check_int(self.seed, "seed", low=0)
        need = expected_bytes(self.clients, self.dim, self.gamma0)
        if need > DEMO_BYTES:
            # the flag to name: dim when the coordinates dominate, else gamma0 (the atoms and the score matrices)
            field = "dim" if expected_bytes(self.clients, self.dim, self.gamma0) > 2 * expected_bytes(
                self.clients, 0, self.gamma0) else "gamma0"
            raise ValueError(
                f"{field}: the layer of J = {self.clients} clients, D = {self.dim} and gamma0 = {self.gamma0:g} would "
                f"need about {need / 2 ** 30:.3g} GiB (expected {self.clients * self.gamma0:.4g} neurons and "
                f"{self.gamma0 * math.fsum(1.0 / j for j in range(1, self.clients + 1)):.4g} atoms of {self.dim} "
                f"coordinates, and a score matrix of each client against every atom), more than the limit of "
                f"{DEMO_BYTES / 2 ** 30:g} GiB (DEMO_BYTES): lower gamma0, clients or dim")


@dataclass(frozen=True)
class RecoveryRow:
    """One matching of the sampled layer.

    :param str objective: ``"map"`` (published), ``"marginal"`` (both with the true hyper-parameters fixed) or
        ``"empirical-bayes"`` (marginal, every hyper-parameter estimated).
    :param float sigma2: the noise variance the matching assumed (or estimated).
    :param int true_atoms: global atoms the sample used.
    :param int found_atoms: global atoms the matching found.
    :param float adjusted_rand: adjusted Rand index of the found assignments against the true ones (1: the same
        grouping of the neurons).
    :param float objective_value: the matching's objective after its last sweep.
    :param float seconds: wall time of the matching.
    """

    objective: str
    sigma2: float
    true_atoms: int
    found_atoms: int
    adjusted_rand: float
    objective_value: float
    seconds: float


def match_recovery(config: RecoveryConfig, *, progress: bool = False) -> list[RecoveryRow]:
    """Sample one layer of ``config`` and match it four ways: with the hyper-parameters fixed at the truth, the
    published (MAP) objective at the true noise variance and at twice it and the marginal objective at the true noise;
    then with every hyper-parameter estimated from the neurons alone (empirical Bayes, started 10 times off the
    truth; its row's ``sigma2`` is the estimate); one row each.

    :param RecoveryConfig config: the layer and its matching.
    :param bool progress: show a progress bar of each matching's passes (the J clients re-matched; tqdm on stderr)
        and a line before each of the four matchings. Default False."""
    from sklearn.metrics import adjusted_rand_score

    if not isinstance(config, RecoveryConfig):
        raise ValueError(f"config: expected a RecoveryConfig, got {type(config).__name__}")
    c = config
    layer = sample_federated_layer(c.clients, c.dim, seed=c.seed, gamma0=c.gamma0, sigma2=c.sigma2,
                                   sigma0_2=c.sigma0_2)
    truth = torch.cat(layer.assignments).numpy()
    rows = []
    start = dict(sigma2=10 * c.sigma2, sigma0_2=c.sigma0_2 / 10, gamma0=10 * c.gamma0)
    runs = (("map", c.sigma2), ("map", 2 * c.sigma2), ("marginal", c.sigma2), ("empirical-bayes", None))
    for k, (objective, sigma2) in enumerate(runs, 1):
        if progress:
            print(f"matching {k} of {len(runs)}: {objective}" + ("" if sigma2 is None else f" at sigma2 = {sigma2:g}"),
                  file=sys.stderr)
        if sigma2 is None:
            found = match_layer(layer.neurons, start=start, seed=c.seed, progress=progress)
            sigma2 = float(found.hyperparameters["sigma2"])
        else:
            found = match_layer(layer.neurons, sigma2=sigma2, sigma0_2=c.sigma0_2, gamma0=c.gamma0, sweeps=c.sweeps,
                                seed=c.seed, objective=objective, hyperparameters="fixed", progress=progress)
        rows.append(RecoveryRow(objective=objective, sigma2=sigma2, true_atoms=layer.num_atoms,
                                found_atoms=found.num_atoms,
                                adjusted_rand=float(adjusted_rand_score(truth, torch.cat(found.assignments).numpy())),
                                objective_value=float(found.objective[-1]), seconds=found.seconds))
    return rows
