"""Test helper (not a test module): run a test with what plugins register undone afterwards, so that the rules,
priors, likelihoods, programs and methods one test registers do not leak into the others (``--rule all`` runs every
rule; the README lists every method)."""

from __future__ import annotations

import contextlib
import sys
from typing import Iterable, Iterator

from bnpfed.combine import available_rules, unregister_rule
from bnpfed.federated import available_federated_methods, available_methods, unregister_federated_method
from bnpfed.federated import unregister_method
from bnpfed.federated.registry import registered_runner
from bnpfed.models import (available_likelihoods, available_priors, available_programs, unregister_likelihood,
                           unregister_prior, unregister_program)
from bnpfed.plugins import load_entry_points


@contextlib.contextmanager
def restored_registries(modules: Iterable[str] = ()) -> Iterator[None]:
    """Undo, on leaving, every registration made inside (rules, priors, likelihoods, programs, federated and experiment
    methods), forget the plugin ``modules`` (so that importing one again registers again) and the entry points
    loaded."""
    rules, priors, likelihoods = set(available_rules()), set(available_priors()), set(available_likelihoods())
    programs = set(available_programs())
    federated, methods = set(available_federated_methods()), set(available_methods())
    try:
        yield
    finally:
        for name in [n for n in available_federated_methods() if n not in federated]:
            unregister_federated_method(name)
        for name in [n for n in available_rules() if n not in rules]:
            unregister_rule(name)
        for name in [n for n in available_methods() if n not in methods and registered_runner(n) is not None]:
            unregister_method(name)
        for name in [n for n in available_priors() if n not in priors]:
            unregister_prior(name)
        for name in [n for n in available_likelihoods() if n not in likelihoods]:
            unregister_likelihood(name)
        for name in [n for n in available_programs() if n not in programs]:
            unregister_program(name)
        for name in modules:
            sys.modules.pop(name, None)
        load_entry_points.cache_clear()
