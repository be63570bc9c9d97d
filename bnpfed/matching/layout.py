"""A group's unit vectors and their layout: what one hidden unit of a network is, as a vector in R^D, for the
matcher (module docstring of :mod:`bnpfed.matching.permutation`, *A unit's vector*)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import Tensor

from bnpfed.matching.spec import BN_FIXED_PRIOR_MEANS, STATISTICS, Group, PermutationSpec

__all__ = ["Segment", "UnitVectors", "VectorLayout", "check_below", "group_layout", "layout_rows", "reindex",
           "select", "unit_vectors", "width"]



def width(state: Mapping[str, Tensor], group: Group, who: str) -> int:
    """The number of units of ``group`` in ``state``, checked to agree across its axes."""
    widths = {}
    for a in group.axes:
        if a.param not in state:
            raise ValueError(f"{who}: expected {a.param!r}, which group {group.name!r} acts on, got no such key")
        t = state[a.param]
        if a.dim >= t.dim() or t.shape[a.dim] % a.block:
            raise ValueError(f"{who}: expected {a.param!r} with an axis {a.dim} made of blocks of {a.block} (group "
                             f"{group.name!r} acts on it), got shape {tuple(t.shape)}")
        widths[str(a)] = t.shape[a.dim] // a.block
    if len(set(widths.values())) != 1:
        raise ValueError(f"{who}: expected one number of units of group {group.name!r} along all its axes, got "
                         f"{widths}")
    return next(iter(widths.values()))


def reindex(t: Tensor, dim: int, block: int, ids: Tensor, size: int) -> Tensor:
    """Scatter axis ``dim`` of ``t`` (units in blocks) into ``size`` global units: client unit l goes to ``ids[l]``;
    a global unit the client lacks gets zeros (two client units on one global unit add)."""
    idx = (ids[:, None] * block + torch.arange(block)).reshape(-1)
    shape = list(t.shape)
    shape[dim] = size * block
    return torch.zeros(shape, dtype=t.dtype).index_add_(dim, idx, t)


def select(t: Tensor, dim: int, block: int, ids: Tensor) -> Tensor:
    """The blocks of global units ``ids`` along axis ``dim``, in that order."""
    idx = (torch.as_tensor(ids, dtype=torch.long)[:, None] * block + torch.arange(block)).reshape(-1)
    return t.index_select(dim, idx)


@dataclass(frozen=True)
class Segment:
    """Where one parameter sits in a group's unit vectors: coordinates ``start:stop``; one unit's slice has shape
    ``unit_shape`` (its ``block`` entries along the group's axis ``dim`` first, then the other axes in order, each
    permuted one at its global size)."""

    param: str
    kind: str
    start: int
    stop: int
    dim: int
    block: int
    unit_shape: tuple[int, ...]


@dataclass(frozen=True)
class VectorLayout:
    """The coordinates of a group's unit vectors (the same for every client, given the global sizes of the groups
    matched before it).

    :param str group: the group's name.
    :param tuple segments: one :class:`Segment` per parameter in the vector, in ``kinds`` order.
    :param Tensor classes: (D,) the class (index along the output layer's axis 0) of each output-weight coordinate,
        -1 for every other coordinate.
    """

    group: str
    segments: tuple[Segment, ...]
    classes: Tensor = field(repr=False)

    @property
    def D(self) -> int:
        return self.segments[-1].stop if self.segments else 0

    def kinds(self) -> list[str]:
        """The kind of every coordinate, (D,)."""
        return [s.kind for s in self.segments for _ in range(s.stop - s.start)]

    def prior_mean(self, mu0: float | None = None, bias_mu0: float | None = None, *,
                   fixed: bool = False) -> Tensor | None:
        """(D,) prior means for :func:`~bnpfed.matching.match_layer`: ``mu0`` on weight coordinates (incoming and
        output weights), ``bias_mu0`` on biases, and with ``fixed`` :data:`BN_FIXED_PRIOR_MEANS` on batch-norm
        scales and shifts; NaN where None (estimated under empirical Bayes). None when nothing is given."""
        by_kind = {"weight": mu0, "output_weight": mu0, "bias": bias_mu0}
        if fixed:
            by_kind.update(BN_FIXED_PRIOR_MEANS)
        values = [by_kind.get(k) for k in self.kinds()]
        if all(v is None for v in values):
            return None
        return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64)

    def precisions(self, shares: Tensor) -> Tensor | None:
        """(J, D) per-client precision scales: ``shares[j, k]`` on client j's output-weight coordinates of class k,
        1 elsewhere; None when the group has no output coordinate."""
        out = self.classes >= 0
        if not bool(out.any()):
            return None
        p = torch.ones(shares.shape[0], self.D, dtype=torch.float64)
        p[:, out] = shares.to(torch.float64)[:, self.classes[out]]
        return p

    def to_params(self, atoms: Tensor, *, contiguous: bool = True) -> dict[str, Tensor]:
        """The parameters held in ``atoms`` (L, D), each with the group's axis at L units (in the atoms' floating
        dtype; float64 for anything else). ``contiguous=False`` leaves each parameter a view of ``atoms`` wherever
        its layout allows (for a caller that copies it anyway: no second copy of a wide group's atoms)."""
        atoms = torch.as_tensor(atoms)
        if not atoms.dtype.is_floating_point:
            atoms = atoms.to(torch.float64)
        if atoms.dim() != 2 or atoms.shape[1] != self.D:
            raise ValueError(f"atoms[{self.group!r}]: expected shape (L, {self.D}), got {tuple(atoms.shape)}")
        L = atoms.shape[0]
        out = {}
        for s in self.segments:
            t = atoms[:, s.start:s.stop].reshape(L * s.block, *s.unit_shape[1:])
            t = t.movedim(0, s.dim)
            out[s.param] = t.contiguous() if contiguous else t
        return out


def group_layout(spec: PermutationSpec, shapes: Mapping[str, tuple[int, ...]], group: str, sizes: Mapping[str, int],
            *, statistics: bool = False) -> VectorLayout:
    """The layout of ``group``'s vectors: the parameters it owns (the running statistics instead, with
    ``statistics``), with the other groups' axes at ``sizes``."""
    index = spec.group_names.index(group)
    segments, classes, start = [], [], 0
    for param in spec.owned(group):
        kind = spec.kinds[param]
        if (kind in STATISTICS) != statistics:
            continue
        shape = list(shapes[param])
        own = None
        for c, a in spec.axes_of(param):
            if c == index:
                own = a
            else:
                name = spec.groups[c].name
                if name not in sizes:
                    raise ValueError(f"below: expected the global ids of group {name!r} (matched before group "
                                     f"{group!r}, which needs them), got none")
                shape[a.dim] = sizes[name] * a.block
        shape[own.dim] = own.block
        unit_shape = (own.block, *(s for d, s in enumerate(shape) if d != own.dim))
        n = math.prod(unit_shape)
        segments.append(Segment(param, kind, start, start + n, own.dim, own.block, unit_shape))
        if kind == "output_weight":
            cls = torch.arange(shape[0]).reshape(-1, *([1] * (len(shape) - 1))).expand(*shape)
            classes.append(cls.movedim(own.dim, 0).reshape(-1))
        else:
            classes.append(torch.full((n,), -1, dtype=torch.long))
        start += n
    if not segments and not statistics:
        raise ValueError(f"spec: expected a parameter for group {group!r} to match (each parameter is matched in the "
                         f"last group acting on it), got none; put the group later in the spec's order")
    cls = torch.cat(classes) if classes else torch.zeros(0, dtype=torch.long)
    return VectorLayout(group, tuple(segments), cls)


def layout_rows(state: Mapping[str, Tensor], spec: PermutationSpec, layout: VectorLayout,
          below: Mapping[str, tuple[Tensor, int]]) -> Tensor:
    """A client's (L_j, D) unit vectors under ``layout``."""
    index = spec.group_names.index(layout.group)
    parts = []
    for s in layout.segments:
        t = torch.as_tensor(state[s.param]).detach().to(torch.float64)
        for c, a in spec.axes_of(s.param):
            if c != index:
                ids, size = below[spec.groups[c].name]
                t = reindex(t, a.dim, a.block, torch.as_tensor(ids, dtype=torch.long), size)
        t = t.movedim(s.dim, 0)
        parts.append(t.reshape(t.shape[0] // s.block, -1))
    return torch.cat(parts, dim=1)


@dataclass(frozen=True)
class UnitVectors:
    """A client's unit vectors of one group and their :class:`VectorLayout`.

    :param Tensor vectors: (L_j, D) float64, one row per unit of the client, in its own order.
    :param VectorLayout layout: what each coordinate is (``layout.prior_mean``, ``layout.precisions``,
        ``layout.to_params``).
    """

    vectors: Tensor
    layout: VectorLayout


def check_below(below, spec: PermutationSpec) -> dict[str, tuple[Tensor, int]]:
    out = {}
    for name, value in (below or {}).items():
        if name not in spec.group_names:
            raise ValueError(f"below: expected group names among {spec.group_names}, got {name!r}")
        try:
            ids, size = value
            ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
            size = int(size)
        except (TypeError, ValueError) as err:
            raise ValueError(f"below[{name!r}]: expected (global ids of the client's units, number of global "
                             f"units), got {value!r}") from err
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= size):
            raise ValueError(f"below[{name!r}]: expected ids in [0, {size}), got {ids.tolist()}")
        out[name] = (ids, size)
    return out


def unit_vectors(state: Mapping[str, Tensor], spec: PermutationSpec, group: str,
                 below: Mapping[str, tuple[Tensor, int]] | None = None) -> UnitVectors:
    """One client's vectors of the units of ``group``, for :func:`~bnpfed.matching.match_layer` (see the module
    docstring for what they hold).

    Two channels of a conv over 1 input channel with 2x2 kernels; the next conv's input columns belong to the next
    group, so the vector of a channel is its 4 kernel weights and its bias::

        >>> from torch import nn
        >>> from bnpfed.matching import derive_spec
        >>> net = nn.Sequential(nn.Conv2d(1, 2, 2), nn.ReLU(), nn.Conv2d(2, 3, 2), nn.Flatten(), nn.Linear(3, 2))
        >>> spec = derive_spec(net, (1, 3, 3))
        >>> first = unit_vectors(net.state_dict(), spec, "0")
        >>> tuple(first.vectors.shape), [(s.param, s.start, s.stop) for s in first.layout.segments]
        ((2, 5), [('0.weight', 0, 4), ('0.bias', 4, 5)])

    The second conv's channels, with the first group matched to 4 global channels (this client's two are global 3
    and 0): the kernels' input axis is re-indexed to them (zeros for global channels 1 and 2), and as the last hidden
    group they carry the output layer's weights (the last two coordinates, classes 0 and 1)::

        >>> second = unit_vectors(net.state_dict(), spec, "2", below={"0": (torch.tensor([3, 0]), 4)})
        >>> tuple(second.vectors.shape), second.layout.classes.tolist()[-3:]
        ((3, 19), [-1, 0, 1])
        >>> torch.equal(second.vectors[:, 12:16], net[2].weight[:, 0].reshape(3, 4).double())  # client channel 0
        True
        >>> float(second.vectors[:, 4:12].abs().sum())                                      # global 1 and 2
        0.0

    :param state: the client's ``state_dict`` (or any mapping of its parameter names to tensors).
    :param spec: the :class:`PermutationSpec`.
    :param str group: the group to build vectors for.
    :param below: for every group matched before ``group`` that acts on a parameter ``group`` owns, ``(ids, L)``:
        the global ids of the client's units of that group (``ids[l]`` for its unit l) and the number of global units.
    :returns: :class:`UnitVectors`.
    """
    g = spec.group(group)
    below = check_below(below, spec)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    width(state, g, "state")
    for name, (ids, _) in below.items():
        other = spec.group(name)
        n = width(state, other, "state")
        if ids.numel() != n:
            raise ValueError(f"below[{name!r}]: expected {n} ids (the client has {n} units in group {name!r}), got "
                             f"{ids.numel()}")
    layout = group_layout(spec, shapes, group, {n: s for n, (_, s) in below.items()})
    return UnitVectors(layout_rows(state, spec, layout, below), layout)
