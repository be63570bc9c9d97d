"""Argument checks, in one place: every public entry point, config and payload boundary validates with these, so
every message has one shape, ``"<name>: expected <what>, got <value>"``.

Usage::

    >>> check_int(3, "rounds", low=1)
    3
    >>> check_positive(0.0, "sigma2")
    Traceback (most recent call last):
    ...
    ValueError: sigma2: expected a positive finite number, got 0.0
    >>> check_choice("hetero", ("iid", "dirichlet"), "partition", aliases={"hetero": "dirichlet"})
    'dirichlet'
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Optional, Sequence

import torch

__all__ = [
    "check_device",
    "check_bool",
    "check_choice",
    "check_float",
    "check_fraction",
    "check_int",
    "check_ints",
    "check_names",
    "check_positive",
    "check_positives",
    "check_tensor",
]


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(value: Any, name: str, *, low: Optional[int] = None, high: Optional[int] = None) -> int:
    """``value`` as an int in ``[low, high]`` (either bound optional); bools and non-integral floats are refused."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if ok:
        value = int(value)
        ok = (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        bounds = (f" >= {low}" if low is not None else "") + (f" and <= {high}" if high is not None else "")
        raise ValueError(f"{name}: expected an int{bounds}, got {value!r}")
    return value


def check_float(value: Any, name: str, *, low: Optional[float] = None, high: Optional[float] = None,
                low_open: bool = False, high_open: bool = False, what: Optional[str] = None) -> float:
    """``value`` as a finite float within the given bounds (``low_open`` / ``high_open`` exclude them)."""
    ok = _is_real(value) and math.isfinite(float(value))
    if ok:
        x = float(value)
        ok = (low is None or (x > low if low_open else x >= low)) and (
            high is None or (x < high if high_open else x <= high))
    if not ok:
        if what is None:
            parts = []
            if low is not None:
                parts.append(f"{'>' if low_open else '>='} {low}")
            if high is not None:
                parts.append(f"{'<' if high_open else '<='} {high}")
            what = "a finite number" + (" " + " and ".join(parts) if parts else "")
        raise ValueError(f"{name}: expected {what}, got {value!r}")
    return float(value)


def check_positive(value: Any, name: str) -> float:
    """A finite number > 0."""
    return check_float(value, name, low=0.0, low_open=True, what="a positive finite number")


def check_fraction(value: Any, name: str, *, allow_zero: bool = False, allow_one: bool = True) -> float:
    """A number in (0, 1] by default; ``allow_zero`` / ``allow_one`` close or open the ends."""
    what = f"a number in {'[' if allow_zero else '('}0, 1{']' if allow_one else ')'}"
    return check_float(value, name, low=0.0, high=1.0, low_open=not allow_zero, high_open=not allow_one, what=what)


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {value!r}")
    return value


def check_choice(value: Any, choices: Sequence[str], name: str, *, aliases: Optional[Mapping[str, str]] = None
                 ) -> str:
    """``value`` if it is one of ``choices``, or the choice an alias stands for."""
    aliases = dict(aliases or {})
    if isinstance(value, str) and value in aliases:
        return aliases[value]
    if not isinstance(value, str) or value not in choices:
        also = f" (or the aliases {sorted(aliases)})" if aliases else ""
        raise ValueError(f"{name}: expected one of {list(choices)}{also}, got {value!r}")
    return value


def _as_sequence(values: Any, name: str, what: str) -> list:
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
        raise ValueError(f"{name}: expected a sequence of {what}, got {values!r}")
    return list(values)


def check_ints(values: Any, name: str, *, low: int = 1, nonempty: bool = True) -> tuple[int, ...]:
    """A sequence of ints >= ``low`` (e.g. hidden widths) as a tuple."""
    items = _as_sequence(values, name, f"ints >= {low}")
    if nonempty and not items:
        raise ValueError(f"{name}: expected at least one int >= {low}, got {values!r}")
    return tuple(check_int(v, f"{name}[{i}]", low=low) for i, v in enumerate(items))


def check_positives(values: Any, name: str, *, nonempty: bool = True) -> tuple[float, ...]:
    """A sequence of positive finite numbers (e.g. a grid of variances) as a tuple."""
    items = _as_sequence(values, name, "positive numbers")
    if nonempty and not items:
        raise ValueError(f"{name}: expected at least one positive number, got {values!r}")
    return tuple(check_positive(v, f"{name}[{i}]") for i, v in enumerate(items))


def check_names(given: Any, expected: Mapping[str, torch.Size], argument: str, kind: str) -> None:
    """``given`` must be a mapping with exactly the keys of ``expected``."""
    if not isinstance(given, Mapping):
        raise ValueError(f"{argument}: expected a dict {kind} name -> value, got {type(given).__name__}")
    missing = [name for name in expected if name not in given]
    if missing:
        raise ValueError(f"{argument}: missing {kind}(s) {missing}; expected exactly {list(expected)}")
    extra = [name for name in given if name not in expected]
    if extra:
        raise ValueError(f"{argument}: unknown {kind}(s) {extra}; expected exactly {list(expected)}")


def check_tensor(value: Any, shape: torch.Size, label: str) -> None:
    """``value`` must be a finite floating-point tensor of ``shape``; ``label`` names it in the message."""
    if not torch.is_tensor(value):
        raise ValueError(f"{label}: expected a tensor of shape {tuple(shape)}, got {type(value).__name__}")
    if value.shape != shape:
        raise ValueError(f"{label}: expected shape {tuple(shape)}, got {tuple(value.shape)}")
    if not value.is_floating_point():
        raise ValueError(f"{label}: expected a floating-point tensor, got dtype {value.dtype}")
    if not torch.isfinite(value).all():
        raise ValueError(f"{label}: expected finite values, got {int((~torch.isfinite(value)).sum())} NaN or "
                         "infinite value(s)")


def check_device(value: Any, name: str) -> str:
    """``value`` if it names the CPU (``"cpu"``) or a CUDA device torch sees (``"cuda"``, ``"cuda:N"``)."""
    if not isinstance(value, str):
        raise ValueError(f"{name}: expected 'cpu' or 'cuda[:N]', got {value!r}")
    try:
        device = torch.device(value)
    except RuntimeError:
        raise ValueError(f"{name}: expected 'cpu' or 'cuda[:N]', got {value!r}") from None
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index not in (None, 0)):
        raise ValueError(f"{name}: expected 'cpu' or 'cuda[:N]', got {value!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}: expected 'cpu' or a CUDA device torch sees, got {value!r} (torch sees no "
                             "CUDA device here: torch.cuda.is_available() is False)")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"{name}: expected a CUDA device index below {count} (the devices torch sees), got "
                             f"{value!r}")
    return value
