"""PFNM's hyper-parameters chosen from a grid by the held-out accuracy of the one-shot global network
(:func:`select_hyperparameters`; ``ExperimentConfig(select="federated" | "pooled-train")``): the alternative to
empirical Bayes, which needs no held-out data. :mod:`~bnpfed.federated.operating_point` chooses among empirical-Bayes
candidates instead."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from bnpfed.federated.config import EB_DEFAULTS, PFNMConfig
from bnpfed.federated.results import Selection
from bnpfed.federated.server import pfnm_step
from bnpfed.matching import SpecMatch

__all__ = ["select_hyperparameters"]


def select_hyperparameters(local_models: Sequence[nn.Module], class_counts, validation: Sequence, pfnm: PFNMConfig, *,
                           grid_sigma2: Sequence[float], grid_sigma0_2: Sequence[float], grid_gamma0: Sequence[float],
                           seed: int, by: str = "federated", test=None, input_shape=None,
                           reestimate: Optional[Callable[[SpecMatch], SpecMatch]] = None,
                           activity: Optional[Sequence] = None) -> Selection:
    """Choose PFNM's ``sigma2, sigma0_2, gamma0`` from a grid by validation accuracy of the one-shot global network
    (each candidate with fixed hyper-parameters; the alternative to empirical Bayes, which needs no held-out data).

    Every candidate matches ``local_models`` once; its score is the accuracy summed over the validation sets
    (``[(x, y), ...]``: each client's held-out split, the federated way, or pooled training data) divided by their
    total size. The best score wins, the narrower network on a tie.

    :param test: optional ``(x, y)`` whose accuracy is recorded in the curve (never used to choose).
    :param input_shape: the shape of one input (to derive a convolutional network's permutation spec).
    :param reestimate: applied to every candidate's match before it is scored (an experiment's
        :meth:`Experiment.reestimate` of the batch-norm statistics).
    :param activity: the clients' reports on their units (:meth:`Experiment.activity`), as for
        :func:`~bnpfed.federated.server.pfnm_step`.
    """
    best: Optional[Selection] = None
    curve = []
    total = sum(len(y) for _, y in validation)
    if total == 0:
        raise ValueError("validation: expected at least one held-out example, got none")
    for s2, s02, g in itertools.product(grid_sigma2, grid_sigma0_2, grid_gamma0):
        # fixed values: the settings of empirical Bayes (its starts and stopping rule) go back to their defaults
        candidate = replace(pfnm, hyperparameters="fixed", sigma2=s2, sigma0_2=s02, gamma0=g,
                            experimental=replace(pfnm.experimental, **EB_DEFAULTS))
        match = pfnm_step(local_models, class_counts, candidate, seed=seed, round=1, input_shape=input_shape,
                          activity=activity)
        if reestimate is not None:
            match = reestimate(match)
        net = match.network().eval()
        with torch.no_grad():
            correct = sum(float((net(x).argmax(-1) == y).double().sum()) for x, y in validation)
            point = dict(sigma2=s2, sigma0_2=s02, gamma0=g, hidden=match.hidden_sizes, validation=correct / total)
            if test is not None:
                point["test"] = float((net(test[0]).argmax(-1) == test[1]).double().mean())
        curve.append(point)
        narrower = best is not None and sum(match.hidden_sizes) < sum(best.match.hidden_sizes)
        if best is None or point["validation"] > best.score or (point["validation"] == best.score and narrower):
            best = Selection(candidate, by, point["validation"], match=match)
    best.curve = curve
    return best
