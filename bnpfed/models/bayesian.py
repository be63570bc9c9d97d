"""A Bayesian neural network as a Pyro program: any ``nn.Module`` plus a prior object plus a likelihood object.

The generative story for client k with ``n_k`` examples ``(x_i, y_i)``:

    w_s ~ p_s                                      for every Bayesian parameter site s (the prior object decides)
    y_i | x_i, w ~ p(y_i | f(x_i; w, theta))       i = 1 .. n_k (the likelihood object decides)

where ``theta`` are the parameters the prior keeps deterministic; for classification (:class:`Categorical`, the
default) ``p(y | f) = Categorical(softmax(f))``. A mini-batch of B examples stands for all ``n_k``: the likelihood
sits in ``pyro.plate("data", size=n_k, subsample=...)``, which scales it by ``n_k / B``, so an ELBO on a batch is an
unbiased estimate of the ELBO on the whole local dataset.

Parameters live on the modules, never in Pyro's global parameter store: every run of the network is in Pyro's
``module_local_params`` mode (``PyroModule`` parameters are otherwise mirrored into, and shared through, the global
store by name, so two clients' copies of one architecture would be the same parameters).

The Pyro program (:meth:`BayesianNetwork.model`) is the reference semantics: users trace, condition and replay it.
For code that evaluates the same function many times (a fast ELBO), :meth:`BayesianNetwork.output_at` runs the same
network as plain torch with given values of the Bayesian sites; it shares the deterministic parameters and buffers.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Mapping, Optional

import pyro
import torch
from pyro import poutine
from pyro.infer.autoguide.initialization import init_to_mean, init_to_median
from pyro.nn.module import to_pyro_module_
from pyro.poutine.messenger import Messenger
from torch import Tensor, nn
from torch.distributions import constraints

from bnpfed.models.likelihoods import Categorical, Likelihood, StudentT, predictive_of
from bnpfed.models.local_reparameterization import LocalReparameterizedLinear, local_reparameterization
from bnpfed.models.priors import Prior, SitePrior
from bnpfed.seeding import seeded
from bnpfed.validation import check_bool, check_int

__all__ = ["BayesianNetwork"]

#: Layers whose forward never calls ``torch.nn.functional.linear`` on their own parameters, besides ``nn.Linear``
#: (which does, on its weight): on a network whose Bayesian sites all belong to such layers (exactly these classes),
#: converting its ``nn.Linear`` s to :class:`LocalReparameterizedLinear` does what the local reparameterisation
#: handler does.
_LAYERS_WITHOUT_LINEAR = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
                          nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm, nn.Embedding,
                          nn.PReLU)


def _module_local_params():
    return pyro.settings.context(module_local_params=True)


class BayesianNetwork(nn.Module):
    """A Bayesian copy of a plain network: the chosen parameters become Pyro sample sites named like the
    parameters (``"fc1.weight"``), the others stay deterministic ``nn.Parameter`` s of this module.

    The user's network is deep-copied, never modified.

    Usage::

        >>> import torch
        >>> from pyro import poutine
        >>> from bnpfed.models import BayesianNetwork, Gaussian, LeNet, mlp, only_linear_weights
        >>> bnn = BayesianNetwork(LeNet(image_size=8), only_linear_weights())
        >>> bnn.bayesian_sites
        ('fc1.weight', 'fc2.weight', 'fc3.weight')
        >>> x, y = torch.zeros(5, 1, 8, 8), torch.zeros(5, dtype=torch.long)
        >>> trace = poutine.trace(bnn.model).get_trace(x, y, dataset_size=1000)
        >>> trace.nodes["y"]["scale"]                               # the batch stands for 1000 examples
        200.0
        >>> bnn.predict(x, num_samples=3, seed=0).shape            # prior predictive class probabilities
        torch.Size([5, 10])
        >>> regression = BayesianNetwork(mlp(1, [8], 1), only_linear_weights(), likelihood=Gaussian(scale=0.1))
        >>> regression.predict(torch.zeros(4, 1), num_samples=3, seed=0).mean.shape
        torch.Size([4])

    :param nn.Module net: the network; ``net(x)`` returns the output the likelihood reads (logits
        ``(B, num_classes)`` for :class:`~bnpfed.models.likelihoods.Categorical`).
    :param Prior prior: which parameters are random, and their priors. The network reads it on every run, so
        ``prior.update_(posterior)`` changes this network's prior.
    :param Likelihood likelihood: the observation model, e.g. ``Categorical()`` (default) or ``Gaussian(scale)``.
    :param bool local_reparameterization: sample the pre-activations of linear layers with Gaussian weights instead
        of the weights (see :mod:`bnpfed.models.local_reparameterization`) in every run under :meth:`context` and in
        :meth:`output_at`. Default ``False``.
    """

    def __init__(self, net: nn.Module, prior: Prior, *, likelihood: Optional[Likelihood] = None,
                 local_reparameterization: bool = False):
        super().__init__()
        if not isinstance(net, nn.Module):
            raise ValueError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
        if not isinstance(prior, Prior):
            raise ValueError(f"prior: expected a bnpfed.models.Prior, got {type(prior).__name__}")
        if likelihood is None:
            likelihood = Categorical()
        if not isinstance(likelihood, Likelihood):
            raise ValueError(f"likelihood: expected a bnpfed.models.Likelihood such as Categorical() or "
                             f"Gaussian(scale), got {likelihood!r}")
        self._prior = prior
        #: The observation model.
        self.likelihood = likelihood
        self._local_reparameterization = check_bool(local_reparameterization, "local_reparameterization")
        pyro_net = copy.deepcopy(net)
        with _module_local_params():  # a PyroModule's parameter bookkeeping is set up when it is created
            to_pyro_module_(pyro_net)
            #: Values of the Bayesian parameters in the user's network, ``{site: tensor}``, and of the prior's
            #: hyper-parameters (their prior means), in the order of :attr:`latent_sites`.
            self.init_values: dict[str, Tensor] = prior.apply_(pyro_net)
        self.net = pyro_net
        #: Names of the Pyro sample sites of the weights, in ``net.named_parameters()`` order.
        self.bayesian_sites: tuple[str, ...] = tuple(self.init_values)
        #: Names of the parameters kept deterministic (``nn.Parameter`` s of ``self.net``).
        self.deterministic_params: tuple[str, ...] = tuple(name for name, _ in pyro_net.named_parameters())
        self._site_priors: dict[str, SitePrior] = {}
        for name in self.bayesian_sites:
            module_name, _, attr = name.rpartition(".")
            self._site_priors[name] = pyro_net.get_submodule(module_name)._pyro_samples[attr]
        hyper = self._read_hyper_sites()
        hyper.update(self._likelihood_sites(hyper))
        #: Names of the latent sites the prior draws besides the weights (hyper-parameters, such as a per-layer
        #: prior scale), each just before the weight site whose prior it sets, then the likelihood's (a learned
        #: noise scale, :meth:`Likelihood.latent_sites`); empty for a fixed prior and likelihood.
        self.hyper_sites: tuple[str, ...] = tuple(hyper)
        #: Names of every latent site, in the order the model samples them: each weight's hyper-parameters, then
        #: the weight; the likelihood's last.
        self.latent_sites: tuple[str, ...] = tuple(name for site in (*self.bayesian_sites, None)
                                                   for name in (*(h for h, (owner, _, _) in hyper.items()
                                                                  if owner == site), *((site,) if site else ())))
        #: ``{site: support}`` of every latent site (the weights' are the real numbers).
        self.supports: dict[str, Any] = {name: constraints.real for name in self.bayesian_sites}
        self.supports.update({h: support for h, (_, _, support) in hyper.items()})
        self.init_values.update({h: value for h, (_, value, _) in hyper.items()})
        self.init_values = {name: self.init_values[name] for name in self.latent_sites}
        self._build_plain(net)
        object.__setattr__(self, "_template", copy.deepcopy(net))  # not a submodule: the structure, plain torch

    def template(self) -> nn.Module:
        """A plain torch copy of the network this Bayesian network was built from (its parameters as they were
        given): the structure that matching and fusion rebuild global networks from
        (:func:`~bnpfed.matching.posteriors.match_posteriors`)."""
        return copy.deepcopy(self._template)

    @property
    def prior(self) -> Prior:
        """The prior object, which the sample sites read on every run (``prior.update_`` changes it in place)."""
        return self._prior

    @property
    def local_reparameterization(self) -> bool:
        """Whether runs under :meth:`context` and :meth:`output_at` use local reparameterisation (fixed at
        construction)."""
        return self._local_reparameterization

    # ------------------------------------------------------------------------------------------ the Pyro program

    def output(self, x: Tensor) -> Tensor:
        """Run the network once: ``(B, ...)`` inputs to its ``(B, ...)`` output (logits for classification).
        Bayesian parameters are sampled at their sites (from the prior, or from a guide's trace under
        ``poutine.replay``)."""
        with _module_local_params():
            return self.net(x)

    def model(self, x: Tensor, y: Optional[Tensor] = None, dataset_size: Optional[int] = None) -> Tensor:
        """The Pyro model: weights from the prior, then targets ``y`` from the likelihood.

        :param Tensor x: inputs, ``(B, ...)``.
        :param Tensor y: targets to condition on (``(B,)`` integer labels for classification), or ``None`` to sample.
        :param int dataset_size: number of examples ``n`` the batch stands for; the likelihood is scaled by
            ``n / B``. Default ``B`` (no scaling).
        :returns: the network's output, ``(B, ...)``.
        """
        batch, dataset_size = self.check_batch(x, y, dataset_size)
        output = self.output(x)
        observations = self.likelihood.distribution(output)
        if y is not None and y.shape != observations.shape():
            raise ValueError(f"y: expected a tensor of shape {tuple(observations.shape())} for {self.likelihood!r}, "
                             f"got {_describe(y)}")
        with pyro.plate("data", size=dataset_size, subsample=torch.arange(batch, device=x.device)):
            pyro.sample("y", observations, obs=y)
        return output

    @staticmethod
    def check_batch(x: Tensor, y: Optional[Tensor] = None, dataset_size: Optional[int] = None) -> tuple[int, int]:
        """``(B, n)`` for a batch of the model's arguments, or a ``ValueError`` naming the bad one: ``x`` a tensor
        ``(B, ...)`` with B >= 1, ``y`` None or a tensor ``(B, ...)``, ``dataset_size`` None (then n = B) or an
        int n >= B."""
        batch = _batch_size(x)
        if y is not None and (not torch.is_tensor(y) or y.dim() < 1 or y.shape[0] != batch):
            raise ValueError(f"y: expected a tensor of shape ({batch}, ...) matching x, got {_describe(y)}")
        if dataset_size is None:
            return batch, batch
        if isinstance(dataset_size, bool) or not isinstance(dataset_size, int) or dataset_size < batch:
            raise ValueError(f"dataset_size: expected an int >= the batch size {batch}, got {dataset_size!r}")
        return batch, dataset_size

    # nn.Module entry point, so that ELBO modules (``TraceMeanField_ELBO()(bnn, guide)``) and optimisers find the
    # deterministic parameters.
    forward = model

    def prior_distributions(self) -> dict[str, Any]:
        """``{site: distribution}``: the prior each Bayesian site has now (after any ``prior.update_``), with the
        site's shape as ``event_shape``: a fixed distribution, for a prior without hyper-parameters.

        :raises ValueError: for a prior with hyper-parameters (:attr:`hyper_sites`), whose weights have no fixed
            prior: it is a function of the hyper-parameters drawn in each run of the model.
        """
        if self.hyper_sites:
            raise ValueError(f"prior: {type(self.prior).__name__} draws hyper-parameters {list(self.hyper_sites)} "
                             "in every run of the model; the weights' priors depend on them, and are no fixed "
                             "distributions")
        return {name: site_prior(None) for name, site_prior in self._site_priors.items()}

    def _likelihood_sites(self, hyper: Mapping) -> dict[str, tuple[None, Tensor, Any]]:
        """``{site: (None, initial value, support)}`` of the likelihood's latent sites, initialised as the prior's
        hyper-parameters are."""
        sites = {}
        for name, fn in self.likelihood.latent_sites().items():
            if name in hyper or name in self._site_priors:
                raise ValueError(f"likelihood: {self.likelihood!r} draws the site {name!r}, which the prior draws too")
            node = {"name": name, "fn": fn, "value": None, "is_observed": False, "type": "sample", "infer": {},
                    "args": (), "kwargs": {}}
            with torch.no_grad(), seeded(0):
                value = init_to_mean(site=node)
                if not bool(torch.isfinite(value).all()):
                    value = init_to_median(site=node, num_samples=101)
            sites[name] = (None, value.detach().clone(), fn.support)
        return sites

    def _read_hyper_sites(self) -> dict[str, tuple[str, Tensor, Any]]:
        """``{hyper site: (weight site, initial value, support)}``: the sample statements each weight's prior makes
        (traced outside any run of the model), with the value Pyro's ``init_to_mean`` gives each (its prior's
        mean; without a finite one, the median of 101 draws of seed 0).

        :raises ValueError: naming the prior and the site, for a prior that draws random values outside
            ``pyro.sample`` statements (a prior of the site that changes from one call to the next with the
            hyper-parameters held: a draw no guide can learn, which a closed-form ELBO would cache), or a hyper site
            two weights' priors both draw.
        """
        hyper: dict[str, tuple[str, Tensor, Any]] = {}
        for name, site_prior in self._site_priors.items():
            with _module_local_params(), seeded(0):
                trace = poutine.trace(site_prior).get_trace(None)
            drawn = {h: node for h, node in trace.nodes.items() if node["type"] == "sample"}
            for h, node in drawn.items():
                if h in hyper or h in self._site_priors:
                    raise ValueError(f"prior: {type(self.prior).__name__} draws the site {h!r} in the priors of both "
                                     f"{hyper[h][0] if h in hyper else h!r} and {name!r}: a hyper-parameter is a "
                                     "sample site of its own, drawn in one weight's prior")
                if node["is_observed"]:
                    raise ValueError(f"prior: {type(self.prior).__name__} observes the site {h!r} in the prior of "
                                     f"{name!r}; expected latent hyper-parameters only")
                with torch.no_grad(), seeded(0):
                    value = init_to_mean(site=node)
                    if not bool(torch.isfinite(value).all()):   # no mean (a half-Cauchy): the median of draws
                        value = init_to_median(site=node, num_samples=101)
                hyper[h] = (name, value.detach().clone(), node["fn"].support)
            held = {h: node["value"] for h, node in drawn.items()}
            first = trace.nodes["_RETURN"]["value"]
            with _module_local_params(), seeded(1):
                second = poutine.condition(site_prior, data=held)(None)
            point = self.init_values[name]
            if not torch.equal(first.log_prob(point), second.log_prob(point)):
                raise ValueError(f"prior: {type(self.prior).__name__} gives site {name!r} a different prior on every "
                                 "call (it draws random values outside pyro.sample statements); draw a "
                                 "hyper-parameter with pyro.sample, so that it is a latent site the guide learns, "
                                 "never one draw fixed for the whole fit")
        return hyper

    @contextlib.contextmanager
    def context(self):
        """Context manager for each joint run of a guide and this model (an ELBO evaluation, a predictive sample):
        keeps parameters module-local and, if enabled, applies local reparameterisation to both."""
        with _module_local_params():
            if self.local_reparameterization:
                with local_reparameterization():
                    yield
            else:
                yield

    def sample_output(self, x: Tensor, guide: Optional[Callable] = None) -> Tensor:
        """The output under one draw of the weights: from ``guide`` (called with ``x``) if given, else from the
        prior."""
        with self.context():
            if guide is None:
                return self.output(x)
            guide_trace = poutine.trace(guide).get_trace(x)
            return poutine.replay(self.output, trace=guide_trace)(x)

    @torch.no_grad()
    def predict(self, x: Tensor, num_samples: int = 10, guide: Optional[Callable] = None,
                seed: Optional[int] = None) -> Any:
        """The posterior predictive from ``num_samples`` draws of the weights, aggregated by the likelihood
        (:meth:`Likelihood.predictive`), with the network in eval mode (batch norms at their running statistics,
        which it leaves unchanged; no dropout; the modes are restored after). For classification, the mean of the
        softmax probabilities:

            p(y | x) ~= 1/S sum_s softmax(f(x; w_s)),   w_s ~ guide (posterior) or the prior when ``guide`` is None

        :param Tensor x: inputs, ``(B, ...)``.
        :param int num_samples: S, the number of weight draws. Default 10.
        :param guide: a guide of this model, e.g. :class:`bnpfed.clients.MeanFieldGuide`; ``None`` samples the prior.
        :param int seed: if given, draws use this seed (Torch's global random state is left as it was).
        :returns: what the likelihood's ``predictive`` returns: ``(B, num_classes)`` probabilities for
            ``Categorical``, a ``GaussianPredictive(mean, variance)`` for ``Gaussian``; for a likelihood with latent
            sites (a learned noise scale), :func:`~bnpfed.models.predictive_of` the draws' observation distributions
            (:meth:`sample_observations`).
        """
        if self.likelihood.latent_sites() or isinstance(self.likelihood, StudentT):
            return predictive_of(self.sample_observations(x, num_samples, guide, seed))
        return self.likelihood.predictive(self.sample_outputs(x, num_samples, guide, seed))

    @torch.no_grad()
    def sample_observations(self, x: Tensor, num_samples: int = 10, guide: Optional[Callable] = None,
                            seed: Optional[int] = None) -> list:
        """The observation distributions ``p(y | x, w_s)`` of ``num_samples`` draws ``w_s`` (from ``guide``, else
        the prior), each of batch shape ``(B,)``: the model's ``"y"`` site run with every latent site (the
        likelihood's too) replayed from the draw, and not drawn itself (:class:`Undrawn`: the weights of draw s are
        the same for any batch); the same eval mode as :meth:`predict`."""
        num_samples = check_int(num_samples, "num_samples", low=1)
        _batch_size(x)
        modes = [(module, module.training) for module in self.modules()]
        self.eval()
        observations = []
        try:
            with seeded(seed, x.device), self.context():
                for _ in range(num_samples):
                    model = self.model
                    if guide is not None:
                        model = poutine.replay(self.model, trace=poutine.trace(guide).get_trace(x))
                    observations.append(poutine.trace(Undrawn("y")(model)).get_trace(x).nodes["y"]["fn"])
        finally:
            for module, training in modes:
                module.training = training
        return observations

    @torch.no_grad()
    def sample_outputs(self, x: Tensor, num_samples: int = 10, guide: Optional[Callable] = None,
                       seed: Optional[int] = None) -> Tensor:
        """``(S, B, ...)`` the network's outputs under ``num_samples`` draws of the weights, the draws :meth:`predict`
        aggregates (the same arguments, the same eval mode)."""
        num_samples = check_int(num_samples, "num_samples", low=1)
        _batch_size(x)
        modes = [(module, module.training) for module in self.modules()]
        self.eval()  # batch norm at its running statistics, no dropout: a prediction changes nothing
        try:
            with seeded(seed, x.device):
                return torch.stack([self.sample_output(x, guide) for _ in range(num_samples)])
        finally:
            for module, training in modes:
                module.training = training

    # ------------------------------------------------------------------------------------------ plain torch

    def _build_plain(self, net: nn.Module) -> None:
        """The user's network once more, as plain torch, for :meth:`output_at`: its deterministic parameters and
        buffers are tied to ``self.net`` 's (re-tied on every call, so moves and reassignments carry over), its
        Bayesian parameters removed (set per call)."""
        plain = copy.deepcopy(net)
        pyro_modules = dict(self.net.named_modules())
        self._plain_pairs = [(pyro_modules[name], module) for name, module in plain.named_modules()]
        self._plain_slots: dict[str, tuple[nn.Module, str]] = {}
        for name in self.bayesian_sites:
            module_name, _, attr = name.rpartition(".")
            module = plain.get_submodule(module_name)
            del module._parameters[attr]
            self._plain_slots[name] = (module, attr)
        owners = {type(module) for module, _ in self._plain_slots.values()}
        #: Whether :meth:`output_at` can apply local reparameterisation exactly as the handler does (every Bayesian
        #: site belongs to an ``nn.Linear`` or to a layer that never calls ``F.linear`` on its parameters).
        self.plain_local_reparameterization = all(t is nn.Linear or t in _LAYERS_WITHOUT_LINEAR for t in owners)
        self._plain_linears: list[tuple[LocalReparameterizedLinear, str, Optional[str]]] = []
        if self.local_reparameterization and self.plain_local_reparameterization:
            for module_name, module in plain.named_modules():
                weight = f"{module_name}.weight" if module_name else "weight"
                if type(module) is nn.Linear and weight in self._plain_slots:
                    bias = weight[: -len("weight")] + "bias"
                    self._plain_linears.append((LocalReparameterizedLinear.convert_(module), weight,
                                                bias if bias in self._plain_slots else None))
        object.__setattr__(self, "_plain", plain)  # not a submodule: its parameters are self.net's

    def output_at(self, x: Tensor, values: Mapping[str, Tensor],
                  moments: Optional[Mapping[str, tuple[Tensor, Tensor]]] = None) -> Tensor:
        """The network's output with every Bayesian site s set to ``values[s]``, as plain torch (no Pyro): the same
        function as ``poutine.condition(self.output, values)(x)``, differentiable in ``values`` and in the
        deterministic parameters.

        :param Mapping values: ``{site: tensor}`` for every Bayesian site.
        :param Mapping moments: ``{site: (mean, variance)}`` of the Gaussian distributions the values were drawn
            from. Given, and with ``local_reparameterization`` on, every ``nn.Linear`` whose weight is a site draws
            its pre-activations from these moments (:class:`LocalReparameterizedLinear`) instead of using the value,
            as :func:`local_reparameterization` does in the Pyro program (only when
            :attr:`plain_local_reparameterization`).
        """
        # plain attributes are written into __dict__: nn.Module.__setattr__ costs more than the small layers' math
        for source, target in self._plain_pairs:
            target.__dict__["training"] = source.training
            target._parameters.update(source._parameters)
            target._buffers.update(source._buffers)
        for name, (module, attr) in self._plain_slots.items():
            module.__dict__[attr] = values[name]
        for module, weight, bias in self._plain_linears:
            module.__dict__["weight_moments"] = None if moments is None else moments[weight]
            module.__dict__["bias_moments"] = None if moments is None or bias is None else moments[bias]
        return self._plain(x)


class Undrawn(Messenger):
    """Runs the named sample sites without drawing them (a placeholder value of zeros, as if observed): a trace
    that only reads their distributions then draws the same random numbers whatever the batch size, so the weight
    draws of a predictive are the same on a whole test split and on any shard of it.

    :param str site: the site's name.
    """

    def __init__(self, site: str):
        super().__init__()
        self.site = site

    def _process_message(self, msg):
        if msg["type"] == "sample" and msg["name"] == self.site and msg["value"] is None:
            msg["value"] = torch.zeros(msg["fn"].shape())
            msg["is_observed"] = True


def _batch_size(x) -> int:
    if not torch.is_tensor(x) or x.dim() < 1 or x.shape[0] < 1:
        raise ValueError(f"x: expected a tensor of shape (B, ...) with B >= 1, got {_describe(x)}")
    return x.shape[0]


def _describe(value) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else repr(value)
