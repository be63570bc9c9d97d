"""Inference: Hungarian MAP matching of neurons (PFNM)."""

from bnpfed.inference.matching import REFERENCE_CONSTANTS, MatchResult, assignment_objective, match_layer

__all__ = ["REFERENCE_CONSTANTS", "MatchResult", "assignment_objective", "match_layer"]
