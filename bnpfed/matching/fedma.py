"""FedMA's layer-wise scheme (Wang et al., ICLR 2020), one group at a time: :func:`match_group` is
:func:`~bnpfed.matching.match_by_spec`'s step for one group (``match_by_spec`` is that step for every group in turn,
the groups matched before re-indexing the next), returning a :class:`~bnpfed.matching.network.GroupMatch`;
:func:`align_to_group` gives a client the matched group (every global unit, the next layer's input columns re-indexed
to them, zeros for units it lacks), so that after it every client holds the same units below the next group, which
:func:`match_group` then takes as the identity. Between two groups FedMA's clients retrain the layers above with the
matched ones frozen (:mod:`bnpfed.federated.pfnm`)."""

from __future__ import annotations

from typing import Callable, Literal, Mapping, Sequence

import torch
from torch import Tensor

from bnpfed.matching.layout import reindex
from bnpfed.matching.layer import match_layer
from bnpfed.matching.network import (GroupMatch, check_global_weights, check_size_limits, client_states,
                                               group_values, limit_width, match_groups, output_bias, pfnm_group,
                                               prepare_clients, warm_start_labels)
from bnpfed.matching.spec import PermutationSpec
from bnpfed.validation import check_choice

__all__ = ["align_to_group", "match_group"]


def match_group(
    client_nets,
    spec: PermutationSpec,
    group: str,
    class_counts=None,
    *,
    below: Mapping[str, tuple[Sequence, int]] | None = None,
    sigma2=None,
    sigma0_2=None,
    gamma0=None,
    mu0=None,
    bias_mu0=None,
    hyperparameters: Literal["empirical-bayes", "fixed"] = "empirical-bayes",
    sweeps: int | None = None,
    seed: int | None = None,
    init_assignments=None,
    layer_fn: Callable = match_layer,
    global_weights: Literal["average", "posterior-mean"] | None = None,
    max_width=None,
    best_effort: bool = False,
    **matcher_kwargs,
) -> GroupMatch:
    """Match one group of J clients' networks: :func:`match_by_spec`'s step for that group, on its own. FedMA's
    layer-wise scheme (Wang et al., ICLR 2020) calls it once per group, the clients retraining in between: after a
    group is matched every client takes its global units (:func:`align_to_group`), so the groups before the next one
    are the same in every client, unit for unit.

    Two clients holding permuted copies of one network, its first layer matched, then aligned::

        >>> from torch import nn
        >>> from bnpfed.matching import client_slice, derive_spec
        >>> net = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
        >>> spec = derive_spec(net, (4,))
        >>> other = client_slice(spec, net.state_dict(), {"0": [2, 0, 1], "2": [1, 2, 0]})
        >>> fixed = dict(hyperparameters="fixed", sigma2=1e-8, sigma0_2=1.0, gamma0=1.0)
        >>> first = match_group([net.state_dict(), other], spec, "0", seed=0, **fixed)
        >>> first.size, first.assignments[1].tolist()
        (3, [2, 0, 1])
        >>> aligned = [align_to_group(s, spec, first, j) for j, s in enumerate([net.state_dict(), other])]
        >>> torch.equal(aligned[0]["0.weight"], aligned[1]["0.weight"])
        True
        >>> match_group(aligned, spec, "2", seed=1, **fixed).size   # the groups below: the same in both
        3

    :param client_nets: J networks (``nn.Module`` s) or ``state_dict`` s of one kind.
    :param spec: the :class:`PermutationSpec`.
    :param str group: the group to match.
    :param class_counts: (J, C) examples per class at each client (for the output weights' precisions); default ones.
    :param below: for the groups before ``group`` in the spec's order, ``{name: (J id tensors, global size)}``: the
        global units each client's units of that group went to. Default: the identity at the clients' (equal)
        widths -- the clients are aligned, as after :func:`align_to_group`.
    :param sigma2: as :func:`match_by_spec` (one value, one per group, or a mapping by name; this group's is used);
        so are ``sigma0_2``, ``gamma0``, ``mu0``, ``bias_mu0``, ``hyperparameters``, ``sweeps``, ``global_weights``
        and ``matcher_kwargs``.
    :param int seed: the seed of this group's sweeps.
    :param init_assignments: J label arrays to start the matching from (a warm start), or None.
    :param layer_fn: the one-group matcher.
    :param max_width: the most global units of the group (as :func:`match_by_spec`'s: one value, one per group, or a
        mapping by name; this group's is used), met by lowering its IBP mass (:mod:`bnpfed.matching.size`); at least
        the most units one client holds in it. None: the model's own width.
    :param bool best_effort: a ``max_width`` the matcher cannot meet gives the smallest match it found (its
        ``size_search.met`` False, the note in its result's notes) instead of a
        :class:`~bnpfed.matching.size.SizeLimitError` (FedMA's default budget, ``PFNMConfig(max_params="auto")``).
    :returns: :class:`GroupMatch`.
    """
    mode = check_choice(hyperparameters, ("empirical-bayes", "fixed"), "hyperparameters")
    combine = check_global_weights(global_weights, mode)
    if not isinstance(spec, PermutationSpec):
        raise ValueError(f"spec: expected a PermutationSpec, got {type(spec).__name__}")
    names = spec.group_names
    if group not in names:
        raise ValueError(f"group: expected one of {names}, got {group!r}")
    if not callable(layer_fn):
        raise ValueError(f"layer_fn: expected a one-layer matcher, got {layer_fn!r}")
    c = names.index(group)
    states, _ = client_states(client_nets)
    clients = prepare_clients({"value": states}, spec, class_counts)
    J, widths = clients.J, clients.widths
    resolved: dict[str, tuple[list[Tensor], int]] = {}
    for h in names[:c]:
        if below is not None and h in below:
            try:
                ids, size = below[h]
                ids = [torch.as_tensor(i, dtype=torch.long).reshape(-1) for i in ids]
                size = int(size)
            except (TypeError, ValueError) as err:
                raise ValueError(f"below[{h!r}]: expected (one id tensor per client, global size), got "
                                 f"{below[h]!r}") from err
            if len(ids) != J or any(i.numel() != widths[j][h] for j, i in enumerate(ids)):
                raise ValueError(f"below[{h!r}]: expected one id per unit of every client's group {h!r} "
                                 f"({[w[h] for w in widths]}), got {[i.numel() for i in ids]}")
            resolved[h] = (ids, size)
        else:
            sizes = sorted({w[h] for w in widths})
            if len(sizes) != 1:
                raise ValueError(f"below: expected the global ids of group {h!r} (matched before {group!r}), as the "
                                 f"clients hold {sizes} units of it, got none; pass below[{h!r}] (their global ids), "
                                 f"or align them first (align_to_group)")
            resolved[h] = ([torch.arange(sizes[0])] * J, sizes[0])
    unknown = sorted(set(below or {}) - set(names[:c]))
    if unknown:
        raise ValueError(f"below: expected groups matched before {group!r} ({names[:c]}), got {unknown}")
    init = None
    if init_assignments is not None:
        init = warm_start_labels({group: init_assignments}, [group], [{group: w[group]} for w in widths])[group]
    values = group_values(names, mode, {"sigma2": sigma2, "sigma0_2": sigma0_2, "gamma0": gamma0}, mu0,
                          bias_mu0)[group]

    cap = check_size_limits(max_width, None, clients, None, states, groups=[group])[0][group]

    def step(name, layout, rows, below_):
        def at(gamma):
            return pfnm_group(clients, spec, name, layout, rows["value"], below_, layer_fn, values.with_gamma0(gamma),
                              mode=mode, sweeps=sweeps, seed=seed, init=init, options=matcher_kwargs,
                              combine=combine)
        return limit_width(at(None), at, cap, best_effort=best_effort)

    match = match_groups(clients, spec, step, below=resolved, groups=[group])[group]
    if clients.output_bias is not None and spec.owner(clients.output_weight) == group:
        bias, match.output_bias_mu0 = output_bias(clients, match.hyperparameters, values, combine)
        match.output_bias = {clients.output_bias: bias}
    return match


def align_to_group(state: Mapping[str, Tensor], spec: PermutationSpec, match: GroupMatch, j: int
                   ) -> dict[str, Tensor]:
    """Client j's state after ``match``: every parameter the group owns takes its global value (all L global units:
    the client now holds the whole matched group, as in FedMA), every other parameter the group acts on is
    re-indexed to the global units (the next layer's input columns: client unit l's go to its global unit, a global
    unit the client lacks gets zeros), everything else is the client's own. Dtypes are kept."""
    if not 0 <= j < len(match.assignments):
        raise ValueError(f"j: expected a client in [0, {len(match.assignments)}), got {j}")
    values = match.values()
    ids, size = match.assignments[j], match.size
    index = spec.group_names.index(match.group)
    out = {}
    for key, t in state.items():
        t = torch.as_tensor(t).detach()
        if key in values:
            out[key] = values[key].to(t.dtype).clone()
            continue
        for c, a in spec.axes_of(key):
            if c == index:
                t = reindex(t, a.dim, a.block, ids, size)
        out[key] = t.clone()
    return out
