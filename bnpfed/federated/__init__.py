"""The federated loop: client partitions, clients, server rounds, baselines."""

from bnpfed.federated.partition import (
    TrainValidationSplit,
    class_counts,
    class_shares,
    partition_dirichlet,
    partition_homogeneous,
    train_validation_split,
)

__all__ = [
    "TrainValidationSplit",
    "class_counts",
    "class_shares",
    "partition_dirichlet",
    "partition_homogeneous",
    "train_validation_split",
]
