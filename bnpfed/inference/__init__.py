"""Inference: Hungarian MAP matching of neurons (PFNM), and SVI for Bayesian clients."""

from bnpfed.inference.matching import REFERENCE_CONSTANTS, MatchResult, assignment_objective, match_layer

from bnpfed.inference.guides import MeanFieldGuide
from bnpfed.inference.elbo import MeanFieldELBO
from bnpfed.inference.svi import BayesianClient, DeterministicClient, TrainingDiverged

__all__ = [
    "REFERENCE_CONSTANTS",
    "MatchResult",
    "assignment_objective",
    "match_layer",
    "MeanFieldGuide",
    "MeanFieldELBO",
    "BayesianClient",
    "DeterministicClient",
    "TrainingDiverged",
]
