import numpy as np
import pytest

from bnpfed.federated import (
    TrainValidationSplit,
    class_counts,
    class_shares,
    partition_dirichlet,
    partition_homogeneous,
    train_validation_split,
)

NUM_CLASSES = 10


def make_labels(per_class=200, num_classes=NUM_CLASSES, seed=0):
    labels = np.repeat(np.arange(num_classes), per_class)
    return np.random.default_rng(seed).permutation(labels)


PARTITIONS = {
    "homogeneous": lambda labels, J, seed: partition_homogeneous(labels, J, seed=seed),
    "dirichlet": lambda labels, J, seed: partition_dirichlet(labels, J, alpha=0.5, seed=seed),
}


def mean_entropy(shares):
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(shares > 0, -shares * np.log(shares), 0.0)
    return terms.sum(axis=1).mean()


@pytest.mark.parametrize("scheme", sorted(PARTITIONS))
@pytest.mark.parametrize("num_clients", [1, 3, 10, 25])
def test_partition_is_a_disjoint_cover_of_all_indices(scheme, num_clients):
    labels = make_labels()
    parts = PARTITIONS[scheme](labels, num_clients, 0)
    assert len(parts) == num_clients
    assert all(part.dtype == np.int64 and part.ndim == 1 for part in parts)
    everything = np.concatenate(parts)
    assert len(everything) == len(labels)
    np.testing.assert_array_equal(np.sort(everything), np.arange(len(labels)))


@pytest.mark.parametrize("scheme", sorted(PARTITIONS))
def test_partition_is_deterministic_for_a_seed_and_varies_with_it(scheme):
    labels = make_labels()
    first, again, other = (PARTITIONS[scheme](labels, 5, seed) for seed in (7, 7, 8))
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


@pytest.mark.parametrize("scheme", sorted(PARTITIONS))
def test_partition_leaves_the_global_rng_alone(scheme):
    state = np.random.get_state()[1].copy()
    PARTITIONS[scheme](make_labels(), 4, 0)
    np.testing.assert_array_equal(np.random.get_state()[1], state)


def test_homogeneous_parts_differ_in_size_by_at_most_one():
    sizes = [len(p) for p in partition_homogeneous(make_labels(per_class=101), 7, seed=0)]
    assert max(sizes) - min(sizes) <= 1


def test_dirichlet_at_small_alpha_is_far_more_heterogeneous_than_homogeneous():
    labels = make_labels()
    iid = class_shares(labels, partition_homogeneous(labels, 10, seed=0), NUM_CLASSES)
    skewed = class_shares(labels, partition_dirichlet(labels, 10, alpha=0.1, seed=0), NUM_CLASSES)
    # IID clients see all 10 classes (entropy near log 10 = 2.30); at alpha = 0.1 each sees a handful.
    assert mean_entropy(iid) > 2.2
    assert mean_entropy(skewed) < 0.6 * mean_entropy(iid)


def test_dirichlet_at_large_alpha_approaches_homogeneous():
    labels = make_labels()
    shares = class_shares(labels, partition_dirichlet(labels, 5, alpha=1000.0, seed=0), NUM_CLASSES)
    np.testing.assert_allclose(shares, 1 / NUM_CLASSES, atol=0.03)


@pytest.mark.parametrize("min_size", [0, 10, 50])
def test_dirichlet_respects_min_size(min_size):
    # With 20 clients at alpha = 0.3 the smallest client of a single draw holds about 30 examples, so min_size=50
    # forces redraws.
    labels = make_labels()
    parts = partition_dirichlet(labels, 20, alpha=0.3, min_size=min_size, seed=1)
    assert min(len(p) for p in parts) >= min_size


def test_dirichlet_gives_up_after_max_tries_naming_min_size_and_alpha():
    # At alpha = 0.01 each class of 10 lands whole on one client, so some client of 3 ends with 30 or fewer.
    labels = make_labels(per_class=10)
    with pytest.raises(RuntimeError, match=r"min_size=33.*max_tries=5.*alpha=0.01"):
        partition_dirichlet(labels, 3, alpha=0.01, min_size=33, seed=0, max_tries=5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_clients=0), "num_clients: expected an int >= 1, got 0"),
        (dict(num_clients=True), "num_clients: expected an int >= 1, got True"),
        (dict(num_clients=2.5), "num_clients: expected an int >= 1, got 2.5"),
        (dict(num_clients=2001), "num_clients: expected at most the number of examples, 2000, got 2001"),
        (dict(alpha=0.0), "alpha: expected .*, got 0.0"),
        (dict(alpha=-1), "alpha: expected .*, got -1"),
        (dict(alpha=float("nan")), "alpha: expected .*, got nan"),
        (dict(min_size=-1), "min_size: expected an int >= 0, got -1"),
        (dict(min_size=300), "min_size: expected at most .*num_clients=10.*got 300"),
        (dict(max_tries=0), "max_tries: expected an int >= 1, got 0"),
        (dict(labels=np.zeros((20, 2), dtype=int)), r"labels: expected a 1-D integer array, got shape \(20, 2\)"),
        (dict(labels=np.linspace(0, 1, 50)), "labels: expected a 1-D integer array, got .*float64"),
    ],
)
def test_dirichlet_rejects_bad_arguments_by_name(kwargs, match):
    args = dict(labels=make_labels(), num_clients=10, alpha=0.5, min_size=10, max_tries=10) | kwargs
    with pytest.raises(ValueError, match=match):
        partition_dirichlet(args.pop("labels"), args.pop("num_clients"), seed=0, **args)


@pytest.mark.parametrize("num_clients, match", [(0, "num_clients: expected an int >= 1, got 0"),
                                                (5, "num_clients: expected at most .*4, got 5")])
def test_homogeneous_rejects_bad_num_clients(num_clients, match):
    with pytest.raises(ValueError, match=match):
        partition_homogeneous([0, 1, 2, 3], num_clients, seed=0)


def test_class_counts_add_up_to_part_sizes_and_class_totals():
    labels = make_labels(per_class=50)
    parts = partition_dirichlet(labels, 6, alpha=0.5, seed=3)
    counts = class_counts(labels, parts, NUM_CLASSES)
    assert counts.shape == (6, NUM_CLASSES) and counts.dtype == np.int64
    np.testing.assert_array_equal(counts.sum(axis=1), [len(p) for p in parts])
    np.testing.assert_array_equal(counts.sum(axis=0), np.bincount(labels))


def test_class_shares_rows_sum_to_one_and_empty_clients_get_zeros():
    labels = np.array([0, 0, 1, 2])
    shares = class_shares(labels, [np.array([0, 1, 2]), np.array([3]), np.array([], dtype=int)], 3)
    np.testing.assert_allclose(shares, [[2 / 3, 1 / 3, 0], [0, 0, 1], [0, 0, 0]])


def test_class_counts_rejects_labels_outside_num_classes():
    with pytest.raises(ValueError, match=r"num_classes=2"):
        class_counts([0, 1, 2], [np.arange(3)], 2)


def test_class_counts_rejects_out_of_range_indices():
    with pytest.raises(ValueError, match=r"parts\[1\]"):
        class_counts([0, 1, 2], [np.array([0]), np.array([5])], 3)


def test_train_validation_split_holds_out_the_fraction_disjointly():
    indices = np.arange(100, 150)
    split = train_validation_split(indices, 0.2, seed=0)
    assert isinstance(split, TrainValidationSplit)
    assert len(split.validation) == 10 and len(split.train) == 40
    assert not set(split.train) & set(split.validation)
    np.testing.assert_array_equal(np.sort(np.concatenate([split.train, split.validation])), indices)
    again = train_validation_split(indices, 0.2, seed=0)
    np.testing.assert_array_equal(split.validation, again.validation)


@pytest.mark.parametrize(
    "indices, fraction, match",
    [
        (np.arange(10), 0.0, "fraction: expected .*, got 0.0"),
        (np.arange(10), 1.0, "fraction: expected .*, got 1.0"),
        (np.arange(1), 0.5, "indices: expected at least 2 entries.*got 1"),
        (np.zeros((2, 2), dtype=int), 0.5, r"indices: expected a 1-D integer array, got shape \(2, 2\)"),
    ],
)
def test_train_validation_split_rejects_bad_arguments_by_name(indices, fraction, match):
    with pytest.raises(ValueError, match=match):
        train_validation_split(indices, fraction, seed=0)
