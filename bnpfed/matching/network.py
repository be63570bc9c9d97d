"""The one network driver: J clients' networks of one kind matched group by group of their permutation spec, every
group through a one-layer matcher, into one global network (PFNM's server step).

The group loop (:func:`match_groups`) is written once: for each group in matching order it lays out the clients'
unit vectors (the groups matched before it re-indexed to their global units) and hands them to a *step*, which calls
the matcher and builds the group's global units. :func:`match_by_spec` is that loop with PFNM's step (the atoms'
posterior means, or the members' average); :func:`~bnpfed.matching.posteriors.match_posteriors` is the same
loop with a fusing step (every global unit's members' posteriors fused by a rule of :mod:`bnpfed.combine`);
:func:`~bnpfed.matching.fedma.match_group` is PFNM's step for one group. ``direction="top-down"`` (the published
order) is the spec with its groups reversed (:meth:`~bnpfed.matching.spec.PermutationSpec.reversed`).
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Literal, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from bnpfed.matching.activity import drop_units, kept_per_client
from bnpfed.matching.assembly import client_slice, network_from_state, state_from_atoms
from bnpfed.matching.derive import derive_spec
from bnpfed.matching.layer_inputs import CompactRows
from bnpfed.matching.layout import VectorLayout, group_layout, layout_rows, width
from bnpfed.matching.layer import average_atoms, averaging_weights, match_layer
from bnpfed.matching.size import (SizeLimitError, SizeSearch, fit_size, head_parameters, minimum_widths,
                                   parameter_count, parameters_in)
from bnpfed.matching.spec import PermutationSpec
from bnpfed.validation import check_bool, check_choice, check_int

__all__ = ["Clients", "GroupMatch", "GroupValues", "SpecMatch", "architecture_difference", "call_matcher",
           "check_global_weights", "check_layer_fns", "check_size_limits", "client_states", "group_values",
           "limit_width", "match_by_spec", "match_gamma0", "match_groups", "output_bias", "pfnm_group",
           "prepare_clients", "resolve_spec", "warm_start_labels", "without_inactive"]


# --------------------------------------------------------------------------------------------------------------------
# results


@dataclass
class GroupMatch:
    """One group of a spec matched: what :func:`pfnm_group` returns (and :func:`match_by_spec` computes for every
    group in turn).

    :param str group: the group's name.
    :param result: the one-group matcher's :class:`~bnpfed.matching.MatchResult`.
    :param list assignments: J long tensors: client j's unit l went to global unit ``assignments[j][l]``.
    :param Tensor atoms: (L, D) float64, the global units' vectors, laid out as ``layout`` says.
    :param VectorLayout layout: the coordinates of the vectors.
    :param dict statistics: the running statistics the group owns (the mean of each global unit's members'), float64.
    :param dict hyperparameters: the result's ``hyperparameters`` (``{}`` when it has none).
    :param dict output_bias: ``{key: (C,) tensor}`` when the group holds the output weights and the spec has an output
        bias (its class-share posterior mean), else empty.
    :param float output_bias_mu0: the prior mean that bias was shrunk towards.
    :param SizeSearch size_search: with a ``max_width`` for the group, what meeting it took
        (:mod:`bnpfed.matching.size`); else None.
    """

    group: str
    result: object
    assignments: list
    atoms: Tensor = field(repr=False)
    layout: VectorLayout = field(repr=False)
    statistics: dict = field(default_factory=dict, repr=False)
    hyperparameters: dict = field(default_factory=dict)
    output_bias: dict = field(default_factory=dict, repr=False)
    output_bias_mu0: float | None = None
    size_search: SizeSearch | None = None

    @property
    def size(self) -> int:
        """L, the number of global units."""
        return int(self.atoms.shape[0])

    def values(self) -> dict[str, Tensor]:
        """The global value of every parameter the group owns (float64, the group's axis at L units; running
        statistics the members' mean), and the output bias when the group holds the output weights."""
        return {**self.layout.to_params(self.atoms), **self.statistics, **self.output_bias}


@dataclass
class SpecMatch:
    """Result of :func:`match_by_spec`.

    :param PermutationSpec spec: the spec the networks were matched by.
    :param dict state: the global network's ``state_dict`` (posterior-mean or average weights, members' mean
        running statistics, the output bias, the template's keys without a kind).
    :param dict assignments: group name -> J long tensors mapping each client's units to global units.
    :param dict layer_results: group name -> the :class:`~bnpfed.matching.MatchResult` of that group's matching.
    :param nn.Module template: the network the global one is built from (client 0's, or the one given).
    :param float seconds: wall time of all the matching.
    :param Tensor class_shares: (J, C) ``share_jk = n_jk / sum_j' n_j'k`` (0 for a class nobody holds).
    :param dict hyperparameters: group name -> the ``hyperparameters`` of its result (``{}`` when it has none).
    :param float output_bias_mu0: the prior mean the output bias was shrunk towards (given or estimated).
    :param list kept_units: with the clients' ``activity`` reports, per client and group the indices of the units
        it kept (the others were inactive on its data and left out; ``assignments`` refer to the kept ones, in
        order); None when every unit was matched.
    :param dict size_searches: with ``max_width`` / ``max_params``, what meeting each limit took
        (:class:`~bnpfed.matching.size.SizeSearch`), by group name and ``"parameters"``; empty without limits.
    """

    spec: PermutationSpec
    state: dict
    assignments: dict
    layer_results: dict
    template: nn.Module | None = field(default=None, repr=False)
    seconds: float = 0.0
    class_shares: Tensor | None = field(default=None, repr=False)
    hyperparameters: dict = field(default_factory=dict)
    output_bias_mu0: float | None = None
    kept_units: list | None = None
    size_searches: dict = field(default_factory=dict)

    @property
    def parameters(self) -> int:
        """The global network's number of parameters (the template's parameters at the matched widths; buffers
        such as running statistics not counted)."""
        if self.template is None:
            raise ValueError("parameters: this match has no template network; pass template= to match_by_spec")
        return parameters_in([self.state], (n for n, _ in self.template.named_parameters()))

    @property
    def widths(self) -> dict[str, int]:
        """Group name -> number of global units."""
        return {g.name: width(self.state, g, "state") for g in self.spec.groups}

    @property
    def hidden_sizes(self) -> list[int]:
        """The global widths in the spec's order (an MLP's hidden widths)."""
        return list(self.widths.values())

    def network(self) -> nn.Module:
        """The global network, of the template's kind with the matched widths."""
        if self.template is None:
            raise ValueError("network: this match has no template network; pass template= to match_by_spec")
        return network_from_state(self.template, self.state)

    def client_slice(self, j: int) -> dict[str, Tensor]:
        """Client j's slice of the global state: for every group, the global units its own units were matched to, in
        its own order (:func:`~bnpfed.matching.assembly.client_slice`)."""
        return client_slice(self.spec, self.state, {g: a[j] for g, a in self.assignments.items()})

    def client_network(self, j: int) -> nn.Module:
        """Client j's slice as a network of the template's kind."""
        if self.template is None:
            raise ValueError("client_network: this match has no template network; pass template= to match_by_spec")
        return network_from_state(self.template, self.client_slice(j))

    def client_start(self, j: int | None) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """What a client starts its next round from, and the global ids of its units per group: its slice if it was
        matched (``j`` its position among the matched clients), else (``j`` None) the whole global network."""
        if j is None:
            return {k: v.clone() for k, v in self.state.items()}, {g: torch.arange(w) for g, w in self.widths.items()}
        return self.client_slice(j), {g: a[j].clone() for g, a in self.assignments.items()}


# --------------------------------------------------------------------------------------------------------------------
# the clients and the settings, checked once


@dataclass
class Clients:
    """J clients' parameters (one or more channels of ``state_dict`` s: values, posterior variances, ...), checked
    against a spec.

    :param PermutationSpec spec: the spec.
    :param dict channels: name -> J ``state_dict`` s (float tensors, every key of the spec's kinds).
    :param list widths: per client, its units per group.
    :param Tensor shares: (J, C) class shares ``share_jk``.
    :param str output_weight: the output layer's weight key; ``output_bias`` its bias key (or None).
    """

    spec: PermutationSpec
    channels: dict
    widths: list
    shares: Tensor
    output_weight: str
    output_bias: str | None

    @property
    def J(self) -> int:
        return len(self.widths)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in next(iter(self.channels.values()))[0].items()}


def _class_shares(class_counts, J: int, C: int) -> Tensor:
    if class_counts is None:
        counts = torch.ones(J, C, dtype=torch.float64)
    else:
        counts = torch.as_tensor(np.asarray(class_counts), dtype=torch.float64)
        if counts.shape != (J, C):
            raise ValueError(f"class_counts: expected shape ({J}, {C}) (clients x classes), got {tuple(counts.shape)}")
        if not torch.isfinite(counts).all() or (counts < 0).any() or (counts.sum(1) <= 0).any():
            raise ValueError("class_counts: expected finite counts >= 0 with a positive total per client")
    # a class nobody holds gets share 0 everywhere (dividing only where the total is positive, so that any positive
    # multiple of the counts gives the same shares)
    total = counts.sum(0, keepdim=True)
    held = total > 0
    return torch.where(held, counts / torch.where(held, total, torch.ones_like(total)), torch.zeros_like(counts))


def _check_state(state, spec: PermutationSpec, ref, j: int) -> dict[str, int]:
    who = f"client_nets[{j}]"
    if ref is not None and set(state) != set(ref):
        missing, extra = sorted(set(ref) - set(state)), sorted(set(state) - set(ref))
        raise ValueError(f"{who}: expected the parameters of client 0's network (one network kind), got "
                         f"{'missing ' + str(missing) if missing else ''}{'; ' if missing and extra else ''}"
                         f"{'unexpected ' + str(extra) if extra else ''}")
    for key, kind in spec.kinds.items():
        if key not in state:
            raise ValueError(f"{who}: expected {key!r} ({kind}), which the spec names, got no such key")
        t = state[key]
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise ValueError(f"{who}: expected {key!r} to be a finite floating-point tensor")
    widths = {g.name: width(state, g, who) for g in spec.groups}
    if ref is not None:
        for key in spec.kinds:
            permuted = {a.dim for _, a in spec.axes_of(key)}
            a, b = state[key].shape, ref[key].shape
            if len(a) != len(b) or any(x != y for d, (x, y) in enumerate(zip(a, b)) if d not in permuted):
                raise ValueError(f"{who}: expected {key!r} of client 0's shape {tuple(b)} but on the axes a group "
                                 f"acts on, got {tuple(a)}")
    return widths


def architecture_difference(net: nn.Module, other: nn.Module) -> str | None:
    """Where ``other`` is not a network of ``net``'s kind, in words, or None: the same modules, name for name and
    class for class (an activation counts: a Tanh network is not a ReLU network). Widths may differ.

    >>> architecture_difference(nn.Sequential(nn.Linear(4, 3), nn.ReLU()), nn.Sequential(nn.Linear(4, 5), nn.Tanh()))
    'module 1 is a Tanh, not a ReLU'
    """
    mine, theirs = dict(net.named_modules()), dict(other.named_modules())
    for name, module in mine.items():
        if name in theirs and type(theirs[name]) is not type(module):
            return f"module {name or '(the network)'} is a {type(theirs[name]).__qualname__}, not a " \
                   f"{type(module).__qualname__}"
    if set(net.state_dict()) != set(other.state_dict()):   # what the parameters' own check names better
        return None
    extra, missing = sorted(set(theirs) - set(mine)), sorted(set(mine) - set(theirs))
    if extra or missing:
        return ("modules differ from the first's: " + ", ".join([*(f"{n} added" for n in extra[:3]),
                                                                 *(f"{n} missing" for n in missing[:3])]))
    return None


def client_states(client_nets, template=None) -> tuple[list[dict[str, Tensor]], nn.Module | None]:
    """J networks or ``state_dict`` s as detached ``state_dict`` s, and the template (the given one, or client 0's
    network)."""
    if not isinstance(client_nets, Sequence) or isinstance(client_nets, (str, bytes)) or not client_nets:
        raise ValueError("client_nets: expected a non-empty sequence of networks (nn.Module) or state dicts")
    states = []
    first = next((net for net in client_nets if isinstance(net, nn.Module)), None)
    for j, net in enumerate(client_nets):
        if isinstance(net, nn.Module):
            template = net if template is None else template
            other = architecture_difference(first, net)
            if other is not None:
                raise ValueError(f"client_nets[{j}]: expected a network of the first's kind, got one whose {other}")
            state = net.state_dict()
        elif isinstance(net, Mapping):
            state = dict(net)
        else:
            raise ValueError(f"client_nets[{j}]: expected an nn.Module or a state dict, got {type(net).__name__}")
        states.append({k: torch.as_tensor(v).detach() for k, v in state.items()})
    return states, template


def prepare_clients(channels: Mapping[str, list], spec: PermutationSpec, class_counts) -> Clients:
    """The clients' channels checked against ``spec`` (the first channel's shapes; the spec needs a hidden group, one
    output weight and at most one output bias), with their class shares."""
    if not isinstance(spec, PermutationSpec):
        raise ValueError(f"spec: expected a PermutationSpec, got {type(spec).__name__}")
    if not spec.groups:
        raise ValueError("spec: expected at least one hidden permutation (PFNM needs a hidden layer), got none")
    out_w, out_b = spec.params_of_kind("output_weight"), spec.params_of_kind("output_bias")
    if len(out_w) != 1 or len(out_b) > 1:
        raise ValueError(f"spec: expected one output weight and at most one output bias, got {out_w} and {out_b}")
    first = next(iter(channels.values()))
    widths = [_check_state(s, spec, first[0] if j else None, j) for j, s in enumerate(first)]
    shares = _class_shares(class_counts, len(first), int(first[0][out_w[0]].shape[0]))
    return Clients(spec, dict(channels), widths, shares, out_w[0], out_b[0] if out_b else None)


@dataclass(frozen=True)
class GroupValues:
    """The hyper-parameters given for one group (None: estimated under empirical Bayes), by role.

    :param dict given: the matcher's variances and IBP mass by its own names: ``sigma2``, ``sigma0_2``, ``gamma0``
        for :func:`~bnpfed.matching.match_layer`, ``tau2``, ``sigma0_2``, ``gamma0`` for
        :func:`~bnpfed.matching.match_bayesian_layer`.
    :param float mu0: the prior mean of the weight coordinates (incoming and output weights).
    :param float bias_mu0: the prior mean of the bias coordinates and of the output bias.
    """

    given: Mapping[str, float | None]
    mu0: float | None = None
    bias_mu0: float | None = None

    def with_gamma0(self, gamma0: float | None) -> GroupValues:
        """These values with the IBP mass given as ``gamma0`` (a size limit's lowered mass); themselves for None."""
        return self if gamma0 is None else replace(self, given={**self.given, "gamma0": gamma0})


def _per_group(value, names: list[str], arg: str) -> list:
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(f"{arg}: expected group names among {names}, got {unknown}")
        return [value.get(n) for n in names]
    if isinstance(value, (list, tuple)):
        if len(value) != len(names):
            raise ValueError(f"{arg}: expected a scalar, one value per group ({len(names)}) or a mapping by group "
                             f"name, got {len(value)} values")
        return list(value)
    return [value] * len(names)


def group_values(names: list[str], mode: str, given: Mapping[str, object], mu0=None, bias_mu0=None
                 ) -> dict[str, GroupValues]:
    """Per group name, its :class:`GroupValues`: every value of ``given`` (a matcher's variances and IBP mass by
    name), ``mu0`` and ``bias_mu0`` a scalar (every group), one value per group in the spec's order, or a mapping by
    group name; with fixed hyper-parameters the published prior means (0 for weights, 0.1 for biases) where not
    given."""
    per = {name: _per_group(value, names, name) for name, value in given.items()}
    mus, bias_mus = _per_group(mu0, names, "mu0"), _per_group(bias_mu0, names, "bias_mu0")
    if mode == "fixed":
        mus = [0.0 if m is None else m for m in mus]
        bias_mus = [0.1 if m is None else m for m in bias_mus]
    return {g: GroupValues({name: per[name][c] for name in given}, mus[c], bias_mus[c]) for c, g in enumerate(names)}


def warm_start_labels(warm_start, names: list[str], widths: list[dict[str, int]]) -> dict | None:
    """Per group, J label tensors to start the matching from: from a previous match (anything with
    ``assignments``), a mapping by group name, or a sequence in spec order; None for None."""
    if warm_start is None:
        return None
    if hasattr(warm_start, "assignments"):
        previous = dict(warm_start.assignments)
    elif isinstance(warm_start, Mapping):
        previous = dict(warm_start)
    elif isinstance(warm_start, Sequence) and not isinstance(warm_start, (str, bytes)):
        if len(warm_start) != len(names):
            raise ValueError(f"warm_start: expected assignments of {len(names)} group(s), got {len(warm_start)}")
        previous = dict(zip(names, warm_start))
    else:
        raise ValueError(f"warm_start: expected a previous match, assignments per group (a mapping by name or a "
                         f"sequence in spec order), or None, got {type(warm_start).__name__}")
    if sorted(previous) != sorted(names):
        raise ValueError(f"warm_start: expected assignments of the groups {names}, got {sorted(previous)}")
    out = {}
    for g in names:
        if len(previous[g]) != len(widths):
            raise ValueError(f"warm_start[{g!r}]: expected one assignment per client ({len(widths)}), got "
                             f"{len(previous[g])}")
        out[g] = []
        for j, labels in enumerate(previous[g]):
            labels = torch.as_tensor(labels)
            if labels.dim() != 1 or labels.numel() != widths[j][g]:
                raise ValueError(f"warm_start[{g!r}][{j}]: expected {widths[j][g]} labels (client {j} has "
                                 f"{widths[j][g]} units in group {g!r}), got shape {tuple(labels.shape)}")
            out[g].append(labels)
    return out


def resolve_spec(spec: PermutationSpec | None, template: nn.Module | None, input_shape: Sequence[int] | None, *,
                 missing: str) -> PermutationSpec:
    """``spec`` checked, or when None derived from ``template`` (:func:`~bnpfed.matching.derive.derive_spec`) with
    ``input_shape``, which defaults to ``(in_features,)`` for a network whose first layer is a Linear. ``missing``:
    the error when there is neither a spec nor a template."""
    if spec is None:
        if template is None:
            raise ValueError(missing)
        if input_shape is None:
            first = next((m for m in template.modules() if isinstance(m, (nn.Linear, nn.Conv2d))), None)
            if not isinstance(first, nn.Linear):
                raise ValueError("input_shape: expected the shape of one input, e.g. (1, 28, 28), to derive the "
                                 "spec of a network that does not start with a Linear layer")
            input_shape = (first.in_features,)
        spec = derive_spec(template, input_shape)
    if not isinstance(spec, PermutationSpec):
        raise ValueError(f"spec: expected a PermutationSpec or None, got {type(spec).__name__}")
    return spec


def check_layer_fns(layer_fn, K: int) -> list[Callable]:
    """One matcher per group: ``layer_fn`` for every group, or a sequence of K of them."""
    if callable(layer_fn):
        return [layer_fn] * K
    if isinstance(layer_fn, Sequence) and len(layer_fn) == K and all(callable(f) for f in layer_fn):
        return list(layer_fn)
    raise ValueError(f"layer_fn: expected a one-layer matcher or one per group ({K}), got {layer_fn!r}")


def _accepts(fn, name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name`` (by name or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


# --------------------------------------------------------------------------------------------------------------------
# the group loop


def match_groups(clients: Clients, spec: PermutationSpec, step: Callable, *, below=None, groups=None,
                 compact: bool = False) -> dict[str, object]:
    """Every group of ``spec`` (the matching order: ``clients.spec`` or its reverse; only ``groups`` if given) in
    turn: its layout at the global sizes of the groups matched before it, every channel's unit vectors of every
    client, and ``step(name, layout, rows, below)`` -> a group result with ``assignments`` (J long tensors) and
    ``size`` (L). ``rows``: channel name -> J (L_j, D) float64 tensors (with ``compact``, J
    :class:`~bnpfed.matching.layer_inputs.CompactRows`: a client's units on the columns it uses, so that a layer
    after a Flatten costs O(N k) memory, not O(N D)); ``below``: group -> (J id tensors, L) of the groups matched
    before (given ones first)."""
    below = dict(below or {})
    shapes = clients.shapes
    out = {}
    pack = CompactRows.from_dense if compact else (lambda rows: rows)
    for name in (spec.group_names if groups is None else groups):
        layout = group_layout(spec, shapes, name, {h: size for h, (_, size) in below.items()})
        rows = {channel: [pack(layout_rows(states[j], spec, layout, {h: (ids[j], size) for h, (ids, size) in
                                                                      below.items()})) for j in range(clients.J)]
                for channel, states in clients.channels.items()}
        out[name] = step(name, layout, rows, below)
        below[name] = (out[name].assignments, out[name].size)
    return out


def call_matcher(fn, data: Sequence, layout: VectorLayout, values: GroupValues, shares: Tensor, *, mode: str,
                 sweeps, seed, init, options: Mapping):
    """``fn(*data, **values.given, mu0=, precisions=, sweeps=, seed=, [hyperparameters=], [init_assignments=],
    **options)`` for one group: the prior means from ``layout.prior_mean`` (the published batch-norm means with
    fixed hyper-parameters), the output coordinates at precision ``share_jk``. Returns (result, J long
    assignments)."""
    kwargs = {} if init is None else {"init_assignments": init}
    if _accepts(fn, "hyperparameters"):
        kwargs["hyperparameters"] = mode
    r = fn(*data, **values.given, mu0=layout.prior_mean(values.mu0, values.bias_mu0, fixed=mode == "fixed"),
           precisions=layout.precisions(shares), sweeps=sweeps, seed=seed, **kwargs, **options)
    return r, [torch.as_tensor(a, dtype=torch.long) for a in r.assignments]


def without_inactive(clients: Clients, spec: PermutationSpec, activity, init=None):
    """``(clients, init, kept)``: every channel of ``clients`` without the units each client reports inactive
    (:mod:`bnpfed.matching.activity`; slices of checked states, so only the widths change), the warm start
    ``init`` (per group J label arrays, or None) restricted to the units kept, and per client the units it kept;
    ``clients`` and ``init`` as given, and None, without reports (``activity`` None)."""
    kept = kept_per_client(activity, spec, clients.widths)
    if kept is None:
        return clients, init, None
    names = spec.group_names
    clients = replace(clients, channels={name: [drop_units(st, spec, k) for st, k in zip(states, kept)]
                                         for name, states in clients.channels.items()},
                      widths=[{g: int(k[g].numel()) for g in names} for k in kept])
    if init is not None:
        init = {g: [labels[k[g]] for labels, k in zip(init[g], kept)] for g in names}
    return clients, init, kept


def check_global_weights(global_weights, mode: str) -> str:
    if global_weights is None:
        return "average" if mode == "empirical-bayes" else "posterior-mean"
    return check_choice(global_weights, ("average", "posterior-mean"), "global_weights")


def pfnm_group(clients: Clients, spec: PermutationSpec, name: str, layout: VectorLayout, neurons: list, below,
               fn, values: GroupValues, *, mode: str, sweeps, seed, init, options, combine: str) -> GroupMatch:
    """PFNM's step for group ``name`` (its clients' unit vectors ``neurons``): the matcher ``fn``, the atoms (their
    posterior means, or with ``combine="average"`` the members' average: :func:`~bnpfed.matching.average_atoms`),
    each running statistic the mean of the members' (module docstring of :mod:`bnpfed.matching.permutation`)."""
    r, assignments = call_matcher(fn, [neurons], layout, values, clients.shares, mode=mode, sweeps=sweeps, seed=seed,
                                  init=init, options=options)
    if combine == "average":
        atoms = average_atoms(neurons, assignments, precisions=layout.precisions(clients.shares))
    else:
        atoms = torch.as_tensor(r.global_atoms).to(torch.float64)
    L = int(atoms.shape[0])
    statistics = {}
    stats = group_layout(spec, clients.shapes, name, {**{h: s for h, (_, s) in below.items()}, name: L},
                         statistics=True)
    if stats.segments:
        total = torch.zeros(L, stats.D, dtype=torch.float64)
        count = torch.zeros(L, 1, dtype=torch.float64)
        for j, state in enumerate(clients.channels["value"]):
            rows = layout_rows(state, spec, stats, {**{h: (ids[j], s) for h, (ids, s) in below.items()},
                                                    name: (assignments[j], L)})
            total.index_add_(0, assignments[j], rows)
            count.index_add_(0, assignments[j], torch.ones(rows.shape[0], 1, dtype=torch.float64))
        statistics = stats.to_params(total / count.clamp(min=1))
    return GroupMatch(group=name, result=r, assignments=assignments, atoms=atoms, layout=layout,
                      statistics=statistics, hyperparameters=dict(getattr(r, "hyperparameters", None) or {}))


def output_bias(clients: Clients, hypers: Mapping, values: GroupValues, combine: str) -> tuple[Tensor, float | None]:
    """The output bias, ``(bias, bias_mu0)``. ``combine="average"``: the clients' biases averaged class by class
    (weights :func:`~bnpfed.matching.averaging_weights` of the class shares), bias_mu0 None. Otherwise the posterior
    mean under N(bias_mu0, sigma0_2) with client j's bias seen at precision share_jk / sigma2, the variances those of
    the group holding the output weights (its ``_scaled`` pair when it has one); bias_mu0 when None the mean over the
    classes of each class's precision-weighted mean of the clients' biases."""
    shares = clients.shares
    b_out = torch.stack([s[clients.output_bias].to(torch.float64) for s in clients.channels["value"]])
    if combine == "average":
        return (averaging_weights(shares) * b_out).sum(0), None
    sigma2, sigma0_2 = values.given.get("sigma2"), values.given.get("sigma0_2")
    s2 = hypers.get("sigma2", sigma2 if sigma2 is not None else 1.0)
    s02 = hypers.get("sigma0_2", sigma0_2 if sigma0_2 is not None else 1.0)
    s2_out = hypers.get("sigma2_scaled", s2)
    s02 = hypers.get("sigma0_2_scaled", s02)
    weighted, precision = (shares * b_out).sum(0) / s2_out, shares.sum(0) / s2_out
    if values.bias_mu0 is not None:
        b_mu0 = float(values.bias_mu0)
    else:
        held = precision > 0
        b_mu0 = float((weighted[held] / precision[held]).mean())
    return (b_mu0 / s02 + weighted) / (1.0 / s02 + precision), b_mu0


def check_size_limits(max_width, max_params, clients: Clients, template: nn.Module | None, states: Sequence, *,
                      groups: Sequence[str] | None = None, best_effort: bool = False, heads: int = 1
                      ) -> tuple[dict[str, int | None], int | None]:
    """``max_width`` per group (None: no limit) and ``max_params`` as a number (None: no limit; ``"ensemble"``: the
    parameters of the clients' networks ``states`` together), checked against the smallest sizes any assignment of
    ``clients`` (their units after any left out) allows (:func:`~bnpfed.matching.size.minimum_widths`); the widths
    only of ``groups`` when given (the ones about to be matched). With ``best_effort`` a ``max_params`` below that
    smallest size is kept (the search then keeps the smallest match it finds) instead of refused. ``heads``: the
    output layers the global network carries (J with pooled heads; :func:`~bnpfed.matching.size.parameter_count`)."""
    spec, names = clients.spec, clients.spec.group_names
    caps = {g: None if v is None else check_int(v, f"max_width[{g!r}]", low=1)
            for g, v in zip(names, _per_group(max_width, names, "max_width"))}
    floor = minimum_widths(clients.widths)
    for g, cap in caps.items():
        if cap is not None and cap < floor[g] and (groups is None or g in groups):
            j = max(range(clients.J), key=lambda i: clients.widths[i][g])
            raise SizeLimitError(f"max_width[{g!r}]: expected at least {floor[g]} (client {j} has {floor[g]} units "
                                 f"in group {g!r}, each needing a global unit of its own), got {cap}")
    if max_params is None:
        return caps, None
    if template is None:
        raise ValueError("max_params: expected a template network (to tell its parameters from its buffers); pass "
                         "template= with state dicts")
    parameters = [n for n, _ in template.named_parameters()]
    if isinstance(max_params, str):
        if max_params != "ensemble":
            raise ValueError(f"max_params: expected a positive int, 'ensemble' or None, got {max_params!r}")
        limit = parameters_in(states, parameters)
    else:
        limit = check_int(max_params, "max_params", low=1)
    smallest = parameter_count(spec, clients.shapes, parameters, floor, heads=heads)
    if limit < smallest and not best_effort:
        given = " ('ensemble')" if max_params == "ensemble" else ""
        pooled = f", {heads} output layers (pooled heads)" if heads > 1 else ""
        raise SizeLimitError(f"max_params: expected at least {smallest} (the parameters at the smallest widths any "
                             f"assignment allows, {floor}{pooled}), got {limit}{given}")
    return caps, limit


def limit_width(first: GroupMatch, rerun: Callable[[float], GroupMatch], cap: int | None, *,
                best_effort: bool = False) -> GroupMatch:
    """``first`` (a group's match at its own gamma0) if ``cap`` is None or it fits; else the match ``rerun(gamma0)``
    at the largest gamma0 below its own found to fit ``cap`` (:func:`~bnpfed.matching.size.fit_size`; with
    ``best_effort``, the smallest found when none fits), with its ``size_search`` set and the search's note added to
    its result's notes."""
    if cap is None:
        return first
    base = match_gamma0(first, "max_width")
    match, search = fit_size(lambda t: first if t == 0.0 else rerun(base * math.exp(-t)), lambda m: m.size, cap,
                             f"max_width[{first.group!r}]", best_effort=best_effort)
    match.size_search = search
    if search.binding and hasattr(match.result, "notes"):
        match.result.notes = [*match.result.notes, search.note()]
    return match


def match_gamma0(match: GroupMatch, arg: str) -> float:
    """The IBP mass a group's match ran at (estimated or given), which a size limit lowers."""
    gamma = match.hyperparameters.get("gamma0")
    if gamma is None:
        raise ValueError(f"{arg}: applies to a Beta-Bernoulli matcher (a layer_fn whose result has hyperparameters "
                         f"with gamma0, such as match_layer); group {match.group!r}'s result has none")
    return float(gamma)


def _average_forward(clients: Clients, assignments: Mapping[str, list], sizes: Mapping[str, int]
                     ) -> dict[str, Tensor]:
    """The members' average of every group in the spec's own (bottom-up) layouts, given every group's assignment (and
    global size): the global weights of ``global_weights="average"`` whatever order the groups were matched in."""
    spec = clients.spec
    atoms = {}
    for c, name in enumerate(spec.group_names):
        layout = group_layout(spec, clients.shapes, name, sizes)
        below = {h: (assignments[h], sizes[h]) for h in spec.group_names[:c]}
        neurons = [layout_rows(s, spec, layout, {h: (ids[j], n) for h, (ids, n) in below.items()})
                   for j, s in enumerate(clients.channels["value"])]
        atoms[name] = average_atoms(neurons, assignments[name], precisions=layout.precisions(clients.shares))
    return atoms


def match_by_spec(
    client_nets,
    class_counts=None,
    spec: PermutationSpec | None = None,
    *,
    input_shape: Sequence[int] | None = None,
    template: nn.Module | None = None,
    sigma2=None,
    sigma0_2=None,
    gamma0=None,
    mu0=None,
    bias_mu0=None,
    hyperparameters: Literal["empirical-bayes", "fixed"] = "empirical-bayes",
    direction: Literal["bottom-up", "top-down"] = "bottom-up",
    sweeps: int | None = None,
    seed: int | None = None,
    warm_start=None,
    layer_fn: Callable | Sequence[Callable] = match_layer,
    global_weights: Literal["average", "posterior-mean"] | None = None,
    activity=None,
    max_width=None,
    max_params=None,
    best_effort: bool = False,
    heads: Literal["fused", "pooled"] = "fused",
    **matcher_kwargs,
) -> SpecMatch:
    """Match J clients' networks of one kind into one global network (PFNM's server step), group by group in the
    spec's order, every group through ``layer_fn`` (:func:`~bnpfed.matching.match_layer`).

    For each group: every client's unit vectors (:func:`~bnpfed.matching.unit_vectors`; the groups before it
    re-indexed to their matched global units), the output-weight coordinates at precision ``share_jk``, prior means
    from ``mu0`` / ``bias_mu0`` (and :data:`~bnpfed.matching.spec.BN_FIXED_PRIOR_MEANS` under fixed
    hyper-parameters); the atoms are the owned parameters' global values, and each running statistic is the mean of
    the members' of its unit. The output bias is the class-share-weighted posterior mean of the clients' output
    biases, with the variances of the group holding the output weights (``sigma2_scaled`` / ``sigma0_2_scaled`` when
    it has them), and prior mean ``bias_mu0`` or, when None, the mean over the classes of the precision-weighted
    means (the reference's ``process_softmax_bias``).

    Two clients hold one conv net with its channels and units permuted differently; matching puts it back together::

        >>> from bnpfed.matching import client_slice, derive_spec, network_from_state
        >>> g = torch.manual_seed(0)
        >>> net = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(12, 5),
        ...                     nn.ReLU(), nn.Linear(5, 2))
        >>> spec = derive_spec(net, (1, 6, 6))
        >>> perms = {"0": torch.tensor([2, 0, 1]), "4": torch.tensor([4, 3, 0, 1, 2])}
        >>> shuffled = network_from_state(net, client_slice(spec, net.state_dict(), perms))
        >>> fixed = dict(hyperparameters="fixed", sigma2=1e-8, sigma0_2=1.0, gamma0=1.0)
        >>> result = match_by_spec([net, shuffled], [[3, 1], [1, 3]], spec, seed=0, **fixed)
        >>> result.widths
        {'0': 3, '4': 5}
        >>> x = torch.randn(4, 1, 6, 6)
        >>> torch.allclose(result.network()(x), net(x), atol=1e-5)
        True
        >>> torch.allclose(result.client_network(1)(x), net(x), atol=1e-5)
        True

    :param client_nets: J networks of one kind (``nn.Module`` s) or their ``state_dict`` s (then pass ``template``
        and ``spec``). Widths may differ; the axes no group acts on may not.
    :param class_counts: (J, C) training examples of each class at each client (any positive multiple works);
        default all ones.
    :param spec: the :class:`~bnpfed.matching.PermutationSpec`; default
        :func:`~bnpfed.matching.derive_spec` of client 0's network.
    :param input_shape: the shape of one input, for :func:`~bnpfed.matching.derive_spec` (default:
        ``(in_features,)`` when the network's first layer is a Linear; required for a convolutional network).
    :param template: the network the global one is built from; default client 0's.
    :param sigma2: noise variance, ``sigma0_2`` prior variance, ``gamma0`` IBP mass, ``mu0`` prior mean of the
        weight coordinates, ``bias_mu0`` of the bias coordinates and of the output bias: None (estimated per group
        under empirical Bayes; sigma2, sigma0_2 and gamma0 required with ``"fixed"``, mu0 0 and bias_mu0 0.1 as
        published), a scalar (every group), one value per group in the spec's order, or a mapping by group name.
    :param str hyperparameters: ``"empirical-bayes"`` (default) or ``"fixed"``.
    :param str direction: ``"bottom-up"`` (default: the spec's order, every group matched on its incoming weights)
        or ``"top-down"`` (the published order: the spec's groups reversed, a unit then being its bias and its
        outgoing weights re-indexed to the matched group above -- for an MLP's upper layers too little evidence to
        tell units apart). Group c of the spec's order draws its sweeps from ``seed + c`` in either order, and
        ``global_weights="average"`` averages the members in the spec's own layouts (a global unit's incoming
        weights the average of its members').
    :param int sweeps: remove-and-rematch passes per group (None: the matcher's default).
    :param int seed: seed of the sweeps' client order; the group at position c of the spec uses ``seed + c``.
    :param warm_start: a previous :class:`SpecMatch` of the same J clients (each client's network then being its
        :meth:`~SpecMatch.client_slice`, trained further), or per group J label arrays (a mapping by name or a
        sequence in spec order): the initial assignments (``init_assignments`` of the matcher). Default None: match
        from scratch.
    :param layer_fn: the one-group matcher (default :func:`~bnpfed.matching.match_layer`), or one per group; any
        function with its signature returning an object with ``global_atoms`` and ``assignments`` (a baseline such
        as k-means). It is passed the neurons, ``sigma2``, ``sigma0_2``, ``gamma0``, ``mu0`` (None, or a (D,)
        tensor with NaN on the coordinates to estimate), ``precisions``, ``sweeps``, ``seed`` and
        ``matcher_kwargs``; ``hyperparameters`` only if it takes it (by name or ``**kwargs``), and
        ``init_assignments`` only with ``warm_start``. If its result has no ``hyperparameters``, a
        ``"posterior-mean"`` output bias uses the given ones, 1 where None.
    :param str global_weights: ``"average"`` (each global unit's owned parameters the average of its members', the
        output layer the clients' logits averaged class by class: :func:`~bnpfed.matching.average_atoms`) or
        ``"posterior-mean"`` (the atoms' posterior means, as published); None (default): ``"average"`` under
        empirical Bayes, ``"posterior-mean"`` with fixed hyper-parameters.
    :param activity: None, or per client what it reports about its units on its own data
        (:func:`~bnpfed.matching.activity.unit_activity`: per group the (L,) largest contribution of each unit):
        the units with activity 0 (dead on the client's data: its network computes the same without them) are left
        out before matching (:mod:`bnpfed.matching.activity`); they join no global unit, the assignments and
        ``warm_start`` refer to each client's remaining units (in their order), and ``SpecMatch.kept_units`` says
        which they are.
    :param max_width: the most global units a group may have: None (default: the model's own width), an int
        (every group), one per group in the spec's order, or a mapping by group name (None: no limit). Met inside
        the model: the group's IBP mass gamma0 is lowered until its match fits, every other hyper-parameter
        estimated at that gamma0 (:mod:`bnpfed.matching.size`). At least the most units one client holds in the
        group (checked before any work).
    :param max_params: the most parameters the global network may have: None (default), an int, or ``"ensemble"``
        (the clients' networks' parameters together: a global network no larger than what it replaces). Met by
        pricing every parameter in the prior: each group's own gamma0 times ``exp(-lambda D_g)``, ``D_g`` the
        parameters one of its units owns (with ``max_width`` applied inside each run). ``SpecMatch.size_searches``
        and each limited group's result ``notes`` say what meeting a limit took.
    :param bool best_effort: with ``max_params``, a budget no pricing strength meets (the clients' units too far
        apart to merge into fewer, or a client holding more than the budget allows, as one sent the whole global
        network does) keeps the smallest match the search found, its ``SizeSearch.met`` False, instead of raising
        :class:`~bnpfed.matching.size.SizeLimitError` (default False; what PFNM's rounds use for a budget that starts
        after round 1: :attr:`~bnpfed.federated.config.PFNMConfig.limit_from_round`).
    :param str heads: the output layer the global network will carry, what ``max_params`` prices: ``"fused"``
        (default: one, :meth:`SpecMatch.network`) or ``"pooled"`` (every matched client's own,
        :func:`~bnpfed.matching.pooled_network`: the J output layers counted, and each unit of the group they read
        priced with its J columns). Refused without ``max_params``, where it changes nothing.
    :param matcher_kwargs: passed to ``layer_fn`` (``objective``, ``popularity_factor``, ``start``, ...).
    :returns: :class:`SpecMatch`.
    """
    t0 = time.perf_counter()
    mode = check_choice(hyperparameters, ("empirical-bayes", "fixed"), "hyperparameters")
    check_choice(direction, ("bottom-up", "top-down"), "direction")
    check_choice(heads, ("fused", "pooled"), "heads")
    if heads != "fused" and max_params is None:
        raise ValueError(f"heads: what max_params prices (the output layers the global network will carry); expected "
                         f"'fused' without max_params, got {heads!r}")
    combine = check_global_weights(global_weights, mode)
    states, template = client_states(client_nets, template)
    spec = resolve_spec(spec, template, input_shape,
                        missing="spec: expected a PermutationSpec when client_nets are state dicts (or a template)")
    names = spec.group_names
    clients = prepare_clients({"value": states}, spec, class_counts)
    init = warm_start_labels(warm_start, names, clients.widths)
    clients, init, kept = without_inactive(clients, spec, activity, init)
    copies = clients.J if heads == "pooled" else 1
    caps, param_limit = check_size_limits(max_width, max_params, clients, template, states,
                                          best_effort=check_bool(best_effort, "best_effort"), heads=copies)
    if best_effort and param_limit is None:
        raise ValueError("best_effort: applies to a max_params budget only (it keeps the smallest match a budget's "
                         "search found); got best_effort=True without max_params")
    states = clients.channels["value"]
    fns = dict(zip(names, check_layer_fns(layer_fn, len(names))))
    values = group_values(names, mode, {"sigma2": sigma2, "sigma0_2": sigma0_2, "gamma0": gamma0}, mu0, bias_mu0)
    order = spec if direction == "bottom-up" else spec.reversed()
    own_gamma0, dims = {}, {}

    def group_at(name, layout, rows, below, gamma):
        c = names.index(name)
        return pfnm_group(clients, order, name, layout, rows["value"], below, fns[name],
                          values[name].with_gamma0(gamma), mode=mode,
                          sweeps=sweeps, seed=None if seed is None else seed + c,
                          init=None if init is None else init[name], options=matcher_kwargs, combine=combine)

    def in_network_dtype(match: GroupMatch) -> GroupMatch:
        """The group's average in the dtype its parameters have in the network (when they share one narrower than
        float64): the state built from it is the same, and a wide group's (L, D) atoms take half the memory while the
        groups after it are matched (gigabytes for LeNet's fc1 at hundreds of clients)."""
        dtypes = {states[0][seg.param].dtype for seg in match.layout.segments}
        if combine == "average" and len(dtypes) == 1:
            dtype = dtypes.pop()
            if dtype.is_floating_point and dtype != torch.float64:
                match.atoms = match.atoms.to(dtype)
        return match

    def steps(strength):
        """The group step with every group's gamma0 at ``exp(-strength D_g / D_max)`` times its own (0: the model's
        own; ``D_g`` the parameters a unit of the group owns, :mod:`bnpfed.matching.size`), and the group's
        ``max_width`` met inside."""
        def step(name, layout, rows, below):
            if strength == 0.0:
                first = group_at(name, layout, rows, below, None)
                dims[name] = layout.D + (copies - 1) * head_parameters(spec, clients.shapes, name)
                if caps[name] is not None or param_limit is not None:
                    own_gamma0[name] = match_gamma0(first, "max_width" if caps[name] is not None else "max_params")
            else:
                factor = math.exp(-strength * dims[name] / max(dims.values()))
                first = group_at(name, layout, rows, below, own_gamma0[name] * factor)
            return in_network_dtype(limit_width(first, lambda gamma: group_at(name, layout, rows, below, gamma),
                                                caps[name]))
        return step

    searches = {}
    # PFNM's own matcher takes a client's units on the columns it uses (after a Flatten a tenth of them or fewer)
    compact = all(fn is match_layer for fn in fns.values())
    if param_limit is None:
        matches = match_groups(clients, order, steps(0.0), compact=compact)
    else:
        parameters = [n for n, _ in template.named_parameters()]
        matches, searches["parameters"] = fit_size(
            lambda f: match_groups(clients, order, steps(f), compact=compact),
            lambda ms: parameter_count(spec, clients.shapes, parameters, {n: m.size for n, m in ms.items()},
                                       heads=copies),
            param_limit, "max_params", best_effort=best_effort)
    searches.update({n: m.size_search for n, m in matches.items() if m.size_search is not None})
    assignments = {n: matches[n].assignments for n in names}
    extra = {k: v for m in matches.values() for k, v in m.statistics.items()}
    owner = matches[order.owner(clients.output_weight)]
    b_mu0 = None
    if clients.output_bias is not None:
        extra[clients.output_bias], b_mu0 = output_bias(clients, owner.hyperparameters, values[owner.group], combine)
    if combine == "average" and direction == "top-down":
        layout_spec, atoms = spec, _average_forward(clients, assignments, {n: m.size for n, m in matches.items()})
    else:
        layout_spec, atoms = order, {n: m.atoms for n, m in matches.items()}
    state = state_from_atoms(layout_spec, states[0], atoms, extra)
    return SpecMatch(spec=spec, state=state, assignments=assignments,
                     layer_results={n: matches[n].result for n in names}, template=template,
                     seconds=time.perf_counter() - t0, class_shares=clients.shares,
                     hyperparameters={n: matches[n].hyperparameters for n in names}, output_bias_mu0=b_mu0,
                     kept_units=kept, size_searches=searches)
