"""One seeding module: every random stream derived from (seed, stream, round, client) by SeedSequence spawn keys."""

import itertools

import numpy as np
import pytest
import torch

from bnpfed.seeding import Stream, derive_seed, numpy_rng, seeded, torch_generator


def test_no_two_streams_of_a_grid_share_a_seed():
    grid = itertools.product(range(10), Stream, range(61), range(101))  # seeds x streams x rounds x clients
    seeds = [derive_seed(seed, stream, round, client) for seed, stream, round, client in grid]
    assert len(seeds) == 10 * len(Stream) * 61 * 101
    assert len(set(seeds)) == len(seeds)


def test_the_old_arithmetic_collision_is_gone():
    """``(seed + round) * 100003 + j`` gave seed 0's round 2 the stream of seed 2's round 0, and so on."""
    for stream in Stream:
        assert derive_seed(0, stream, 2, 3) != derive_seed(2, stream, 0, 3)
        assert derive_seed(0, stream, 2, 3) != derive_seed(1, stream, 1, 3)
    assert derive_seed(0, Stream.FIT, 1, 100_003) != derive_seed(1, Stream.FIT, 1, 0)


def test_the_same_key_gives_the_same_stream_and_seeds_are_64_bit():
    assert derive_seed(7, Stream.POOLING, 3) == derive_seed(7, Stream.POOLING, 3, 0)
    seeds = [derive_seed(s, Stream.INIT) for s in range(200)]
    assert all(0 <= s < 2 ** 64 for s in seeds) and max(seeds) >= 2 ** 32
    a, b = torch_generator(7, Stream.FIT, 2, 1), torch_generator(7, Stream.FIT, 2, 1)
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))
    assert np.array_equal(numpy_rng(7, Stream.SAMPLING, 4).random(5), numpy_rng(7, Stream.SAMPLING, 4).random(5))
    assert not np.array_equal(numpy_rng(7, Stream.SAMPLING, 4).random(5), numpy_rng(7, Stream.SAMPLING, 5).random(5))


def test_seeded_draws_from_the_seed_and_restores_the_global_state():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    with seeded(derive_seed(0, Stream.INIT)):
        first = torch.rand(4)
    with seeded(derive_seed(0, Stream.INIT)):
        second = torch.rand(4)
    assert torch.equal(first, second)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("kwargs, message", [
    (dict(seed=-1, stream=Stream.FIT), "seed: expected an int >= 0, got -1"),
    (dict(seed=0, stream=Stream.FIT, round=-1), "round: expected an int >= 0"),
    (dict(seed=0, stream=Stream.FIT, client=1.5), "client: expected an int >= 0"),
    (dict(seed=True, stream=Stream.FIT), "seed: expected an int >= 0"),
])
def test_bad_keys_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        derive_seed(**kwargs)
