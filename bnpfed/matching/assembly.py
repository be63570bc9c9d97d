"""From matched atoms back to a network: every group's atoms laid out into the parameters it owns, the template
rebuilt at the matched widths, and a client's slice of a global state."""

from __future__ import annotations

import copy
from typing import Mapping

import torch
from torch import Tensor, nn

from bnpfed.matching.layout import group_layout, select
from bnpfed.matching.spec import PermutationSpec

__all__ = ["client_slice", "network_from_atoms", "network_from_state", "state_from_atoms"]



def state_from_atoms(spec: PermutationSpec, template: Mapping[str, Tensor], atoms: Mapping[str, Tensor],
                     extra: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """A global ``state_dict`` from every group's matched atoms.

    :param spec: the :class:`PermutationSpec`.
    :param template: a ``state_dict`` of the network kind (a client's); gives the shapes of the axes no group acts on
        and the values of the keys without a kind.
    :param atoms: group name -> (L_g, D_g) atoms laid out as :func:`unit_vectors` lays out that group's vectors given
        the sizes of the groups before it (the L_g).
    :param extra: values for keys the atoms do not hold: the output bias and the running statistics (default:
        the template's, when its shape fits; running statistics otherwise start fresh, mean 0 and variance 1, for
        :func:`reestimate_batch_norm`).
    :returns: parameter name -> tensor, in the template's order and dtypes.
    """
    missing = [g for g in spec.group_names if g not in atoms]
    if missing:
        raise ValueError(f"atoms: expected atoms of every group {spec.group_names}, got none for {missing}")
    shapes = {k: tuple(v.shape) for k, v in template.items()}
    sizes = {g: int(torch.as_tensor(atoms[g]).shape[0]) for g in spec.group_names}
    owned: dict[str, Tensor] = {}   # each parameter the atoms hold, copied once into the template's dtype
    for g in spec.group_names:
        for key, view in group_layout(spec, shapes, g, sizes).to_params(atoms[g], contiguous=False).items():
            owned[key] = torch.empty(view.shape, dtype=torch.as_tensor(template[key]).dtype,
                                     device=view.device).copy_(view.detach())
    extra = dict(extra or {})
    out = {}
    for key, t in template.items():
        t = torch.as_tensor(t)
        if key in owned:   # already its own contiguous copy (a wide group's atoms are not copied twice)
            out[key] = owned.pop(key)
            continue
        if key in extra:
            v = torch.as_tensor(extra[key])
        else:
            v = t
            axes = spec.axes_of(key)
            if axes:  # a running statistic: resized to the global widths
                shape = list(t.shape)
                for c, a in axes:
                    shape[a.dim] = sizes[spec.groups[c].name] * a.block
                if tuple(shape) != tuple(t.shape):
                    fill = 1.0 if spec.kinds[key] == "running_var" else 0.0
                    v = torch.full(shape, fill, dtype=t.dtype)
        out[key] = v.detach().to(t.dtype, copy=True)   # one copy (a float64 atom: the cast is it)
    return out


def client_slice(spec: PermutationSpec, state: Mapping[str, Tensor], ids: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The slice of a (global) ``state`` made of the units ``ids[g]`` of every group g, in that order: along every
    axis a group acts on, the blocks of those units; every other entry unchanged. A client's slice of the global
    network takes its assignments (``ids[g][l]`` the global unit its unit l was matched to); with a permutation of
    every group's units it permutes the network (:func:`verify_spec`).

    >>> from bnpfed.matching import derive_spec
    >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    >>> spec = derive_spec(net, (2,))
    >>> piece = client_slice(spec, net.state_dict(), {"0": torch.tensor([2, 0])})
    >>> {k: tuple(v.shape) for k, v in piece.items()}
    {'0.weight': (2, 2), '0.bias': (2,), '2.weight': (1, 2), '2.bias': (1,)}
    >>> torch.equal(piece["2.weight"], net[2].weight[:, [2, 0]].detach())
    True
    """
    missing = [g for g in spec.group_names if g not in ids]
    if missing:
        raise ValueError(f"ids: expected global unit ids for every group {spec.group_names}, got none for {missing}")
    out = {}
    for key, t in state.items():
        t = torch.as_tensor(t).detach()
        for c, a in spec.axes_of(key):
            name = spec.groups[c].name
            chosen = torch.as_tensor(ids[name], dtype=torch.long).reshape(-1)
            n = t.shape[a.dim] // a.block
            if chosen.numel() and (int(chosen.min()) < 0 or int(chosen.max()) >= n):
                raise ValueError(f"ids[{name!r}]: expected ids in [0, {n}) (the units of group {name!r}), got "
                                 f"{chosen.tolist()}")
            t = select(t, a.dim, a.block, chosen)
        out[key] = t.clone()
    return out


def _resized(name: str, module: nn.Module, state: Mapping[str, Tensor]) -> nn.Module:
    """A module of ``module``'s type and settings, sized for the given state."""
    ref = next(iter(module.parameters()), None)
    if ref is None:
        ref = next(iter(module.buffers()))
    factory = dict(dtype=ref.dtype, device=ref.device)
    if type(module) is nn.Linear:
        w = state[f"{name}.weight"]
        new = nn.Linear(w.shape[1], w.shape[0], bias=module.bias is not None, **factory)
    elif type(module) is nn.Conv2d:
        w = state[f"{name}.weight"]
        new = nn.Conv2d(w.shape[1] * module.groups, w.shape[0], module.kernel_size, stride=module.stride,
                        padding=module.padding, dilation=module.dilation, groups=module.groups,
                        bias=module.bias is not None, padding_mode=module.padding_mode, **factory)
    elif type(module) in (nn.BatchNorm1d, nn.BatchNorm2d):
        key = next(f"{name}.{k}" for k in ("weight", "running_mean") if f"{name}.{k}" in state)
        new = type(module)(state[key].shape[0], eps=module.eps, momentum=module.momentum, affine=module.affine,
                           track_running_stats=module.track_running_stats, **factory)
    else:
        raise ValueError(f"state: expected resized parameters only in a Linear, Conv2d or BatchNorm1d/2d (only they "
                         f"can be rebuilt with other widths), got one in module {name!r} ({type(module).__name__})")
    return new.train(module.training)


def network_from_state(template: nn.Module, state: Mapping[str, Tensor]) -> nn.Module:
    """A copy of ``template`` carrying ``state``, every Linear, Conv2d and BatchNorm whose parameters changed shape
    rebuilt with the new widths (its other settings kept). The template is not modified; its ``forward`` runs on the
    rebuilt modules (it must not hard-code widths, as none of bnpfed's networks does).

    >>> from bnpfed.matching import client_slice, derive_spec
    >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    >>> network_from_state(net, client_slice(derive_spec(net, (2,)), net.state_dict(), {"0": [1]}))
    Sequential(
      (0): Linear(in_features=2, out_features=1, bias=True)
      (1): ReLU()
      (2): Linear(in_features=1, out_features=1, bias=True)
    )
    """
    net = copy.deepcopy(template)
    current = net.state_dict()
    missing, unexpected = sorted(set(current) - set(state)), sorted(set(state) - set(current))
    if missing or unexpected:
        raise ValueError(f"state: expected the keys of the template's state_dict, got missing {missing}, "
                         f"unexpected {unexpected}")
    resized = {key.rpartition(".")[0] for key, t in state.items() if tuple(torch.as_tensor(t).shape) !=
               tuple(current[key].shape)}
    for name in sorted(resized):
        if not name:
            raise ValueError("state: expected the template's own parameters (not of a submodule) at their shapes, "
                             "got one that changed shape")
        net.set_submodule(name, _resized(name, net.get_submodule(name), state))
    net.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
    return net


def network_from_atoms(template: nn.Module, spec: PermutationSpec, atoms: Mapping[str, Tensor],
                       extra: Mapping[str, Tensor] | None = None) -> nn.Module:
    """The network of ``template``'s kind carrying the matched atoms, with the matched widths:
    ``network_from_state(template, state_from_atoms(spec, template.state_dict(), atoms, extra))``.

    >>> from bnpfed.matching import derive_spec
    >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    >>> spec = derive_spec(net, (2,))
    >>> atoms = torch.arange(20.0).reshape(5, 4)          # 5 global units: 2 incoming weights, bias, output weight
    >>> wide = network_from_atoms(net, spec, {"0": atoms})
    >>> wide[0].out_features, wide[2].weight.tolist()
    (5, [[3.0, 7.0, 11.0, 15.0, 19.0]])
    """
    return network_from_state(template, state_from_atoms(spec, template.state_dict(), atoms, extra))
