"""The sums on a layer matcher's shared coordinates that the pooled-moment estimates read
(:class:`~bnpfed.matching.empirical_bayes.PooledMoments`): the neurons' sum and sum of squares, and each atom's sum
of its members' means, added client by client on a client's own columns where it has few
(:attr:`~bnpfed.matching.matcher.LayerMatcher.columns_of`), so that a compact layer (every client given as
:class:`~bnpfed.matching.layer_inputs.CompactRows`, the layer after a Flatten) never builds an (N, |F|) or, atom
block by atom block, an (L, |F|) array. Each function reads a matcher's public per-client data (``F``,
``columns_of``, ``vF``, ``vF_compact``, ``vF_all``); it imports nothing of the matcher, which calls it."""

from __future__ import annotations

import numpy as np

__all__ = ["shared_atom_moments", "shared_moments", "shared_sums"]


def shared_sums(matcher, labels: list[np.ndarray], L: int) -> np.ndarray:
    """(L, |F|): per atom of the compact assignment ``labels`` (values 0 .. L-1; -1 for a neuron left out) the sum
    of its members' means on the shared coordinates, added client by client (on a client's own columns when it
    has few)."""
    out = np.zeros((L, matcher.F.size))
    for j, a in enumerate(labels):
        cols = matcher.columns_of[j]
        inside = a >= 0
        if not inside.any():
            continue
        rows = matcher.vF[j] if cols is None else matcher.vF_compact[j]
        if not inside.all():   # a block of the atoms (:func:`shared_atom_moments`): this client's rows in it
            a, rows = a[inside], rows[inside]
        if cols is None:
            out[a] += rows
        else:
            out[np.ix_(a, cols)] += rows
    return out


def shared_moments(matcher) -> tuple[np.ndarray, float]:
    """The neurons' sum (|F|,) and sum of squares (a number) on the shared coordinates, client by client on their
    own columns when the matcher is compact (computed once, kept on the matcher)."""
    if matcher.shared_moments_ is None:
        if matcher.vF_all is not None:
            matcher.shared_moments_ = (matcher.vF_all.sum(axis=0), float((matcher.vF_all ** 2).sum()))
        else:
            total, square = np.zeros(matcher.F.size), 0.0
            for x, cols in zip(matcher.vF_compact, matcher.columns_of):
                total[cols] += x.sum(axis=0)
                square += float((x ** 2).sum())
            matcher.shared_moments_ = (total, square)
    return matcher.shared_moments_


def shared_atom_moments(matcher, labels: list[np.ndarray], L: int, W: np.ndarray,
                        budget: int = 2 ** 24) -> tuple[np.ndarray, np.ndarray]:
    """Per atom of the compact assignment ``labels`` (values 0 .. L-1, W members each) ``||S_i / W_i||^2`` and, per
    shared coordinate, ``sum_i S_i / W_i``, S_i the atom's sum of its members' means (:func:`shared_sums`): at once
    when the (L, |F|) sums fit in ``budget`` entries (64 MiB of them by default), else atom block by atom block (the
    same sums per atom)."""
    F = matcher.F.size
    if L * F <= budget:
        S = shared_sums(matcher, labels, L)
        return np.einsum("ld,ld->l", S, S) / W ** 2, (1.0 / W) @ S
    step = max(1, budget // max(F, 1))
    sq, total = np.empty(L), np.zeros(F)
    for a0 in range(0, L, step):
        a1 = min(a0 + step, L)
        S = shared_sums(matcher, [np.where((a >= a0) & (a < a1), a - a0, -1) for a in labels], a1 - a0)
        sq[a0:a1] = np.einsum("ld,ld->l", S, S) / W[a0:a1] ** 2
        total += (1.0 / W[a0:a1]) @ S
    return sq, total
