"""One layer's inputs checked, in one voice (``<name>: expected ..., got ...``): the clients' neurons (posterior means)
and posterior variances, per-client precision scales, prior means, atom labels."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = ["CompactRows", "result_dtype", "to_numpy", "validate_clients", "validate_labels", "validate_mu0",
           "validate_precisions"]


class CompactRows:
    """A client's (L_j, D) neurons held on the columns where some neuron of it is not 0: ``values`` (L_j, k) float64 on
    the sorted coordinates ``columns`` (k,), 0 on every other coordinate. After a Flatten a client's units read only
    the columns of the global channels it holds (LeNet's fc1 at J = 500: about 400 of 20,000), so J clients' layer
    costs O(N k) memory instead of O(N D); :func:`~bnpfed.matching.match_layer` and
    :func:`~bnpfed.matching.average_atoms` take them wherever they take a dense array, with the same results.

    >>> rows = CompactRows.from_dense(torch.tensor([[0.0, 2.0, 0.0, 1.0], [0.0, -1.0, 0.0, 0.0]]))
    >>> rows.shape, rows.columns.tolist(), rows.values.tolist()
    ((2, 4), [1, 3], [[2.0, 1.0], [-1.0, 0.0]])
    >>> rows.dense().tolist()
    [[0.0, 2.0, 0.0, 1.0], [0.0, -1.0, 0.0, 0.0]]

    :param values: (L_j, k) the neurons on ``columns``.
    :param columns: (k,) distinct coordinates in [0, D), increasing.
    :param int D: the coordinates of a neuron.
    """

    dtype = torch.float64

    def __init__(self, values, columns, D: int):
        self.values = np.ascontiguousarray(to_numpy(values, "values"))
        self.columns = np.asarray(columns, dtype=np.int64).reshape(-1)
        self.D = int(D)
        if self.values.ndim != 2 or self.values.shape[1] != self.columns.size:
            raise ValueError(f"values: expected shape (L_j, {self.columns.size}) (one column per entry of columns), "
                             f"got {self.values.shape}")
        if self.columns.size and (self.columns[0] < 0 or self.columns[-1] >= self.D
                                  or (np.diff(self.columns) <= 0).any()):
            raise ValueError(f"columns: expected increasing coordinates in [0, {self.D}), got {self.columns.tolist()}")

    @classmethod
    def from_dense(cls, rows) -> "CompactRows":
        """The rows of a dense (L_j, D) array or tensor on the columns where some row is not 0."""
        a = to_numpy(rows, "rows")
        if a.ndim != 2:
            raise ValueError(f"rows: expected shape (L_j, D), got shape {a.shape}")
        cols = np.flatnonzero((a != 0).any(axis=0))
        return cls(a[:, cols], cols, a.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        return self.values.shape[0], self.D

    def dense(self) -> np.ndarray:
        """The (L_j, D) float64 array."""
        out = np.zeros(self.shape)
        out[:, self.columns] = self.values
        return out

    def on(self, idx: np.ndarray) -> np.ndarray:
        """(L_j, |idx|) the rows on the sorted coordinates ``idx`` (dense there)."""
        out = np.zeros((self.values.shape[0], idx.size))
        _, mine, there = np.intersect1d(self.columns, idx, assume_unique=True, return_indices=True)
        out[:, there] = self.values[:, mine]
        return out

    def own_columns(self, F: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The columns of the sorted block ``F`` where some neuron is not 0 (positions in ``F``) and the rows there:
        what ``(v != 0).any(axis=0)`` finds on the dense (L_j, |F|) block."""
        used = (self.values != 0).any(axis=0)
        _, mine, there = np.intersect1d(self.columns, F, assume_unique=True, return_indices=True)
        keep = used[mine]
        return there[keep], np.ascontiguousarray(self.values[:, mine[keep]])

    def __repr__(self) -> str:
        return f"CompactRows(L_j={self.values.shape[0]}, D={self.D}, columns={self.columns.size})"



def to_numpy(x, name: str) -> np.ndarray:
    """``x`` as a float64 array; a ValueError naming ``name`` if it is not numeric."""
    if isinstance(x, Tensor):
        x = x.detach().cpu().numpy()
    try:
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: expected numeric arrays or tensors, got {type(x).__name__} ({e})") from None


def _client_arrays(arrays, name: str, compact: bool = False) -> list:
    """J float64 (L_j, D) arrays (or, with ``compact``, :class:`CompactRows` as given), checked finite and of one
    D."""
    if isinstance(arrays, (Tensor, np.ndarray)) and np.ndim(arrays) == 3:
        arrays = list(arrays)
    if not isinstance(arrays, Sequence) or isinstance(arrays, (str, bytes)):
        raise ValueError(f"{name}: expected a sequence of J arrays of shape (L_j, D), got {type(arrays).__name__}")
    if len(arrays) == 0:
        raise ValueError(f"{name}: expected at least one client's (L_j, D) array, got none")
    out = []
    for j, v in enumerate(arrays):
        if isinstance(v, CompactRows):
            if not compact:
                raise ValueError(f"{name}[{j}]: expected an array of shape (L_j, D), got CompactRows (only "
                                 "point estimates without posterior variances are taken compact)")
            if out and v.shape[1] != out[0].shape[1]:
                raise ValueError(f"{name}[{j}]: expected D = {out[0].shape[1]} coordinates (as {name}[0]; every "
                                 f"client shares D), got {v.shape[1]}")
            if not np.isfinite(v.values).all():
                raise ValueError(f"{name}[{j}]: expected finite values, got NaN or inf")
            out.append(v)
            continue
        a = to_numpy(v, f"{name}[{j}]")
        if a.ndim != 2:
            raise ValueError(f"{name}[{j}]: expected shape (L_j, D), got shape {a.shape}")
        if out and a.shape[1] != out[0].shape[1]:
            raise ValueError(f"{name}[{j}]: expected D = {out[0].shape[1]} coordinates (as {name}[0]; every client "
                             f"shares D), got {a.shape[1]}")
        if not np.isfinite(a).all():
            raise ValueError(f"{name}[{j}]: expected finite values, got NaN or inf")
        out.append(np.ascontiguousarray(a))
    return out


def validate_clients(means, variances=None, *, name: str = "neurons") -> tuple[list, list | None]:
    """J float64 arrays (L_j, D) of neurons (posterior means; :class:`CompactRows` kept as given when there are no
    variances), and of their posterior variances (>= 0, the same shapes) when given; at least one client must hold a
    neuron (a client without neurons still counts in J)."""
    V = _client_arrays(means, name, compact=variances is None)
    U = None
    if variances is not None:
        U = _client_arrays(variances, "variances")
        if len(U) != len(V):
            raise ValueError(f"variances: expected one array per client ({len(V)}, as many as {name}), got {len(U)}")
        for j, (v, u) in enumerate(zip(V, U)):
            if u.shape != v.shape:
                raise ValueError(f"variances[{j}]: expected shape {v.shape} (that of {name}[{j}]), got {u.shape}")
            if (u < 0).any():
                raise ValueError(f"variances[{j}]: expected posterior variances >= 0, got minimum {float(u.min())}")
    if not any(v.shape[0] for v in V):
        raise ValueError(f"{name}: expected at least one client with a neuron (L_j >= 1), got {len(V)} client(s), "
                         "all with L_j = 0: nothing to match")
    return V, U


def validate_precisions(precisions, sizes: Sequence[int], D: int) -> np.ndarray | None:
    """(J, D) precision scales >= 0 (``sizes``: the clients' L_j), or None."""
    if precisions is None:
        return None
    J = len(sizes)
    if isinstance(precisions, (Tensor, np.ndarray)) and np.ndim(precisions) == 2:
        s = to_numpy(precisions, "precisions")
    else:
        if len(precisions) != J:
            raise ValueError(f"precisions: expected one (D,) vector per client ({J}), got {len(precisions)}")
        rows = [to_numpy(p, f"precisions[{j}]") for j, p in enumerate(precisions)]
        for j, r in enumerate(rows):
            if r.shape != (D,):
                raise ValueError(f"precisions[{j}]: expected shape ({D},), got {r.shape}")
        s = np.stack(rows)
    if s.shape != (J, D):
        raise ValueError(f"precisions: expected shape ({J}, {D}), got {s.shape}")
    if not np.isfinite(s).all() or (s < 0).any():
        raise ValueError(f"precisions: expected finite scales >= 0, got minimum {float(np.nanmin(s))}")
    # a client without neurons says nothing whatever its precisions: its row is never used
    silent = np.flatnonzero((s == 0).all(axis=1) & (np.asarray(sizes) > 0))
    if silent.size:
        raise ValueError(f"precisions[{int(silent[0])}]: expected some scale > 0, got all 0 (its neurons would carry "
                         "no information; a zero marks one coordinate a client says nothing about)")
    return s


def validate_mu0(mu0, D: int, *, estimable: bool = False) -> np.ndarray:
    """(D,) prior mean from a scalar or a (D,) vector; with ``estimable`` NaN entries mark coordinates to estimate."""
    m = to_numpy(mu0, "mu0")
    if m.ndim == 0:
        m = np.full(D, float(m))
    if m.shape != (D,):
        raise ValueError(f"mu0: expected a scalar or shape ({D},), got shape {m.shape}")
    bad = np.isinf(m) if estimable else ~np.isfinite(m)
    if bad.any():
        raise ValueError(f"mu0: expected finite values{' or NaN (estimated)' if estimable else ''}, got "
                         f"{float(m[bad][0])}")
    return m


def validate_labels(assignments, sizes: Sequence[int], name: str) -> list[np.ndarray]:
    """J int64 arrays of atom labels, one of length L_j per client, distinct within a client (any values)."""
    J = len(sizes)
    if isinstance(assignments, (str, bytes)) or not isinstance(assignments, (Sequence, Tensor, np.ndarray)):
        raise ValueError(f"{name}: expected one integer array per client ({J}), got {type(assignments).__name__}")
    if len(assignments) != J:
        raise ValueError(f"{name}: expected one integer array per client ({J}), got {len(assignments)} arrays")
    out = []
    for j, a in enumerate(assignments):
        a = a.detach().cpu().numpy() if isinstance(a, Tensor) else np.asarray(a)
        if a.ndim != 1 or a.size != sizes[j]:
            raise ValueError(f"{name}[{j}]: expected {sizes[j]} atom labels (client {j} has L_j = {sizes[j]} "
                             f"neurons), got shape {a.shape}")
        integral = np.issubdtype(a.dtype, np.integer) or (
            np.issubdtype(a.dtype, np.floating) and bool(np.isfinite(a).all() and (a == np.round(a)).all()))
        if a.size and not integral:
            raise ValueError(f"{name}[{j}]: expected integer atom labels, got {a.tolist()}")
        a = a.astype(np.int64)
        if np.unique(a).size != a.size:
            raise ValueError(f"{name}[{j}]: expected atom labels distinct within client {j} (one neuron per atom), "
                             f"got {a.tolist()}")
        out.append(a)
    return out


def result_dtype(neurons):
    """The dtype of the result's tensors: the neurons', if they are floating-point tensors; else torch's default."""
    dtype = neurons[0].dtype if isinstance(neurons[0], (Tensor, CompactRows)) else torch.get_default_dtype()
    return dtype if dtype.is_floating_point else torch.get_default_dtype()
