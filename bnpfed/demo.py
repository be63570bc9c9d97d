"""The foundation demo: sample a federated layer from the Beta-Bernoulli model, match it, report recovery."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from sklearn.metrics import adjusted_rand_score

from bnpfed.inference import match_layer
from bnpfed.models import sample_federated_layer


@dataclass
class DemoRow:
    objective: str
    sigma2: float
    true_atoms: int
    found_atoms: int
    adjusted_rand: float
    objective_value: float
    seconds: float


def matching_demo(*, clients: int = 10, dim: int = 50, gamma0: float = 20.0, noise: float = 0.01,
                  sigma0_2: float = 1.0, sweeps: int = 5, seed: int = 0) -> list[DemoRow]:
    """Match one sampled layer with the published (MAP) objective at the true noise and at twice it, and with the
    marginal objective at the true noise; one row each."""
    layer = sample_federated_layer(clients, dim, seed=seed, gamma0=gamma0, sigma2=noise, sigma0_2=sigma0_2)
    truth = torch.cat(layer.assignments).numpy()
    rows = []
    for objective, sigma2 in (("map", noise), ("map", 2 * noise), ("marginal", noise)):
        r = match_layer(layer.neurons, sigma2=sigma2, sigma0_2=sigma0_2, gamma0=gamma0, sweeps=sweeps, seed=seed,
                        objective=objective)
        rows.append(DemoRow(objective=objective, sigma2=sigma2, true_atoms=layer.num_atoms, found_atoms=r.num_atoms,
                            adjusted_rand=float(adjusted_rand_score(truth, torch.cat(r.assignments).numpy())),
                            objective_value=float(r.objective[-1]), seconds=r.seconds))
    return rows


def rows_as_dicts(rows) -> list[dict]:
    return [asdict(r) for r in rows]
