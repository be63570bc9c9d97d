"""Moved to :mod:`bnpfed.matching.network` (bnpfed 0.2); this path goes in 0.3."""

from bnpfed._moved import moved

moved(__name__, "bnpfed.matching.network")
