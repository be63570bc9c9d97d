"""Inference: Hungarian MAP matching of neurons (PFNM), permutation specs (matching any feed-forward network), and
SVI for Bayesian clients."""

from bnpfed.inference.matching import REFERENCE_CONSTANTS, MatchResult, assignment_objective, match_layer
from bnpfed.inference.bayesian_matching import bayesian_assignment_objective, match_bayesian_layer
from bnpfed.inference.permutation import (
    BatchNormMoments,
    GroupMatch,
    PermutationSpec,
    SpecMatch,
    align_to_group,
    batch_norm_moments,
    client_slice,
    derive_spec,
    match_by_spec,
    match_group,
    network_from_state,
    reestimate_batch_norm,
    set_batch_norm_statistics,
    unit_vectors,
    verify_spec,
)

from bnpfed.inference.guides import MeanFieldGuide
from bnpfed.inference.elbo import MeanFieldELBO
from bnpfed.inference.svi import BayesianClient, DeterministicClient, TrainingDiverged

__all__ = [
    "REFERENCE_CONSTANTS",
    "MatchResult",
    "assignment_objective",
    "match_layer",
    "match_bayesian_layer",
    "bayesian_assignment_objective",
    "BatchNormMoments",
    "GroupMatch",
    "PermutationSpec",
    "SpecMatch",
    "align_to_group",
    "batch_norm_moments",
    "client_slice",
    "derive_spec",
    "match_by_spec",
    "match_group",
    "network_from_state",
    "reestimate_batch_norm",
    "set_batch_norm_statistics",
    "unit_vectors",
    "verify_spec",
    "MeanFieldGuide",
    "MeanFieldELBO",
    "BayesianClient",
    "DeterministicClient",
    "TrainingDiverged",
]
