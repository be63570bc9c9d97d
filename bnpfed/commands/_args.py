"""argparse types shared by the subcommands: each parses one option and says what it expected when it cannot."""

from __future__ import annotations

import argparse

from bnpfed.data import DATASET_NAMES, NPZ_PREFIX


def dataset_name(value: str) -> str:
    """``--dataset``: a known name or ``npz:PATH`` (which no ``choices`` list can hold)."""
    if value.startswith(NPZ_PREFIX):
        if not value[len(NPZ_PREFIX):]:
            raise argparse.ArgumentTypeError(f"{value!r} has no path; expected {NPZ_PREFIX}PATH naming an .npz file")
        return value
    if value.lower().replace("_", "-") in DATASET_NAMES:
        return value.lower().replace("_", "-")
    raise argparse.ArgumentTypeError(f"unknown dataset {value!r}; expected one of {', '.join(DATASET_NAMES)} or "
                                     f"{NPZ_PREFIX}PATH")


def positive_ints(value: str) -> tuple[int, ...]:
    """Comma-separated positive ints, e.g. ``--hidden 200,100`` or ``--clients 5,10,20``."""
    try:
        values = tuple(int(v) for v in value.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: expected comma-separated positive ints, e.g. 100 or 200,100")
    return values


def floats(value: str) -> tuple[float, ...]:
    """Comma-separated numbers, e.g. a grid ``0.1,0.3,1``."""
    try:
        values = tuple(float(v) for v in value.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values:
        raise argparse.ArgumentTypeError(f"{value!r}: expected comma-separated numbers, e.g. 0.1,0.3,1")
    return values


def fraction(value: str) -> float:
    """A number in (0, 1]."""
    try:
        f = float(value)
    except ValueError:
        f = float("nan")
    if not 0 < f <= 1:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a number in (0, 1]")
    return f


def positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a positive int")
    return n


def positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        x = float("nan")
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r}: expected a positive number")
    return x
