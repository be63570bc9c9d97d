"""Priors, likelihoods and Pyro programs by name: the names a config (:class:`~bnpfed.federated.BayesianConfig`), a
command's ``--prior`` / ``--likelihood`` / ``--program`` and a Flower run config's ``prior`` / ``likelihood`` /
``program`` keys take, as a registry that a plugin (:mod:`bnpfed.plugins`) can add to, like the fusion rules of
:mod:`bnpfed.combine`.

* a named prior is a factory ``factory(scale, variance) -> Prior``: ``scale`` is the config's ``prior_scale`` (the
  prior's standard deviation), ``variance`` one of :data:`PRIOR_VARIANCES` (``"fixed"``: that scale throughout;
  ``"empirical-bayes"``: each client's own estimate, starting at it). A factory that has no empirical-Bayes form
  raises ``ValueError("prior_variance: ...")``. Built in: ``"linear-weights"`` (N(0, scale^2) on the ``nn.Linear``
  weight matrices, Ozer et al.'s choice) and ``"all"`` (on every parameter);
* a named likelihood is a factory ``factory() -> Likelihood``. Built in: ``"categorical"``
  (:class:`~bnpfed.models.likelihoods.Categorical`, classification), and for regression ``"gaussian"`` and
  ``"student-t"`` (:class:`~bnpfed.models.likelihoods.Gaussian`, :class:`~bnpfed.models.likelihoods.StudentT` with 4
  degrees of freedom), each with its noise scale learned (``HalfNormal(1)`` prior, on standardised targets);
* a named program is a factory ``factory() -> program``, called with no arguments once per client, that returns a
  fresh Pyro program: a ``PyroModule`` whose ``PyroSample`` statements are its prior and whose one observed site is
  its likelihood (its guide then Pyro's ``AutoNormal``), or a pair ``(model, guide)`` (a model function or module
  and its guide module, e.g. ``AutoNormal(model)``): what a client of the federations is when a config names it
  (``BayesianConfig(program=...)``; :class:`~bnpfed.clients.BayesianClient` takes the same two forms). None is built
  in.

Usage::

    >>> import pyro.distributions as dist
    >>> from bnpfed.models import IIDPrior
    >>> _ = register_prior("laplace-all", lambda scale, variance: IIDPrior(dist.Laplace(0.0, scale)))
    >>> type(build_prior("laplace-all", scale=0.5)).__name__, "laplace-all" in available_priors()
    ('IIDPrior', True)
    >>> _ = unregister_prior("laplace-all")
    >>> build_likelihood("categorical")
    Categorical()
    >>> import pyro
    >>> from pyro.nn import PyroModule, PyroSample
    >>> class Line(PyroModule):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.slope = PyroSample(dist.Normal(0.0, 1.0))
    ...     def forward(self, x, y=None):
    ...         with pyro.plate("data", x.shape[0]):
    ...             return pyro.sample("obs", dist.Normal(self.slope * x[:, 0], 1.0), obs=y)
    >>> _ = register_program("line", Line)
    >>> model, guide = build_program("line")
    >>> type(model).__name__, guide, "line" in available_programs()
    ('Line', None, True)
    >>> _ = unregister_program("line")
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pyro.distributions as dist
from pyro.nn import PyroModule
from torch import nn

from bnpfed.models.likelihoods import Categorical, Gaussian, Likelihood, StudentT
from bnpfed.models.priors import EmpiricalBayesPrior, IIDPrior, Prior, only_linear_weights

__all__ = ["LIKELIHOODS", "PRIORS", "PRIOR_VARIANCES", "LikelihoodFactory", "PriorFactory", "ProgramFactory",
           "available_likelihoods", "available_priors", "available_programs", "build_likelihood", "build_prior",
           "build_program", "program_of", "register_likelihood", "register_prior", "register_program",
           "unregister_likelihood", "unregister_prior", "unregister_program"]

#: ``factory(scale, variance) -> Prior``.
PriorFactory = Callable[[float, str], Prior]
#: ``factory() -> Likelihood``.
LikelihoodFactory = Callable[[], Likelihood]
#: ``factory() -> PyroModule`` or ``factory() -> (model, guide)``.
ProgramFactory = Callable[[], Any]

#: How a named prior's variance is set: ``scale^2`` throughout, or each client's type-II maximum-likelihood estimate
#: per site (:class:`~bnpfed.models.EmpiricalBayesPrior`, starting at ``scale``).
PRIOR_VARIANCES = ("fixed", "empirical-bayes")
#: The built-in prior names (:func:`available_priors` lists those plugins add too).
PRIORS = ("linear-weights", "all")
#: The built-in likelihood names (:func:`available_likelihoods` lists those plugins add too).
LIKELIHOODS = ("categorical", "gaussian", "student-t")

_PRIORS: dict[str, PriorFactory] = {}
_LIKELIHOODS: dict[str, LikelihoodFactory] = {}
_PROGRAMS: dict[str, ProgramFactory] = {}


def _check_name(name, registry: dict, what: str, overwrite: bool) -> None:
    if not isinstance(name, str) or not name.strip() or name != name.strip() or "," in name:
        raise ValueError(f"name: expected a non-empty {what} name without spaces at its ends or commas, got {name!r}")
    if name in registry and not overwrite:
        raise ValueError(f"name: expected a {what} name not registered yet, got {name!r}, which is; pass "
                         "overwrite=True to replace it")


def register_prior(name: str, factory: PriorFactory, *, overwrite: bool = False) -> PriorFactory:
    """Make ``factory`` the prior named ``name`` (a config's ``prior``, ``bnpfed fuse --prior``, the run config's
    ``prior``).

    :param str name: the prior's name.
    :param callable factory: ``factory(scale, variance) -> Prior`` (module docstring).
    :param bool overwrite: replace a prior registered under ``name``; default False raises instead.
    :returns: ``factory``.
    """
    _check_name(name, _PRIORS, "prior", overwrite)
    if not callable(factory):
        raise ValueError(f"factory: expected a callable factory(scale, variance) -> Prior, got "
                         f"{type(factory).__name__}")
    _PRIORS[name] = factory
    return factory


def unregister_prior(name: str) -> PriorFactory:
    """Remove the prior ``name`` and return its factory."""
    if name not in _PRIORS:
        raise ValueError(f"name: expected a registered prior, got {name!r} (registered: {available_priors()})")
    return _PRIORS.pop(name)


def available_priors() -> list[str]:
    """The prior names, in registration order (built-ins first)."""
    return list(_PRIORS)


def build_prior(name: str, *, scale: float = 1.0, variance: str = "fixed") -> Prior:
    """The prior ``name`` at ``scale`` with its ``variance`` (:data:`PRIOR_VARIANCES`), a new object each call.

    :raises ValueError: ``"prior: ..."`` for an unknown name, ``"prior_variance: ..."`` for a variance it has no form
        of, or a factory that returns no :class:`~bnpfed.models.Prior`.
    """
    if not isinstance(name, str) or name not in _PRIORS:
        raise ValueError(f"prior: expected one of {available_priors()} (or a Prior object), got {name!r}")
    if variance not in PRIOR_VARIANCES:
        raise ValueError(f"prior_variance: expected one of {list(PRIOR_VARIANCES)}, got {variance!r}")
    prior = _PRIORS[name](float(scale), variance)
    if not isinstance(prior, Prior):
        raise ValueError(f"prior: the factory of {name!r} returned a {type(prior).__name__}, expected a "
                         f"bnpfed.models.Prior")
    return prior


def register_likelihood(name: str, factory: LikelihoodFactory, *, overwrite: bool = False) -> LikelihoodFactory:
    """Make ``factory`` the likelihood named ``name`` (a config's ``likelihood``, ``bnpfed fuse --likelihood``, the
    run config's ``likelihood``).

    :param str name: the likelihood's name.
    :param callable factory: ``factory() -> Likelihood``.
    :param bool overwrite: replace a likelihood registered under ``name``; default False raises instead.
    :returns: ``factory``.
    """
    _check_name(name, _LIKELIHOODS, "likelihood", overwrite)
    if not callable(factory):
        raise ValueError(f"factory: expected a callable factory() -> Likelihood, got {type(factory).__name__}")
    _LIKELIHOODS[name] = factory
    return factory


def unregister_likelihood(name: str) -> LikelihoodFactory:
    """Remove the likelihood ``name`` and return its factory."""
    if name not in _LIKELIHOODS:
        raise ValueError(f"name: expected a registered likelihood, got {name!r} (registered: "
                         f"{available_likelihoods()})")
    return _LIKELIHOODS.pop(name)


def available_likelihoods() -> list[str]:
    """The likelihood names, in registration order (built-ins first)."""
    return list(_LIKELIHOODS)


def build_likelihood(name: str) -> Likelihood:
    """The likelihood ``name``, a new object each call.

    :raises ValueError: ``"likelihood: ..."`` for an unknown name, or a factory that returns no
        :class:`~bnpfed.models.Likelihood`.
    """
    if not isinstance(name, str) or name not in _LIKELIHOODS:
        raise ValueError(f"likelihood: expected one of {available_likelihoods()} (or a Likelihood object), got "
                         f"{name!r}")
    likelihood = _LIKELIHOODS[name]()
    if not isinstance(likelihood, Likelihood):
        raise ValueError(f"likelihood: the factory of {name!r} returned a {type(likelihood).__name__}, expected a "
                         f"bnpfed.models.Likelihood")
    return likelihood


def register_program(name: str, factory: ProgramFactory, *, overwrite: bool = False) -> ProgramFactory:
    """Make ``factory`` the Pyro program named ``name`` (a config's ``program``, ``bnpfed fuse --program``, the run
    config's ``program``).

    :param str name: the program's name.
    :param callable factory: ``factory() -> PyroModule`` or ``factory() -> (model, guide)``, a fresh program each
        call (module docstring); a ``PyroModule`` class with no constructor arguments is one.
    :param bool overwrite: replace a program registered under ``name``; default False raises instead.
    :returns: ``factory``.
    """
    _check_name(name, _PROGRAMS, "program", overwrite)
    if not callable(factory):
        raise ValueError(f"factory: expected a callable factory() -> PyroModule or (model, guide), got "
                         f"{type(factory).__name__}")
    _PROGRAMS[name] = factory
    return factory


def unregister_program(name: str) -> ProgramFactory:
    """Remove the program ``name`` and return its factory."""
    if name not in _PROGRAMS:
        raise ValueError(f"name: expected a registered program, got {name!r} (registered: {available_programs()})")
    return _PROGRAMS.pop(name)


def available_programs() -> list[str]:
    """The program names, in registration order (none is built in)."""
    return list(_PROGRAMS)


def program_of(made: Any, what: str = "program") -> tuple[Any, Optional[nn.Module]]:
    """What a program factory returned, as ``(model, guide)``: a ``PyroModule`` (or a model function) alone is
    ``(model, None)`` (the client's default guide, ``AutoNormal``), a pair ``(model, guide)`` is itself.

    :raises ValueError: ``"<what>: ..."`` for anything else (a class instead of an instance, a plain ``nn.Module``,
        a guide that is no module).
    """
    if isinstance(made, tuple) and len(made) == 2:
        model, guide = made
        if not isinstance(guide, nn.Module):
            raise ValueError(f"{what}: expected the factory's (model, guide) to hold a guide module (e.g. "
                             f"AutoNormal(model)), got a {type(guide).__name__}")
    else:
        model, guide = made, None
    if isinstance(model, type) or not callable(model) or (isinstance(model, nn.Module)
                                                          and not isinstance(model, PyroModule)):
        raise ValueError(f"{what}: expected the factory to return a fresh Pyro program (a PyroModule instance, or a "
                         f"(model, guide) pair), got {made!r}")
    return model, guide


def build_program(name: Any) -> tuple[Any, Optional[nn.Module]]:
    """A fresh program ``(model, guide)`` from the factory registered as ``name``, or from ``name`` itself when it
    is a factory (a callable, what a config's ``program`` holds in Python); ``guide`` None for the default.

    :raises ValueError: ``"program: ..."`` for an unknown name or a factory that returns no program
        (:func:`program_of`).
    """
    if isinstance(name, str):
        if name not in _PROGRAMS:
            raise ValueError(f"program: expected one of {available_programs()} (or a factory), got {name!r}")
        factory = _PROGRAMS[name]
    elif callable(name) and not isinstance(name, nn.Module):
        factory = name
    else:
        raise ValueError(f"program: expected a registered program's name or a factory() -> PyroModule or (model, "
                         f"guide), got {name!r}")
    try:
        made = factory()
    except TypeError as error:
        raise ValueError(f"program: expected a factory that takes no arguments and returns a fresh program (a "
                         f"model function is no factory: give lambda: (model, AutoNormal(model))), got {name!r}, "
                         f"which raised {type(error).__name__}: {error}") from error
    return program_of(made)


def _linear_weights(scale: float, variance: str) -> Prior:
    if variance == "empirical-bayes":
        return EmpiricalBayesPrior(None, init_scale=scale)
    return only_linear_weights(dist.Normal(0.0, scale))


def _all(scale: float, variance: str) -> Prior:
    if variance == "empirical-bayes":
        return EmpiricalBayesPrior(["*"], init_scale=scale)
    return IIDPrior(dist.Normal(0.0, scale))


register_prior("linear-weights", _linear_weights)
register_prior("all", _all)
register_likelihood("categorical", Categorical)
register_likelihood("gaussian", lambda: Gaussian(scale=None))
register_likelihood("student-t", lambda: StudentT(4.0, scale=None))
