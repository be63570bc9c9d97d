"""Matching: PFNM's Hungarian MAP assignment of neurons under the Beta-Bernoulli process, for one layer and for any
network with a permutation spec, and the matched fusion of Bayesian clients built on it.

This is the folder's one public face: import from ``bnpfed.matching``; the files behind it are private to it.

* one layer: :func:`match_layer` (point-estimate neurons, Yurochkin et al. 2019, section 3.2) and
  :func:`match_bayesian_layer` (neurons with posterior variances), both returning a :class:`MatchResult`; their
  hyper-parameters fixed or by empirical Bayes;
* a whole network: a :class:`PermutationSpec` lists its hidden-unit symmetries (derived from the module tree by
  :func:`derive_spec`, or written by hand), and :func:`match_by_spec` matches J clients' networks group by group
  into one global network (:class:`SpecMatch`); :func:`match_group` and :func:`align_to_group` are FedMA's one group
  at a time; a size asked for (``max_width``, ``max_params``) is met through the IBP mass (:class:`SizeSearch`);
  a layer this machine cannot hold is refused before anything is allocated (:func:`check_matching_memory`,
  :func:`matching_bytes`);
* what clients report: the units they hold inactive (:func:`unit_activity`), batch-norm moments
  (:func:`batch_norm_moments`), their class shares (:func:`estimate_class_shares`);
* the global output layer under label skew: the clients' own heads pooled (:class:`PooledHeads`,
  :func:`pooled_network`, :class:`PooledPosterior`);
* matched posterior fusion: :func:`match_posteriors` matches Bayesian clients' units and fuses each global unit's
  members with a rule of :mod:`bnpfed.combine` (:class:`PosteriorMatch`);
* the demo's question, does matching recover a layer drawn from its own model: :func:`match_recovery`;
* the exchangeable components of any locally fitted models (mixture components, topics): :func:`match_components`
  (SPAHM), the same matcher.

The matcher reads the model: :func:`match_layer` takes :func:`~bnpfed.models.beta_bernoulli_layer`'s ``atom_prior``,
``noise`` and ``concentration``; Gaussian models take the closed forms, others the general path
(:mod:`bnpfed.matching.model_matcher`).
"""

from bnpfed.matching.layer import REFERENCE_CONSTANTS, MatchResult, assignment_objective, average_atoms, \
    averaging_weights, match_layer
from bnpfed.matching.bayesian_layer import bayesian_assignment_objective, match_bayesian_layer
from bnpfed.matching.layer_inputs import CompactRows
from bnpfed.matching.driver import SCHEDULES, STARTS, STOPS
from bnpfed.matching.permutation import (BN_FIXED_PRIOR_MEANS, KINDS, Axis, BatchNormMoments, Group, GroupMatch,
                                         PermutationSpec, SpecMatch, UnitVectors, VectorLayout, align_to_group,
                                         batch_norm_moments, batch_norm_statistics, client_slice, derive_spec,
                                         match_by_spec, match_group, network_from_atoms, network_from_state,
                                         reestimate_batch_norm, resolve_spec, set_batch_norm_statistics,
                                         state_from_atoms, unit_vectors, verify_spec)
from bnpfed.matching.spec import STATISTICS
from bnpfed.matching.layout import width
from bnpfed.matching.batch_norm import batch_norm_order
from bnpfed.matching.activity import drop_units, inactive_units, kept_per_client, kept_units, unit_activity
from bnpfed.matching.size import SizeLimitError, SizeSearch, minimum_widths, parameter_count, proportional_widths
from bnpfed.matching.class_shares import estimate_class_shares
from bnpfed.matching.pooled_heads import (HEAD_CHOICES, SHARES_DIFFER_LEVEL, chosen_heads, homogeneity_p_value,
                                          shares_differ, TEMPERATURES, PooledHeads, PooledPosterior, attach_heads,
                                          client_heads, fit_temperature, pool_log_probabilities, pool_nll,
                                          pooled_heads_layer, pooled_heads_of, pooled_network, set_temperature)
from bnpfed.matching.posteriors import (ATOM_POSTERIOR, MATCH_ON, MIN_VARIANCE, PVI, PosteriorMatch, cavity,
                                        check_prior_variance, client_posterior, fuse_members, match_posteriors,
                                        matched_rules, prior_precision, pvi_factor)
from bnpfed.matching.recovery import RecoveryConfig, RecoveryRow, match_recovery
from bnpfed.matching.network import architecture_difference
from bnpfed.matching.memory import (MemoryLimitError, available_memory, check_matching_memory, check_network_matching,
                                    matching_bytes)
from bnpfed.matching.components import match_components

__all__ = [
    # one layer
    "REFERENCE_CONSTANTS", "MatchResult", "CompactRows", "match_layer", "assignment_objective", "average_atoms",
    "averaging_weights", "match_bayesian_layer", "bayesian_assignment_objective", "SCHEDULES", "STARTS", "STOPS",
    # permutation specs and the network driver
    "Axis", "Group", "KINDS", "STATISTICS", "BN_FIXED_PRIOR_MEANS", "PermutationSpec", "derive_spec", "resolve_spec",
    "verify_spec", "VectorLayout", "UnitVectors", "unit_vectors", "width", "state_from_atoms", "network_from_state",
    "network_from_atoms", "client_slice", "SpecMatch", "match_by_spec", "GroupMatch", "match_group",
    "align_to_group", "architecture_difference",
    # batch norms, inactive units, sizes, class shares
    "BatchNormMoments", "batch_norm_moments", "batch_norm_order", "batch_norm_statistics",
    "set_batch_norm_statistics", "reestimate_batch_norm", "drop_units", "inactive_units", "kept_per_client",
    "kept_units", "unit_activity", "SizeLimitError", "SizeSearch", "minimum_widths", "parameter_count",
    "proportional_widths", "estimate_class_shares", "MemoryLimitError", "available_memory", "check_matching_memory",
    "check_network_matching", "matching_bytes",
    # pooled heads
    "HEAD_CHOICES", "SHARES_DIFFER_LEVEL", "chosen_heads", "homogeneity_p_value", "shares_differ",
    "TEMPERATURES", "PooledHeads", "PooledPosterior", "attach_heads", "client_heads", "fit_temperature",
    "pool_log_probabilities", "pool_nll", "pooled_heads_layer", "pooled_heads_of", "pooled_network",
    "set_temperature",
    # matched posterior fusion
    "ATOM_POSTERIOR", "MATCH_ON", "MIN_VARIANCE", "PVI", "PosteriorMatch", "cavity", "check_prior_variance",
    "client_posterior", "fuse_members", "match_posteriors", "matched_rules", "prior_precision", "pvi_factor",
    # the demo
    "RecoveryConfig", "RecoveryRow", "match_recovery",
    # the components of any model
    "match_components",
]
