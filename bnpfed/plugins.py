"""Plugins: a user's modules whose imports register fusion rules, priors, likelihoods, federated methods or
experiment methods, so that every ``bnpfed`` command and the Flower apps see them with no file of bnpfed changed.

A plugin is a plain module. Importing it is what registers: ``register_rule(...)`` (:mod:`bnpfed.combine`),
``register_prior(...)`` and ``register_likelihood(...)`` (:mod:`bnpfed.models`), ``register_federated_method(...)``
and ``register_method(...)`` (:mod:`bnpfed.federated`) at its top level. :func:`load_plugins` imports the named
modules and every entry point of the group ``bnpfed.plugins`` (:data:`ENTRY_POINT_GROUP`) of the installed
distributions:

* on the command line, ``bnpfed <command> --plugin MODULE`` (repeatable) loads them before the command's flags are
  read, so that ``--rule``, ``--methods``, ``--prior`` and ``--likelihood`` accept what they register;
* on Flower, the run config key ``plugins = "MODULE,MODULE"``: the ServerApp loads them before it reads the rest of
  the run config, and every ClientApp message (each a fresh process on a SuperNode) before its settings; a node that
  cannot import one answers with an error naming it;
* an installed package declares ``[project.entry-points."bnpfed.plugins"] name = "package.module"`` in its
  ``pyproject.toml`` and is loaded everywhere, with no flag (an entry point may also name a function,
  ``"package.module:register"``, which is called once with no arguments).

This module imports nothing of bnpfed and nothing heavy: the Flower ClientApp loads it for every message.

Usage::

    >>> load_plugins(["json"])                 # any importable module; what it registers is then visible
    ['json']
    >>> load_plugins(["bnpfed_no_such_plugin"])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    bnpfed.plugins.PluginError: plugin 'bnpfed_no_such_plugin': cannot import it (ModuleNotFoundError: ...
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from typing import Iterable

__all__ = ["ENTRY_POINT_GROUP", "PluginError", "load_entry_points", "load_plugins", "plugin_names"]

#: The entry-point group whose entries :func:`load_plugins` loads in every process.
ENTRY_POINT_GROUP = "bnpfed.plugins"


class PluginError(ImportError):
    """A plugin that cannot be loaded; the message names it and says why."""


def plugin_names(value) -> list[str]:
    """Module names from a comma-separated string, a sequence of them, or None (none), each stripped; empty
    items are dropped, repeats kept once in their first place.

    >>> plugin_names(" my_rules, pkg.priors ,my_rules")
    ['my_rules', 'pkg.priors']
    """
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    out = []
    for item in items:
        if not isinstance(item, str):
            raise PluginError(f"plugins: expected module names (strings), got {item!r}")
        name = item.strip()
        if name and name not in out:
            out.append(name)
    return out


def _import(name: str) -> None:
    if not all(part.isidentifier() for part in name.split(".")):
        raise PluginError(f"plugin {name!r}: expected a module name (dotted identifiers, e.g. my_package.rules), "
                          f"not a path")
    try:
        importlib.import_module(name)
    except Exception as error:   # whatever the module raises while it registers is the plugin's failure
        hint = ""
        missing = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
        if missing is not None and (name == missing or name.startswith(missing + ".")):
            hint = " (install it, or put its folder on PYTHONPATH on every machine that runs bnpfed)"
        raise PluginError(f"plugin {name!r}: cannot import it ({type(error).__name__}: {error}){hint}") from error


@functools.cache
def load_entry_points() -> tuple[str, ...]:
    """Load every entry point of the group :data:`ENTRY_POINT_GROUP` once per process (a module is imported; a
    function is called with no arguments). Returns their names.

    :raises PluginError: naming the entry point that fails.
    """
    loaded = []
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            value = entry.load()
            if callable(value):   # a module is not callable: importing it was the registration
                value()
        except Exception as error:
            load_entry_points.cache_clear()   # a failed load is tried again next time, and fails again, loudly
            raise PluginError(f"entry point {entry.name!r} ({entry.value}) of group {ENTRY_POINT_GROUP!r}: cannot "
                              f"load it ({type(error).__name__}: {error})") from error
        loaded.append(entry.name)
    return tuple(loaded)


def load_plugins(modules: Iterable[str] | str | None = (), *, entry_points: bool = True) -> list[str]:
    """Import every module of ``modules`` (in order; a module imported already is not imported again) and, with
    ``entry_points``, every entry point of :data:`ENTRY_POINT_GROUP` (once per process). What they register is
    visible from then on.

    :param modules: module names: a sequence, or a comma-separated string (a run config's ``plugins``).
    :param bool entry_points: also load the installed distributions' entry points. Default True.
    :returns: the module names given, in order.
    :raises PluginError: naming the module (or entry point) and the error that stopped its import.
    """
    names = plugin_names(modules)
    if entry_points:
        load_entry_points()
    for name in names:
        _import(name)
    return names
