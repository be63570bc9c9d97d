"""Inference: Hungarian MAP matching of neurons (PFNM), and SVI for Bayesian clients."""

from bnpfed.inference.matching import REFERENCE_CONSTANTS, MatchResult, assignment_objective, match_layer

from bnpfed.inference.guides import MeanFieldGuide
from bnpfed.inference.svi import BayesianClient, DeterministicClient

__all__ = [
    "REFERENCE_CONSTANTS",
    "MatchResult",
    "assignment_objective",
    "match_layer",
    "MeanFieldGuide",
    "BayesianClient",
    "DeterministicClient",
]
