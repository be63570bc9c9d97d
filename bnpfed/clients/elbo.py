"""The ELBO of a Bayesian network under a mean-field Gaussian guide, computed straight from the guide's parameters.

For a :class:`~bnpfed.models.BayesianNetwork` with Normal priors ``p(w_s) = N(m_s, t_s^2)`` (scalars or tensors of
the site's shape) and a :class:`~bnpfed.clients.MeanFieldGuide` ``q(w_s) = N(mu_s, sigma_s^2)``,
``sigma_s = softplus(rho_s)``, the loss on a batch of B of the ``n`` examples is the one-sample estimate of -ELBO

    KL(q || p) - n / B sum_{i in batch} log p(y_i | f(x_i; w)),        w_s = mu_s + sigma_s * eps_s,  eps_s ~ N(0, I)

    KL(q || p) = sum_s sum_j 1/2 (r_sj + (mu_sj - m_sj)^2 / t_sj^2 - 1 - log r_sj),   r_sj = sigma_sj^2 / t_sj^2

what Pyro's ``TraceMeanField_ELBO`` computes from the Pyro program (up to floating-point rounding; the guide's trace
replayed in :meth:`BayesianNetwork.model`), with the same random numbers in the same order: one ``eps_s`` per site in
the guide's order, then the network's own draws (local reparameterisation's pre-activation noise, in forward order).
The Pyro program is the reference semantics; this is an implementation of the same objective without the two traces
per step (tests check that both give the same loss for the same seed).

Anything else (another guide, a non-Normal prior, a prior with hyper-parameters drawn in the model, a subclass that
changes the model, local reparameterisation on a network where the module-level layer cannot reproduce the handler)
is handed to ``TraceMeanField_ELBO`` unchanged. The closed form is used only when every prior is a fixed
distribution: a prior that draws a random value is never evaluated once and cached (:class:`BayesianNetwork` reads
its draws as latent sites, or refuses it).

Usage::

    >>> import torch
    >>> from pyro.infer import TraceMeanField_ELBO
    >>> from bnpfed.clients import MeanFieldGuide
    >>> from bnpfed.models import BayesianNetwork, mlp, only_linear_weights
    >>> from bnpfed.seeding import seeded
    >>> bnn = BayesianNetwork(mlp(4, [3], 2), only_linear_weights())
    >>> guide = MeanFieldGuide(bnn.init_values, init_scale=0.1)
    >>> x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    >>> elbo = MeanFieldELBO()
    >>> elbo.supports(bnn, guide)
    True
    >>> with seeded(0):
    ...     fast = elbo.differentiable_loss(bnn, guide, x, y, dataset_size=100)
    >>> with seeded(0), bnn.context():
    ...     reference = TraceMeanField_ELBO().differentiable_loss(bnn, guide, x, y, dataset_size=100)
    >>> torch.allclose(fast, reference)
    True
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Optional, Union

import torch
import torch.nn.functional as F
from pyro.infer import TraceMeanField_ELBO
from pyro.poutine.messenger import Messenger
from torch import Tensor

from bnpfed.clients.guides import MeanFieldGuide
from bnpfed.models import BayesianNetwork
from bnpfed.validation import check_float

__all__ = ["MeanFieldELBO"]

#: A prior mean or scale: a float when the prior is one value expanded to the site's shape, else a tensor.
_Param = Union[float, Tensor]


class MeanFieldELBO:
    """``-ELBO`` of a :class:`BayesianNetwork` and a :class:`MeanFieldGuide`, with the closed-form KL of
    ``TraceMeanField_ELBO``, computed from the guide's parameters and the plain network
    (:meth:`BayesianNetwork.output_at`); any other model or guide goes to ``TraceMeanField_ELBO`` (under
    ``model.context()`` for a :class:`BayesianNetwork`). The same interface as a Pyro ELBO's ``differentiable_loss``.

    The object caches what it read of the model, the guide and the prior (``prior.version``); one object serves any
    number of (model, guide) pairs, fastest when it keeps seeing the same one.

    :param float kl_weight: lambda in ``lambda KL(q || p) - sum_i E_q[log p(y_i | x_i, w)]``, > 0. Default 1 (the
        ELBO). lambda < 1 is a *tempered* (cold) posterior: ``-loss / lambda`` is the ELBO of the same prior with
        every example's likelihood counted ``1 / lambda`` times, so the optimum is the mean-field fit of
        ``p(w) prod_i p(y_i | x_i, w)^(1 / lambda)``: the data weigh more against the prior, and the posterior is
        narrower than Bayes' rule gives (Wenzel et al., ICML 2020, "How good is the Bayes posterior in deep neural
        networks really?", temper the whole posterior instead; for a Gaussian mean-field q the two agree up to
        q's entropy). Not a posterior of the model any more: say so beside results that use it. With a model or
        guide off the closed-form path the weight multiplies each Bayesian site's KL term of
        ``TraceMeanField_ELBO`` (the latent sites' ``scale``, hyper-parameters included).
    """

    def __init__(self, kl_weight: float = 1.0):
        self.kl_weight = check_float(kl_weight, "kl_weight", low=0.0, low_open=True, what="a finite number > 0")
        self._reference = TraceMeanField_ELBO(max_plate_nesting=1)
        self._key: Optional[tuple] = None
        self._plan: Optional[list[tuple[str, Tensor, Tensor, _Param, _Param]]] = None

    @staticmethod
    def supports(model, guide) -> bool:
        """Whether the closed-form path applies: a :class:`BayesianNetwork` (whose ``model`` is not overridden) with
        a fixed prior (no hyper-parameters drawn in the model: :attr:`BayesianNetwork.hyper_sites` empty), a
        :class:`MeanFieldGuide` (whose ``forward`` is not overridden) over exactly its Bayesian sites, all real,
        Normal priors on every site, and, with local reparameterisation, a network whose Bayesian sites all belong to
        layers the module-level layer covers (:attr:`BayesianNetwork.plain_local_reparameterization`)."""
        return (isinstance(model, BayesianNetwork) and type(model).model is BayesianNetwork.model
                and not model.hyper_sites
                and isinstance(guide, MeanFieldGuide) and type(guide).forward is MeanFieldGuide.forward
                and not guide.transforms
                and set(guide.site_names) == set(model.bayesian_sites)
                and (not model.local_reparameterization or model.plain_local_reparameterization)
                and all(_normal(fn) is not None for fn in model.prior_distributions().values()))

    def _prepare(self, model, guide) -> Optional[list]:
        key, version = self._key, getattr(getattr(model, "prior", None), "version", None)
        if key is not None and key[0]() is model and key[1]() is guide and key[2] == version:
            return self._plan
        plan = None
        if self.supports(model, guide):
            priors = model.prior_distributions()
            # the guide's Parameter objects themselves: indexing a ParameterList costs more than a small layer
            plan = [(name, loc, rho, *(_scalar_or_tensor(p) for p in _normal(priors[name])))
                    for name, loc, rho in zip(guide.site_names, guide.locs, guide.rhos)]
        try:
            self._key = (weakref.ref(model), weakref.ref(guide), version)
        except TypeError:  # a model or guide that takes no weak reference (a plain function is fine)
            self._key = None
        self._plan = plan
        return plan

    def differentiable_loss(self, model, guide, x: Tensor, y: Tensor, dataset_size: Optional[int] = None) -> Tensor:
        """``-ELBO`` on the batch ``(x, y)`` standing for ``dataset_size`` examples (default: the batch), a scalar
        differentiable in the guide's and the model's parameters; see the module docstring."""
        plan = self._prepare(model, guide)
        if plan is None:
            context = model.context() if isinstance(model, BayesianNetwork) else contextlib.nullcontext()
            if self.kl_weight != 1.0:
                if not isinstance(model, BayesianNetwork):
                    raise ValueError(f"kl_weight: tempers the Bayesian sites of a BayesianNetwork; the model "
                                     f"{model!r} is not one, got kl_weight={self.kl_weight!r}")
                sites = frozenset(model.latent_sites)
                model, guide = (_ScaleSites(sites, self.kl_weight)(model),
                                _ScaleSites(sites, self.kl_weight)(guide))
            with context:
                return self._reference.differentiable_loss(model, guide, x, y, dataset_size=dataset_size)
        if y is None:
            raise ValueError("y: expected the observed targets of the batch, got None")
        batch, n = model.check_batch(x, y, dataset_size)
        local = model.local_reparameterization
        values, moments, kl = {}, {} if local else None, 0.0
        for name, loc, rho, prior_loc, prior_scale in plan:
            scale = F.softplus(rho)
            variance = scale * scale
            # Normal(loc, scale).rsample(): the guide's draw, in the guide's order
            values[name] = loc + torch.empty_like(loc).normal_() * scale
            if local:
                moments[name] = (loc, variance)
            kl = kl + _kl_normal_normal(loc, variance, prior_loc, prior_scale).sum()
        if self.kl_weight != 1.0:
            kl = self.kl_weight * kl
        output = model.output_at(x, values, moments)
        return kl - (n / batch) * model.likelihood.log_likelihood(output, y)

    def kl_divergence(self, model, guide) -> Tensor:
        """``KL(q || p)`` summed over every Bayesian site, in closed form (differentiable).

        :raises ValueError: when :meth:`supports` is false for ``(model, guide)``.
        """
        plan = self._prepare(model, guide)
        if plan is None:
            raise ValueError("model, guide: expected a BayesianNetwork with Normal priors and a MeanFieldGuide over "
                             "its Bayesian sites (see MeanFieldELBO.supports)")
        return sum(_kl_normal_normal(loc, F.softplus(rho).square(), m, t).sum() for _, loc, rho, m, t in plan)


class _ScaleSites(Messenger):
    """Multiplies the ``scale`` of the named sample sites by ``factor`` (their log densities, hence their KL terms in
    ``TraceMeanField_ELBO``)."""

    def __init__(self, sites: frozenset, factor: float):
        super().__init__()
        self.sites, self.factor = sites, factor

    def _process_message(self, msg):
        if msg["type"] == "sample" and msg["name"] in self.sites:
            msg["scale"] = self.factor * msg["scale"]


def _normal(fn) -> Optional[tuple[Tensor, Tensor]]:
    """``(loc, scale)`` of a (possibly ``Independent``) ``Normal``, else None."""
    while isinstance(fn, torch.distributions.Independent):
        fn = fn.base_dist
    return (fn.loc, fn.scale) if isinstance(fn, torch.distributions.Normal) else None


def _scalar_or_tensor(value: Tensor) -> _Param:
    """A float when ``value`` is one number expanded (``Normal(0, 1).expand(shape)``), else the tensor."""
    if value.numel() == 1 or all(stride == 0 for stride in value.stride()):
        return value.reshape(-1)[0].item()
    return value


def _kl_normal_normal(loc: Tensor, variance: Tensor, prior_loc: _Param, prior_scale: _Param) -> Tensor:
    """Elementwise ``KL(N(loc, variance) || N(prior_loc, prior_scale^2))``, as ``torch.distributions.kl`` writes it,
    ``1/2 (r + (loc - m)^2 / t^2 - 1 - log r)`` with ``r = variance / t^2``; operations with a prior of mean 0 or
    scale 1 are skipped, and squares are products (cheaper autograd nodes than ``pow``)."""
    unit = isinstance(prior_scale, float) and prior_scale == 1.0
    centred = isinstance(prior_loc, float) and prior_loc == 0.0
    var_ratio = variance if unit else variance / (prior_scale * prior_scale)
    t1 = loc if centred else loc - prior_loc
    t1 = t1 * t1 if unit else t1 * t1 / (prior_scale * prior_scale)
    return 0.5 * (var_ratio + t1 - 1 - var_ratio.log())
