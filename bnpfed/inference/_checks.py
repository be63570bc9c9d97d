"""Boundary checks for client payloads: name sets, shapes, finite values. Messages name the argument and entry."""

from __future__ import annotations

from typing import Mapping

import torch

__all__ = ["check_names", "check_tensor"]


def check_names(given, expected: Mapping[str, torch.Size], argument: str, kind: str) -> None:
    """``given`` must be a mapping with exactly the keys of ``expected``."""
    if not isinstance(given, Mapping):
        raise ValueError(f"{argument}: expected a dict {kind} name -> value, got {type(given).__name__}")
    missing = [name for name in expected if name not in given]
    if missing:
        raise ValueError(f"{argument}: missing {kind}(s) {missing}; expected exactly {list(expected)}")
    extra = [name for name in given if name not in expected]
    if extra:
        raise ValueError(f"{argument}: unknown {kind}(s) {extra}; expected exactly {list(expected)}")


def check_tensor(value, shape: torch.Size, label: str) -> None:
    """``value`` must be a finite floating-point tensor of ``shape``; ``label`` names it in the message."""
    if not torch.is_tensor(value):
        raise ValueError(f"{label}: expected a tensor of shape {tuple(shape)}, got {type(value).__name__}")
    if value.shape != shape:
        raise ValueError(f"{label}: expected shape {tuple(shape)}, got {tuple(value.shape)}")
    if not value.is_floating_point():
        raise ValueError(f"{label}: expected a floating-point tensor, got dtype {value.dtype}")
    if not torch.isfinite(value).all():
        raise ValueError(f"{label}: contains NaN or infinite values")
