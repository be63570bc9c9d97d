"""The federated floor: partitions, configs, the clients' and the server's steps, the federations, the experiments.

* :mod:`~bnpfed.federated.partition`: splitting a dataset among clients (IID, label-Dirichlet);
* :mod:`~bnpfed.federated.config`: one small frozen dataclass per concern (partition, network, local training,
  Bayesian clients, PFNM server, fusion server);
* :mod:`~bnpfed.federated.clients` and :mod:`~bnpfed.federated.server`: the steps, written once, that the in-process
  federations and the Flower apps both call;
* :mod:`~bnpfed.federated.pfnm`, :mod:`~bnpfed.federated.fusion`: PFNM, posterior fusion and FedAvg round by round;
* :mod:`~bnpfed.federated.rounds`: what a matching server remembers between rounds (in process and on Flower);
* :mod:`~bnpfed.federated.registry`: the comparison methods' names (a registry of runners);
* :mod:`~bnpfed.federated.experiment`: the experiment harness (:class:`~bnpfed.federated.experiment.ExperimentConfig`,
  :class:`~bnpfed.federated.experiment.Experiment`);
* :mod:`~bnpfed.federated.methods`: the built-in methods' runners, :func:`run_experiment`.
"""

from bnpfed.federated.partition import (
    TrainValidationSplit,
    class_counts,
    class_shares,
    partition_dirichlet,
    partition_homogeneous,
    train_validation_split,
)
from bnpfed.federated.config import (
    FUSION_TRAINING,
    PFNM_NETWORK,
    PFNM_TRAINING,
    BayesianConfig,
    FusionConfig,
    NetworkConfig,
    PartitionConfig,
    PFNMConfig,
    TrainingConfig,
)
from bnpfed.federated.fusion import FedAvgFederation, FusionFederation
from bnpfed.federated.pfnm import PFNMFederation
from bnpfed.federated.methods import ExperimentConfig, available_methods, register_method, run_experiment

__all__ = [
    "TrainValidationSplit",
    "class_counts",
    "class_shares",
    "partition_dirichlet",
    "partition_homogeneous",
    "train_validation_split",
    "FUSION_TRAINING",
    "PFNM_NETWORK",
    "PFNM_TRAINING",
    "BayesianConfig",
    "ExperimentConfig",
    "FusionConfig",
    "NetworkConfig",
    "PartitionConfig",
    "PFNMConfig",
    "TrainingConfig",
    "FedAvgFederation",
    "FusionFederation",
    "PFNMFederation",
    "available_methods",
    "register_method",
    "run_experiment",
]
