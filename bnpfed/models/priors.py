"""Prior objects: which parameters of a plain network are random, and with which distribution.

A prior maps ``(name, module, param)`` — the qualified parameter name as in ``net.named_parameters()``, the module
that owns it, and the parameter — to a scalar Pyro distribution, or to ``None`` to keep that parameter
deterministic. :meth:`Prior.apply_` then replaces every chosen ``nn.Parameter`` of a ``PyroModule`` by a
``PyroSample`` with that distribution expanded to the parameter's shape; the network's own code is untouched.

Parameters are picked by *selectors*, one of

- a name pattern (``str``, shell-style, matched against the whole qualified name): ``"fc1.weight"``, ``"*.bias"``,
  ``"fc*"``;
- an ``nn.Module`` subclass: every parameter of modules of that type, e.g. ``nn.Conv2d``;
- a callable ``(name, module) -> bool``, such as :func:`linear_weights`.

A prior is read, not copied: the network's sample sites ask the prior object for their distribution on every
run, so :meth:`Prior.update_` (a posterior becomes the next prior, as when a federated client's prior is the global
posterior of the last round) takes effect in every network built with that prior object.

Usage::

    >>> import pyro.distributions as dist
    >>> from torch import nn
    >>> from bnpfed.models import BayesianNetwork, mlp
    >>> net = mlp(4, [3], 2)                                            # parameters "1.weight", "1.bias", "3.*"
    >>> BayesianNetwork(net, IIDPrior()).bayesian_sites                  # every parameter ~ N(0, 1)
    ('1.weight', '1.bias', '3.weight', '3.bias')
    >>> BayesianNetwork(net, IIDPrior(dist.Normal(0.0, 0.1), hide=["*.bias"])).bayesian_sites
    ('1.weight', '3.weight')
    >>> BayesianNetwork(net, only_linear_weights()).bayesian_sites      # Ozer et al. (2022): nn.Linear weights
    ('1.weight', '3.weight')
    >>> prior = LayerwisePrior({"1.weight": dist.Normal(0.0, 0.05), nn.Linear: dist.Normal(0.0, 1.0)})
    >>> BayesianNetwork(net, prior).bayesian_sites
    ('1.weight', '1.bias', '3.weight', '3.bias')
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from fnmatch import fnmatchcase
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions.torch_distribution import TorchDistributionMixin as Distribution
from pyro.nn.module import PyroModule, PyroSample
from torch import Tensor, nn

from bnpfed.posterior import GaussianPosterior
from bnpfed.validation import check_float

__all__ = ["EmpiricalBayesPrior", "HierarchicalPrior", "IIDPrior", "LayerwisePrior", "Prior", "Selector", "SitePrior",
           "linear_weights", "only_linear_weights"]

#: A name pattern, an ``nn.Module`` subclass, or a callable ``(name, module) -> bool``.
Selector = Union[str, type, Callable[[str, nn.Module], bool]]


def linear_weights(name: str, module: nn.Module) -> bool:
    """Selector of the weight matrices of ``nn.Linear`` layers (not their biases, not convolutions)."""
    return isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] == "weight"


class Prior(ABC):
    """Base class: maps each parameter of a network to a prior distribution, or to ``None`` (deterministic).

    Subclasses implement :meth:`distribution`; :meth:`apply_` does the conversion, :meth:`update_` replaces the
    prior of named sites by a Gaussian posterior (the sites stay Bayesian; the others keep their prior).
    """

    # Class-level defaults, replaced per instance on the first update_ / apply_ (subclasses need not call an
    # __init__ of this base class).
    _posterior_priors: Mapping[str, Distribution] = MappingProxyType({})
    _site_shapes: Mapping[str, torch.Size] = MappingProxyType({})
    #: Incremented by every :meth:`update_`; code that caches the prior's parameters compares it.
    version: int = 0
    #: Whether a client re-estimates this prior from its fit (``estimate_(posterior)``, as
    #: :class:`EmpiricalBayesPrior` does); False: the prior is what it is.
    estimable: bool = False

    @abstractmethod
    def distribution(self, name: str, module: nn.Module, param: Tensor) -> Optional[Distribution]:
        """The prior of one parameter: a distribution with empty ``event_shape`` whose ``batch_shape`` broadcasts
        to ``param.shape`` (usually a scalar one such as ``Normal(0, 1)``), or ``None`` to keep it deterministic.

        :param str name: qualified parameter name, as in ``net.named_parameters()`` (``"fc1.weight"``).
        :param nn.Module module: the module owning the parameter.
        :param Tensor param: the parameter itself.
        """

    def apply_(self, net: PyroModule) -> dict[str, Tensor]:
        """Replace the chosen parameters of ``net``, in place, by ``PyroSample`` sites.

        A parameter of shape ``shape`` gets the prior ``distribution(...).expand(shape).to_event(len(shape))`` (or,
        after :meth:`update_`, the posterior given there), so its Pyro sample site is named by its qualified name and
        holds the whole tensor as one event. The site asks this object for its distribution on every run.

        :param PyroModule net: a network already converted with ``pyro.nn.module.to_pyro_module_``.
        :returns: the values the chosen parameters had, ``{name: tensor}`` in ``named_parameters`` order (useful
            to start a guide's means at the network's initialisation).
        """
        if not isinstance(net, PyroModule):
            raise ValueError(
                f"net: expected a PyroModule (convert it with pyro.nn.module.to_pyro_module_), got {type(net).__name__}"
            )
        chosen: list[tuple[nn.Module, str, str, Distribution]] = []
        for module_name, module in net.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{param_name}" if module_name else param_name
                prior = self.distribution(name, module, param)
                if prior is not None:
                    chosen.append((module, param_name, name, _expanded(prior, param, name)))
        self._check_selectors_used([name for name, _ in net.named_parameters()])
        shapes = {name: getattr(module, param_name).shape for module, param_name, name, _ in chosen}
        unknown = [name for name in self._posterior_priors if name not in shapes]
        if unknown:
            raise ValueError(f"prior: expected posteriors (from update_) for Bayesian sites of this network, "
                             f"{list(shapes)}, got ones for {unknown}, which this prior does not make Bayesian "
                             "in this network")
        for name, posterior in self._posterior_priors.items():
            _check_event_shape(posterior, shapes[name], name)
        values = {}
        for module, param_name, name, prior in chosen:
            values[name] = getattr(module, param_name).detach().clone()
            setattr(module, param_name, PyroSample(SitePrior(self, name, prior)))
        self._site_shapes = {**self._site_shapes, **shapes}
        return values

    def update_(self, posterior: Mapping[str, Any]) -> "Prior":
        """Make the prior of every named site the Gaussian ``N(loc, variance)`` of ``posterior``, weight by weight,
        in place; sites not named keep their prior. Every network built with this prior uses the new prior from its
        next run on.

            p(w_s) <- N(w_s | loc_s, diag(variance_s))     for every site s in ``posterior``

        :param Mapping posterior: ``{site: GaussianPosterior}`` or ``{site: (loc, variance)}``, e.g. a client's
            :meth:`~bnpfed.clients.BayesianClient.posterior` or a server's fused posterior; sites this prior has
            made Bayesian (in a network it was applied to), finite tensors of the site's shape, variances > 0.
            The tensors are copied.
        :returns: ``self``.
        :raises ValueError: naming the site, for a site this prior does not make Bayesian, a wrong shape, a NaN or
            a variance <= 0; the prior is then unchanged.
        """
        if not isinstance(posterior, Mapping):
            raise ValueError(f"posterior: expected a dict site -> (loc, variance), got {type(posterior).__name__}")
        if self._site_shapes:
            unknown = [name for name in posterior if name not in self._site_shapes]
            if unknown:
                raise ValueError(f"posterior: expected sites among this prior's Bayesian sites "
                                 f"{list(self._site_shapes)}, got unknown site(s) {unknown}")
        updates = {}
        for name, value in posterior.items():
            loc, variance = GaussianPosterior.of(value, f"posterior[{name!r}]", self._site_shapes.get(name))
            loc, scale = loc.detach().clone(), variance.detach().sqrt()
            updates[name] = dist.Normal(loc, scale).to_event(loc.dim())
        self._posterior_priors = {**self._posterior_priors, **updates}
        self.version += 1
        return self

    @property
    def posterior_sites(self) -> frozenset:
        """The sites whose prior is a posterior given by :meth:`update_`."""
        return frozenset(self._posterior_priors)

    def initial(self) -> "Prior":
        """A copy of this prior as it was before any :meth:`update_`: the same rules and distributions, no
        posterior-as-prior, tied to no network yet (e.g. the prior of a global network whose widths differ from a
        client's, whose prior is its slice of the last global posterior)."""
        fresh = copy.deepcopy(self)
        fresh._posterior_priors, fresh._site_shapes, fresh.version = {}, {}, 0
        return fresh

    def _check_selectors_used(self, names: list[str]) -> None:
        """Hook for subclasses that pick parameters with selectors: complain about selectors that matched nothing."""

    def site_distribution(self, name: str, default: Distribution) -> Distribution:
        """The distribution site ``name`` has now: the posterior :meth:`update_` gave for it if any, else
        ``default`` (the prior's own distribution of the site, expanded to its shape). Subclasses whose prior
        changes with the fit (:class:`EmpiricalBayesPrior`) override it."""
        return self._posterior_priors.get(name, default)


class SitePrior:
    """The prior of one sample site as a ``PyroSample`` reads it: the posterior :meth:`Prior.update_` gave for the
    site if any, else the prior's own distribution expanded to the site's shape.

    :param Prior prior: the prior object.
    :param str name: the site (the parameter's qualified name).
    :param Distribution default: the prior's own distribution of the site, expanded to its shape.
    """

    def __init__(self, prior: Prior, name: str, default: Distribution):
        self.prior, self.name, self.default = prior, name, default

    def __call__(self, module: Optional[nn.Module]) -> Distribution:  # PyroSample passes the owning module
        return self.prior.site_distribution(self.name, self.default)


class _SelectorPrior(Prior):
    """A prior given by ordered rules ``(selector, distribution or None)``: the first matching rule decides; a
    parameter no rule matches is deterministic."""

    def __init__(self, rules: list[tuple[Selector, Optional[Distribution], str]]):
        for selector, prior, argument in rules:
            _check_selector(selector, argument)
            if prior is not None:
                _check_distribution(prior, argument)
        self._rules = rules
        self._used: set[int] = set()

    def distribution(self, name, module, param):
        matched = [i for i, (selector, _, _) in enumerate(self._rules) if _matches(selector, name, module)]
        self._used.update(matched)  # a rule shadowed by an earlier one still counts as matching
        return self._rules[matched[0]][1] if matched else None

    def apply_(self, net):
        self._used = set()
        return super().apply_(net)

    def _check_selectors_used(self, names):
        unused = [argument for i, (_, _, argument) in enumerate(self._rules) if i not in self._used and argument]
        if unused:
            raise ValueError(
                f"{type(self).__name__}: expected every selector to match a parameter of the network (its "
                f"parameters are {names}), got {', '.join(unused)} matching none"
            )


class IIDPrior(_SelectorPrior):
    """The same scalar distribution, independently for every entry of every chosen parameter.

    Usage::

        >>> import pyro.distributions as dist
        >>> from torch import nn
        >>> from bnpfed.models import BayesianNetwork, LeNet
        >>> BayesianNetwork(LeNet(image_size=8), IIDPrior()).bayesian_sites[:3]       # everything, N(0, 1)
        ('conv1.weight', 'conv1.bias', 'conv2.weight')
        >>> prior = IIDPrior(dist.Normal(0.0, 0.1), expose=[nn.Conv2d], hide=["*.bias"])
        >>> BayesianNetwork(LeNet(image_size=8), prior).bayesian_sites
        ('conv1.weight', 'conv2.weight')

    :param Distribution distribution: scalar prior of each entry. Default ``Normal(0, 1)``.
    :param expose: selectors of the parameters to make Bayesian; ``None`` (default) means all of them.
    :param hide: selectors of parameters to keep deterministic; they win over ``expose``. Default none.

    Every selector given must match at least one parameter, or :meth:`apply_` raises a ``ValueError``.
    """

    def __init__(
        self,
        distribution: Optional[Distribution] = None,
        *,
        expose: Optional[Iterable[Selector]] = None,
        hide: Iterable[Selector] = (),
    ):
        if distribution is None:
            distribution = dist.Normal(0.0, 1.0)
        _check_distribution(distribution, "distribution")
        rules = [(s, None, f"hide[{i}]={s!r}") for i, s in enumerate(_as_list(hide, "hide"))]
        if expose is None:
            rules.append(("*", distribution, ""))
        else:
            rules += [(s, distribution, f"expose[{i}]={s!r}") for i, s in enumerate(_as_list(expose, "expose"))]
        super().__init__(rules)


class LayerwisePrior(_SelectorPrior):
    """A prior per group of parameters in one line: ``{selector: distribution or None}``.

    The first key (in dict order) that matches a parameter gives its prior; ``None`` keeps it deterministic;
    parameters no key matches are deterministic.

    Usage::

        >>> import pyro.distributions as dist
        >>> from bnpfed.models import BayesianNetwork, LeNet
        >>> prior = LayerwisePrior({"fc3.*": dist.Normal(0.0, 0.1), linear_weights: dist.Normal(0.0, 1.0)})
        >>> bnn = BayesianNetwork(LeNet(image_size=8), prior)
        >>> bnn.bayesian_sites                                     # fc3's bias by the first rule
        ('fc1.weight', 'fc2.weight', 'fc3.weight', 'fc3.bias')
        >>> scale = lambda site: bnn.prior_distributions()[site].base_dist.scale[0, 0].item()
        >>> round(scale("fc3.weight"), 6), round(scale("fc1.weight"), 6)                # first matching rule
        (0.1, 1.0)

    :param Mapping rules: selector -> scalar distribution (or ``None``). Every key must match at least one
        parameter, or :meth:`apply_` raises a ``ValueError``.
    """

    def __init__(self, rules: Mapping[Selector, Optional[Distribution]]):
        if not isinstance(rules, Mapping):
            raise ValueError(f"rules: expected a mapping selector -> distribution, got {type(rules).__name__}")
        super().__init__([(s, d, f"rules[{s!r}]") for s, d in rules.items()])


class EmpiricalBayesPrior(Prior):
    """A zero-mean Gaussian prior per site whose variance is the client's own type-II maximum-likelihood estimate.

    Every chosen site s (by default the ``nn.Linear`` weight matrices, Ozer et al.'s choice) has the prior
    ``w_sj ~ N(0, v_s)``, one variance ``v_s`` per site (per layer's weight matrix), which :meth:`estimate_`
    sets to the value that maximises the ELBO for the current mean-field posterior ``q(w_sj) = N(mu_sj, sigma_sj^2)``:

        d/dv_s KL(q || p) = sum_j ( 1/(2 v_s) - (sigma_sj^2 + mu_sj^2) / (2 v_s^2) ) = 0
        =>  v_s = 1/D_s sum_j (mu_sj^2 + sigma_sj^2)                                  (D_s: the site's size)

    (variational EM's M-step; MacKay's evidence framework for a Gaussian weight prior). A
    :class:`~bnpfed.clients.BayesianClient` with this prior calls :meth:`estimate_` before its first optimiser
    step and after every one, so the prior follows the fit (``init_scale`` is the prior only before any fit): a
    prior a thousand times wider than the weights it describes, as the paper's N(0, 1) is for a 784-100-10 MLP, no
    longer dominates ``-ELBO / n``.
    A weight no datum touches ends at this prior, ``N(0, v_s)``.

    Sites given a posterior by :meth:`update_` (posterior as prior) keep it: :meth:`estimate_` leaves them alone.

    Usage::

        >>> import torch
        >>> from bnpfed.models import BayesianNetwork, mlp
        >>> prior = EmpiricalBayesPrior()
        >>> bnn = BayesianNetwork(mlp(4, [3], 2), prior)
        >>> bnn.bayesian_sites, prior.variances["1.weight"]
        (('1.weight', '3.weight'), 1.0)
        >>> posterior = {"1.weight": (torch.full((3, 4), 0.3), torch.full((3, 4), 0.07)),
        ...              "3.weight": (torch.zeros(2, 3), torch.full((2, 3), 0.5))}
        >>> round(prior.estimate_(posterior).variances["1.weight"], 6)          # 0.3^2 + 0.07
        0.16
        >>> round(bnn.prior_distributions()["3.weight"].base_dist.scale[0, 0].item() ** 2, 6)
        0.5

    :param expose: selectors of the parameters to make Bayesian (see the module docstring); ``None`` (default):
        the ``nn.Linear`` weight matrices (:func:`linear_weights`).
    :param hide: selectors of parameters to keep deterministic; they win over ``expose``. Default none.
    :param float init_scale: the prior standard deviation before the first estimate, > 0. Default 1 (the paper's).
    """

    #: A client fitting with this prior re-estimates it after every step (:meth:`estimate_`).
    estimable = True

    def __init__(self, expose: Optional[Iterable[Selector]] = None, hide: Iterable[Selector] = (), *,
                 init_scale: float = 1.0):
        self.init_scale = check_float(init_scale, "init_scale", low=0.0, low_open=True, what="a finite number > 0")
        self._selection = IIDPrior(dist.Normal(0.0, self.init_scale),
                                   expose=[linear_weights] if expose is None else expose, hide=hide)
        #: ``{site: v_s}``, the current prior variance of every chosen site (filled by :meth:`apply_`).
        self.variances: dict[str, float] = {}
        self._distributions: dict[str, Distribution] = {}

    def distribution(self, name, module, param):
        return self._selection.distribution(name, module, param)

    def apply_(self, net):
        self._selection._used = set()
        values = super().apply_(net)
        for name in values:
            self.variances.setdefault(name, self.init_scale ** 2)
            self._distributions.pop(name, None)
        return values

    def _check_selectors_used(self, names):
        self._selection._check_selectors_used(names)

    def site_distribution(self, name, default):
        if name in self._posterior_priors or name not in self.variances:
            return super().site_distribution(name, default)
        fn = self._distributions.get(name)
        if fn is None:
            scale = torch.tensor(self.variances[name], dtype=default.mean.dtype).sqrt()
            fn = dist.Normal(torch.zeros((), dtype=scale.dtype), scale).expand(default.event_shape) \
                .to_event(len(default.event_shape))
            self._distributions[name] = fn
        return fn

    @torch.no_grad()
    def estimate_(self, posterior: Mapping[str, Any]) -> "EmpiricalBayesPrior":
        """Set each site's prior variance to its maximum-likelihood value for the mean-field posterior
        ``posterior`` (``{site: GaussianPosterior or (loc, variance)}``, e.g. a client's guide):
        ``v_s = mean_j (loc_sj^2 + variance_sj)``. Sites with a posterior prior (:meth:`update_`) and sites this
        prior does not hold are refused; returns ``self``.

        :raises ValueError: naming the site, for an unknown site or one whose prior is a posterior, a wrong shape,
            a NaN or a variance <= 0; nothing is changed then.
        """
        if not isinstance(posterior, Mapping):
            raise ValueError(f"posterior: expected a dict site -> (loc, variance), got {type(posterior).__name__}")
        estimates = {}
        for name, value in posterior.items():
            if name not in self.variances:
                raise ValueError(f"posterior: expected sites of this prior {list(self.variances)}, got {name!r}")
            if name in self._posterior_priors:
                raise ValueError(f"posterior[{name!r}]: the site's prior is a posterior (update_), which "
                                 "estimate_ does not change")
            loc, variance = GaussianPosterior.of(value, f"posterior[{name!r}]", self._site_shapes.get(name))
            estimates[name] = float((loc.double().square() + variance.double()).mean())
        for name, v in estimates.items():
            if v != self.variances[name]:
                self.variances[name] = v
                self._distributions.pop(name, None)
        self.version += 1
        return self

    def initial(self) -> "EmpiricalBayesPrior":
        fresh = super().initial()
        fresh.variances, fresh._distributions = {}, {}
        return fresh

    def __repr__(self) -> str:
        return f"EmpiricalBayesPrior(init_scale={self.init_scale!r}, variances={self.variances!r})"


class HierarchicalPrior(Prior):
    """A zero-mean Gaussian prior per site whose scale is itself random: a per-layer scale with a hyper-prior (ARD
    by layer; with a heavy-tailed hyper-prior, horseshoe-like).

    Every chosen site s (by default the ``nn.Linear`` weight matrices) has one scale ``tau_s``:

        tau_s ~ scale                              (default HalfNormal(1))
        w_sj | tau_s ~ N(0, tau_s^2)               for every entry j of the site

    ``tau_s`` is a latent site of the model named ``f"{s}_scale"`` (``"fc1.weight_scale"``), drawn in every run
    just before the weights it scales: a guide learns it with the weights
    (:class:`~bnpfed.clients.MeanFieldGuide` as a Normal of ``log tau_s``), a client's
    :meth:`~bnpfed.clients.BayesianClient.posterior` reports it, and the fusion rules fuse it as any site, in log
    space. The full-Bayes counterpart of :class:`EmpiricalBayesPrior`'s point estimate of the same variance. Its
    weights have no fixed prior, so a client's ELBO is Pyro's (``TraceMeanField_ELBO``: the weights' KL term in
    closed form given the drawn scale, the scale's by Monte Carlo), not the closed-form fast path.

    Usage::

        >>> import pyro.distributions as dist
        >>> from bnpfed.models import BayesianNetwork, mlp
        >>> bnn = BayesianNetwork(mlp(4, [3], 2), HierarchicalPrior(dist.HalfNormal(1.0)))
        >>> bnn.latent_sites                                 # each layer's scale, then its weights
        ('1.weight_scale', '1.weight', '3.weight_scale', '3.weight')
        >>> round(bnn.init_values["1.weight_scale"].item(), 4)         # a guide starts at the hyper-prior's mean
        0.7979

    :param Distribution scale: the hyper-prior of each site's scale, a scalar distribution on the positive numbers.
        Default ``HalfNormal(1)``.
    :param expose: selectors of the parameters to make Bayesian (see the module docstring); ``None`` (default):
        the ``nn.Linear`` weight matrices (:func:`linear_weights`).
    :param hide: selectors of parameters to keep deterministic; they win over ``expose``. Default none.
    """

    #: The suffix of a site's scale site (``"fc1.weight" + SUFFIX``).
    SUFFIX = "_scale"

    def __init__(self, scale: Optional[Distribution] = None, expose: Optional[Iterable[Selector]] = None,
                 hide: Iterable[Selector] = ()):
        scale = dist.HalfNormal(1.0) if scale is None else scale
        _check_distribution(scale, "scale")
        if not _positive(scale.support):
            raise ValueError(f"scale: expected a distribution on the positive numbers (a prior scale), got {scale!r} "
                             f"with support {scale.support}")
        self.scale = scale
        self._selection = IIDPrior(dist.Normal(0.0, 1.0), expose=[linear_weights] if expose is None else expose,
                                   hide=hide)

    def distribution(self, name, module, param):
        return self._selection.distribution(name, module, param)

    def apply_(self, net):
        self._selection._used = set()
        return super().apply_(net)

    def _check_selectors_used(self, names):
        self._selection._check_selectors_used(names)

    def site_distribution(self, name, default):
        tau = pyro.sample(name + self.SUFFIX, self.scale)
        shape = default.event_shape
        return dist.Normal(torch.zeros((), dtype=tau.dtype), tau).expand(shape).to_event(len(shape))

    def update_(self, posterior):
        raise ValueError("posterior: a hierarchical prior's weights are Normal given their drawn scale; a posterior "
                         "as their prior would drop the scale from the model (keep the hierarchical prior, or use a "
                         "prior without hyper-parameters)")

    def __repr__(self) -> str:
        return f"HierarchicalPrior(scale={self.scale!r})"


def only_linear_weights(distribution: Optional[Distribution] = None) -> IIDPrior:
    """Ozer et al. (2022)'s choice: only the weight matrices of ``nn.Linear`` layers are Bayesian; convolutions and
    all biases stay deterministic.

    :param Distribution distribution: scalar prior of each weight. Default ``Normal(0, 1)``.
    """
    return IIDPrior(distribution, expose=[linear_weights])


def _matches(selector: Selector, name: str, module: nn.Module) -> bool:
    if isinstance(selector, str):
        return fnmatchcase(name, selector)
    if isinstance(selector, type):
        return isinstance(module, selector)
    return bool(selector(name, module))


def _positive(support) -> bool:
    return isinstance(support, (torch.distributions.constraints._GreaterThan,
                                torch.distributions.constraints._GreaterThanEq)) and support.lower_bound == 0


def _check_selector(selector, argument: str) -> None:
    ok = (
        isinstance(selector, str)
        or (isinstance(selector, type) and issubclass(selector, nn.Module))
        or (callable(selector) and not isinstance(selector, type))
    )
    if not ok:
        raise ValueError(
            f"{argument}: expected a name pattern (str), an nn.Module subclass or a callable (name, module) -> bool, "
            f"got {selector!r}"
        )


def _check_distribution(prior, argument: str) -> None:
    if not isinstance(prior, Distribution):
        raise ValueError(f"{argument}: expected a pyro.distributions distribution or None, got {prior!r}")
    if prior.event_shape != ():
        raise ValueError(
            f"{argument}: expected a distribution with empty event_shape (it is expanded to each parameter's shape), "
            f"got event_shape {tuple(prior.event_shape)}"
        )


def _expanded(prior, param: Tensor, name: str):
    _check_distribution(prior, f"prior of {name!r}")
    try:
        return prior.expand(param.shape).to_event(param.dim())
    except (RuntimeError, ValueError) as error:
        raise ValueError(
            f"prior of {name!r}: expected a batch_shape that broadcasts to the parameter's shape "
            f"{tuple(param.shape)}, got {tuple(prior.batch_shape)}"
        ) from error


def _check_event_shape(posterior, shape: torch.Size, name: str) -> None:
    if posterior.event_shape != shape:
        raise ValueError(f"prior: expected a posterior (from update_) of its parameter's shape {tuple(shape)} for "
                         f"{name!r}, got shape {tuple(posterior.event_shape)}")


def _as_list(selectors, argument: str) -> list:
    if isinstance(selectors, (str, type)) or callable(selectors):
        raise ValueError(f"{argument}: expected a list of selectors, got the single selector {selectors!r}")
    return list(selectors)
