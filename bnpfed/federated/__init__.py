"""The federated loop: partitions, configs, the clients' and the server's steps, the federations, the experiments.

This is the folder's one public face: import from ``bnpfed.federated``; the files behind it are private to it.

* splitting a dataset among clients: :func:`partition_homogeneous`, :func:`partition_dirichlet`,
  :func:`class_counts`, :func:`class_shares`, :func:`train_validation_split`;
* the settings, one small frozen dataclass per concern: :class:`PartitionConfig`, :class:`NetworkConfig`,
  :class:`TrainingConfig`, :class:`BayesianConfig`, :class:`PFNMConfig`, :class:`FusionConfig`, and
  :class:`ExperimentConfig` for the experiment harness;
* the steps, written once, that the in-process federations and the Flower apps both call: a client's
  (:func:`initial_network`, :func:`train_network`, :func:`fit_bayesian`, ...) and the server's (:func:`pfnm_step`,
  :func:`fuse_posteriors`, :func:`matched_fusion_step`, :func:`average_states`, ...); what a matching server
  remembers between rounds (:class:`MatchRounds`, :class:`PVIFactors`);
* the federations, round by round: :class:`PFNMFederation`, :class:`FusionFederation`, :class:`FedAvgFederation`,
  :class:`MatchedFusionFederation`;
* the experiment harness: :func:`run_experiment` runs the registered comparison methods
  (:func:`register_method`, :func:`available_methods`; a method's options in its spec, ``match:rule=gaa``:
  :func:`method_spec`) on one partition and returns a table;
* a federated method in one file (:mod:`bnpfed.federated.protocol`): a :class:`FederatedMethod` (a client step
  and a server step, on :class:`ClientTask` / :class:`ServerTask`, returning :class:`ClientUpdate` /
  :class:`ServerUpdate`) registered with :func:`register_federated_method` runs in process
  (:class:`MethodFederation`), in :func:`run_experiment`, on the commands' ``--methods`` and on Flower
  (``method = "<name>"``);
* a federated Gaussian mixture (:func:`fuse_mixtures`: the clients' components matched by the Beta-Bernoulli
  process, :func:`~bnpfed.matching.match_components`), and its experiment on held-out data
  (:func:`run_mixture_experiment`, ``bnpfed mixture``).
"""

from bnpfed.federated.partition import (TrainValidationSplit, class_counts, class_shares, partition_dirichlet,
                                        partition_homogeneous, train_validation_split)
from bnpfed.federated.config import (ARCHITECTURES, CLIENT_KINDS, CLIENT_WEIGHTS, CNN_LR, FIT, FUSION_TRAINING, HEADS,
                                     INITIALISATIONS, LAPLACE_PRIORS, LATER_ROUNDS, LIKELIHOODS, PAPER_MIN_VARIANCE,
                                     PARTITION_ALIASES, PARTITIONS, PFNM_NETWORK, PFNM_TRAINING, PRIOR_VARIANCES,
                                     PRIORS, PVI_DAMPING, ROUND_PRIORS, BayesianConfig, FusionConfig, LocalSchedule,
                                     NetworkConfig, PartitionConfig, PFNMConfig, TrainingConfig, config_dict,
                                     training_for)
from bnpfed.federated.clients import (batch_norm_moments_step, bayesian_client, build_network, check_program_task,
                                      fit_bayesian, initial_network, pool_nll_step, pooled_posterior_nll_step,
                                      posterior_client, posterior_nll_step, program_client, server_program_client,
                                      start_round_prior_, train_network, unit_activity_step)
from bnpfed.federated.server import (FusionStep, average_states, batch_norm_steps, client_weights,
                                     clients_per_round, floor_variances, fuse_posteriors, matched_fusion_step,
                                     mean_sigma, pfnm_step, sample_clients, with_statistics)
from bnpfed.federated.rounds import Architecture, HoldsRounds, MatchRounds, PVIFactors
from bnpfed.federated.fusion import (FUSION_ARCHITECTURES, FedAvgFederation, FusionFederation, check_fusion_network,
                                    check_program_fusion)
from bnpfed.federated.matched_fusion import (MatchedFusionFederation, bayesian_from_match, client_from_slice,
                                             pvi_factors, pvi_prior_variance, tempered)
from bnpfed.federated.pfnm import PFNMFederation
from bnpfed.federated.results import ExperimentResult, MethodResult, Selection
from bnpfed.federated.methods import (ALIGNMENT_METHODS, ExperimentConfig, MethodOption, MethodSpec, available_methods,
                                      check_methods, method_options, method_spec, network_widths, register_method,
                                      run_experiment, unregister_method, width_sweep)
from bnpfed.federated.protocol import (ClientTask, ClientUpdate, FederatedMethod, ServerTask, ServerUpdate,
                                       check_tensors, client_metrics, client_step, initial_global_state, server_step)
from bnpfed.federated.mixture import (FederatedMixture, MixtureConfig, MixtureRow, fuse_mixtures,
                                      run_mixture_experiment)
from bnpfed.federated.generic import (MethodFederation, available_federated_methods, federated_method,
                                      register_federated_method, unregister_federated_method)

__all__ = [
    # partitions
    "TrainValidationSplit", "class_counts", "class_shares", "partition_dirichlet", "partition_homogeneous",
    "train_validation_split",
    # settings
    "PartitionConfig", "NetworkConfig", "TrainingConfig", "LocalSchedule", "BayesianConfig", "PFNMConfig",
    "FusionConfig", "ExperimentConfig", "config_dict", "FUSION_TRAINING", "PFNM_NETWORK", "PFNM_TRAINING",
    "CNN_LR", "training_for",
    "ARCHITECTURES", "CLIENT_KINDS", "CLIENT_WEIGHTS", "FIT", "HEADS", "INITIALISATIONS", "LAPLACE_PRIORS",
    "LATER_ROUNDS", "PAPER_MIN_VARIANCE", "PARTITIONS", "PARTITION_ALIASES", "PRIORS", "PRIOR_VARIANCES", "LIKELIHOODS",
    "PVI_DAMPING", "ROUND_PRIORS",
    # the clients' steps
    "build_network", "initial_network", "train_network", "bayesian_client", "fit_bayesian", "posterior_client",
    "program_client", "server_program_client", "check_program_task",
    "start_round_prior_", "batch_norm_moments_step", "unit_activity_step", "pool_nll_step",
    "pooled_posterior_nll_step", "posterior_nll_step",
    # the server's steps and round state
    "FusionStep", "clients_per_round", "sample_clients", "client_weights", "fuse_posteriors", "floor_variances",
    "matched_fusion_step", "average_states", "pfnm_step", "batch_norm_steps", "with_statistics", "mean_sigma",
    "Architecture", "HoldsRounds", "MatchRounds", "PVIFactors", "bayesian_from_match", "client_from_slice",
    "pvi_factors", "pvi_prior_variance", "tempered",
    # federations
    "FUSION_ARCHITECTURES", "check_fusion_network", "check_program_fusion", "FedAvgFederation", "FusionFederation",
    "MatchedFusionFederation", "PFNMFederation",
    # experiments
    "available_methods", "check_methods", "method_options", "method_spec", "MethodOption", "MethodSpec",
    "register_method", "unregister_method", "run_experiment", "width_sweep", "network_widths", "ALIGNMENT_METHODS",
    "ExperimentResult", "MethodResult", "Selection",
    # a federated method in one file
    "FederatedMethod", "ClientTask", "ClientUpdate", "ServerTask", "ServerUpdate", "register_federated_method",
    "unregister_federated_method", "available_federated_methods", "federated_method", "MethodFederation",
    "client_step", "server_step", "initial_global_state", "check_tensors", "client_metrics",
    # the federated Gaussian mixture
    "FederatedMixture", "MixtureConfig", "MixtureRow", "fuse_mixtures", "run_mixture_experiment",
]
