"""Laplace clients: a Gaussian posterior for an ordinary trained network, after the fact, without retraining.

A client trains its network as a PFNM client does (maximum likelihood, :func:`~bnpfed.federated.clients.train_network`);
its weights ``theta*`` are then the mode, and the diagonal Laplace approximation (MacKay 1992; "Laplace Redux",
Daxberger et al., NeurIPS 2021) puts a Gaussian there whose precision is the curvature of the negative log joint.
For the chosen sites ``s`` (the parameters a :class:`~bnpfed.models.Prior` makes Bayesian, by default the
``nn.Linear`` weight matrices; the others stay at their trained values, deterministic), with the prior
``N(0, 1 / delta_s)`` per weight of site s,

    q(w_i) = N(theta*_i, 1 / (h_i + delta_s)),     h_i = [sum_n J_n^T (diag p_n - p_n p_n^T) J_n]_ii,

``h`` the diagonal of the generalised Gauss-Newton matrix of the summed cross-entropy over the client's ``n``
examples (``J_n`` the Jacobian of example n's logits in the weights, ``p_n`` its softmax), computed by
``laplace-torch``'s curvature backends (CurvLinOps' GGN). A weight no example's loss depends on has ``h_i = 0`` and
keeps the prior: variance ``1 / delta_s``.

**The prior precision by the marginal likelihood** (type-II maximum likelihood, per site). Laplace's evidence,

    log p(D | delta) ~ log p(D | theta*) - 1/2 sum_s delta_s ||theta*_s||^2 + 1/2 sum_s P_s log delta_s
                       - 1/2 sum_i log(h_i + delta_{s(i)}) + const,

(``P_s`` the number of weights of site s; laplace-torch's ``log_marginal_likelihood``) is stationary in
``delta_s`` where

    g_s(delta) = P_s / delta - sum_{i in s} 1 / (h_i + delta) - ||theta*_s||^2 = 0,

MacKay's evidence condition ``delta ||theta*||^2 = gamma``, ``gamma = sum_i h_i / (h_i + delta)`` the number of
well-determined weights. ``P / delta - sum 1/(h + delta) = sum h / (delta (h + delta))`` falls from +infinity to 0
as delta grows, so the root is unique whenever some ``h_i > 0`` and ``theta*_s != 0``; it is found to machine
precision (scipy's brentq in log delta) rather than by laplace-torch's gradient steps. A site with no curvature
(no example touches it) or all-zero weights has no finite maximiser and is refused, naming it.

**The prior precision on held-out data** (``prior_precision="held-out"``). The evidence above is that of the
*diagonal* posterior, which drops the curvature's correlations; the linearised predictive of such a posterior is
under-confident (the docs' benchmark page on calibration measures it on MNIST clients), the failure Laplace Redux
meets and answers with a prior precision tuned on validation data.
Here the client holds out ``held_out`` of its examples (a seeded split), trains and fits the curvature on the rest,
and scales every site's evidence precision by the factor ``c`` of :data:`HELD_OUT_SCALES` whose linearised predictive
gives the held-out examples the lowest negative log-likelihood (the same :data:`HELD_OUT_SAMPLES` draws of ``eps`` for
every ``c``): ``q(w_i) = N(theta*_i, 1 / (h_i + c delta_s))``. The sites keep their evidence's ratios; the data
choose one temperature-like factor, as Laplace Redux's grid search over the prior precision does.

The mode is the mode of the *likelihood* when the client trained without weight decay (as bnpfed's clients do by
default): treating it as the mode of the posterior under the fitted prior is the post-hoc approximation Laplace
Redux makes and measures.

**The predictive.** The GGN is the curvature of the network *linearised* at the mode, and the Laplace posterior is a
good one for that model, not for the network itself: sampling weights into the nonlinear network (``"sample"``)
underfits badly (Immer, Korzepa & Bauer, AISTATS 2021; Laplace Redux), the more so the better the network fits, as
``diag p - p p^T`` vanishes on examples it is sure of and the variances go to the prior's. The default predictive is
therefore the linearised one (``"linearised"``, Laplace Redux's ``glm`` with Monte Carlo link): logits
``f(x; theta*) + J(x) eps``, ``eps ~ N(0, diag variances)``, each draw one forward-mode Jacobian-vector product, the
softmax averaged over the draws. The same holds for a global network fused from Laplace clients
(:meth:`LaplaceClient.holding`).

Usage: a small network trained by maximum likelihood, then its posterior::

    >>> import torch
    >>> from torch import nn
    >>> g = torch.manual_seed(0)
    >>> x = torch.randn(200, 4); y = (x[:, 0] > 0).long()
    >>> client = LaplaceClient(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))
    >>> client = client.fit(x, y, epochs=5, batch_size=32, lr=1e-2, seed=0)
    >>> sorted(client.posterior())                       # the Linear weights; the biases stay deterministic
    ['0.weight', '2.weight']
    >>> sorted(client.deterministic_state())
    ['0.bias', '2.bias']
    >>> all(p.variance.lt(1 / d).all().item() for p, d in zip(client.posterior().values(),
    ...                                                          client.prior_precision_.values()))
    True
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from dataclasses import dataclass
from typing import Mapping, Optional, Union

import numpy as np
import torch
from torch import Tensor, nn

from bnpfed.clients.variational import DeterministicClient
from bnpfed.metrics import nll
from bnpfed.models import Categorical
from bnpfed.models import Prior, only_linear_weights
from bnpfed.posterior import GaussianPosterior
from bnpfed.seeding import seeded
from bnpfed.validation import check_float, check_int, check_positive

__all__ = ["HELD_OUT_FRACTION", "HELD_OUT_SAMPLES", "HELD_OUT_SCALES", "PREDICTIVES", "LaplaceClient", "LaplaceFit",
           "evidence_precision", "laplace_posterior", "prior_sites"]

#: Laplace clients' posterior predictives: the network linearised at the mode (default), or weights sampled into it.
PREDICTIVES = ("linearised", "sample")

#: ``prior_precision="held-out"``: the factors of the evidence precisions tried (quarter decades, 0.1 to 1000), the
#: share of a client's examples held out, and the predictive draws each factor's held-out NLL averages over.
HELD_OUT_SCALES = tuple(10.0 ** (k / 4) for k in range(-4, 13))
HELD_OUT_FRACTION = 0.1
HELD_OUT_SAMPLES = 20


def prior_sites(prior: Prior, net: nn.Module) -> list[str]:
    """The parameters of ``net`` that ``prior`` makes Bayesian (its ``distribution`` is not None), in
    ``named_parameters`` order."""
    if not isinstance(prior, Prior):
        raise ValueError(f"prior: expected a bnpfed.models.Prior, got {type(prior).__name__}")
    sites = []
    for module_name, module in net.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if prior.distribution(name, module, param) is not None:
                sites.append(name)
    if not sites:
        raise ValueError(f"prior: expected a prior that makes some parameter of the network Bayesian, got "
                         f"{type(prior).__name__}, which makes none")
    return sites


def evidence_precision(curvature: Tensor, theta: Tensor, site: str = "site") -> float:
    """The prior precision ``delta`` that maximises Laplace's marginal likelihood for one site: the root of
    ``P / delta - sum_i 1 / (h_i + delta) - ||theta||^2`` (see the module docstring), to machine precision.

    :param Tensor curvature: the site's diagonal curvature ``h`` (>= 0).
    :param Tensor theta: the site's weights at the mode.
    :raises ValueError: when no finite maximiser exists (no curvature, or every weight 0), naming ``site``.
    """
    from scipy.optimize import brentq

    h = curvature.detach().double().reshape(-1).numpy()
    if h.size != theta.numel() or (h < 0).any() or not np.isfinite(h).all():
        raise ValueError(f"curvature[{site!r}]: expected {theta.numel()} finite values >= 0")
    s = float(theta.detach().double().pow(2).sum())
    h = h[h > 0]
    if h.size == 0 or s == 0.0:
        why = "no example's loss depends on it (curvature 0)" if h.size == 0 else "its weights are all 0"
        raise ValueError(f"{site}: the marginal likelihood has no finite maximiser in the prior precision: {why}")

    def g(log_delta: float) -> float:     # sum h / (delta (h + delta)) - s, falling in delta
        delta = math.exp(log_delta)
        return float(np.sum(h / (delta * (h + delta)))) - s

    # bracket: g > 0 for small delta (it grows like 1 / delta), g -> -s < 0 for large delta
    lo, hi = math.log(float(h.min())) - 5.0, math.log(float(h.max())) + 5.0
    while g(lo) <= 0:
        lo -= 10.0
    while g(hi) >= 0:
        hi += 10.0
    return math.exp(brentq(g, lo, hi, xtol=1e-14, rtol=4 * np.finfo(float).eps, maxiter=500))


@dataclass
class LaplaceFit:
    """A diagonal Laplace posterior of some sites of a network (:func:`laplace_posterior`).

    :param dict locs: site -> the weights at the mode (float64).
    :param dict variances: site -> posterior variances ``1 / (h + delta_s)`` (float64).
    :param dict curvature: site -> the GGN diagonal ``h`` of the summed loss (float64).
    :param dict prior_precision: site -> ``delta_s``.
    :param float log_marginal_likelihood: Laplace's log evidence at these precisions (laplace-torch's).
    :param int num_examples: n.
    """

    locs: dict
    variances: dict
    curvature: dict
    prior_precision: dict
    log_marginal_likelihood: float
    num_examples: int

    def posterior(self) -> dict[str, GaussianPosterior]:
        """``{site: GaussianPosterior(loc, variance)}``."""
        return {k: GaussianPosterior(self.locs[k], v) for k, v in self.variances.items()}

    def at_prior_precision(self, prior_precision: Mapping[str, float]) -> "LaplaceFit":
        """The same mode and curvature at other prior precisions ``{site: delta_s}``: variances ``1 / (h +
        delta_s)`` and the log evidence there (its log-likelihood term is the mode's, recovered from this fit's
        evidence), with no second pass over the data."""
        log_likelihood = self.log_marginal_likelihood + 0.5 * _evidence_penalty(self.curvature, self.locs,
                                                                                 self.prior_precision)
        delta = {k: float(prior_precision[k]) for k in self.curvature}
        return LaplaceFit(dict(self.locs), {k: 1.0 / (h + delta[k]) for k, h in self.curvature.items()},
                          dict(self.curvature), delta, _log_evidence(log_likelihood, self.curvature, self.locs, delta),
                          self.num_examples)


@contextlib.contextmanager
def _without_jit_script_warning():
    """torch 2.14 warns that ``torch.jit.script`` is deprecated wherever a library still calls it: ASDL (a
    laplace-torch dependency) at import, and torch's own forward-mode AD on its first ``jvp`` (loading its
    decompositions). Neither is the caller's doing, so neither reaches them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.* is deprecated", category=FutureWarning)
        yield


def _laplace_torch():
    try:
        with _without_jit_script_warning():
            from laplace import Laplace
            from laplace.curvature import BackPackGGN, CurvlinopsGGN
    except ImportError as error:  # pragma: no cover - the extra is installed by `make test`
        raise ImportError("Laplace clients need laplace-torch: pip install 'bnpfed[laplace]'") from error
    return Laplace, BackPackGGN, CurvlinopsGGN


#: The layers BackPACK's exact GGN diagonal backpropagates through (its second-order extensions know each one).
BACKPACK_LAYERS = (nn.Linear, nn.Conv2d, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Flatten, nn.MaxPool2d, nn.AvgPool2d,
                   nn.Identity)


def backpack_supports(net: nn.Module) -> bool:
    """Whether ``net`` is an ``nn.Sequential`` of :data:`BACKPACK_LAYERS` only: then laplace-torch's BackPACK backend
    computes the GGN diagonal (one backward pass of the loss's symmetric factorisation: hundreds of times faster than
    the CurvLinOps backend on an MNIST MLP, the same numbers); any other network (a ``forward`` with functional
    calls, batch norm, a custom container) takes CurvLinOps, which needs only autograd."""
    return isinstance(net, nn.Sequential) and all(isinstance(m, BACKPACK_LAYERS) for m in net)


def laplace_posterior(net: nn.Module, x: Tensor, y: Tensor, *, sites: list[str],
                      prior_precision: Union[str, float, Mapping[str, float]] = "marglik",
                      batch_size: int = 256) -> LaplaceFit:
    """The diagonal Laplace posterior of ``sites`` of a trained classifier ``net`` on ``(x, y)`` (the module
    docstring's formulas); the other parameters are held at their values. ``net`` is not changed.

    :param list sites: parameter names of ``net`` (e.g. :func:`prior_sites`).
    :param prior_precision: ``"marglik"`` (default: each site's own evidence maximiser,
        :func:`evidence_precision`), one float for every site, or ``{site: float}``.
    :param int batch_size: examples per curvature batch (the sum does not depend on it beyond rounding).
    """
    Laplace, BackPackGGN, CurvlinopsGGN = _laplace_torch()
    if not isinstance(net, nn.Module):
        raise ValueError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
    batch_size = check_int(batch_size, "batch_size", low=1)
    names = [n for n, _ in net.named_parameters()]
    unknown = [s for s in sites if s not in names]
    if not sites or unknown:
        raise ValueError(f"sites: expected parameter names of the network {names}, got {list(sites)}")
    if isinstance(prior_precision, str):
        if prior_precision != "marglik":
            raise ValueError(f"prior_precision: expected 'marglik', a float > 0 or a dict site -> float, got "
                             f"{prior_precision!r}")
        given = None
    elif isinstance(prior_precision, Mapping):
        if sorted(prior_precision) != sorted(sites):
            raise ValueError(f"prior_precision: expected a value for each site {sorted(sites)}, got "
                             f"{sorted(prior_precision)}")
        given = {s: check_positive(prior_precision[s], f"prior_precision[{s!r}]") for s in sites}
    else:
        value = check_positive(prior_precision, "prior_precision")
        given = {s: value for s in sites}
    if not torch.is_tensor(x) or x.dim() < 1 or x.shape[0] == 0:
        raise ValueError(f"x: expected a tensor of examples (n >= 1, ...), got {getattr(x, 'shape', type(x).__name__)}")
    n = int(x.shape[0])
    model = copy.deepcopy(net).eval()
    with torch.no_grad():
        Categorical().check_targets(y, n, model(x[:1]))
    params = dict(model.named_parameters())
    order = [name for name in names if name in set(sites)]
    backpack = backpack_supports(model)
    # laplace-torch's vector runs over model.parameters() that require grad: BackPACK needs all of them (the
    # diagonal's entries of a site do not depend on which others are included), CurvLinOps takes the sites alone
    included = names if backpack else order
    for name, p in params.items():
        p.requires_grad_(name in set(included))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, Categorical().targets(y)),
                                         batch_size=batch_size, shuffle=False)
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="diag",
                 backend=BackPackGGN if backpack else CurvlinopsGGN)
    with warnings.catch_warnings():   # BackPACK's module hooks fire with no input requiring grad: as intended here
        warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
        la.fit(loader, progress_bar=False)
    h_all = dict(zip(included, la.H.detach().double().split([params[name].numel() for name in included])))
    curvature = {name: h_all[name].reshape(params[name].shape).clone() for name in order}
    locs = {name: params[name].detach().double().clone() for name in order}
    delta = given or {name: evidence_precision(curvature[name], locs[name], name) for name in order}
    variances = {name: 1.0 / (curvature[name] + delta[name]) for name in order}
    return LaplaceFit(locs, variances, curvature, {k: float(delta[k]) for k in order},
                      _log_evidence(float(la.log_likelihood), curvature, locs, delta), n)


def _log_evidence(log_likelihood: float, curvature: Mapping[str, Tensor], locs: Mapping[str, Tensor],
                  delta: Mapping[str, float]) -> float:
    """Laplace's log evidence of the sites (the module docstring; laplace-torch's ``log_marginal_likelihood`` of the
    sites alone, tested equal): ``log p(D | theta*) - 1/2 sum_s [sum_i log(1 + h_i / delta_s) + delta_s
    ||theta*_s||^2]``. The parameters that are no site are held at their values, so they have no term (with the
    BackPACK backend laplace-torch's own evidence would count them too)."""
    return log_likelihood - 0.5 * _evidence_penalty(curvature, locs, delta)


def _evidence_penalty(curvature: Mapping[str, Tensor], locs: Mapping[str, Tensor],
                      delta: Mapping[str, float]) -> float:
    """``sum_s [sum_i log(1 + h_i / delta_s) + delta_s ||theta*_s||^2]``: twice what the evidence subtracts from the
    log-likelihood (:func:`_log_evidence`)."""
    total = 0.0
    for k, h in curvature.items():
        d = float(delta[k])
        total += float(torch.log1p(h / d).sum()) + d * float(locs[k].pow(2).sum())
    return total


def _check_draws(num_samples, predictive: str) -> int:
    """``num_samples`` (an int >= 1) once ``predictive`` is one of :data:`PREDICTIVES`, or a ``ValueError``."""
    num_samples = check_int(num_samples, "num_samples", low=1)
    if predictive not in PREDICTIVES:
        raise ValueError(f"predictive: expected one of {PREDICTIVES}, got {predictive!r}")
    return num_samples


class LaplaceClient:
    """A client whose posterior is the diagonal Laplace approximation of its trained network (the module docstring).

    It trains as a deterministic (PFNM / FedAvg) client does, then fits the posterior of the sites ``prior`` makes
    Bayesian (default :func:`~bnpfed.models.only_linear_weights`: the ``nn.Linear`` weight matrices, as the
    variational clients' default prior) with their prior precisions by the marginal likelihood. It offers what
    matched fusion reads from a :class:`~bnpfed.clients.BayesianClient` (:meth:`posterior`,
    :meth:`deterministic_state`), so :func:`~bnpfed.matching.posteriors.match_posteriors` takes it like
    any other Gaussian posterior.

    :param nn.Module net: the network (deep-copied); ``net(x)`` returns logits.
    :param Prior prior: selects the Bayesian sites (its distributions are not used: the precisions come from the
        marginal likelihood, or from ``prior_precision``).
    :param prior_precision: ``"marglik"`` (default), ``"held-out"`` (the evidence's precisions scaled by the factor
        a held-out split prefers: the module docstring), a float, or ``{site: float}`` (see
        :func:`laplace_posterior`).
    :param float held_out: with ``"held-out"``, the share of the client's examples :meth:`fit` holds out, in (0, 1)
        (default :data:`HELD_OUT_FRACTION`); the network trains on the rest.

    Attributes after :meth:`fit` / :meth:`fit_posterior`: ``fit_`` (the :class:`LaplaceFit`), ``prior_precision_``,
    ``log_marginal_likelihood_``, ``losses_`` (the training's mean cross-entropy per epoch; empty when only
    :meth:`fit_posterior` ran), and with ``"held-out"`` ``held_out_`` (the factors tried, their held-out NLLs, the
    chosen ``scale`` and the evidence's precisions it multiplied).
    """

    def __init__(self, net: nn.Module, prior: Optional[Prior] = None, *,
                 prior_precision: Union[str, float, Mapping[str, float]] = "marglik",
                 held_out: float = HELD_OUT_FRACTION):
        if not isinstance(net, nn.Module):
            raise ValueError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
        if isinstance(prior_precision, str) and prior_precision not in ("marglik", "held-out"):
            raise ValueError(f"prior_precision: expected 'marglik', 'held-out', a float > 0 or a dict site -> float, "
                             f"got {prior_precision!r}")
        held_out = check_float(held_out, "held_out", low=0.0, high=1.0, low_open=True, high_open=True)
        if held_out != HELD_OUT_FRACTION and prior_precision != "held-out":
            raise ValueError(f"held_out: the share held out to choose the prior precision, which applies with "
                             f"prior_precision='held-out' only; got held_out={held_out!r} with prior_precision="
                             f"{prior_precision!r}")
        self.net = copy.deepcopy(net).eval()
        self.prior = only_linear_weights() if prior is None else prior
        self.sites = prior_sites(self.prior, self.net)
        self.prior_precision = prior_precision
        self.held_out = held_out
        self.fit_: Optional[LaplaceFit] = None
        self.held_out_: Optional[dict] = None
        #: the predictive's temperature T: every draw's logits divided by T before the softmax (1: none); set on a
        #: fused global model (:func:`~bnpfed.federated.matched_fusion.tempered`), never used in a fit
        self.temperature = 1.0
        self._posterior: Optional[dict[str, GaussianPosterior]] = None
        self.losses_: list[float] = []

    @classmethod
    def holding(cls, net: nn.Module, posterior: Mapping[str, GaussianPosterior],
                prior: Optional[Prior] = None, *, temperature: float = 1.0) -> "LaplaceClient":
        """A client of ``net`` holding a given Gaussian posterior of its sites (e.g. the fused posterior of Laplace
        clients; ``net`` carries its means and the deterministic values), for the linearised predictive, at
        ``temperature`` (> 0; every draw's logits divided by it); it has no :attr:`fit_`."""
        client = cls(net, prior)
        client.temperature = float(check_positive(temperature, "temperature"))
        if sorted(posterior) != sorted(client.sites):
            raise ValueError(f"posterior: expected the sites {sorted(client.sites)}, got {sorted(posterior)}")
        params = dict(client.net.named_parameters())
        client._posterior = {}
        for k in client.sites:
            loc, variance = GaussianPosterior.of(posterior[k], f"posterior[{k!r}]", params[k].shape)
            if not torch.allclose(loc.to(params[k].dtype), params[k].detach()):
                raise ValueError(f"posterior[{k!r}]: expected its mean to be the network's weights")
            client._posterior[k] = GaussianPosterior(loc.detach().clone(), variance.detach().clone())
        return client

    def fit(self, x: Tensor, y: Tensor, *, epochs: int = 1, batch_size: int = 64, lr: float = 1e-3, seed: int = 0,
            amsgrad: bool = False, weight_decay: float = 0.0, optimizer: str = "adam",
            momentum: Optional[float] = None, augment: str = "none") -> "LaplaceClient":
        """Train the network by maximum likelihood (:meth:`~bnpfed.clients.DeterministicClient.fit`, the same
        schedule and seeding), then :meth:`fit_posterior` on the same data. With ``prior_precision="held-out"`` a
        share ``held_out`` of the examples (drawn from ``seed``) is held out first: the network and its curvature
        are fitted on the rest, and the held-out examples choose the prior precision. ``augment`` transforms the
        training mini-batches only: the curvature and the held-out choice see the images as they are. Returns
        ``self``."""
        validation = None
        if self.prior_precision == "held-out":
            if not torch.is_tensor(x) or x.dim() < 1 or x.shape[0] < 2:
                raise ValueError(f"x: expected at least 2 examples to hold some out, got "
                                 f"{getattr(x, 'shape', type(x).__name__)}")
            n = int(x.shape[0])
            order = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed)))
            k = min(n - 1, math.ceil(self.held_out * n))
            validation = (x[order[:k]], y[order[:k]])
            keep = order[k:].sort().values      # the training examples in their own order
            x, y = x[keep], y[keep]
        trained = DeterministicClient(self.net)
        trained.net.train()      # in training mode, as a deterministic client trains (train_network)
        trained.fit(x, y, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed, amsgrad=amsgrad,
                    weight_decay=weight_decay, optimizer=optimizer, momentum=momentum, augment=augment)
        self.net = trained.net.eval()
        self.fit_posterior(x, y, validation=validation, seed=seed)
        self.losses_ = list(trained.losses_)
        return self

    def fit_posterior(self, x: Tensor, y: Tensor, *, batch_size: int = 256, validation=None,
                      seed: int = 0) -> "LaplaceClient":
        """The Laplace posterior of the network as it is now, on ``(x, y)`` (the client's own data). With
        ``prior_precision="held-out"``, ``validation`` = ``(x_val, y_val)`` (examples the network did not train on)
        chooses the factor of the evidence precisions (``seed`` draws the predictive's ``eps``); it is an error
        otherwise. Returns ``self``."""
        if (validation is not None) != (self.prior_precision == "held-out"):
            raise ValueError(f"validation: the held-out examples that choose the prior precision; expected them with "
                             f"prior_precision='held-out' only, got validation "
                             f"{'None' if validation is None else 'given'} with prior_precision="
                             f"{self.prior_precision!r}")
        self.held_out_ = None
        if validation is None:
            self.fit_ = laplace_posterior(self.net, x, y, sites=self.sites, prior_precision=self.prior_precision,
                                          batch_size=batch_size)
        else:
            self.fit_, self.held_out_ = self._held_out_fit(x, y, validation, batch_size, seed)
        self._posterior = self.fit_.posterior()
        self.losses_ = []
        return self

    def _held_out_fit(self, x: Tensor, y: Tensor, validation, batch_size: int, seed: int):
        """The evidence's fit, then each factor of :data:`HELD_OUT_SCALES` scored by the held-out NLL of its
        linearised predictive (common draws); the fit at the best factor and what the choice saw."""
        if not isinstance(validation, (tuple, list)) or len(validation) != 2:
            raise ValueError("validation: expected (x_val, y_val)")
        xv, yv = validation
        if not torch.is_tensor(xv) or xv.dim() < 1 or xv.shape[0] == 0:
            raise ValueError(f"validation: expected at least one held-out example, got "
                             f"{getattr(xv, 'shape', type(xv).__name__)}")
        with torch.no_grad():
            Categorical().check_targets(yv, int(xv.shape[0]), self.net(xv[:1]))
        evidence = laplace_posterior(self.net, x, y, sites=self.sites, prior_precision="marglik",
                                     batch_size=batch_size)
        like = dict(self.net.named_parameters())
        target = Categorical().targets(yv)
        nlls = []
        for c in HELD_OUT_SCALES:
            posterior = {k: GaussianPosterior(evidence.locs[k].to(like[k].dtype),
                                              (1.0 / (evidence.curvature[k] + c * evidence.prior_precision[k]))
                                              .to(like[k].dtype)) for k in self.sites}
            nlls.append(nll(self._predictive(posterior, xv, HELD_OUT_SAMPLES, seed, "linearised"), target))
        best = HELD_OUT_SCALES[int(np.argmin(nlls))]
        fit = evidence.at_prior_precision({k: best * d for k, d in evidence.prior_precision.items()})
        return fit, dict(scales=list(HELD_OUT_SCALES), nll=nlls, scale=best,
                         evidence_precision=dict(evidence.prior_precision), examples=int(xv.shape[0]))

    def _fitted(self) -> LaplaceFit:
        if self.fit_ is None:
            raise ValueError("LaplaceClient: no posterior yet; call fit or fit_posterior first")
        return self.fit_

    @property
    def prior_precision_(self) -> dict[str, float]:
        return dict(self._fitted().prior_precision)

    @property
    def log_marginal_likelihood_(self) -> float:
        return self._fitted().log_marginal_likelihood

    def posterior(self) -> dict[str, GaussianPosterior]:
        """``{site: GaussianPosterior(loc, variance)}`` of the Bayesian sites, in the network's dtype."""
        if self._posterior is None:
            raise ValueError("LaplaceClient: no posterior yet; call fit or fit_posterior first")
        like = dict(self.net.named_parameters())
        return {k: GaussianPosterior(p.loc.to(like[k].dtype), p.variance.to(like[k].dtype))
                for k, p in self._posterior.items()}

    def deterministic_state(self) -> dict[str, Tensor]:
        """The network's other state (``state_dict`` entries that are no Bayesian site), copied."""
        return {k: v.detach().clone() for k, v in self.net.state_dict().items() if k not in set(self.sites)}

    def mean_network(self) -> nn.Module:
        """The network at the posterior mean (its trained weights), in eval mode (a copy)."""
        return copy.deepcopy(self.net).eval()

    @torch.no_grad()
    def predict_proba(self, x: Tensor, num_samples: int = 10, seed: Optional[int] = None,
                      predictive: str = "linearised") -> Tensor:
        """Posterior predictive class probabilities ``(B, num_classes)``, the softmax averaged over ``num_samples``
        draws of the Bayesian sites from the posterior (the other parameters at their values); ``seed`` fixes the
        draws. ``predictive``: ``"linearised"`` (default: the network linearised at the mode, logits
        ``f(x; theta*) + J(x) eps``) or ``"sample"`` (the weights drawn into the network itself, as a
        :class:`~bnpfed.clients.BayesianClient` predicts); see the module docstring. Every draw's logits are divided
        by :attr:`temperature` (1 unless the client is a tempered global model)."""
        num_samples = _check_draws(num_samples, predictive)
        return self._predictive(self.posterior(), x, num_samples, seed, predictive, self.temperature)

    @torch.no_grad()
    def sample_outputs(self, x: Tensor, num_samples: int = 10, seed: Optional[int] = None,
                       predictive: str = "linearised") -> Tensor:
        """``(S, B, C)`` the logits of the ``num_samples`` draws that :meth:`predict_proba` averages (the same draws
        for the same ``seed``), before its temperature: what a temperature is fitted on
        (:func:`~bnpfed.federated.clients.posterior_nll_step`), as for a
        :class:`~bnpfed.clients.BayesianClient`."""
        num_samples = _check_draws(num_samples, predictive)
        return torch.stack(self._draws(self.posterior(), x, num_samples, seed, predictive))

    def _draws(self, posterior: Mapping[str, GaussianPosterior], x: Tensor, num_samples: int,
               seed: Optional[int], predictive: str) -> list[Tensor]:
        """The logits of each of ``num_samples`` draws from ``posterior`` (checked arguments)."""
        state = dict(self.net.state_dict())
        means = {k: p.loc for k, p in posterior.items()}

        def logits(params):
            return torch.func.functional_call(self.net, {**state, **params}, (x,))

        outputs = []
        with seeded(seed):
            for _ in range(num_samples):
                eps = {k: p.scale * torch.randn_like(p.loc) for k, p in posterior.items()}
                if predictive == "linearised":
                    with _without_jit_script_warning():
                        f, jvp = torch.func.jvp(logits, (means,), (eps,))
                    outputs.append(f + jvp)
                else:
                    outputs.append(logits({k: means[k] + eps[k] for k in means}))
        return outputs

    @torch.no_grad()
    def _predictive(self, posterior: Mapping[str, GaussianPosterior], x: Tensor, num_samples: int,
                    seed: Optional[int], predictive: str, temperature: float = 1.0) -> Tensor:
        """:meth:`predict_proba` of a given posterior of the sites (checked arguments), at ``temperature``."""
        total = None
        for out in self._draws(posterior, x, num_samples, seed, predictive):
            probs = (out if temperature == 1.0 else out / temperature).softmax(-1)
            total = probs if total is None else total + probs
        return total / num_samples
