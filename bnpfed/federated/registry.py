"""The names of an experiment's comparison methods and the options each takes: a registry of runners, like the fusion
rules of :mod:`bnpfed.combine`. :mod:`bnpfed.federated.methods` registers the built-in runners and runs them; this
module holds only the names, so that :class:`~bnpfed.federated.experiment.ExperimentConfig` can check a method
without importing the runners.

A runner takes an :class:`~bnpfed.federated.experiment.Experiment` (and the method's options as keywords) and
returns one or more :class:`~bnpfed.federated.results.MethodResult` rows. A method is asked for by a *spec*: its
name, then any options as ``:key=value``, each looked up in the registry: ``pfnm``, ``pfnm:heads=pooled``,
``fusion:rule=eaa`` (weight-wise posterior fusion with that rule), ``match:rule=gaa:heads=pooled`` (matched
posterior fusion). An option left out takes the experiment's config value (``fusion.rule``, ``pfnm.heads``). A row's
name says its method and options, as before: ``pfnm-pooled``, ``eaa``, ``match-gaa-pooled``. Several settings in one
table are several specs, one row each (``bnpfed fuse --rule eaa,gaa --heads both`` writes them).

The method names of bnpfed 0.1 that carried an option (``match-<rule>``, ``match-<rule>-pooled``, ``pfnm-pooled``,
``fedma-pooled``, and a fusion rule's own name for weight-wise fusion) keep working until 0.3, with a
``DeprecationWarning`` that names the spec (:func:`method_spec`).

Usage::

    >>> "pfnm" in available_methods() and "match" in available_methods()
    True
    >>> str(method_spec("match:heads=pooled:rule=gaa"))
    'match:rule=gaa:heads=pooled'
    >>> method_spec("pfnm:rule=gaa")
    Traceback (most recent call last):
    ...
    ValueError: methods: pfnm takes the options ['heads'], got 'rule' (in 'pfnm:rule=gaa')
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from bnpfed.combine import available_rules
from bnpfed.federated.results import MethodResult
from bnpfed.matching import matched_rules

__all__ = ["MATCH_PREFIX", "POOLED_SUFFIX", "MethodOption", "MethodSpec", "Runner", "available_methods",
           "method_options", "method_spec", "register_method", "registered_runner", "resolve_options", "row_name",
           "runner_of", "unregister_method"]

#: ``runner(experiment, **options) -> MethodResult | list[MethodResult]``, the experiment an
#: :class:`~bnpfed.federated.experiment.Experiment` (which imports this module, so it is not named here).
Runner = Callable[..., "MethodResult | list[MethodResult]"]


@dataclass(frozen=True)
class MethodOption:
    """An option of a method.

    :param choices: a callable returning the values it takes (asked at each check, so that a registry's additions
        count: ``matched_rules``), or a sequence.
    :param str reads: the experiment's config whose field of the option's name gives its value when a spec leaves it
        out (``"pfnm"``: ``experiment.pfnm.heads``); None when no config holds it, ``default`` then gives it.
    :param str help: what it chooses.
    :param default: with ``reads`` None, ``default(configs) -> str``: the option's value when a spec leaves it out,
        from the experiment's configs (``{"network": NetworkConfig, ...}``).
    """

    choices: Any
    reads: Optional[str]
    help: str
    default: Optional[Callable[[Mapping[str, Any]], str]] = None

    def __post_init__(self):
        if (self.reads is None) == (self.default is None):
            raise ValueError(f"reads, default: expected exactly one (a config to read, or a default from the "
                             f"configs), got reads={self.reads!r} and default={self.default!r}")

    def values(self) -> list[str]:
        return list(self.choices() if callable(self.choices) else self.choices)


@dataclass(frozen=True)
class _Method:
    runner: Runner
    options: dict[str, MethodOption]
    label: Optional[Callable[[dict[str, str]], str]]


_METHODS: dict[str, _Method] = {}


def register_method(name: str, runner: Runner, *, overwrite: bool = False,
                    options: Optional[Mapping[str, MethodOption]] = None,
                    label: Optional[Callable[[dict[str, str]], str]] = None) -> Runner:
    """Make ``runner`` available as the method ``name`` (in :class:`~bnpfed.federated.experiment.ExperimentConfig`'s
    ``methods`` and the commands' ``--methods``).

    :param options: the options the method takes (``{name: MethodOption}``); the runner is called with every one,
        resolved (:func:`resolve_options`), as keywords.
    :param label: ``label(options) -> str``, the name of the method's one row under those (resolved) options, when it
        has one row whose name the options decide (the experiment refuses two specs that give one row name).
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"name: expected a non-empty string without ':' (which starts a spec's options), got "
                         f"{name!r}")
    if not callable(runner):
        raise ValueError(f"runner: expected a callable runner(experiment), got {type(runner).__name__}")
    if (name in _METHODS or name in available_rules()) and not overwrite:
        raise ValueError(f"name: expected a method name not registered yet, got {name!r}, which is (as a method "
                         "or a fusion rule); pass overwrite=True to replace it")
    options = dict(options or {})
    for key, value in options.items():
        if not isinstance(value, MethodOption):
            raise ValueError(f"options: expected MethodOption values, got {type(value).__name__} for {key!r}")
    if label is not None and not callable(label):
        raise ValueError(f"label: expected a callable label(options) -> str, got {type(label).__name__}")
    _METHODS[name] = _Method(runner, options, label)
    return runner


def unregister_method(name: str) -> Runner:
    """Remove the method ``name`` that :func:`register_method` added, and return its runner."""
    if name not in _METHODS:
        raise ValueError(f"name: expected a registered method, got {name!r} (registered: {list(_METHODS)})")
    return _METHODS.pop(name).runner


def registered_runner(name: str) -> Optional[Runner]:
    """The runner registered as ``name`` (:func:`register_method`), or None."""
    method = _METHODS.get(name)
    return None if method is None else method.runner


def available_methods() -> list[str]:
    """Every method name, in the order they were registered (their options: :func:`method_options`)."""
    return list(_METHODS)


def method_options(name: str) -> dict[str, MethodOption]:
    """The options the method ``name`` takes."""
    if name not in _METHODS:
        raise ValueError(f"methods: expected one of {available_methods()}, got {name!r}")
    return dict(_METHODS[name].options)


@dataclass(frozen=True)
class MethodSpec:
    """A method and the options a user gave it: ``match:rule=gaa:heads=pooled``."""

    name: str
    options: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        return self.name + "".join(f":{k}={v}" for k, v in self.options)

    def given(self) -> dict[str, str]:
        return dict(self.options)


#: The prefix of bnpfed 0.1's matched-fusion method names (``match-<rule>``): now ``match:rule=<rule>``.
MATCH_PREFIX = "match-"
#: The suffix of bnpfed 0.1's method names with pooled heads (``pfnm-pooled``): now the option ``heads=pooled``.
POOLED_SUFFIX = "-pooled"


def _old_name(name: str) -> Optional[str]:
    """The spec of one of bnpfed 0.1's method names that carried an option, or None."""
    base, pooled = (name[:-len(POOLED_SUFFIX)], True) if name.endswith(POOLED_SUFFIX) else (name, False)
    heads = ":heads=pooled" if pooled else ""
    if base.startswith(MATCH_PREFIX) and base[len(MATCH_PREFIX):] in matched_rules():
        return f"match:rule={base[len(MATCH_PREFIX):]}{heads}"
    if pooled and base in ("pfnm", "fedma"):
        return base + heads
    if not pooled and name in available_rules():
        return f"fusion:rule={name}"
    return None


def method_spec(value) -> MethodSpec:
    """``value`` (a spec's text or a :class:`MethodSpec`) checked against the registry: a registered method, options
    it takes, values among their choices. A bnpfed 0.1 name (``match-gaa-pooled``) is read as its spec with a
    ``DeprecationWarning``. Raises ``ValueError("methods: ...")``."""
    if isinstance(value, MethodSpec):
        text = str(value)
    elif isinstance(value, str):
        text = value.strip()
    else:
        raise ValueError(f"methods: expected a method's name or spec (name:key=value), got {value!r}")
    if text not in _METHODS and ":" not in text:
        new = _old_name(text)
        if new is not None and new.split(":")[0] in _METHODS:
            warnings.warn(f"method {text!r} is a bnpfed 0.1 name; write {new!r} (a method's options are options, not "
                          f"parts of its name); the old name goes in 0.3", DeprecationWarning, stacklevel=3)
            text = new
    name, *parts = text.split(":")
    if name not in _METHODS:
        raise ValueError(f"methods: expected one of {available_methods()} (a name, or name:key=value with its "
                         f"options), got {value!r}")
    options = _METHODS[name].options
    given: dict[str, str] = {}
    for part in parts:
        key, sep, option = (s.strip() for s in part.partition("="))
        if not sep or not key or not option:
            raise ValueError(f"methods: expected name:key=value options, got {text!r}")
        if key not in options:
            raise ValueError(f"methods: {name} takes the options {list(options)}, got {key!r} (in {text!r})")
        if key in given:
            raise ValueError(f"methods: expected each option once, got {key!r} twice (in {text!r})")
        choices = options[key].values()
        if option not in choices:
            raise ValueError(f"methods: {name}'s {key}: expected one of {choices}, got {option!r} (in {text!r})")
        given[key] = option
    return MethodSpec(name, tuple((k, given[k]) for k in options if k in given))


def resolve_options(spec: MethodSpec, configs: Mapping[str, Any]) -> dict[str, str]:
    """Every option of ``spec``'s method: the given ones, the others from ``configs`` (``{"pfnm": PFNMConfig,
    ...}``: an experiment's) as each option :attr:`~MethodOption.reads`."""
    given = spec.given()
    return {key: given[key] if key in given else
            option.default(configs) if option.reads is None else getattr(configs[option.reads], key)
            for key, option in _METHODS[spec.name].options.items()}


def row_name(spec: MethodSpec, configs: Mapping[str, Any]) -> Optional[str]:
    """The name of the one row ``spec`` gives under ``configs``, when its method registered a label; else None."""
    method = _METHODS[spec.name]
    return None if method.label is None else method.label(resolve_options(spec, configs))


def runner_of(spec: MethodSpec, configs: Mapping[str, Any]) -> Callable[[Any], Any]:
    """``runner(experiment)``: the method's runner with ``spec``'s options resolved under ``configs``."""
    method = _METHODS[spec.name]
    options = resolve_options(spec, configs)
    return lambda experiment: method.runner(experiment, **options)

