"""Permutation specs: a feed-forward network's hidden-unit symmetries as data (Git Re-Basin, Ainsworth et al., ICLR
2023, ``weight_matching.py``). The format, and how to write a spec by hand, are in :mod:`bnpfed.matching.permutation`;
:func:`~bnpfed.matching.derive.derive_spec` finds one from a module tree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

__all__ = ["Axis", "BN_FIXED_PRIOR_MEANS", "Group", "KINDS", "PermutationSpec", "STATISTICS"]

#: The kinds of parameters a spec names (see :mod:`bnpfed.matching.permutation`).
KINDS = ("weight", "bias", "bn_weight", "bn_bias", "running_mean", "running_var", "output_weight", "output_bias")
STATISTICS = ("running_mean", "running_var")

#: Prior means of the batch-norm coordinates under fixed hyper-parameters: torch's initial scale and shift (under
#: empirical Bayes they are estimated per coordinate, as every coordinate is).
BN_FIXED_PRIOR_MEANS = {"bn_weight": 1.0, "bn_bias": 0.0}


# --------------------------------------------------------------------------------------------------------------------
# the spec


@dataclass(frozen=True)
class Axis:
    """One axis of one parameter (or buffer) that a hidden permutation acts on.

    :param str param: the ``state_dict`` key, e.g. ``"conv2.weight"``.
    :param int dim: the axis, >= 0 (0 for a layer's own rows and bias, 1 for the next layer's input columns).
    :param int block: entries per unit along the axis, >= 1: unit u owns indices ``u*block .. (u+1)*block - 1``
        (a channel's H*W columns of the Linear after a Flatten; 1 otherwise).
    """

    param: str
    dim: int
    block: int = 1

    def __post_init__(self):
        if not isinstance(self.param, str) or not self.param:
            raise ValueError(f"Axis.param: expected a state_dict key, got {self.param!r}")
        for name, low in (("dim", 0), ("block", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"Axis.{name}: expected an int >= {low}, got {value!r} (for {self.param!r})")

    def __str__(self) -> str:
        return f"{self.param}[{self.dim}]" + (f" in blocks of {self.block}" if self.block > 1 else "")


@dataclass(frozen=True)
class Group:
    """One hidden permutation: a name (for a derived spec, the qualified name of the layer whose units it permutes)
    and every parameter axis it acts on.

    :param str name: unique within the spec.
    :param axes: the :class:`Axis` es (a list is accepted and stored as a tuple).
    """

    name: str
    axes: tuple[Axis, ...]

    def __post_init__(self):
        object.__setattr__(self, "axes", tuple(self.axes))
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Group.name: expected a non-empty string, got {self.name!r}")
        if not self.axes or not all(isinstance(a, Axis) for a in self.axes):
            raise ValueError(f"Group.axes: expected a non-empty sequence of Axis, got {self.axes!r} (for group "
                             f"{self.name!r})")
        params = [a.param for a in self.axes]
        twice = sorted({p for p in params if params.count(p) > 1})
        if twice:
            raise ValueError(f"Group.axes: expected at most one axis of each parameter, got two of {twice[0]!r} (for "
                             f"group {self.name!r}); a permutation that acts on both axes of one parameter (e.g. "
                             f"x + W x) is not supported")


@dataclass(frozen=True)
class PermutationSpec:
    """A network's hidden permutations and the kind of each of its parameters (see the module docstring for the
    format, how to write one by hand and what matching does with it).

    Usage::

        >>> from bnpfed.matching import derive_spec
        >>> from bnpfed.models import mlp
        >>> print(derive_spec(mlp(4, [3], 2), (4,)))
        PermutationSpec: 1 hidden permutation, matched in this order
          1: 1.weight[0], 1.bias[0], 3.weight[1]
          output layer (axis 0 = classes): 3.weight, 3.bias

    :param groups: the :class:`Group` s, in matching order (a list is accepted).
    :param kinds: ``state_dict`` key -> kind (one of :data:`KINDS`) for every parameter a group acts on and for the
        output bias; the order of the keys is the order of the parameters inside a unit's vector.
    """

    groups: tuple[Group, ...]
    kinds: Mapping[str, str]

    def __post_init__(self):
        object.__setattr__(self, "groups", tuple(self.groups))
        object.__setattr__(self, "kinds", dict(self.kinds))
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"PermutationSpec.groups: expected distinct names, got {names}")
        for param, kind in self.kinds.items():
            if kind not in KINDS:
                raise ValueError(f"PermutationSpec.kinds[{param!r}]: expected one of {KINDS}, got {kind!r}")
        acted = {}
        for g in self.groups:
            for a in g.axes:
                if a.param not in self.kinds:
                    raise ValueError(f"PermutationSpec.kinds: expected a kind for every parameter a group acts on, "
                                     f"got none for {a.param!r}, which group {g.name!r} acts on")
                acted.setdefault(a.param, []).append(a.dim)
        for param, kind in self.kinds.items():
            dims = acted.get(param, [])
            if kind == "output_bias" and dims:
                raise ValueError(f"PermutationSpec.groups: expected no group acting on the output bias {param!r} "
                                 f"(one entry per class), got group(s) acting on its axis {dims}")
            if kind not in ("output_bias", "output_weight") and not dims:
                raise ValueError(f"PermutationSpec.groups: expected a group acting on {param!r} ({kind}), got none; "
                                 f"give it a group or leave it out of kinds (it is then copied from the template)")
            if kind == "output_weight" and 0 in dims:
                raise ValueError(f"PermutationSpec.groups: expected no group acting on axis 0 of the output weight "
                                 f"{param!r} (it indexes the classes), got group(s) acting on its axes {dims}")
            if len(set(dims)) != len(dims):
                raise ValueError(f"PermutationSpec.groups: expected at most one group acting on each axis of "
                                 f"{param!r}, got two acting on its axes {dims}")

    @property
    def group_names(self) -> list[str]:
        return [g.name for g in self.groups]

    def group(self, name: str) -> Group:
        for g in self.groups:
            if g.name == name:
                return g
        raise ValueError(f"group: expected one of {self.group_names}, got {name!r}")

    def axes_of(self, param: str) -> list[tuple[int, Axis]]:
        """(group index, axis) of every group acting on ``param``, in matching order."""
        return [(c, a) for c, g in enumerate(self.groups) for a in g.axes if a.param == param]

    def owner(self, param: str) -> str | None:
        """The group a parameter's values are matched in: the last one (in matching order) acting on it."""
        axes = self.axes_of(param)
        return self.groups[axes[-1][0]].name if axes else None

    def owned(self, group: str) -> list[str]:
        """The parameters (``kinds`` order) whose values group ``group`` matches or averages."""
        return [p for p in self.kinds if self.owner(p) == group]

    def reversed(self) -> PermutationSpec:
        """The same symmetries matched in the opposite order (top-down for a derived spec): every parameter then
        belongs to the first group acting on it in this spec's order, the last in the reversed one.

        >>> spec = PermutationSpec([Group("a", [Axis("a.w", 0), Axis("b.w", 1)]), Group("b", [Axis("b.w", 0)])],
        ...                        {"a.w": "weight", "b.w": "weight"})
        >>> spec.owner("b.w"), spec.reversed().owner("b.w")
        ('b', 'a')
        """
        return PermutationSpec(groups=self.groups[::-1], kinds=self.kinds)

    def params_of_kind(self, *kinds: str) -> list[str]:
        return [p for p, k in self.kinds.items() if k in kinds]

    def to_dict(self) -> dict:
        """The spec as plain data (the file format of ``bnpfed match --spec FILE``, as JSON): ``{"groups": [{"name":
        ..., "axes": [[param, dim], [param, dim, block], ...]}, ...], "kinds": {param: kind, ...}}``, groups in
        matching order, an axis's block given when it is not 1.

        >>> spec = PermutationSpec([Group("a", [Axis("a.w", 0), Axis("b.w", 1, 4)])], {"a.w": "weight",
        ...                                                                          "b.w": "output_weight"})
        >>> spec.to_dict()["groups"]
        [{'name': 'a', 'axes': [['a.w', 0], ['b.w', 1, 4]]}]
        >>> PermutationSpec.from_dict(spec.to_dict()) == spec
        True
        """
        return {"groups": [{"name": g.name, "axes": [[a.param, a.dim] + ([a.block] if a.block != 1 else [])
                                                     for a in g.axes]} for g in self.groups],
                "kinds": dict(self.kinds)}

    @classmethod
    def from_dict(cls, data, *, where: str = "spec") -> PermutationSpec:
        """The spec written as :meth:`to_dict` writes it (a file's JSON), checked as the constructor checks it; a
        malformed entry raises a ``ValueError`` naming its place (``where``, then the path inside)."""
        if not isinstance(data, Mapping) or set(data) != {"groups", "kinds"}:
            got = sorted(data) if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(f"{where}: expected an object with the keys 'groups' and 'kinds', got {got}")
        groups_data, kinds = data["groups"], data["kinds"]
        if not isinstance(groups_data, list) or not groups_data:
            raise ValueError(f"{where}.groups: expected a non-empty list of groups, got {groups_data!r}")
        if not isinstance(kinds, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in kinds.items()):
            raise ValueError(f"{where}.kinds: expected an object of parameter name -> kind, got {kinds!r}")
        groups = []
        for i, g in enumerate(groups_data):
            here = f"{where}.groups[{i}]"
            if not isinstance(g, Mapping) or set(g) != {"name", "axes"} or not isinstance(g["axes"], list):
                raise ValueError(f"{here}: expected an object with 'name' and a list 'axes', got {g!r}")
            axes = []
            for k, a in enumerate(g["axes"]):
                if not (isinstance(a, list) and len(a) in (2, 3) and isinstance(a[0], str)
                        and all(isinstance(x, int) and not isinstance(x, bool) for x in a[1:])):
                    raise ValueError(f"{here}.axes[{k}]: expected [param, dim] or [param, dim, block] (a name and "
                                     f"integers), got {a!r}")
                axes.append(Axis(*a))
            groups.append(Group(g["name"], axes))
        return cls(groups=groups, kinds=dict(kinds))

    def __str__(self) -> str:
        n = len(self.groups)
        lines = [f"PermutationSpec: {n} hidden permutation{'s' if n != 1 else ''}, matched in this order"]
        lines += [f"  {g.name}: " + ", ".join(str(a) for a in g.axes) for g in self.groups]
        outputs = self.params_of_kind("output_weight", "output_bias")
        if outputs:
            lines.append("  output layer (axis 0 = classes): " + ", ".join(outputs))
        return "\n".join(lines)
