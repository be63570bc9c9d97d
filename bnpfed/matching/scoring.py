"""The two pure steps of one client's re-match in the layer matcher (:mod:`bnpfed.matching.matcher`): the Gaussian
part of the scores on coordinates whose noise precision varies by neuron (:func:`join_scores`), and the Hungarian
assignment of a client's score matrix, shrunk to the rows and atoms that can change it (:func:`best_assignment`)."""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment

__all__ = ["CHUNK_ELEMENTS", "best_assignment", "join_scores"]

#: At most this many (neuron, atom, coordinate) entries are broadcast at once when scoring the per-neuron
#: coordinates of a client (32 MiB each).
CHUNK_ELEMENTS = 2 ** 22


def join_scores(x: np.ndarray, w: np.ndarray, g: np.ndarray, P: np.ndarray, marginal: bool = True) -> np.ndarray:
    """(L_j, K) Gaussian part of the change of the objective when neuron l (``x = w v``, ``w``, (L_j, D)) joins atom k
    (``g``, ``P``, (K, D)): ``sum_d [(g + x)^2/(P + w) - g^2/P]`` (marginal: ``- log((P + w)/P)`` too), broadcast
    in chunks of at most :data:`CHUNK_ELEMENTS`."""
    L_j, D = x.shape
    K = g.shape[0]
    out = np.empty((L_j, K))
    base = (g ** 2 / P).sum(axis=1)
    step = max(1, CHUNK_ELEMENTS // max(L_j * D, 1))
    for k0 in range(0, K, step):
        gk, Pk = g[None, k0:k0 + step], P[None, k0:k0 + step]
        Pw = Pk + w[:, None, :]
        part = gk + x[:, None, :]
        np.square(part, out=part)
        part /= Pw
        if marginal:
            Pw /= Pk
            np.log(Pw, out=Pw)
            part -= Pw
        out[:, k0:k0 + step] = part.sum(axis=2) - base[None, k0:k0 + step]
    return out


def best_assignment(S: np.ndarray, L: int, *, prune: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The best assignment of a client's scores ``S`` (L_j, L + L_j): rows to distinct columns, the first L columns
    the active atoms, the others new atoms, every new column holding the row's one new-atom score (no ``max_atoms``,
    no ``log_k`` penalty: ``prune``). Then a row always has a free new column, so an atom can only be chosen by a row
    whose score for it beats its new-atom score: the assignment problem shrinks to those rows and atoms (and as many
    new columns), the other rows open new atoms -- the same optimum (barring exact ties), and the LSA of a trained
    layer sees a few rows of a few atoms. Returns ``(rows, cols)`` as ``scipy.optimize.linear_sum_assignment``.

    >>> S = np.array([[5.0, 0.0, 1.0, 1.0], [0.0, 0.5, 1.0, 1.0]])    # two atoms, then each row's new-atom score
    >>> best_assignment(S, 2)[1].tolist()                            # row 0 takes atom 0, row 1 a new atom
    [0, 2]
    """
    if not L or not prune:
        return linear_sum_assignment(S, maximize=True)
    new = S[:, L]
    candidate = S[:, :L] > new[:, None]
    r, c = np.flatnonzero(candidate.any(axis=1)), np.flatnonzero(candidate.any(axis=0))
    if r.size * (c.size + r.size) >= 0.5 * S.size:
        return linear_sum_assignment(S, maximize=True)
    cols = np.full(S.shape[0], -1, dtype=np.int64)
    if r.size:
        sub = np.concatenate([S[np.ix_(r, c)], np.repeat(new[r][:, None], r.size, axis=1)], axis=1)
        rr, cc = linear_sum_assignment(sub, maximize=True)
        chosen = cc < c.size
        cols[r[rr[chosen]]] = c[cc[chosen]]
    opened = np.flatnonzero(cols < 0)
    cols[opened] = L + np.arange(opened.size)
    return np.arange(S.shape[0]), cols
