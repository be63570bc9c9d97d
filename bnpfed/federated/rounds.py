"""What a matching server remembers between rounds, written once: the in-process federations
(:class:`~bnpfed.federated.pfnm.PFNMFederation`, :class:`~bnpfed.federated.matched_fusion.MatchedFusionFederation`)
and the Flower strategies (:class:`~bnpfed.flower.strategies.PFNMStrategy`,
:class:`~bnpfed.flower.strategies.MatchedFusionStrategy`) each hold one :class:`MatchRounds`.

* :class:`Architecture`: the clients' network kind as the server builds it -- a template network (what a client's
  own initialisation looks like), its permutation spec, its batch norms in forward order;
* :class:`MatchRounds`: the last match, the clients it matched, and for every client of the round what it was sent
  (its slice of the global model if it was matched, else the whole model; nothing in round 1) and the global ids of
  its units, from which the next match warm-starts and against which its reply's widths are checked; the round's
  summary (widths, hyper-parameters, mean posterior sigma).

Usage::

    >>> from bnpfed.federated.config import NetworkConfig
    >>> arch = Architecture.of(NetworkConfig(arch="simple-cnn-bn"), (1, 8, 8), 10, seed=0)
    >>> arch.spec.group_names, arch.batch_norms
    (['conv1', 'conv2', 'fc1', 'fc2'], ['bn1', 'bn2'])
    >>> rounds = MatchRounds(arch)
    >>> rounds.start(3) is None, rounds.widths(3)          # round 1: client 3 starts from its own initialisation
    (True, {'conv1': 6, 'conv2': 16, 'fc1': 120, 'fc2': 84})
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from torch import Tensor, nn

from bnpfed.federated.clients import initial_network
from bnpfed.federated.config import NetworkConfig
from bnpfed.federated.server import match_hyperparameters, mean_sigma
from bnpfed.matching import batch_norm_order
from bnpfed.matching import PermutationSpec, derive_spec, network_from_state
from bnpfed.matching import cavity, check_prior_variance, pvi_factor
from bnpfed.validation import check_bool, check_fraction

__all__ = ["Architecture", "HoldsRounds", "MatchRounds", "PVIFactors"]


@dataclass(frozen=True)
class Architecture:
    """The clients' network kind, as the server (and every client) builds it.

    :param nn.Module template: a network of the kind (the shared initialisation's), the shape global networks are
        rebuilt in.
    :param PermutationSpec spec: its permutation spec.
    :param tuple input_shape: the shape of one input.
    :param list batch_norms: its batch norms in forward order (re-estimated in that order after a match).
    """

    template: nn.Module = field(repr=False)
    spec: PermutationSpec
    input_shape: tuple
    batch_norms: list

    @classmethod
    def of(cls, network: NetworkConfig, input_shape: Sequence[int], num_classes: int, *, seed: int) -> Architecture:
        """The architecture of ``network`` for inputs of ``input_shape`` and ``num_classes`` classes, its template
        the shared initialisation of ``seed``."""
        if not isinstance(network, NetworkConfig):
            raise ValueError(f"network: expected a NetworkConfig, got {type(network).__name__}")
        input_shape = tuple(int(s) for s in input_shape)
        template = initial_network(network, input_shape, num_classes, seed=seed)
        return cls(template, derive_spec(template, input_shape), input_shape, batch_norm_order(template, input_shape))

    @property
    def statistics(self) -> list[str]:
        """The running-statistic keys of the template's state (batch norms' means and variances)."""
        return [k for k, kind in self.spec.kinds.items() if kind in ("running_mean", "running_var")]

    def widths(self) -> dict[str, int]:
        """Units per hidden permutation of the template (what a client's own initialisation has)."""
        state = self.template.state_dict()
        return {g.name: int(state[g.axes[0].param].shape[g.axes[0].dim]) // g.axes[0].block for g in self.spec.groups}

    def network(self, state: Mapping[str, Tensor]) -> nn.Module:
        """A network of the kind carrying ``state`` (at its widths)."""
        return network_from_state(self.template, state)


class MatchRounds:
    """The server's memory between rounds of a matching method (PFNM, FedMA, matched posterior fusion).

    :param Architecture architecture: the clients' network kind.
    :param bool whole: after round 1 every client starts from the whole global model (matched fusion's
        ``later_rounds="fixed"``), not from its slice. Default False.

    Attributes: ``match`` (the last match: a :class:`~bnpfed.matching.SpecMatch` or a
    :class:`~bnpfed.matching.posteriors.PosteriorMatch`; None before round 1 ends), ``matched`` (the clients
    it matched, in its order), ``sent`` (client -> the global ids per group of the units it was sent this round, None
    when it started from its own initialisation).
    """

    def __init__(self, architecture: Architecture, *, whole: bool = False):
        if not isinstance(architecture, Architecture):
            raise ValueError(f"architecture: expected an Architecture, got {type(architecture).__name__}")
        self.architecture = architecture
        self.whole = check_bool(whole, "whole")
        self.match: Any = None
        self.matched: list[int] = []
        self.sent: dict[int, Optional[dict[str, Tensor]]] = {}

    def start(self, j: int) -> Any:
        """What client ``j`` starts this round from, remembered with the global ids of its units: None in round 1
        (its own initialisation); later the match's :meth:`client_start` -- its slice if it was matched last round
        (and not ``whole``), else the whole global model (a state dict for PFNM, ``(locs, variances)`` for matched
        fusion)."""
        if self.match is None:
            self.sent[j] = None
            return None
        own = j in self.matched and not self.whole
        payload, ids = self.match.client_start(self.matched.index(j) if own else None)
        self.sent[j] = ids
        return payload

    def widths(self, j: int) -> dict[str, int]:
        """The units per group client ``j``'s reply must have: those of what it was sent (:meth:`start`)."""
        ids = self.sent.get(j)
        return self.architecture.widths() if ids is None else {g: int(len(i)) for g, i in ids.items()}

    def warm_start(self, clients: Sequence[int]) -> Optional[list[dict[str, Tensor]]]:
        """Per client (in the given order), the global ids it was sent: the assignment the next match starts from;
        None in round 1."""
        if self.match is None:
            return None
        missing = [j for j in clients if self.sent.get(j) is None]
        if missing:
            raise ValueError(f"clients: expected clients that were sent the global model this round, got {missing}")
        return [self.sent[j] for j in clients]

    def update(self, match: Any, clients: Sequence[int]) -> None:
        """The round's match, of ``clients`` in its order."""
        self.match, self.matched = match, list(clients)

    def summary(self) -> dict:
        """The round's numbers: ``hidden`` (the global widths per group), ``hyperparameters`` (per group, as
        :func:`~bnpfed.federated.server.match_hyperparameters`) and, for a posterior, ``mean_sigma``."""
        out = {"hidden": list(self.match.widths.values()), "hyperparameters": match_hyperparameters(self.match)}
        variances = getattr(self.match, "variances", None)
        if variances is not None:
            out["mean_sigma"] = mean_sigma(variances.values())
        return out


class PVIFactors:
    """The server's PVI bookkeeping between rounds (:data:`~bnpfed.matching.posteriors.PVI`): per client its
    approximate-likelihood factor ``t_j`` (natural parameters per Bayesian site, in its own units), and this round
    the cavity ``c_j = slice_j / t_j`` it was sent to train against.

    After the round its factor becomes ``q_j / c_j`` (round 1: ``q_j / p``), damped from the second update on:
    ``t_j <- (1 - rho_k) t_j + rho_k q_j / c_j`` in natural parameters at the client's k-th update (all clients update
    at once, and the undamped parallel update overshoots: Bui et al. 2018, Ashman et al. 2022). ``rho_k`` is
    ``damping`` at every update, or with ``damping=None`` the harmonic schedule ``rho_k = 1 / k``: the factor after k
    updates is then the mean of the k values it was computed as, so a round-1 error is ``1 / R`` of itself after R
    rounds (``(1 - damping) ** (R - 1)`` at a fixed damping) while the steps shrink.

    :param prior_variance: the clients' zero-mean prior variance, one for every site or ``{site: variance}``; None
        until it is known (:meth:`cavity` and :meth:`update` need it: set ``prior_variance`` first).
    :param damping: a number in (0, 1] (1: undamped), or None: the harmonic schedule.

    Attributes: ``factors`` (client -> ``(precisions, etas)``), ``updates`` (client -> how many times its factor was
    set: the k of its last update), ``improper`` (this round's cavity coordinates set to the prior, summed over its
    clients).
    """

    def __init__(self, prior_variance: Any, damping: Optional[float] = 1.0):
        if prior_variance is not None:
            check_prior_variance(prior_variance, prior_variance if isinstance(prior_variance, Mapping) else ())
        self.prior_variance = prior_variance
        self.damping = None if damping is None else check_fraction(damping, "damping")
        self.factors: dict[int, tuple[dict, dict]] = {}
        self.updates: dict[int, int] = {}   # client -> how many times its factor was set
        self.sent: dict[int, tuple] = {}
        self.improper = 0

    def cavity(self, j: int, slice_: tuple) -> tuple[dict, dict]:
        """Client ``j``'s cavity this round: ``slice_`` (its slice of the global posterior, ``(locs, variances)``)
        divided by its factor; remembered for :meth:`update`."""
        if j not in self.factors:
            raise ValueError(f"j: expected a client that took part in the last round, got {j}")
        out, improper = cavity(slice_, self.factors[j], self.prior_variance)
        self.improper += improper
        self.sent[j] = out
        return out

    def update(self, clients: Sequence[int], posteriors: Sequence[tuple]) -> list[tuple[dict, dict]]:
        """The round's replies ``q_j`` (``(locs, variances)`` each, in ``clients``' order) turned into the clients'
        new factors, returned in that order (what the server's fusion multiplies)."""
        out = []
        for j, posterior in zip(clients, posteriors):
            new = pvi_factor(posterior, self.sent.get(j), self.prior_variance)
            old = self.factors.get(j)
            self.updates[j] = self.updates.get(j, 0) + 1
            rho = self.step(j)
            if old is not None and rho < 1:
                new = tuple({k: (1 - rho) * o[k] + rho * n[k] for k in n} for o, n in zip(old, new))
            self.factors[j] = new
            out.append(new)
        self.sent, self.improper = {}, 0
        return out

    def step(self, j: int) -> float:
        """The damping ``rho_k`` of client ``j``'s latest factor update, the k-th (1 for the first, k = 1)."""
        k = self.updates.get(j, 0)
        if k <= 1:
            return 1.0
        return 1.0 / k if self.damping is None else self.damping

    def step_arguments(self, clients: Sequence[int], posteriors: Sequence[tuple]) -> dict:
        """:meth:`update` of the round's replies, as the keyword arguments of
        :func:`~bnpfed.federated.server.matched_fusion_step` (``factors``, ``prior_variance``): what the in-process
        federation and the Flower strategy both pass it."""
        return {"factors": self.update(clients, posteriors), "prior_variance": self.prior_variance}


class HoldsRounds:
    """What a server holding a :class:`MatchRounds` as ``rounds`` (None until it knows the architecture) shows of it:
    the in-process federations and the Flower strategies alike."""

    rounds: Optional[MatchRounds] = None

    @property
    def match(self) -> Any:
        """The last match (None before round 1 is aggregated)."""
        return None if self.rounds is None else self.rounds.match

    @property
    def matched(self) -> list[int]:
        """The clients the last match matched, in its order."""
        return [] if self.rounds is None else self.rounds.matched

    @property
    def spec(self) -> Optional[PermutationSpec]:
        """The clients' networks' permutation spec."""
        return None if self.rounds is None else self.rounds.architecture.spec

    @property
    def template(self) -> Optional[nn.Module]:
        """A network of the clients' kind, the shape global networks are rebuilt in."""
        return None if self.rounds is None else self.rounds.architecture.template
