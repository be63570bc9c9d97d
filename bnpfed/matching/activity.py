"""Inactive units: what each client reports about its own hidden units, and what matching does with it.

A hidden unit of a trained ReLU network can be *dead* on its client's data: its output is 0 on every example (and,
for a convolutional channel, at every position), so nothing downstream ever sees it. Such units are not evidence
about the global atoms -- their incoming weights are whatever the initialisation and the first steps left -- yet
they look alike across clients, and under empirical Bayes their tight agreement sets the noise variance of the whole
layer: the estimated noise then falls to the distance between dead units, far below the distance at which truly
matched trained units lie apart, and nothing else merges (the docs' benchmark page on one-shot matching measures
it).

* :func:`unit_activity` (a client step, on the client's own data): per group of the permutation spec, each unit's
  largest absolute contribution ``a_u = max |x_u|`` over the inputs, read where the units enter the next layer (the
  input of every layer whose input axis the group acts on: after the activation, pooling and flatten) -- one
  forward pass, nothing but these maxima leaves the client.
* :func:`inactive_units`: the units with ``a_u = 0`` exactly. No threshold is involved: such a unit contributes
  exactly 0 to every later layer on the client's data, so the client's network without it (:func:`drop_units`)
  computes the same outputs on that data, bit for bit.
* :func:`~bnpfed.matching.network.match_by_spec` takes the clients' reports (``activity=``) and leaves
  the inactive units out before matching: they join no global unit, and in a later round the client's slice of the
  global network simply lacks them.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor, nn

from bnpfed.matching.assembly import client_slice, network_from_state
from bnpfed.matching.layout import width
from bnpfed.matching.spec import PermutationSpec

__all__ = ["drop_units", "inactive_units", "kept_per_client", "kept_units", "unit_activity"]


def _consumers(net: nn.Module, spec: PermutationSpec) -> dict[str, list[tuple[str, nn.Module, int]]]:
    """Per group, the layers its units enter: (module name, module, block) for every axis at dim 1 of a weight."""
    out = {}
    for group in spec.groups:
        entries = []
        for axis in group.axes:
            if axis.dim != 1 or not axis.param.endswith(".weight"):
                continue
            name = axis.param.rsplit(".", 1)[0]
            module = net.get_submodule(name)
            if not isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
                raise ValueError(f"spec: group {group.name!r} enters {name!r} ({type(module).__name__}) through "
                                 f"{axis}; unit activity is read at the input of a Linear or Conv layer only")
            entries.append((name, module, axis.block))
        if not entries:
            raise ValueError(f"spec: group {group.name!r} enters no Linear or Conv layer (no axis at dim 1 of a "
                             f"weight): its units' activity cannot be read")
        out[group.name] = entries
    return out


@torch.no_grad()
def unit_activity(net: nn.Module, inputs: Tensor, spec: PermutationSpec, *, batch_size: int = 1024
                  ) -> dict[str, Tensor]:
    """Per group of ``spec``, the (L,) largest absolute value each unit takes where it enters the next layer(s),
    over ``inputs`` (the client's own training inputs) and every position: 0 exactly for a unit nothing downstream
    ever sees. The network runs in eval mode (batch norm on its running statistics, as it predicts) and is left in
    the mode it was in.

    >>> from bnpfed.matching import derive_spec
    >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    >>> with torch.no_grad():
    ...     _ = net[0].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]))
    ...     _ = net[0].bias.zero_()
    >>> unit_activity(net, torch.tensor([[1.0, 2.0], [3.0, 0.5]]), derive_spec(net, (2,)))["0"].tolist()
    [3.0, 2.0, 0.0]
    """
    if not isinstance(inputs, Tensor) or inputs.dim() < 2 or inputs.shape[0] < 1:
        raise ValueError(f"inputs: expected a tensor of at least one example (batch first), got "
                         f"{type(inputs).__name__}{'' if not isinstance(inputs, Tensor) else tuple(inputs.shape)}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    if not isinstance(spec, PermutationSpec):
        raise ValueError(f"spec: expected the network's PermutationSpec (derive_spec(net, input_shape)), got "
                         f"{type(spec).__name__} {spec!r}"[:200])
    consumers = _consumers(net, spec)
    state = net.state_dict()
    sizes = {g.name: width(state, g, "net") for g in spec.groups}
    activity = {g: torch.zeros(n, dtype=torch.float64) for g, n in sizes.items()}
    hooks = []

    def record(group: str, module: nn.Module, block: int):
        def hook(_module, args):
            x = args[0].detach()
            feature = -1 if isinstance(module, nn.Linear) else 1
            x = x.movedim(feature, 0).reshape(x.shape[feature], -1).abs()
            x = x.reshape(sizes[group], block * x.shape[1]).amax(dim=1)
            activity[group] = torch.maximum(activity[group], x.double())
        return hook

    for group, entries in consumers.items():
        for _, module, block in entries:
            hooks.append(module.register_forward_pre_hook(record(group, module, block)))
    was_training = net.training
    try:
        net.eval()
        for i in range(0, inputs.shape[0], batch_size):
            net(inputs[i:i + batch_size])
    finally:
        for h in hooks:
            h.remove()
        net.train(was_training)
    return activity


def inactive_units(activity: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Per group, the (L,) boolean mask of the units whose activity (:func:`unit_activity`) is exactly 0."""
    return {g: torch.as_tensor(a) == 0 for g, a in activity.items()}


def kept_units(activity: Mapping[str, Tensor], spec: PermutationSpec, *, who: str = "activity") -> dict[str, Tensor]:
    """Per group of ``spec``, the indices (ascending) of the units a client keeps: those with activity above 0. A
    group whose every unit is inactive keeps its first unit (a layer of width 0 is no network), which contributes
    nothing on the client's data either."""
    if not isinstance(activity, Mapping) or sorted(activity) != sorted(spec.group_names):
        got = sorted(activity) if isinstance(activity, Mapping) else type(activity).__name__
        raise ValueError(f"{who}: expected a mapping with one (L,) tensor per group {spec.group_names}, got {got}")
    out = {}
    for g in spec.group_names:
        a = torch.as_tensor(activity[g])
        if a.dim() != 1 or not a.is_floating_point() or bool((a < 0).any()) or not bool(torch.isfinite(a).all()):
            raise ValueError(f"{who}[{g!r}]: expected a 1-d tensor of finite activities >= 0, got "
                             f"{tuple(a.shape)} {a.dtype}")
        kept = torch.nonzero(a > 0).flatten()
        out[g] = kept if kept.numel() else torch.zeros(1, dtype=torch.long)
    return out


def drop_units(net_or_state, spec: PermutationSpec, kept: Mapping[str, Tensor], template: nn.Module | None = None):
    """A client's network (or ``state_dict``) with only the units ``kept`` (:func:`kept_units`) of every group:
    each unit's incoming weights, bias, batch-norm entries and outgoing weights go together, so a network without
    its inactive units computes what it did on the data its activity was read on. Returns what it was given (a
    network, built on ``template`` or the network itself, or a state dict)."""
    if isinstance(net_or_state, nn.Module):
        state = client_slice(spec, net_or_state.state_dict(), kept)
        return network_from_state(template if template is not None else net_or_state, state)
    return client_slice(spec, net_or_state, kept)


def kept_per_client(activity, spec: PermutationSpec, widths: Sequence[Mapping[str, int]]) -> list | None:
    """The clients' reports (None, or one :func:`unit_activity` mapping per client) checked against their widths
    (per client, its units per group), and per client the units it keeps (:func:`kept_units`); None for None. What
    :func:`~bnpfed.matching.network.match_by_spec` and FedMA's layer-wise rounds
    (:func:`~bnpfed.federated.server.drop_inactive`) leave out."""
    if activity is None:
        return None
    J = len(widths)
    if not isinstance(activity, Sequence) or isinstance(activity, (str, bytes)) or len(activity) != J:
        raise ValueError(f"activity: expected None or one report per client ({J}: per group the units' activity, "
                         f"unit_activity), got {type(activity).__name__}"
                         f"{'' if not isinstance(activity, Sequence) else f' of length {len(activity)}'}")
    kept = []
    for j, report in enumerate(activity):
        kept.append(kept_units(report, spec, who=f"activity[{j}]"))
        for g in spec.group_names:
            n = widths[j][g]
            if len(report[g]) != n:
                raise ValueError(f"activity[{j}][{g!r}]: expected {n} activities (client {j} has {n} units in "
                                 f"group {g!r}), got {len(report[g])}")
    return kept
