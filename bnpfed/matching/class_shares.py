"""Each client's class shares estimated from its own output layer, for pre-trained networks whose class counts are
not known (PFNM's server weighs the output coordinates by them: :func:`~bnpfed.matching.match_by_spec`).

A class a client never saw (or rarely saw) is pushed down for every input while it trains. The hidden units feeding
the output layer are ReLUs (>= 0), so the sum of a class's output weights, ``(W_j 1)_k``, is how its logit moves with
the typical input, and that sum falls for the classes the client did not see. Standardised over the classes (``z``:
minus the mean, over the standard deviation) it is scale-free; the estimate is

    share_jk = softmax_k( z(W_j 1)_k / T )

with ``W_j`` client j's output weights (C, H) and the temperature ``T`` = :data:`TEMPERATURE`. It is a heuristic,
not a posterior, and its form and T were chosen on measurements (PFNM's accuracy with the estimate against the true
counts and uniform shares on label-skewed MNIST, Fashion-MNIST and digits federations: the docs' benchmark page on
one-shot matching, "Pre-trained networks without class counts"); adding the standardised output bias helped on one
federation and hurt on another, so the bias is not used.

Usage::

    >>> import torch
    >>> W = torch.tensor([[1.0, 1.0], [0.5, 0.5], [-3.0, -3.0]])     # class 2 pushed down
    >>> [round(v, 3) for v in estimate_shares([W])[0].tolist()]
    [0.603, 0.381, 0.015]
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from bnpfed.validation import check_positive

__all__ = ["TEMPERATURE", "estimate_class_shares", "estimate_shares"]

#: T of the module docstring: the estimate's sharpness (chosen on the measurements the module docstring names)
TEMPERATURE = 0.5


def _z(v: Tensor) -> Tensor:
    sd = v.std()
    return (v - v.mean()) / sd if float(sd) > 0 else torch.zeros_like(v)


def estimate_shares(output_weights: Sequence[Tensor], *, temperature: float = TEMPERATURE) -> Tensor:
    """(J, C) float64 estimated class shares (rows sum to 1) from each client's output weights ``(C, H)`` (any
    trailing shape: summed), at ``temperature`` T (module docstring)."""
    temperature = check_positive(temperature, "temperature")
    if not output_weights:
        raise ValueError("output_weights: expected one per client, got none")
    rows = []
    for j, w in enumerate(output_weights):
        w = torch.as_tensor(w).detach().double()
        if w.dim() < 2 or w.shape[0] < 2:
            raise ValueError(f"output_weights[{j}]: expected (C, H) with C >= 2 classes, got {tuple(w.shape)}")
        if not bool(torch.isfinite(w).all()):
            raise ValueError(f"output_weights[{j}]: expected finite values")
        rows.append(torch.softmax(_z(w.reshape(w.shape[0], -1).sum(1)) / temperature, 0))
    return torch.stack(rows)


def estimate_class_shares(states: Sequence, spec, *, temperature: float = TEMPERATURE) -> Tensor:
    """(J, C) estimated class shares of J clients' networks (``nn.Module`` s or state dicts) of one
    :class:`~bnpfed.matching.PermutationSpec`: :func:`estimate_shares` of the spec's output weights."""
    keys = spec.params_of_kind("output_weight")
    if not keys:
        raise ValueError("spec: expected an output layer (an output_weight parameter) to estimate class shares from")
    return estimate_shares([(s.state_dict() if hasattr(s, "state_dict") else s)[keys[0]] for s in states],
                           temperature=temperature)
