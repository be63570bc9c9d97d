"""Splitting a labelled dataset among federated clients, shared by PFNM and posterior fusion.

A partition is a list of ``J`` sorted int64 index arrays, one per client, that together cover every example exactly
once. Every function takes a ``seed`` and uses its own ``np.random.default_rng(seed)``; no global RNG state is read
or changed.

Usage::

    parts = partition_dirichlet(ds.y_train.numpy(), num_clients=10, alpha=0.5, seed=0)
    class_shares(ds.y_train.numpy(), parts, ds.num_classes)   # (10, C) label mix of each client
    split = train_validation_split(parts[0], 0.1, seed=0)      # split.train, split.validation
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from bnpfed.seeding import Stream, derive_seed
from bnpfed.validation import check_int

__all__ = [
    "TrainValidationSplit",
    "class_counts",
    "class_shares",
    "holdout_split",
    "partition_dirichlet",
    "partition_homogeneous",
    "train_validation_split",
]


def partition_homogeneous(labels, num_clients: int, *, seed) -> list[np.ndarray]:
    """IID partition: shuffle all indices and cut them into ``num_clients`` near-equal parts.

    As in the PFNM reference code (Yurochkin et al., 2019), ``np.array_split(permutation(N), J)``: part sizes
    differ by at most one.

    Parameters
    ----------
    labels : array-like of int, shape (N,)
        Class label of every example (only its length is used; validated like the other partitions).
    num_clients : int
        ``J``, between 1 and ``N``.
    seed : int or numpy.random.Generator
        Seed of the shuffle.

    Returns
    -------
    list of numpy.ndarray
        ``J`` sorted int64 index arrays into ``labels``, disjoint, covering ``0 .. N - 1``.

    Examples
    --------
    >>> [len(p) for p in partition_homogeneous([0, 1, 0, 1, 2], 2, seed=0)]
    [3, 2]
    """
    labels = _check_labels(labels)
    num_clients = _check_num_clients(num_clients, len(labels))
    rng = np.random.default_rng(seed)
    return [np.sort(part) for part in np.array_split(rng.permutation(len(labels)), num_clients)]


def partition_dirichlet(
    labels,
    num_clients: int,
    *,
    alpha: float = 0.5,
    min_size: int = 10,
    seed,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Label-Dirichlet heterogeneous partition (PFNM's ``hetero-dir``, Yurochkin et al., 2019).

    For each class ``k`` in turn, draw client proportions ``p ~ Dirichlet(alpha * 1_J)``, set ``p_j = 0`` for every
    client that already holds ``>= N / J`` examples (so no client grows far past its fair share), renormalise, and
    cut the shuffled indices of class ``k`` at the cumulative proportions. The whole draw is repeated until every
    client holds at least ``min_size`` examples. Small ``alpha`` gives each client few classes; large ``alpha``
    approaches the homogeneous partition.

    Parameters
    ----------
    labels : array-like of int, shape (N,)
        Class label of every example.
    num_clients : int
        ``J``, between 1 and ``N``.
    alpha : float
        Dirichlet concentration, > 0. Reference default 0.5.
    min_size : int
        Fewest examples any client may hold, >= 0 and at most ``N / J``. Reference default 10.
    seed : int or numpy.random.Generator
        Seed of the draws.
    max_tries : int
        Whole draws to attempt before giving up, >= 1.

    Returns
    -------
    list of numpy.ndarray
        ``J`` sorted int64 index arrays into ``labels``, disjoint, covering ``0 .. N - 1``.

    Raises
    ------
    RuntimeError
        No draw in ``max_tries`` gave every client ``min_size`` examples (lower ``min_size`` or raise ``alpha``).
    """
    labels = _check_labels(labels)
    n = len(labels)
    num_clients = _check_num_clients(num_clients, n)
    if not isinstance(alpha, numbers.Real) or not np.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha: expected a finite Dirichlet concentration > 0, got {alpha!r}")
    min_size = check_int(min_size, "min_size", low=0)
    if min_size * num_clients > n:
        raise ValueError(
            f"min_size: expected at most N / num_clients = {n / num_clients:g} (num_clients={num_clients}), got "
            f"{min_size}, which needs {min_size * num_clients} examples"
        )
    max_tries = check_int(max_tries, "max_tries", low=1)

    rng = np.random.default_rng(seed)
    class_indices = [np.flatnonzero(labels == k) for k in np.unique(labels)]
    fair_share = n / num_clients
    for _ in range(max_tries):
        parts = _dirichlet_draw(class_indices, num_clients, alpha, fair_share, rng)
        if parts is not None and min(len(part) for part in parts) >= min_size:
            return parts
    raise RuntimeError(
        f"partition_dirichlet found no partition giving each of {num_clients} clients at least min_size={min_size} "
        f"examples in max_tries={max_tries} draws with alpha={alpha}; lower min_size or raise alpha"
    )


def _dirichlet_draw(class_indices, num_clients, alpha, fair_share, rng) -> list[np.ndarray] | None:
    """One whole draw of :func:`partition_dirichlet` (sorted int64 parts); None when it degenerates (see below)."""
    chunks: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    sizes = np.zeros(num_clients, dtype=np.int64)
    for idx_k in class_indices:
        idx_k = rng.permutation(idx_k)
        proportions = rng.dirichlet(np.full(num_clients, alpha)) * (sizes < fair_share)
        total = proportions.sum()
        if total <= 0:
            # At tiny alpha all the mass can land on clients already full (or underflow); the reference code then
            # divides by zero. Treat it as a failed draw and try again.
            return None
        cuts = (np.cumsum(proportions / total) * len(idx_k)).astype(int)[:-1]
        for j, chunk in enumerate(np.split(idx_k, cuts)):
            chunks[j].append(chunk)
            sizes[j] += len(chunk)
    return [np.sort(np.concatenate(client_chunks)).astype(np.int64) for client_chunks in chunks]


def class_counts(labels, parts, num_classes: int) -> np.ndarray:
    """Examples of each class held by each client.

    Parameters
    ----------
    labels : array-like of int, shape (N,)
        Class labels, in ``0 .. num_classes - 1``.
    parts : sequence of index arrays
        A partition, e.g. from :func:`partition_dirichlet`.
    num_classes : int
        ``C``, >= 1.

    Returns
    -------
    numpy.ndarray
        int64 ``(J, C)``: entry ``(j, k)`` counts the examples of class ``k`` on client ``j``.
    """
    labels = _check_labels(labels)
    num_classes = check_int(num_classes, "num_classes", low=1)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(
            f"labels: expected values in [0, num_classes={num_classes}), got range [{labels.min()}, {labels.max()}]"
        )
    counts = np.zeros((len(parts), num_classes), dtype=np.int64)
    for j, part in enumerate(parts):
        counts[j] = np.bincount(labels[_check_indices(f"parts[{j}]", part, len(labels))], minlength=num_classes)
    return counts


def class_shares(labels, parts, num_classes: int) -> np.ndarray:
    """Each client's label distribution: :func:`class_counts` with rows normalised to sum to 1.

    Returns
    -------
    numpy.ndarray
        float64 ``(J, C)``; the row of a client holding no examples is all zeros.
    """
    counts = class_counts(labels, parts, num_classes)
    totals = counts.sum(axis=1, keepdims=True)
    return np.divide(counts, totals, out=np.zeros(counts.shape), where=totals > 0)


@dataclass(frozen=True)
class TrainValidationSplit:
    """A client's examples split into a training part and a held-out validation part.

    :param numpy.ndarray train: sorted int64 indices to train on.
    :param numpy.ndarray validation: sorted int64 indices held out, e.g. for federated hyper-parameter selection.
    """

    train: np.ndarray
    validation: np.ndarray


def train_validation_split(indices, fraction: float, *, seed) -> TrainValidationSplit:
    """Hold out a random ``fraction`` of a client's indices for validation.

    The validation part has ``ceil(fraction * n)`` indices (as scikit-learn's ``train_test_split`` rounds its test
    size); the training part keeps the rest and must not be empty.

    Parameters
    ----------
    indices : array-like of int, shape (n,)
        The client's example indices, e.g. one part of a partition.
    fraction : float
        Share held out, in (0, 1).
    seed : int or numpy.random.Generator
        Seed of the shuffle.

    Returns
    -------
    TrainValidationSplit
        Disjoint ``train`` and ``validation`` whose union is ``indices``.

    Examples
    --------
    >>> split = train_validation_split(range(10), 0.2, seed=0)
    >>> len(split.train), len(split.validation)
    (8, 2)
    """
    indices = _check_indices("indices", indices)
    if not isinstance(fraction, numbers.Real) or not 0 < fraction < 1:
        raise ValueError(f"fraction: expected a share of the indices strictly between 0 and 1, got {fraction!r}")
    n_validation = int(np.ceil(fraction * len(indices)))
    if n_validation >= len(indices):
        raise ValueError(
            f"indices: expected at least {n_validation + 1} entries, to hold out fraction={fraction} and still "
            f"train, got {len(indices)}"
        )
    shuffled = np.random.default_rng(seed).permutation(indices)
    return TrainValidationSplit(train=np.sort(shuffled[n_validation:]), validation=np.sort(shuffled[:n_validation]))


def _check_labels(labels) -> np.ndarray:
    array = np.asarray(labels)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"labels: expected a 1-D integer array, got shape {array.shape} and dtype {array.dtype}")
    return array


def _check_indices(name: str, indices, n: int | None = None) -> np.ndarray:
    array = np.asarray(indices)
    if array.size == 0:
        array = array.astype(np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected a 1-D integer array, got shape {array.shape} and dtype {array.dtype}")
    if n is not None and array.size and (array.min() < 0 or array.max() >= n):
        raise ValueError(
            f"{name}: expected indices into labels, in [0, {n}), got indices in [{array.min()}, {array.max()}]"
        )
    return array.astype(np.int64, copy=False)


def _check_num_clients(num_clients, n: int) -> int:
    num_clients = check_int(num_clients, "num_clients", low=1)
    if num_clients > n:
        raise ValueError(f"num_clients: expected at most the number of examples, {n}, got {num_clients}")
    return num_clients


def holdout_split(parts, fraction: float, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each client's indices split into (train, held-out) parts, client j from the stream ``(seed, HOLDOUT, 0,
    j)``: the held-out splits of federated hyper-parameter selection."""
    splits = [train_validation_split(p, fraction, seed=derive_seed(seed, Stream.HOLDOUT, 0, j))
              for j, p in enumerate(parts)]
    return [s.train for s in splits], [s.validation for s in splits]
