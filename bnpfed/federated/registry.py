"""The names of an experiment's comparison methods: a registry of runners, like the fusion rules of
:mod:`bnpfed.combine`. :mod:`bnpfed.federated.methods` registers the built-in runners and runs them; this module
holds only the names, so that :class:`~bnpfed.federated.experiment.ExperimentConfig` can check a method's name
without importing the runners.

A runner takes an :class:`~bnpfed.federated.experiment.Experiment` and returns one or more
:class:`~bnpfed.federated.results.MethodResult` rows. Besides the registered runners every fusion rule of
:mod:`bnpfed.combine` is a method (weight-wise posterior fusion with that rule), and every rule of matched fusion is
one as ``match-<rule>`` (and ``match-<rule>-pooled``).

Usage::

    >>> "pfnm" in available_methods() and "match-conflation" in available_methods()
    True
"""

from __future__ import annotations

from typing import Callable, Optional

from bnpfed.combine import available_rules
from bnpfed.federated.results import MethodResult
from bnpfed.matching import matched_rules

__all__ = ["MATCH_PREFIX", "POOLED_SUFFIX", "Runner", "available_methods", "register_method", "registered_runner",
           "unregister_method"]

#: ``runner(experiment) -> MethodResult | list[MethodResult]``, the experiment an
#: :class:`~bnpfed.federated.experiment.Experiment` (which imports this module, so it is not named here).
Runner = Callable[..., "MethodResult | list[MethodResult]"]

_METHODS: dict[str, Runner] = {}


def register_method(name: str, runner: Runner, *, overwrite: bool = False) -> Runner:
    """Make ``runner`` available as the method ``name`` (in :class:`~bnpfed.federated.experiment.ExperimentConfig`'s
    ``methods`` and the commands' ``--methods``)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    if not callable(runner):
        raise ValueError(f"runner: expected a callable runner(experiment), got {type(runner).__name__}")
    if (name in _METHODS or name in available_rules()) and not overwrite:
        raise ValueError(f"name: expected a method name not registered yet, got {name!r}, which is (as a method "
                         "or a fusion rule); pass overwrite=True to replace it")
    _METHODS[name] = runner
    return runner


def unregister_method(name: str) -> Runner:
    """Remove the method ``name`` that :func:`register_method` added, and return its runner."""
    if name not in _METHODS:
        raise ValueError(f"name: expected a registered method, got {name!r} (registered: {list(_METHODS)})")
    return _METHODS.pop(name)


def registered_runner(name: str) -> Optional[Runner]:
    """The runner registered as ``name`` (:func:`register_method`), or None (a fusion rule's method, or no method)."""
    return _METHODS.get(name)


#: Prefix of the matched posterior fusion methods: ``match-<rule>`` for every fusion rule.
MATCH_PREFIX = "match-"
#: Suffix of matched posterior fusion with the clients' own output layers pooled: ``match-<rule>-pooled``.
POOLED_SUFFIX = "-pooled"


def available_methods() -> list[str]:
    """Every method name: the registered runners, then one per fusion rule of :mod:`bnpfed.combine` (weight-wise
    fusion), then ``match-<rule>`` per rule of matched fusion (those rules and ``atom-posterior``, the matching
    model's own posterior of each atom), then ``match-<rule>-pooled`` per rule (its output layers pooled)."""
    rules = [rule for rule in available_rules() if rule not in _METHODS]
    matched = [MATCH_PREFIX + rule + suffix for suffix in ("", POOLED_SUFFIX) for rule in matched_rules()]
    return list(_METHODS) + rules + [name for name in matched if name not in _METHODS]
