"""Every random stream of bnpfed, derived from one experiment seed.

A federated run draws random numbers in many places: the partition of the data, each client's initial network,
which clients a round samples, each client's local fit in each round, the pooling rule's draws, the predictive
draws of an evaluation, the order of the matcher's sweeps. Each such *stream* gets its own seed,

    derive_seed(seed, stream, round, client)
        = the first 64 bits of SeedSequence(seed, spawn_key=(stream, round, client))

``numpy.random.SeedSequence`` hashes the experiment seed and the spawn key together, so distinct keys give
statistically independent streams, and no arithmetic accident makes two (seed, round, client) triples share one
(``(seed + round) * 100003 + j`` did: seed 0's round 2 was seed 2's round 1). Seeds are 64-bit, so a grid of
millions of streams has no collision in practice (tests enumerate one and find none).

``round`` is 1-based for the steps of a round and 0 for what happens once (the partition, the initial networks);
``client`` is the client's index j (0-based) and 0 for server-side streams.

Usage::

    >>> from bnpfed.seeding import Stream, derive_seed, torch_generator
    >>> derive_seed(0, Stream.FIT, 2, 0) == derive_seed(2, Stream.FIT, 1, 0)
    False
    >>> g = torch_generator(0, Stream.POOLING, round=3)       # a torch.Generator for the pooling rule of round 3
    >>> with seeded(derive_seed(0, Stream.INIT, 0, 1)):     # torch's global RNG, restored afterwards
    ...     net = torch.nn.Linear(3, 2)
"""

from __future__ import annotations

import contextlib
from enum import IntEnum
from typing import Optional

import numpy as np
import torch

__all__ = ["Stream", "derive_seed", "numpy_rng", "torch_generator", "seeded"]


class Stream(IntEnum):
    """The kinds of random step; the first element of a stream's spawn key."""

    #: the partition of the training data among the clients (and the clients' held-out splits)
    PARTITION = 0
    #: a client's (or the shared) initial network
    INIT = 1
    #: which clients a round samples
    SAMPLING = 2
    #: a client's local fit in a round (shuffling, dropout, weight draws)
    FIT = 3
    #: the pooling rule's draws in a round
    POOLING = 4
    #: the predictive draws of the evaluation after a round
    PREDICT = 5
    #: the order of the matcher's sweeps in a round (``client`` is the layer)
    MATCH = 6
    #: which clients evaluate the global model after a round (Flower's client-side evaluation)
    EVALUATION = 7
    #: a client's held-out split (federated hyper-parameter selection)
    HOLDOUT = 8
    #: a local fit's random image transforms (crops, flips), spawned from the fit's own seed
    AUGMENT = 9
    #: a federated method's own server-side draws in a round (:class:`~bnpfed.federated.ServerTask`)
    SERVER = 10
    #: the bootstrap resamples of the test examples behind a result's confidence intervals
    #: (:func:`~bnpfed.metrics.bootstrap_intervals`)
    BOOTSTRAP = 11


def _check_key(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    return int(value)


def derive_seed(seed: int, stream: Stream | int, round: int = 0, client: int = 0) -> int:
    """The 64-bit seed of one random stream: ``SeedSequence(seed, spawn_key=(stream, round, client))``'s first
    64 bits, an int in ``[0, 2**64)`` that ``torch.Generator.manual_seed`` and ``numpy.random.default_rng`` accept.

    :param int seed: the experiment's seed, >= 0.
    :param stream: a :class:`Stream` (or its int value).
    :param int round: 1-based communication round, 0 for once-per-run steps.
    :param int client: the client's index j, 0 for server-side streams.
    """
    seed = _check_key(seed, "seed")
    keys = (_check_key(int(stream), "stream"), _check_key(round, "round"), _check_key(client, "client"))
    state = np.random.SeedSequence(seed, spawn_key=keys).generate_state(1, dtype=np.uint64)
    return int(state[0])


def numpy_rng(seed: int, stream: Stream | int, round: int = 0, client: int = 0) -> np.random.Generator:
    """A ``numpy.random.Generator`` on the stream :func:`derive_seed` names."""
    return np.random.default_rng(derive_seed(seed, stream, round, client))


def torch_generator(seed: int, stream: Stream | int, round: int = 0, client: int = 0) -> torch.Generator:
    """A CPU ``torch.Generator`` on the stream :func:`derive_seed` names."""
    return torch.Generator().manual_seed(derive_seed(seed, stream, round, client))


@contextlib.contextmanager
def seeded(seed: Optional[int], device: torch.device | str = "cpu"):
    """Context in which Torch's global random numbers come from ``seed`` and after which the global random state
    is as before; a no-op when ``seed`` is None. For code that draws from the global generator (``nn.Linear``'s
    initialisation, Pyro's samplers)."""
    if seed is None:
        yield
        return
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed: expected an int or None, got {seed!r}")
    seed = int(seed)
    device = torch.device(device)
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        # only the forked generators are seeded (torch.manual_seed would also reseed every CUDA device)
        torch.random.default_generator.manual_seed(seed)
        for index in cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        yield
