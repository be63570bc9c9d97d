"""Matching Bayesian neurons: fuse the posteriors of independently initialised variational Bayesian networks.

Posterior fusion (Ozer et al. 2022, :mod:`bnpfed.combine`) fuses weight i of client 1 with weight i of client 2,
which means something only when every client started from one shared initialisation and drifted little. PFNM
(Yurochkin et al. 2019) matches the hidden units of independently trained networks first, but takes point
estimates. Here the two meet: client j holds a mean-field Gaussian posterior, so every hidden unit l is a neuron with
posterior means ``v_jl`` and posterior variances ``u_jl`` (0 on a deterministic coordinate, e.g. a bias that the
prior keeps deterministic), and the server

1. matches each group of the permutation spec bottom-up (:func:`~bnpfed.matching.permutation.match_by_spec`'s
   order and unit vectors) with the heteroscedastic Beta-Bernoulli model
   (:func:`~bnpfed.matching.bayesian_layer.match_bayesian_layer`: neuron l of client j observes its atom with
   variance ``u_jld + tau2`` per coordinate, tau2 estimated per group);
2. fuses, for every global unit, the posteriors of its members with one rule of :mod:`bnpfed.combine`
   (:func:`fuse_members`), giving a global Bayesian network: a Gaussian posterior per Bayesian weight, a value per
   deterministic parameter.

**Member weights.** On a unit's own coordinates (its incoming weights and bias) member j weighs ``b_j = n_j`` (its
training examples); on the output-layer coordinates of class k it weighs ``share_jk = n_jk / sum_j' n_j'k`` (PFNM's
class shares). The rule sees the members' weights normalised over the members that hold the coordinate (for a class
none of the members saw, equal weights: the unit's value for its members' slices; the global network gives it
coverage 0).

**A unit that few clients have, and coverage.** Not every member holds every coordinate: a client that lacks global
unit g of the layer below has no weight from g (a structural zero, not an uncertain value), and a class a member
never saw carries no share. Per coordinate d the rule therefore fuses the members that hold it, and the result is
then scaled by the coverage ``kappa_d = sum_{members holding d} b_jd / sum_{reference} b_jd`` -- mean times kappa,
variance times kappa^2 (the law of ``kappa w``) -- where the reference set is the unit's members on its own
coordinates and *all* clients on the output coordinates. This is the deterministic "average" construction of
:func:`~bnpfed.matching.layer.average_atoms` made Bayesian: under ``eaa`` (and ``gaa``, ``log_variance``,
``pooling`` for the mean) the fused means are exactly that average -- a global unit's incoming weights are its
members' average, and the output layer computes the clients' logits averaged class by class, so that a unit only one
client has speaks with that client's share and no more. A coordinate no member holds is 0 with variance
``min_variance``.

**What the rules mean here.** For one global unit the members are J' <= J noisy views of one atom.

* ``conflation`` (equal weights: the product of the members' densities) is the precision-weighted combination;
  with the atom prior as one more factor and every member's variance widened by tau2 it is *the model's own
  conjugate posterior of the atom*, ``N(g_i / P_i, 1 / P_i)`` of :mod:`bnpfed.matching.bayesian_layer`
  (tested). With unequal weights each density is raised to ``b_j / b_max``.
* ``gaa`` is the law of the weighted average of independent draws from the members: its variance shrinks like 1/J'.
* ``eaa`` averages means and variances (a unit keeps a member's typical uncertainty); ``log_variance`` takes the
  weighted geometric mean of the variances; ``pooling`` moment-matches a sample pooled from the members (the mixture:
  it widens by the members' disagreement, which for matched units of independently trained clients is the tau2
  between them).

Deterministic coordinates (variance 0 at every member) are averaged with the same weights and coverage.

**The model's own atom posterior** (``rule="atom-posterior"``, :data:`ATOM_POSTERIOR`; not a rule of
:mod:`bnpfed.combine`, as it needs the matching model). Every global unit i becomes the posterior of its atom under
the model it was matched by, given its members: per coordinate

    P_id = 1 / sigma0_2 + sum_{j in i} s_jd / (u_jd + tau2),      theta_id | V ~ N(g_id / P_id, 1 / P_id),
    g_id = mu0_d / sigma0_2 + sum_{j in i} s_jd v_jd / (u_jd + tau2),

at the matcher's final hyper-parameters (the per-group tau2 and sigma0_2 of the coordinate's kind, estimated or
given), i.e. the matcher's ``MatchResult.global_atoms`` and ``1 / posterior_precision``. Unlike ``conflation`` it
widens every member by tau2 (copies of a unit at two clients lie further apart than either's posterior says) and
keeps the atom prior: it says what the model says of the atom, where conflation of the members' raw variances is
more confident whenever tau2 is not negligible beside them. Within the atom a client's class share enters once, as
the model has it: ``s_jd`` is ``share_jk`` on the output coordinates of class k (1 elsewhere) and divides the
member's noise variance ``u_jd + tau2``; a coordinate a member lacks (a unit of the layer below it does not have) is,
as in matching, an observation 0 with variance tau2. The global network is then built from the atoms as from any
rule's fusion: the coverage ``kappa`` above scales each unit (the clients' logits averaged class by class; the
client slices hold the atoms themselves). Deterministic coordinates take the atom's mean, with variance 0. The output
bias (no atom) is each class's share-weighted conflation of the clients' (a weighted average where it is
deterministic).

**Partitioned variational inference** (``rule="pvi"``, :data:`PVI`; Bui et al. 2018, Ashman et al. 2022). The
global posterior is the prior times one approximate-likelihood factor per client, ``q = p prod_j t_j``, and client
j's factor is what its fit added to what it trained against (its *cavity* ``c_j``): ``t_j = q_j / c_j``, in
natural parameters (precision ``lambda = 1 / v``, ``eta = m / v``) a difference. Matched, every global unit is the
prior times its members' factors, per Bayesian coordinate over the members holding it:

    lambda_id = lambda_0 + sum_{j in i} (1 / u_jd - lambda^c_jd),     eta_id = sum_{j in i} (v_jd / u_jd - eta^c_jd),

``lambda_0 = 1 / prior_variance`` the clients' zero-mean prior; the unit is ``N(eta / lambda, 1 / lambda)``, then
the coverage as for every rule. In round 1 (``cavities=None``) every cavity is the prior, so this is conflation of
the members with the prior counted once instead of once per member. In later rounds client j trains against the
cavity of its slice, ``c_j = slice_j(q) / t_j`` (:func:`cavity`), so that its own data, already in the slice through
its last factor, is not counted twice. A coordinate whose product is improper (the factors' precisions sum below
``-lambda_0``, which a client whose posterior came out wider than its cavity can cause) is set to the prior and
counted (``PosteriorMatch.improper``). Deterministic coordinates are averaged as for every rule.

**Matched on the means** (``match_on="means"``). The assignment may instead come from PFNM's homoscedastic model on
the posterior means alone (:func:`~bnpfed.matching.layer.match_layer`, tau2 in the role of its noise variance
sigma2: the heteroscedastic model with every ``u = 0``), the posteriors fused along it as above. This is for
posteriors whose variances say more about the prior than about the data: a post-hoc Laplace posterior of a network
trained without weight decay keeps most weights at their prior variance, so under the heteroscedastic model every unit
is uninformative and nothing merges (the docs' benchmark page on calibration, Laplace clients); on the means the
units merge as PFNM's do. With the clients' ``activity`` reports (:mod:`bnpfed.matching.activity`) the units dead on a
client's data are left out first, as :func:`~bnpfed.matching.network.match_by_spec` leaves them out: they join no
global unit.

**Rounds.** :meth:`PosteriorMatch.client_slice` gives a client its own units of the global posterior (its assignment
in every group): in PFNM with communication (Yurochkin et al. 2019, section 3.3) that slice is the client's next
starting point; by default it trains under its configured prior again, and with
``BayesianConfig(round_prior="posterior")`` the slice is its next prior too
(:func:`~bnpfed.clients.BayesianClient.update_prior_`), which counts the client's data once more every round
(:class:`~bnpfed.federated.config.BayesianConfig`; the docs' benchmark page on posterior fusion, matched fusion
over rounds).

Usage: two clients hold one Bayesian MLP with its hidden units permuted; matching and fusing puts it back together::

    >>> from torch import nn
    >>> from bnpfed.matching.permutation import derive_spec, client_slice
    >>> g = torch.manual_seed(0)
    >>> net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    >>> locs = {k: v.detach() for k, v in net.state_dict().items()}
    >>> variances = {"0.weight": torch.full((3, 4), 1e-4), "2.weight": torch.full((2, 3), 1e-4)}
    >>> spec = derive_spec(net, (4,))
    >>> perm = {"0": torch.tensor([2, 0, 1])}
    >>> other = (client_slice(spec, locs, perm), client_slice(spec, variances, perm))
    >>> fixed = dict(hyperparameters="fixed", tau2=1e-6, sigma0_2=1.0, gamma0=1.0)
    >>> match = match_posteriors([(locs, variances), other], rule="eaa", spec=spec, template=net, seed=0, **fixed)
    >>> match.widths, torch.allclose(match.locs["0.weight"], locs["0.weight"].double(), atol=1e-6)
    ({'0': 3}, True)
    >>> [j.tolist() for j in match.assignments["0"]]
    [[0, 1, 2], [2, 0, 1]]
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import torch
from torch import Tensor, nn

from bnpfed.combine import available_rules, average_deterministic, fuse
from bnpfed.matching.assembly import client_slice, network_from_state, state_from_atoms
from bnpfed.matching.bayesian_layer import match_bayesian_layer
from bnpfed.matching.layout import width
from bnpfed.matching.layer import match_layer
from bnpfed.matching.network import (call_matcher, group_values, match_groups, prepare_clients,
                                               resolve_spec, warm_start_labels, without_inactive)
from bnpfed.matching.spec import STATISTICS, PermutationSpec
from bnpfed.clients import BayesianClient
from bnpfed.models import Likelihood
from bnpfed.models import Prior
from bnpfed.posterior import GaussianPosterior
from bnpfed.validation import check_choice, check_int, check_positive

__all__ = ["ATOM_POSTERIOR", "MATCH_ON", "MIN_VARIANCE", "PVI", "PosteriorMatch", "cavity", "check_prior_variance",
           "client_posterior", "fuse_members", "match_means", "match_posteriors", "matched_rules", "prior_precision",
           "pvi_factor"]

#: What a matched fusion's assignment is computed from (:func:`match_posteriors`' ``match_on``).
MATCH_ON = ("posteriors", "means")


def match_means(means, variances, *, tau2=None, hyperparameters: str = "empirical-bayes", **options):
    """One group matched on its neurons' posterior means alone (``match_on="means"``, module docstring): PFNM's
    :func:`~bnpfed.matching.layer.match_layer` with tau2 as its noise variance sigma2; ``variances`` are not
    looked at. ``options``: the rest of :func:`~bnpfed.matching.layer.match_layer`'s keywords."""
    return match_layer(means, sigma2=tau2, hyperparameters=hyperparameters, **options)

#: The fusion of matched units by the matching model's own posterior of their atom (module docstring).
ATOM_POSTERIOR = "atom-posterior"
#: Partitioned variational inference: the prior times the members' approximate-likelihood factors (module docstring).
PVI = "pvi"


def matched_rules() -> tuple[str, ...]:
    """The rules matched fusion takes: every rule of :mod:`bnpfed.combine`, :data:`ATOM_POSTERIOR` and :data:`PVI`."""
    return (*available_rules(), ATOM_POSTERIOR, PVI)


def check_prior_variance(prior_variance: Any, sites: Iterable[str]) -> None:
    """The clients' zero-mean prior of rule ``"pvi"``: one variance ``v > 0`` for every Bayesian site, or a mapping
    ``{site: v_s}`` naming each of ``sites``; else a ``ValueError`` naming ``prior_variance``."""
    if isinstance(prior_variance, Mapping):
        missing = [k for k in sites if k not in prior_variance]
        if missing:
            raise ValueError(f"prior_variance: expected a variance for every Bayesian site, got none for {missing}")
        for k, v in prior_variance.items():
            check_positive(v, f"prior_variance[{k!r}]")
    else:
        check_positive(prior_variance, "prior_variance")


def prior_precision(prior_variance: Any, site: str) -> float:
    """``1 / v_s``, the prior precision of ``site`` under ``prior_variance`` (a float, or ``{site: v_s}``)."""
    return 1.0 / float(prior_variance[site] if isinstance(prior_variance, Mapping) else prior_variance)


def cavity(posterior: tuple[Mapping[str, Tensor], Mapping[str, Tensor]],
           factor: tuple[Mapping[str, Tensor], Mapping[str, Tensor]], prior_variance: Any
           ) -> tuple[tuple[dict, dict], int]:
    """PVI's cavity ``posterior / factor`` per Bayesian site, ``((means, variances), improper)``: natural parameters
    subtracted (``factor`` given as ``(precisions, etas)``); where the cavity's precision would fall below the
    prior's ``1 / prior_variance`` (the other clients' factors would make it wider than the prior) it is the prior
    ``N(0, prior_variance)`` there, and ``improper`` counts those coordinates. ``prior_variance``: one variance, or
    ``{site: variance}`` (:func:`check_prior_variance`)."""
    (locs, variances), (lam_t, eta_t) = posterior, factor
    check_prior_variance(prior_variance, variances)
    means, out_var, improper = {}, {}, 0
    for k, v in variances.items():
        lam0 = prior_precision(prior_variance, k)
        v = v.to(torch.float64)
        lam = 1.0 / v - lam_t[k].to(torch.float64)
        eta = locs[k].to(torch.float64) / v - eta_t[k].to(torch.float64)
        bad = lam < lam0
        improper += int(bad.sum())
        lam = torch.where(bad, torch.full_like(lam, lam0), lam)
        eta = torch.where(bad, torch.zeros_like(eta), eta)
        means[k], out_var[k] = eta / lam, 1.0 / lam
    return (means, out_var), improper


def pvi_factor(posterior: tuple[Mapping[str, Tensor], Mapping[str, Tensor]],
               cavity_: tuple[Mapping[str, Tensor], Mapping[str, Tensor]] | None, prior_variance: Any
               ) -> tuple[dict, dict]:
    """Client j's approximate-likelihood factor ``t_j = q_j / c_j`` per Bayesian site as natural parameters
    ``(precisions, etas)``; ``cavity_`` None: the prior ``N(0, prior_variance)``."""
    locs, variances = posterior
    check_prior_variance(prior_variance, variances)
    precisions, etas = {}, {}
    for k, v in variances.items():
        lam0 = prior_precision(prior_variance, k)
        v = v.to(torch.float64)
        if cavity_ is None:
            lam_c, eta_c = torch.full_like(v, lam0), torch.zeros_like(v)
        else:
            lam_c = 1.0 / cavity_[1][k].to(torch.float64)
            eta_c = cavity_[0][k].to(torch.float64) * lam_c
        precisions[k], etas[k] = 1.0 / v - lam_c, locs[k].to(torch.float64) / v - eta_c
    return precisions, etas

#: The variance of a coordinate no member holds (a structural zero of the global network), and the floor of every
#: fused variance (as posterior fusion's default floor).
MIN_VARIANCE = 1e-16


def client_posterior(client) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A :class:`~bnpfed.clients.BayesianClient` 's posterior as ``(locs, variances)``: ``locs`` every parameter of
    its network by ``state_dict`` key (posterior means of the Bayesian sites, values of the deterministic ones),
    ``variances`` the Bayesian sites' posterior variances."""
    posterior = client.posterior()
    locs = {k: v.detach().clone() for k, v in client.deterministic_state().items()}
    locs.update({k: p.loc.detach().clone() for k, p in posterior.items()})
    return locs, {k: p.variance.detach().clone() for k, p in posterior.items()}


@dataclass
class PosteriorMatch:
    """Result of :func:`match_posteriors`: a global Bayesian network.

    :param PermutationSpec spec: the spec the clients were matched by.
    :param dict locs: the global network's ``state_dict`` of fused means (Bayesian sites) and values (deterministic
        parameters), float64, the template's keys.
    :param dict variances: the fused posterior variances of the Bayesian sites (the keys of the clients'
        ``variances``), float64.
    :param dict unit_locs: as ``locs`` but every global unit its members' fusion without the coverage (what a
        member's slice holds: its units at their own scale); ``unit_variances`` likewise.
    :param dict assignments: group name -> J long tensors: client j's unit l went to global unit
        ``assignments[g][j][l]``.
    :param dict layer_results: group name -> the matcher's :class:`~bnpfed.matching.MatchResult`.
    :param str rule: the fusion rule.
    :param nn.Module template: the network kind the global one is built from.
    :param float seconds: wall time of matching and fusion; ``match_seconds`` of the matching alone.
    :param Tensor class_shares: (J, C) ``share_jk``.
    :param Tensor sizes: (J,) the clients' example counts ``n_j`` (member weights on a unit's own coordinates).
    :param int improper: ``rule="pvi"``: the coordinates whose product of factors was improper, set to the prior.
    :param list kept_units: with the clients' ``activity`` reports, per client and group the indices of the units
        it kept (the assignments refer to those); None without reports.
    """

    spec: PermutationSpec
    locs: dict
    variances: dict
    unit_locs: dict
    unit_variances: dict
    assignments: dict
    layer_results: dict
    rule: str
    template: nn.Module | None = field(default=None, repr=False)
    seconds: float = 0.0
    match_seconds: float = 0.0
    class_shares: Tensor | None = field(default=None, repr=False)
    sizes: Tensor | None = field(default=None, repr=False)
    improper: int = 0
    kept_units: list | None = None

    @property
    def widths(self) -> dict[str, int]:
        """Group name -> number of global units."""
        return {g.name: width(self.locs, g, "locs") for g in self.spec.groups}

    @property
    def hyperparameters(self) -> dict:
        """Group name -> the hyper-parameters its matching used (estimated or given)."""
        return {n: dict(getattr(r, "hyperparameters", None) or {}) for n, r in self.layer_results.items()}

    def posterior(self) -> dict[str, GaussianPosterior]:
        """``{site: GaussianPosterior(loc, variance)}`` of the Bayesian sites (float64)."""
        return {k: GaussianPosterior(self.locs[k], v) for k, v in self.variances.items()}

    def deterministic(self) -> dict[str, Tensor]:
        """The deterministic parameters' global values (every ``locs`` key that is no Bayesian site)."""
        return {k: v for k, v in self.locs.items() if k not in self.variances}

    def network(self) -> nn.Module:
        """The posterior-mean network: the template's kind at the matched widths, every weight at its fused mean."""
        if self.template is None:
            raise ValueError("network: this match has no template network; pass template= to match_posteriors")
        return network_from_state(self.template, self.locs)

    def client(self, prior: Prior, *, likelihood: Likelihood | None = None,
               local_reparameterization: bool = False) -> BayesianClient:
        """The global Bayesian network as a :class:`~bnpfed.clients.BayesianClient`: :meth:`network` made Bayesian
        by ``prior`` (which must make exactly the fused sites Bayesian), its posterior the fused one (in the network's
        dtype), for its posterior predictive (``predict_proba``) or to save (:func:`bnpfed.saved.save_global`)."""
        client = BayesianClient(self.network(), prior, likelihood=likelihood,
                                local_reparameterization=local_reparameterization)
        like = client.posterior()
        if sorted(like) != sorted(self.variances):
            raise ValueError(f"prior: expected a prior that makes the fused sites {sorted(self.variances)} Bayesian, "
                             f"got one that makes {sorted(like)} Bayesian")
        client.load_posterior({k: GaussianPosterior(self.locs[k].to(like[k].loc.dtype), v.to(like[k].loc.dtype))
                               for k, v in self.variances.items()})
        return client

    def client_slice(self, j: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Client j's slice of the global posterior, ``(locs, variances)``: for every group the global units its own
        units were matched to, in its own order (:func:`~bnpfed.matching.permutation.client_slice`), each its
        members' fusion without the coverage (``unit_locs``, ``unit_variances``): the global network scales a unit's
        outgoing weights by the share of the data its members hold, which a client's own network must not (its logits
        would shrink by its share)."""
        J = len(next(iter(self.assignments.values())))
        if not 0 <= int(j) < J:
            raise ValueError(f"j: expected a client in [0, {J}), got {j}")
        ids = {g: a[int(j)] for g, a in self.assignments.items()}
        return client_slice(self.spec, self.unit_locs, ids), client_slice(self.spec, self.unit_variances, ids)

    def client_start(self, j: int | None) -> tuple[tuple[dict, dict], dict[str, Tensor]]:
        """What a client starts its next round from, ``((locs, variances), ids)``: its slice (:meth:`client_slice`)
        if it was matched (``j`` its position among the matched clients; ``ids`` per group the global units of its
        slice), else (``j`` None) the whole global posterior (``ids``: every global unit)."""
        if j is None:
            return (self.locs, self.variances), {g: torch.arange(w) for g, w in self.widths.items()}
        return self.client_slice(j), {g: a[j].clone() for g, a in self.assignments.items()}


def _pair(client, j: int) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    if isinstance(client, (tuple, list)) and len(client) == 2 and all(isinstance(c, Mapping) for c in client):
        locs, variances = client
    elif hasattr(client, "posterior") and hasattr(client, "deterministic_state"):
        locs, variances = client_posterior(client)
    else:
        raise ValueError(f"clients[{j}]: expected a BayesianClient or a (locs, variances) pair of dicts, got "
                         f"{type(client).__name__}")
    locs = {k: torch.as_tensor(v).detach() for k, v in locs.items()}
    variances = {k: torch.as_tensor(v).detach() for k, v in variances.items()}
    for k, v in variances.items():
        if k not in locs:
            raise ValueError(f"clients[{j}]: variances has {k!r}, which locs lacks")
        if tuple(v.shape) != tuple(locs[k].shape):
            raise ValueError(f"clients[{j}]: variances[{k!r}] has shape {tuple(v.shape)}, its loc "
                             f"{tuple(locs[k].shape)}")
        if not v.is_floating_point() or not bool(torch.isfinite(v).all()) or bool((v <= 0).any()):
            raise ValueError(f"clients[{j}]: variances[{k!r}] must be finite and > 0")
    return locs, variances


def _full_variances(locs: Mapping[str, Tensor], variances: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Every key of ``locs`` with its variance: the given ones, 0 on the deterministic parameters."""
    return {k: (variances[k] if k in variances else torch.zeros_like(v, dtype=torch.float64)) for k, v in
            locs.items()}


def _sizes(sizes, class_counts, J: int) -> Tensor:
    if sizes is None:
        if class_counts is None:
            return torch.ones(J, dtype=torch.float64)
        return torch.as_tensor(class_counts, dtype=torch.float64).sum(1)
    n = torch.as_tensor(sizes, dtype=torch.float64).reshape(-1)
    if n.numel() != J or not bool(torch.isfinite(n).all()) or bool((n <= 0).any()):
        raise ValueError(f"sizes: expected {J} positive example counts (one per client), got {sizes!r}")
    return n


def fuse_members(locs: Tensor, variances: Tensor, weights: Tensor, reference: Tensor | None, rule: str, *,
                 bayesian: Tensor, num_samples: int = 1000, generator: torch.Generator | None = None,
                 min_variance: float = MIN_VARIANCE) -> tuple[Tensor, Tensor]:
    """Fuse the m members of one global unit coordinate by coordinate (the module docstring's rule and coverage).

    :param Tensor locs: (m, D) the members' posterior means.
    :param Tensor variances: (m, D) their posterior variances (0 on deterministic coordinates).
    :param Tensor weights: (m, D) ``b_jd >= 0``: 0 where member j does not hold coordinate d.
    :param Tensor reference: (D,) ``sum_{reference} b_jd``: the denominator of the coverage ``kappa_d``; None: no
        coverage (the members' fusion itself, ``kappa_d = 1``).
    :param str rule: a rule of :mod:`bnpfed.combine` for the Bayesian coordinates.
    :param Tensor bayesian: (D,) bool, which coordinates are Bayesian (the others are averaged).
    :returns: ``(loc, variance)``, (D,) float64 each; variance 0 on deterministic coordinates, ``min_variance``
        where no member holds a Bayesian coordinate.

    Two members of one unit, one of which lacks the second coordinate (coverage 3/4 of the weight there)::

        >>> loc, var = fuse_members(torch.tensor([[1.0, 2.0], [3.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 1.0]]),
        ...                         torch.tensor([[3.0, 3.0], [1.0, 0.0]]), torch.tensor([4.0, 4.0]), "eaa",
        ...                         bayesian=torch.tensor([True, True]))
        >>> loc.tolist(), var.tolist()
        ([1.5, 1.5], [1.0, 0.5625])
    """
    locs, variances, weights = (torch.as_tensor(t, dtype=torch.float64) for t in (locs, variances, weights))
    bayesian = torch.as_tensor(bayesian, dtype=torch.bool)
    total = weights.sum(0)
    held_any = total > 0
    loc = torch.zeros_like(total)
    variance = torch.where(bayesian, torch.full_like(total, float(min_variance)), torch.zeros_like(total))
    cols = torch.nonzero(held_any & bayesian).reshape(-1)
    if cols.numel():  # the rule on the Bayesian coordinates some member holds (the others' entries are not read)
        safe = torch.where(weights > 0, variances, torch.ones_like(variances))[:, cols]
        fused = fuse(locs[:, cols], safe, rule, weights[:, cols], num_samples=num_samples, generator=generator)
        loc[cols], variance[cols] = fused.loc.to(torch.float64), fused.variance.to(torch.float64)
    cols = torch.nonzero(held_any & ~bayesian).reshape(-1)
    if cols.numel():  # deterministic coordinates: averaged with the same weights
        loc[cols] = average_deterministic(locs[:, cols], weights[:, cols])
    if reference is None:
        kappa = torch.ones_like(total)
    else:
        reference = torch.as_tensor(reference, dtype=torch.float64)
        positive = reference > 0
        kappa = torch.where(positive, total / torch.where(positive, reference, torch.ones_like(reference)),
                            torch.zeros_like(total))
    loc = torch.where(held_any, kappa * loc, torch.zeros_like(loc))
    variance = torch.where(held_any & bayesian, torch.clamp(kappa * kappa * variance, min=float(min_variance)),
                           variance)
    return loc, variance


def _fuse_group(means, variances, held, assignments, L: int, layout, shares: Tensor, sizes: Tensor, rule: str,
                bayesian: Tensor, min_variance: float, **kwargs) -> tuple[Tensor, Tensor, Tensor]:
    """(L, D) fused means and variances of one group's global units (the members' fusion, no coverage), and (L, D)
    their coverage ``kappa``."""
    J, D = len(means), layout.D
    out = layout.classes >= 0
    base = []  # per client, (D,) weight of a coordinate it holds: n_j, or share_jk on class k's output coordinates
    for j in range(J):
        w = torch.full((D,), float(sizes[j]), dtype=torch.float64)
        w[out] = shares[j, layout.classes[out]]
        base.append(w)
    class_total = torch.zeros(D, dtype=torch.float64)
    class_total[out] = shares.sum(0)[layout.classes[out]]
    members = [[] for _ in range(L)]
    for j in range(J):
        for l, i in enumerate(assignments[j].tolist()):
            members[i].append((j, l))
    loc = torch.zeros(L, D, dtype=torch.float64)
    var = torch.zeros(L, D, dtype=torch.float64)
    kappa = torch.zeros(L, D, dtype=torch.float64)
    for i, who in enumerate(members):
        x = torch.stack([means[j][l] for j, l in who])
        u = torch.stack([variances[j][l] for j, l in who])
        h = torch.stack([held[j][l] for j, l in who])
        b = torch.stack([base[j] for j, _ in who]) * h
        reference = torch.where(out, class_total, torch.stack([base[j] for j, _ in who]).sum(0))
        kappa[i] = torch.where(reference > 0, b.sum(0) / torch.where(reference > 0, reference, 1.0), 0.0)
        # a class none of the members saw: the unit (what its members' slices hold) fuses them with equal weights
        unseen = (b.sum(0) == 0) & (h.sum(0) > 0)
        b = torch.where(unseen, h, b)
        loc[i], var[i] = fuse_members(x, u, b, None, rule, bayesian=bayesian, min_variance=min_variance, **kwargs)
    return loc, var, kappa


@dataclass
class _FusedGroup:
    """One group matched and fused: the assignment, its L global units' members' fusion (``loc``, ``var``) and their
    coverage ``kappa`` (L, D), the matcher's result."""

    assignments: list
    size: int
    result: object
    loc: Tensor
    var: Tensor
    kappa: Tensor
    bayesian: Tensor


def match_posteriors(
    clients,
    class_counts=None,
    spec: PermutationSpec | None = None,
    *,
    rule: str = "conflation",
    sizes=None,
    input_shape: Sequence[int] | None = None,
    template: nn.Module | None = None,
    tau2=None,
    sigma0_2=None,
    gamma0=None,
    mu0=None,
    bias_mu0=None,
    hyperparameters: Literal["empirical-bayes", "fixed"] = "empirical-bayes",
    sweeps: int | None = None,
    seed: int | None = None,
    warm_start=None,
    layer_fn: Callable | None = None,
    num_samples: int = 1000,
    min_variance: float = MIN_VARIANCE,
    stop: Literal["fixed-point", "result"] = "result",
    starts: Literal["even-split", "both", "small-noise"] = "even-split",
    factors=None,
    prior_variance: Any = 1.0,
    match_on: Literal["posteriors", "means"] = "posteriors",
    activity=None,
    device=None,
) -> PosteriorMatch:
    """Match J Bayesian clients' hidden units group by group and fuse every global unit's members' posteriors (see
    the module docstring).

    :param clients: J :class:`~bnpfed.clients.BayesianClient` s, or J ``(locs, variances)`` pairs: ``locs`` every
        parameter by ``state_dict`` key (posterior means of the Bayesian ones), ``variances`` the Bayesian
        parameters' posterior variances (> 0). Widths may differ.
    :param class_counts: (J, C) training examples per class at each client (class shares on the output coordinates,
        and the default ``sizes``); default all ones.
    :param spec: the :class:`~bnpfed.matching.permutation.PermutationSpec` (default derived from ``template``).
    :param str rule: the fusion rule of :mod:`bnpfed.combine` (default ``"conflation"``), ``"atom-posterior"``
        (the model's own posterior of each atom) or ``"pvi"`` (the prior times the members' factors): module
        docstring.
    :param sizes: (J,) the clients' example counts ``n_j`` (default: ``class_counts``' row sums, or ones).
    :param input_shape: the shape of one input, to derive the spec of a convolutional network.
    :param template: a network of the clients' kind (required unless ``clients`` are BayesianClients, whose network
        is used).
    :param tau2: the extra noise variance between clients' copies of a unit; ``sigma0_2``, ``gamma0``, ``mu0``,
        ``bias_mu0``: as :func:`~bnpfed.matching.permutation.match_by_spec` (None: estimated per group under
        empirical Bayes; a scalar, one per group, or a mapping by group name).
    :param str hyperparameters: ``"empirical-bayes"`` (default) or ``"fixed"``.
    :param int sweeps: sweeps per group (None: the matcher's default).
    :param int seed: seed of the sweeps (group c: ``seed + c``) and of ``pooling``'s draws.
    :param warm_start: a previous :class:`PosteriorMatch` of the same clients (each holding its
        :meth:`~PosteriorMatch.client_slice`, trained further), or per group J label arrays.
    :param layer_fn: the one-group matcher, called as ``layer_fn(means, variances, tau2=, sigma0_2=, gamma0=, mu0=,
        precisions=, sweeps=, seed=, [hyperparameters=], [init_assignments=])`` (default
        :func:`~bnpfed.matching.bayesian_layer.match_bayesian_layer`).
    :param int num_samples: ``pooling``'s N.
    :param float min_variance: floor of the fused variances.
    :param str stop: when the matcher's empirical-Bayes sweeps stop (``"result"``, ``"fixed-point"``: see
        :func:`~bnpfed.matching.layer.match_layer`); passed to the default ``layer_fn`` only.
    :param str starts: where the matcher's empirical Bayes starts (``"even-split"``, ``"both"``, ``"small-noise"``:
        see :func:`~bnpfed.matching.layer.match_layer`); passed to the default ``layer_fn`` only.
    :param factors: ``rule="pvi"``: per client its factor ``(precisions, etas)`` per Bayesian site, in its own
        coordinates (:func:`pvi_factor`, possibly damped); None (round 1): each client's posterior over the prior.
    :param prior_variance: ``rule="pvi"``: the variance of the clients' zero-mean prior, one float for every site or
        ``{site: variance}`` (:func:`check_prior_variance`).
    :param str match_on: what the assignment is computed from: ``"posteriors"`` (default: the heteroscedastic
        model, every neuron seen with its posterior variances plus tau2) or ``"means"`` (PFNM's model on the posterior
        means, :func:`match_means`); the posteriors are fused along it either way (module docstring). Not with a
        ``layer_fn``, which decides that itself.
    :param activity: None, or per client its report on its units on its own data
        (:func:`~bnpfed.matching.activity.unit_activity` of its posterior-mean network): the units with activity 0
        are left out before matching, as :func:`~bnpfed.matching.network.match_by_spec` does
        (``PosteriorMatch.kept_units``; the assignments and ``warm_start`` refer to the units kept).
    :param device: None (default: numpy) or a torch device for the matcher's cross products
        (:func:`~bnpfed.matching.layer.match_layer`'s ``device``); passed to the default ``layer_fn`` only.
    :returns: :class:`PosteriorMatch`.
    """
    t0 = time.perf_counter()
    mode = check_choice(hyperparameters, ("empirical-bayes", "fixed"), "hyperparameters")
    check_choice(rule, matched_rules(), "rule")
    check_choice(match_on, MATCH_ON, "match_on")
    if layer_fn is not None and match_on != "posteriors":
        raise ValueError(f"match_on: a given layer_fn decides what it matches on; expected the default "
                         f"'posteriors' with one, got {match_on!r}")
    if layer_fn is not None and device is not None:
        raise ValueError(f"device: the default matchers' option; expected None with a given layer_fn, got {device!r}")
    check_int(num_samples, "num_samples", low=1)
    min_variance = check_positive(min_variance, "min_variance")
    if not isinstance(clients, Sequence) or isinstance(clients, (str, bytes)) or not clients:
        raise ValueError("clients: expected a non-empty sequence of BayesianClients or (locs, variances) pairs")
    if template is None and hasattr(clients[0], "bnn"):
        template = clients[0].bnn.template()
    pairs = [_pair(c, j) for j, c in enumerate(clients)]
    sites = sorted(pairs[0][1])
    for j, (_, v) in enumerate(pairs):
        if sorted(v) != sites:
            raise ValueError(f"clients[{j}]: expected the Bayesian sites {sites} of client 0, got {sorted(v)}")
    spec = resolve_spec(spec, template, input_shape,
                        missing="spec: expected a PermutationSpec or a template network to derive it from")
    unknown = [k for k in sites if k not in spec.kinds]
    if unknown:
        raise ValueError(f"clients: expected posteriors of the network's parameters, got sites {unknown} that are "
                         "none (a prior's hyper-parameters: matching aligns a network's units; fuse such a posterior "
                         "weight by weight, align='none')")
    stats = [k for k, kind in spec.kinds.items() if kind in STATISTICS]
    if stats:
        raise ValueError(f"spec: batch-norm running statistics ({stats[:2]}...) are no posterior to fuse; expected a "
                         "network without batch norm")
    locs = [{k: v.to(torch.float64) for k, v in p[0].items()} for p in pairs]
    variances = [_full_variances(p[0], {k: v.to(torch.float64) for k, v in p[1].items()}) for p in pairs]
    ones = [{k: torch.ones_like(v) for k, v in s.items()} for s in locs]
    channels = {"value": locs, "variance": variances, "held": ones}
    if rule == PVI:
        channels.update(_factor_channels(pairs, locs, factors, prior_variance))
    elif factors is not None:
        raise ValueError(f"factors: expected only with rule={PVI!r}, got rule={rule!r}")
    elif isinstance(prior_variance, Mapping) or prior_variance != 1.0:
        raise ValueError(f"prior_variance: the clients' prior of rule={PVI!r}; expected the default 1 with "
                         f"rule={rule!r}, got {prior_variance!r}")
    data = prepare_clients(channels, spec, class_counts)
    names, shares = spec.group_names, data.shares
    n = _sizes(sizes, class_counts, data.J)
    init = warm_start_labels(warm_start, names, data.widths)
    data, init, kept = without_inactive(data, spec, activity, init)   # as match_by_spec leaves them out
    fn = layer_fn if layer_fn is not None else match_means if match_on == "means" else match_bayesian_layer
    if not callable(fn):
        raise ValueError(f"layer_fn: expected a one-group matcher, got {layer_fn!r}")
    values = group_values(names, mode, {"tau2": tau2, "sigma0_2": sigma0_2, "gamma0": gamma0}, mu0, bias_mu0)
    generator = None if seed is None else torch.Generator().manual_seed(int(seed))
    match_seconds = []
    improper = [0]

    def step(name, layout, rows, below):
        c = names.index(name)
        t1 = time.perf_counter()
        r, assignments = call_matcher(fn, [rows["value"], rows["variance"]], layout, values[name], shares,
                                      mode=mode, sweeps=sweeps, seed=None if seed is None else seed + c,
                                      init=None if init is None else init[name],
                                      options={} if layer_fn is not None else {"stop": stop, "starts": starts,
                                                                               "device": device})
        L = int(r.global_atoms.shape[0])
        match_seconds.append(time.perf_counter() - t1)
        bayesian = torch.cat([torch.full((s.stop - s.start,), s.param in sites, dtype=torch.bool)
                              for s in layout.segments])
        member_rule = "eaa" if rule in (ATOM_POSTERIOR, PVI) else rule   # those two: deterministic parts, coverage
        loc, var, kappa = _fuse_group(rows["value"], rows["variance"], rows["held"], assignments, L, layout, shares,
                                      n, member_rule, bayesian, min_variance, num_samples=num_samples,
                                      generator=generator)
        if rule == ATOM_POSTERIOR:   # the matcher's own posterior of each atom
            loc = torch.as_tensor(r.global_atoms, dtype=torch.float64)
            precision = torch.as_tensor(r.posterior_precision, dtype=torch.float64)
            var = torch.where(bayesian, torch.clamp(1.0 / precision, min=min_variance), torch.zeros_like(loc))
        elif rule == PVI:            # the prior times the members' factors
            prior_row = torch.cat([torch.full((s.stop - s.start,), prior_precision(prior_variance, s.param)
                                              if s.param in sites else 1.0, dtype=torch.float64)
                                   for s in layout.segments])
            lam = prior_row.expand(L, layout.D).clone()
            eta = torch.zeros(L, layout.D, dtype=torch.float64)
            for j, a in enumerate(assignments):
                held = rows["held"][j]
                lam.index_add_(0, a, held * rows["factor_precision"][j])
                eta.index_add_(0, a, held * rows["factor_eta"][j])
            bad = bayesian & (lam <= 0)
            improper[0] += int(bad.sum())
            lam = torch.where(bad, prior_row.expand_as(lam), lam)
            eta = torch.where(bad, torch.zeros_like(eta), eta)
            loc = torch.where(bayesian, eta / lam, loc)
            var = torch.where(bayesian, torch.clamp(1.0 / lam, min=min_variance), var)
        return _FusedGroup(assignments, L, r, loc, var, kappa, bayesian)

    groups = match_groups(data, spec, step)
    extra_loc, extra_var = {}, {}
    out_b = data.output_bias
    if out_b is not None:  # the output bias: every client's, class by class with the class shares
        b_locs = torch.stack([s[out_b] for s in locs])
        b_vars = torch.stack([s[out_b] for s in variances])
        C, J = b_locs.shape[1], data.J
        weights = shares.t()  # (C, J)
        bias_loc, bias_var = torch.zeros(C, dtype=torch.float64), torch.zeros(C, dtype=torch.float64)
        for k in range(C):
            who = weights[k] > 0
            if not bool(who.any()):
                who = torch.ones(J, dtype=torch.bool)
                w = torch.ones(J, dtype=torch.float64)
            else:
                w = weights[k]
            if out_b in sites and rule == PVI:   # every client's factor of the class's bias
                lam = prior_precision(prior_variance, out_b) + sum(f[out_b][k]
                                                                   for f in data.channels["factor_precision"])
                eta = sum(f[out_b][k] for f in data.channels["factor_eta"])
                if lam <= 0:
                    improper[0] += 1
                    lam = torch.tensor(prior_precision(prior_variance, out_b), dtype=torch.float64)
                    eta = torch.tensor(0.0)
                bias_loc[k], bias_var[k] = eta / lam, torch.clamp(1.0 / lam, min=min_variance)
            elif out_b in sites:
                fused = fuse(b_locs[who, k], b_vars[who, k], "conflation" if rule == ATOM_POSTERIOR else rule,
                             w[who], num_samples=num_samples, generator=generator)
                bias_loc[k], bias_var[k] = fused.loc, torch.clamp(fused.variance, min=min_variance)
            else:
                bias_loc[k] = (w[who] / w[who].sum()) @ b_locs[who, k]
        extra_loc[out_b], extra_var[out_b] = bias_loc, bias_var
    covered_var = {g: torch.where(f.bayesian, torch.clamp(f.kappa * f.kappa * f.var, min=min_variance), f.var)
                   for g, f in groups.items()}
    states = {
        "locs": state_from_atoms(spec, locs[0], {g: f.kappa * f.loc for g, f in groups.items()}, extra_loc),
        "variances": state_from_atoms(spec, variances[0], covered_var, extra_var),
        "unit_locs": state_from_atoms(spec, locs[0], {g: f.loc for g, f in groups.items()}, extra_loc),
        "unit_variances": state_from_atoms(spec, variances[0], {g: f.var for g, f in groups.items()}, extra_var)}
    for key in ("variances", "unit_variances"):
        states[key] = {k: states[key][k] for k in sites}
    return PosteriorMatch(spec=spec, **states, assignments={g: f.assignments for g, f in groups.items()},
                          layer_results={g: f.result for g, f in groups.items()}, rule=rule, template=template,
                          seconds=time.perf_counter() - t0, match_seconds=sum(match_seconds), class_shares=shares,
                          sizes=n, improper=improper[0], kept_units=kept)


def _factor_channels(pairs, locs, factors, prior_variance) -> dict[str, list]:
    """The clients' PVI factors as two more channels (every ``state_dict`` key; 0 off the Bayesian sites)."""
    check_prior_variance(prior_variance, pairs[0][1])
    J = len(pairs)
    if factors is not None and (not isinstance(factors, Sequence) or len(factors) != J):
        raise ValueError(f"factors: expected one (precisions, etas) pair per client ({J}), got {type(factors)}")
    out = {"factor_precision": [], "factor_eta": []}
    for j, (pair, full) in enumerate(zip(pairs, locs)):
        if factors is None:
            lam, eta = pvi_factor(pair, None, prior_variance)
        else:
            lam, eta = factors[j]
            for k, v in pair[1].items():
                if k not in lam or k not in eta or lam[k].shape != v.shape or eta[k].shape != v.shape:
                    raise ValueError(f"factors[{j}]: expected precisions and etas of the Bayesian sites' shapes, "
                                     f"{k!r} {tuple(v.shape)}")
            lam = {k: lam[k].to(torch.float64) for k in pair[1]}
            eta = {k: eta[k].to(torch.float64) for k in pair[1]}
        out["factor_precision"].append({k: lam.get(k, torch.zeros_like(v)) for k, v in full.items()})
        out["factor_eta"].append({k: eta.get(k, torch.zeros_like(v)) for k, v in full.items()})
    return out
