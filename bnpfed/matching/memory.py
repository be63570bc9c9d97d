"""How much memory matching one layer takes, estimated from its clients' neuron counts before anything is allocated,
and the guard that refuses a layer this machine cannot hold (:func:`check_matching_memory`), with the estimate and
what to change, rather than a numpy ``MemoryError`` (or the system's out-of-memory killer) minutes into a run.

**The estimate** (:func:`matching_bytes`) is a lower bound of the layer matcher's peak (:mod:`~bnpfed.matching.
matcher`), read from its allocations, for clients of widths ``L_(1) >= L_(2) >= ...`` (N neurons in all, D
coordinates each; float64, 8 bytes a number). The greedy pass matches the largest client first, against no atom: its
score matrix ``(L_(1), L_(1))`` (every column a new atom) and the assignment solver's negated copy of it,
``16 L_(1)^2`` bytes. The second client is scored against the ``L_(1)`` atoms the first opened: the score matrix
``(L_(2), L_(1) + L_(2))``, its cross products with the atoms ``(L_(2), L_(1))`` and their scaled copy, and the
candidates' mask, ``8 L_(2) (L_(1) + L_(2)) + 17 L_(2) L_(1)`` bytes. Both come on top of the neurons themselves,
held about three times (as given, in one flat array, and their contributions): ``24 N D`` bytes. Later clients and
sweeps score against at least as many atoms, and the Gram matrix (:data:`~bnpfed.matching.matcher.GRAM_BYTES`) and
the assignment solver's copies where pruning does not shrink the problem come on top: the peak is never lower.

Usage::

    >>> matching_bytes([100, 100, 100], 785)          # PFNM's MNIST MLP, three clients: about 6 MB
    5982000
    >>> round(matching_bytes([100_000], 785) / 2 ** 30, 1)   # one client of 100,000 units: 151 GiB at least
    150.8
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

from torch import Tensor

from bnpfed.matching.layout import width
from bnpfed.matching.spec import PermutationSpec
from bnpfed.validation import check_int

__all__ = ["MemoryLimitError", "QUIET_BYTES", "available_memory", "check_matching_memory", "check_network_matching",
           "matching_bytes"]

#: Below this estimate (256 MiB) a matching is not checked against the machine's memory (nothing is read).
QUIET_BYTES = 2 ** 28


class MemoryLimitError(ValueError):
    """A matching that would need more memory than this machine has available, said before anything is allocated
    (a ``ValueError``: the commands print it as one line naming what to change)."""


def matching_bytes(widths: Sequence[int], dim: int) -> int:
    """A lower bound of the peak memory (bytes) of matching one layer (:func:`~bnpfed.matching.match_layer`,
    :func:`~bnpfed.matching.match_bayesian_layer`) of clients holding ``widths`` neurons of ``dim`` coordinates each:
    the module docstring's ``24 N D + max(16 L_(1)^2, 8 L_(2) (L_(1) + L_(2)) + 17 L_(2) L_(1))``.

    :param widths: each client's number of neurons in the layer (ints >= 0).
    :param int dim: D, the coordinates of one neuron (>= 1).
    """
    widths = [check_int(w, f"widths[{j}]", low=0) for j, w in enumerate(widths)]
    dim = check_int(dim, "dim", low=1)
    first, second = (sorted(widths, reverse=True) + [0, 0])[:2]
    scores = max(16 * first * first, 8 * second * (first + second) + 17 * second * first)
    return 24 * sum(widths) * dim + scores


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_available() -> int | None:
    """What the process's cgroup (v2) still allows, when it sets a limit."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        return max(int(limit) - used, 0)
    except (OSError, ValueError):
        return None


def available_memory() -> int:
    """The memory (bytes) this process may still take: the system's available memory (``MemAvailable`` of
    ``/proc/meminfo``, else the free physical pages) and, inside a container, no more than its cgroup's limit less
    what the cgroup uses."""
    found = [m for m in (_meminfo_available(), _cgroup_available()) if m is not None]
    if not found:
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (AttributeError, ValueError, OSError):   # not on a POSIX system: nothing known, nothing refused
            return 2 ** 62
    return min(found)


def check_matching_memory(widths: Sequence[int], dim: int, *, name: str = "neurons", change: str | None = None
                          ) -> int:
    """Refuse (:class:`MemoryLimitError` naming ``name``) a layer whose matching needs more memory than
    :func:`available_memory` (:func:`matching_bytes`, a lower bound: a refused layer could not be matched here);
    return the estimate (bytes) otherwise.

    :param widths: each client's number of neurons in the layer.
    :param int dim: the coordinates of one neuron.
    :param str name: what the message starts with (the argument or flag the widths come from).
    :param str change: what to change, in words (default: fewer or narrower clients' layers).
    """
    need = matching_bytes(widths, dim)
    if need <= QUIET_BYTES:
        return need
    have = available_memory()
    if need > have:
        largest = max(widths)
        raise MemoryLimitError(
            f"{name}: matching {len(widths)} clients of up to {largest:,} neurons ({sum(widths):,} in all, {dim:,} "
            f"coordinates each) needs at least {need / 2 ** 30:.3g} GiB (the score matrices of the two largest "
            f"clients, about {largest:,} x {largest:,} numbers each, and the neurons), more than the "
            f"{have / 2 ** 30:.3g} GiB this machine has available; "
            + (change or "match fewer or narrower layers (fewer neurons per client), or on a machine with more "
               "memory"))
    return need


def check_network_matching(spec: PermutationSpec, state: Mapping[str, Tensor], clients: int, *, name: str,
                           change: str | None = None) -> None:
    """:func:`check_matching_memory` of every group of ``spec`` for ``clients`` clients holding a network of
    ``state`` 's widths (what a federation of J clients of one configured network matches, checked before anything
    trains); a unit's coordinates are the parameters it owns (every axis its group acts on).

    :param PermutationSpec spec: the network's permutation spec.
    :param dict state: the network's ``state_dict`` (its widths).
    :param int clients: J.
    :param str name: what the message starts with (the flag or key of the widths).
    :param str change: what to change, in words."""
    clients = check_int(clients, "clients", low=1)
    for group in spec.groups:
        units = width(state, group, "state")
        dim = sum(state[a.param].numel() // units for a in group.axes)
        check_matching_memory([units] * clients, dim, name=name,
                              change=(change or "fewer or narrower clients' layers") + f" (group {group.name!r})")
