"""Matched posterior fusion, round by round: variational Bayesian clients from their own initialisations, a server
that matches their hidden units and fuses each global unit's posteriors (issue "matching Bayesian neurons").

Round ``t = 1 .. T``:

1. the server samples the clients of the round (:func:`~bnpfed.federated.server.sample_clients`);
2. each sampled client runs SVI on its data (:func:`~bnpfed.federated.clients.fit_bayesian`): in round 1 from its own
   initialisation (no shared one) with the configured prior; later from its slice of the global posterior -- the
   global units its own were matched to -- or, if it was not matched last round or ``FusionConfig.later_rounds`` is
   ``"fixed"``, from the whole global posterior,
   under the configured prior (``BayesianConfig.round_prior``: ``"prior"``, the default, so that every round fuses
   posteriors that hold each client's data once), or with that slice as its prior too (``"posterior"``: the
   posterior-as-prior of Bayesian federated learning, :meth:`BayesianClient.update_prior_`, which counts the
   client's data once more every round), or under rule ``"pvi"`` against its cavity;
3. the server matches and fuses (:func:`~bnpfed.federated.server.matched_fusion_step`: heteroscedastic
   Beta-Bernoulli matching group by group -- or, for Laplace clients by default (``FusionConfig.match_on``), PFNM's
   matching of the posterior means with each client's dead units left out, from the activity it reports --
   warm-started from the assignment the clients came from, or with ``later_rounds="fixed"`` kept at it, then one
   rule of :mod:`bnpfed.combine` per global unit);
   the width may change from round to round;
4. the global Bayesian network is evaluated: the Monte Carlo posterior predictive (softmax averaged over S weight
   draws from ``(seed, PREDICT, t)``), and the posterior-mean network's accuracy beside it. With
   ``FusionConfig(heads="pooled")`` the global network's output layer is the clients' own posterior output layers
   pooled log-linearly with the class shares (:class:`~bnpfed.matching.PooledPosterior`; the method
   ``match:rule=<rule>:heads=pooled``, rows ``match-<rule>-pooled``) instead of their fusion.

The in-process federation and the Flower strategy call the same server step, so with every client answering they
give the same global posterior.

Usage::

    >>> from bnpfed.data import load_dataset
    >>> from bnpfed.federated.config import BayesianConfig, FusionConfig, NetworkConfig, PartitionConfig
    >>> from bnpfed.federated.config import TrainingConfig
    >>> ds = load_dataset("digits")
    >>> parts = PartitionConfig(clients=3).split(ds.y_train.numpy(), seed=0)
    >>> federation = MatchedFusionFederation(ds, parts, network=NetworkConfig(hidden=(16,)),
    ...                                      training=TrainingConfig(epochs=1), bayesian=BayesianConfig(),
    ...                                      fusion=FusionConfig(rule="eaa", align="match"), seed=0)
    >>> record = federation.run_round()
    >>> federation.method, sorted(federation.match.variances)
    ('match-eaa', ['1.weight', '3.weight'])
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from bnpfed.data import Dataset
from bnpfed.federated.clients import (bayesian_client, fit_bayesian, initial_network, posterior_client,
                                     posterior_nll_step, pooled_posterior_nll_step, unit_activity_step)
from bnpfed.federated.config import (FIT, PVI_DAMPING, BayesianConfig, FusionConfig, NetworkConfig, TrainingConfig,
                                     check_pool_temperature_applies)
from bnpfed.federated.federation import Federation
from bnpfed.federated.fusion import check_fusion_network
from bnpfed.federated.partition import class_counts
from bnpfed.federated.rounds import Architecture, HoldsRounds, MatchRounds, PVIFactors
from bnpfed.federated.server import match_hyperparameters, matched_fusion_step
from bnpfed.clients import BayesianClient, LaplaceClient
from bnpfed.matching import PooledPosterior
from bnpfed.matching import network_from_state
from bnpfed.matching import fit_temperature
from bnpfed.matching import PVI, PosteriorMatch, client_posterior
from bnpfed.metrics import count_parameters
from bnpfed.models import PRIORS, BayesianNetwork, Categorical, Prior
from bnpfed.posterior import GaussianPosterior
from bnpfed.seeding import Stream, derive_seed
from bnpfed.validation import check_positive

__all__ = ["MatchedFusionFederation", "bayesian_from_match", "client_from_slice", "matched_hyperparameters",
           "pvi_factors", "pvi_prior_variance", "tempered"]


def _posterior(locs, variances, like: dict[str, Tensor]) -> dict[str, GaussianPosterior]:
    return {k: GaussianPosterior(locs[k].to(like[k].dtype), v.to(like[k].dtype)) for k, v in variances.items()}


def client_from_slice(template: nn.Module, locs, variances, bayesian: BayesianConfig, *,
                      as_prior: bool = True, prior: Optional[tuple] = None) -> BayesianClient:
    """A Bayesian client holding ``(locs, variances)`` (a client's slice of a global posterior, or the whole of it):
    its network of the template's kind at those widths and its posterior set to them. With ``as_prior``, a client to
    train in the next round, its prior as ``bayesian.round_prior`` says: the configured one (None, ``"prior"``) or
    the slice itself (``"posterior"``; each client has a prior object of its own); ``prior``: ``(means, variances)``
    of its Bayesian sites to be its prior instead (PVI's cavity). With ``as_prior`` and Laplace clients
    (``bayesian.client``), a :class:`~bnpfed.clients.LaplaceClient` of that network at the means instead (its
    next fit starts there; the variances are no prior of a Laplace client); without ``as_prior`` (the global
    network) a client of the configured prior holding them, for Laplace clients
    :meth:`~bnpfed.clients.LaplaceClient.holding` (the linearised predictive suits a posterior of Laplace
    clients)."""
    state = template.state_dict()
    # a posterior's sites that are no parameter of the network (a prior's hyper-parameters) go to the guide only
    net = network_from_state(template, {k: v for k, v in locs.items() if k in state or k not in variances})
    if isinstance(bayesian.prior, Prior) and (prior is not None or (as_prior and bayesian.round_prior == "posterior")):
        # a prior of its own: a prior object is shared by every client built from the config, and this one's
        # prior becomes its own posterior or cavity
        bayesian = replace(bayesian, prior=bayesian.prior.initial())
    if bayesian.client == "laplace":
        if as_prior:
            return posterior_client(net, bayesian)
        posterior = {k: GaussianPosterior(locs[k], v) for k, v in variances.items()}
        return LaplaceClient.holding(net, posterior, bayesian.build_prior())
    client = bayesian_client(net, bayesian)
    like = {k: p.loc for k, p in client.posterior().items()}
    posterior = _posterior(locs, variances, like)
    client.load_posterior(posterior)
    deterministic = client.deterministic_state()
    client.load_deterministic({k: locs[k].to(v.dtype) for k, v in deterministic.items()})
    if prior is not None:
        client.update_prior_(_posterior(prior[0], prior[1], like))
    elif as_prior and bayesian.round_prior == "posterior":
        client.update_prior_(posterior)
    return client


def bayesian_from_match(match: PosteriorMatch, bayesian: BayesianConfig) -> BayesianClient:
    """The global Bayesian network of a match, as a client (for its posterior predictive)."""
    return client_from_slice(match.template, match.locs, match.variances, bayesian, as_prior=False)


def tempered(client: BayesianClient | LaplaceClient, temperature: float) -> BayesianClient | LaplaceClient:
    """``client`` (in place, returned) with its predictive's temperature set to ``temperature``: its posterior
    predictive then averages ``softmax(f(x; w_s) / temperature)`` over its draws (a variational client through its
    likelihood, :class:`~bnpfed.models.likelihoods.Categorical`; a :class:`~bnpfed.clients.LaplaceClient` over the
    draws of its linearised predictive, :attr:`~bnpfed.clients.LaplaceClient.temperature`); for a global client,
    which no one trains."""
    if isinstance(client, LaplaceClient):
        client.temperature = float(check_positive(temperature, "temperature"))
        return client
    likelihood = client.bnn.likelihood
    if not isinstance(likelihood, Categorical):
        raise ValueError(f"client: expected a classifier (a Categorical likelihood) to temper, got {likelihood!r}")
    client.bnn.likelihood = Categorical(likelihood.num_classes, temperature=temperature)
    return client


def pvi_factors(fusion: FusionConfig, bayesian: BayesianConfig, template: Optional[nn.Module] = None
                ) -> Optional[PVIFactors]:
    """The server's PVI bookkeeping for ``fusion.rule == "pvi"`` (None otherwise), after checking that the clients
    can take part: variational clients under a fixed zero-mean Gaussian prior (the factors are measured against it):
    a built-in named prior ``N(0, prior_scale^2)``, or any prior (a named one a plugin registered, a prior object)
    whose every Bayesian site is a zero-mean Normal of one variance (:func:`pvi_prior_variance`, read on
    ``template``, a network of the clients' kind; without one, ``prior_variance`` is set when it is known)."""
    if fusion.rule != PVI:
        return None
    if bayesian.client != "variational" or bayesian.prior_variance != "fixed":
        raise ValueError(f"fusion.rule: {PVI!r} trains variational clients against their cavities under a fixed "
                         f"zero-mean Gaussian prior; expected client='variational' and prior_variance='fixed', got "
                         f"client={bayesian.client!r}, prior_variance={bayesian.prior_variance!r}")
    damping = PVI_DAMPING if fusion.pvi_damping is None else fusion.pvi_damping
    if isinstance(bayesian.prior, str) and bayesian.prior in PRIORS:
        return PVIFactors(bayesian.prior_scale ** 2, damping)
    return PVIFactors(None if template is None else pvi_prior_variance(bayesian, template), damping)


def pvi_prior_variance(bayesian: BayesianConfig, template: nn.Module) -> dict[str, float]:
    """``{site: v_s}``: the variance of each Bayesian site's prior under ``bayesian``'s prior on a network of the
    clients' kind, which PVI measures the clients' factors against; every site's prior must be ``N(0, v_s)`` with
    one ``v_s`` for all its entries (it is then the prior of every unit a match puts there).

    :raises ValueError: ``"fusion.rule: ..."`` naming the site, for a prior that is not.
    """
    prior = bayesian.build_prior()
    if prior.estimable:
        raise ValueError(f"fusion.rule: {PVI!r} measures the clients' factors against a fixed prior; expected one, "
                         f"got {prior!r}, which each client re-estimates")
    try:
        distributions = BayesianNetwork(template, prior.initial()).prior_distributions()
    except ValueError as error:
        raise ValueError(f"fusion.rule: {PVI!r} expected a prior with fixed Gaussian sites: {error}") from None
    variances = {}
    for site, fn in distributions.items():
        base = fn
        while isinstance(base, torch.distributions.Independent):
            base = base.base_dist
        ok = isinstance(base, torch.distributions.Normal)
        ok = ok and bool((base.loc == 0).all()) and bool((base.scale == base.scale.reshape(-1)[0]).all())
        if not ok:
            raise ValueError(f"fusion.rule: {PVI!r} expected the prior of every Bayesian site to be N(0, v) with one "
                             f"variance v for the site, got {fn!r} for {site!r}")
        variances[site] = float(base.scale.reshape(-1)[0]) ** 2
    return variances


#: The hyper-parameter table of a match (one function for PFNM and matched fusion alike).
matched_hyperparameters = match_hyperparameters


class MatchedFusionFederation(HoldsRounds, Federation):
    """J variational Bayesian clients from their own initialisations and a server that matches and fuses them.

    :param Dataset dataset: train split (partitioned) and test split (evaluation).
    :param parts: J index arrays into ``dataset.y_train``.
    :param NetworkConfig network: the clients' network kind (``shared_init`` is ignored: each starts from its own).
    :param TrainingConfig training: the clients' local SVI schedule.
    :param BayesianConfig bayesian: the round-1 prior, initial posterior scale, local reparameterisation.
    :param FusionConfig fusion: the rule, member weights, ``tau2``, pooling draws, variance floor, client sampling,
        the output layer (``heads``: with ``"pooled"`` the federation's name is ``match-<rule>-pooled``).
    :param int seed: the experiment's seed.
    :param int ece_bins: bins of the calibration error. Default 15.
    :param int predictive_samples: weight draws S of the posterior predictive. Default 10.
    :param initial_clients: optional, the J Bayesian clients after round 1's local SVI with these settings and seed
        (shared by several rules in an experiment): round 1 then reuses them.

    Attributes: ``clients`` (the J clients as they last trained), ``match`` (the last
    :class:`~bnpfed.matching.posteriors.PosteriorMatch`), ``global_model`` (its Bayesian network, the fused
    output layer's), ``pooled`` (with ``fusion.heads="pooled"``, the :class:`~bnpfed.matching.PooledPosterior` the
    predictions come from; else None), ``spec``, ``template``, ``class_counts``.
    """

    def __init__(self, dataset: Dataset, parts: Sequence, *, network: NetworkConfig, training: TrainingConfig,
                 bayesian: BayesianConfig, fusion: FusionConfig, seed: int, ece_bins: int = 15,
                 predictive_samples: int = 10, initial_clients: Optional[Sequence[BayesianClient]] = None):
        super().__init__(dataset, parts, seed=seed, fraction=fusion.fraction, ece_bins=ece_bins)
        for name, value, kind in (("network", network, NetworkConfig), ("training", training, TrainingConfig),
                                  ("bayesian", bayesian, BayesianConfig), ("fusion", fusion, FusionConfig)):
            if not isinstance(value, kind):
                raise ValueError(f"{name}: expected a {kind.__name__}, got {type(value).__name__}")
        self.check_network(network)
        counts = class_counts(dataset.y_train.numpy(), [p.numpy() for p in self.parts], dataset.num_classes)
        fusion = fusion.with_heads(counts)   # heads="auto": pooled when the clients' class shares differ
        check_pool_temperature_applies(fusion, fusion.heads == "pooled")
        bayesian.check_training(training)
        if bayesian.program is not None:
            raise ValueError("bayesian.program: matched fusion lines up a network's hidden units, which a Pyro "
                             "program does not expose; a program's clients are fused site by site "
                             "(FusionFederation, align='none'), expected no program here")
        bayesian.check_task(dataset.task)
        training.check_inputs(dataset.input_shape)
        if initial_clients is not None and len(initial_clients) != self.num_clients:
            raise ValueError(f"initial_clients: expected one client per partition ({self.num_clients}), got "
                             f"{len(initial_clients)}")
        self.network = replace(network, shared_init=False)
        self.training, self.bayesian, self.fusion = training, bayesian, fusion
        self.method = f"match-{fusion.rule}" + ("-pooled" if fusion.heads == "pooled" else "")
        self.predictive_samples = int(predictive_samples)
        self.class_counts = counts
        self.architecture = Architecture.of(self.network, dataset.input_shape, dataset.num_classes, seed=seed)
        self.rounds = MatchRounds(self.architecture, whole=fusion.rounds_after_first() == "fixed")
        self.initial_clients = initial_clients
        self.clients: list[Optional[BayesianClient]] = [None] * self.num_clients
        self.global_model: Optional[BayesianClient] = None
        self.pooled: Optional[PooledPosterior] = None
        self.pvi = pvi_factors(fusion, bayesian, self.architecture.template)
        fusion.client_prior(bayesian)   # raises if bayesian.round_prior does not apply to this fusion

    @staticmethod
    def check_network(network: NetworkConfig) -> None:
        """Raise unless ``network`` can be matched and fused: the rule of every posterior fusion
        (:func:`~bnpfed.federated.fusion.check_fusion_network`: no batch norm)."""
        check_fusion_network(network)

    def _start(self, j: int) -> BayesianClient:
        start = self.rounds.start(j)
        if start is None:  # round 1: the client's own initialisation
            net = initial_network(self.network, self.dataset.input_shape, self.dataset.num_classes, seed=self.seed,
                                  client=j)
            return posterior_client(net, self.bayesian)
        if self.pvi is not None:   # PVI: its slice as the start, the slice less its own factor as the prior
            return client_from_slice(self.template, *start, self.bayesian, prior=self.pvi.cavity(j, start))
        return client_from_slice(self.template, *start, self.bayesian)

    def _round(self, round, sampled):
        losses = []
        for j in sampled:
            if round == 1 and self.initial_clients is not None:
                self.rounds.start(j)
                self.clients[j] = self.initial_clients[j]
                continue
            client = self._start(j)
            x, y = self.client_data[j]
            losses.append(fit_bayesian(client, x, y, self.training, seed=self.seed, round=round, index=j,
                                       scale_lr_factor=self.bayesian.scale_lr_factor))
            self.clients[j] = client
        t0 = time.perf_counter()
        posteriors = [client_posterior(self.clients[j]) for j in sampled]
        match_on = self.fusion.matches_on(self.bayesian.client)
        activity = None
        if match_on == "means":   # each client's report on its units (its posterior-mean network), on its own data
            activity = [unit_activity_step(self.clients[j].mean_network(), self.client_data[j][0],
                                           self.dataset.input_shape, self.training.batch_size) for j in sampled]
        extra = {} if self.pvi is None else {"cavity_at_prior": self.pvi.improper}
        pvi = {} if self.pvi is None else self.pvi.step_arguments(sampled, posteriors)
        match = matched_fusion_step(posteriors, self.class_counts[sampled], [self.sizes[j] for j in sampled],
                                    self.fusion, seed=self.seed, round=round, starts=self.rounds.warm_start(sampled),
                                    spec=self.spec, template=self.template, match_on=match_on, activity=activity,
                                    **pvi)
        seconds = time.perf_counter() - t0
        self.rounds.update(match, sampled)
        if self.pvi is not None:
            extra["improper"] = match.improper
        self.global_model = bayesian_from_match(match, self.bayesian)
        if self.fusion.heads == "pooled":   # the sampled clients' own heads, in the match's order
            self.pooled = PooledPosterior.of_match(match, posteriors)
            self.pooled.temperature = self._temperature(self.fusion.pool_temperature, pooled_posterior_nll_step,
                                                        self.pooled, sampled, round)
            extra["pool_temperature"] = self.pooled.temperature
            self._mean_net = self.pooled.mean_network().float().eval()
        else:
            self._mean_net = match.network().float().eval()
            if self.fusion.temperature != 1:   # the fused predictive's temperature, given or fitted
                temperature = self._temperature(self.fusion.temperature, posterior_nll_step, self.global_model,
                                                sampled, round)
                self.global_model = tempered(self.global_model, temperature)
                extra["temperature"] = temperature
        metrics = {**self.rounds.summary(), "parameters": count_parameters(self._mean_net),
                   "server_seconds": seconds, **extra}
        if losses:
            metrics["train_loss"] = sum(losses) / len(losses)
        with torch.no_grad():
            x, y = self.dataset.x_test, self.dataset.y_test
            metrics["mean_accuracy"] = float((self._mean_net(x).argmax(-1) == y).double().mean())
        return [], metrics

    def _temperature(self, value, nll_step, model, sampled: Sequence[int], round: int) -> float:
        """``value`` (a number), or with ``"fit"`` the temperature of least summed NLL of ``model``'s predictive
        (``nll_step(model, x, y, S, draws)``) on each sampled client's own data, with the round's evaluation draws."""
        if value != FIT:
            return float(value)
        draws = derive_seed(self.seed, Stream.PREDICT, round)
        return float(fit_temperature([nll_step(model, *self.client_data[j], self.predictive_samples, draws)
                                      for j in sampled]))

    def predict_proba(self, x: Tensor) -> Tensor:
        """The global posterior predictive: softmax averaged over ``predictive_samples`` weight draws, drawn from
        ``(seed, PREDICT, round)`` (with ``heads="pooled"``, :meth:`PooledPosterior.predict_proba`)."""
        if self.global_model is None:
            raise ValueError("no round has run yet: the federation has no global network")
        if self.pooled is not None:
            return self.pooled.predict_proba(x, num_samples=self.predictive_samples,
                                             seed=derive_seed(self.seed, Stream.PREDICT, self.round))
        return self.global_model.predict_proba(x, num_samples=self.predictive_samples,
                                               seed=derive_seed(self.seed, Stream.PREDICT, self.round))

    @torch.no_grad()
    def predict_mean(self, x: Tensor) -> Tensor:
        """The posterior-mean network's class probabilities (with ``heads="pooled"``, the pooled one's)."""
        if self.match is None:
            raise ValueError("no round has run yet: the federation has no global network")
        return self._mean_net(x).softmax(-1)

