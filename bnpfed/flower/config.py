"""Settings across the wire: a frozen settings dataclass (``PFNMSettings``, ``FusionConfig``) to and from a flat
mapping of Flower values.

Flower carries configuration in two flat forms: a run config (``[tool.flwr.app.config]`` in the app's
``pyproject.toml`` plus ``flwr run --run-config 'k=v'``: ints, floats, strings, bools) and the ``ConfigRecord``
a server puts into every message (the same scalars and homogeneous lists of them, no ``None``). A dataclass field
``sigma0_2`` is the key ``sigma0-2``; a tuple field is a list in a ``ConfigRecord`` and a comma-separated string
(``hidden = "100,100"``) in a run config. Values are coerced to the type of the field's default, and a value that
does not convert raises ``ValueError`` naming the key.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

__all__ = ["config_key", "dataclass_from_config", "config_from_dataclass", "known_keys"]


def config_key(field_name: str) -> str:
    """The Flower key of a dataclass field: ``sigma0_2`` -> ``sigma0-2``."""
    return field_name.replace("_", "-")


def known_keys(cls) -> set[str]:
    """The Flower keys of every field of the dataclass ``cls``."""
    return {config_key(f.name) for f in dataclasses.fields(cls)}


def _coerce(value: Any, default: Any, key: str) -> Any:
    """``value`` as the type of ``default``; tuples from lists or comma-separated strings."""
    try:
        if isinstance(default, bool):
            if isinstance(value, str):
                if value.strip().lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                return value.strip().lower() in ("true", "1")
            if isinstance(value, (bool, int)):
                return bool(value)
            raise ValueError(value)
        if isinstance(default, tuple):
            items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else list(value)
            kind = type(default[0]) if default else str
            return tuple(_coerce(v, kind(), key) for v in items)
        if isinstance(default, int):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if isinstance(default, float):
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ValueError(f"config key {key!r}: expected a value like {default!r} ({type(default).__name__}), got "
                         f"{value!r}") from None


def dataclass_from_config(cls, config: Mapping[str, Any], **overrides: Any):
    """Build the settings dataclass ``cls`` from the keys of ``config`` it knows (others are ignored); fields
    absent from ``config`` keep their defaults, and ``overrides`` (by field name) win over both.

    Usage::

        settings = dataclass_from_config(PFNMSettings, {"hidden": "32", "sigma2": 0.3}, clients=3)

    :raises ValueError: naming the key whose value does not convert (the dataclass's own checks follow).
    """
    values = {}
    for f in dataclasses.fields(cls):
        key = config_key(f.name)
        if key in config:
            values[f.name] = _coerce(config[key], f.default, key)
    values.update(overrides)
    return cls(**values)


def config_from_dataclass(settings) -> dict[str, Any]:
    """Every field of ``settings`` under its Flower key, tuples as lists: ready for a ``ConfigRecord``."""
    out = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        out[config_key(f.name)] = list(value) if isinstance(value, tuple) else value
    return out
