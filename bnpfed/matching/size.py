"""A global network of the size a user asks for (``max_width`` per group, ``max_params`` for the whole network), met
inside the Beta-Bernoulli model by the IBP mass, never by truncating a result.

**Why gamma0.** Under the IBP prior the number of global units is Poisson(gamma0 H_J), and in the matcher's objective
every global unit carries ``2 log(gamma0 / J)`` (:mod:`bnpfed.matching.matcher`): the smaller gamma0, the more a
unit of its own costs against joining the best existing one. Lowering gamma0 is therefore the model's own way to a
smaller network: units merge where the evidence for keeping them apart is weakest, every client unit still belongs to
exactly one global unit, and under empirical Bayes every other hyper-parameter (noise and prior variances, prior
means) is estimated again at the lowered gamma0, so the noise model describes the merged units.

**Width.** ``max_width`` of a group multiplies its own gamma0 (estimated, ``L / H_J`` at empirical Bayes' fixed
point, or the given value) by ``exp(-t)``, with the strength ``t >= 0`` found by :func:`fit_size`.

**Parameters.** Every parameter of the network belongs to exactly one group's unit vectors (the group that matches
it: a unit's incoming weights at the matched width below, its bias and batch-norm entries; the last group's also its
output weights), so a network of widths ``L_g`` has ``sum_g L_g D_g`` parameters plus the output bias, ``D_g`` the
length of group g's unit vectors. ``max_params`` puts a price on parameters: the prior of the global network times
``exp(-lambda * parameters)``, which factorises over the groups as they are matched: group g's gamma0 times
``exp(-lambda D_g)``, exact given the groups below it (``D_g`` at their matched widths). ``lambda = t / D_max``
(``D_max`` the largest ``D_g`` of the model's own match), ``t`` found by :func:`fit_size`, every group's own
``max_width`` applied inside each run. Units are given up where they cost most (a fully connected layer after a
Flatten, not the first convolution); one factor on every group's gamma0 would instead collapse the small early layers
first (the docs' benchmark page on communication and size has the measurements).

**The search** (:func:`fit_size`): the model's own match (``t = 0``) if it fits; else the strengths in
:data:`BRACKET` in turn until a match fits, then :data:`BISECTIONS` bisections between the last strength that did not
fit and the first that did; the match kept is the one at the weakest strength found that fits. Size is not exactly
monotone in ``t`` (the sweeps are a local search): the strength is the weakest *found*, not the weakest that exists.

**The floor.** A client's units go to distinct global units, so no assignment has fewer global units in a group than
the client with the most units there: :func:`minimum_widths`. Limits below that (or a ``max_params`` below the
parameters at those widths) are refused before any matching.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from bnpfed.matching.spec import PermutationSpec

__all__ = ["BISECTIONS", "BRACKET", "SizeLimitError", "SizeSearch", "check_heads", "fit_size", "head_parameters",
           "minimum_widths", "parameter_count", "parameters_in", "proportional_widths"]

#: Strengths ``t = -log f`` (``f`` the factor on gamma0) tried in turn until a match fits the limit.
BRACKET = (2.0, 8.0, 32.0, 128.0, 512.0)
#: Bisections of ``t`` between the last strength that did not fit and the first that did.
BISECTIONS = 8


class SizeLimitError(ValueError):
    """A ``max_width`` / ``max_params`` no assignment can meet (below the floor), or that the matcher did not meet at
    the strongest strength; its message starts with the argument's name."""


@dataclass
class SizeSearch:
    """What meeting one size limit took.

    :param str what: ``"max_width['<group>']"`` or ``"max_params"``.
    :param int limit: the limit asked for.
    :param int own: the size at the model's own gamma0.
    :param int size: the size of the match kept (<= ``limit``).
    :param float strength: ``t`` of the match kept (0: the limit did not bind): the group's gamma0 was multiplied
        by ``exp(-t)`` (``max_width``), or every group's by ``exp(-t D_g / D_max)`` (``max_params``).
    :param list trace: ``(t, size)`` of every match run, in order.
    :param bool met: whether ``size <= limit``; False only for a best-effort search (``fit_size(...,
        best_effort=True)``) that kept the smallest match it found above the limit.
    """

    what: str
    limit: int
    own: int
    size: int
    strength: float
    trace: list = field(default_factory=list)
    met: bool = True

    @property
    def binding(self) -> bool:
        """Whether the limit changed the result (the model's own size was over it)."""
        return self.own > self.limit

    def note(self) -> str:
        """One line: what the limit cost."""
        if not self.binding:
            return f"{self.what} = {self.limit}: not binding (the model's own size is {self.own})"
        if not self.met:
            return (f"{self.what} = {self.limit}: not met (best effort): the smallest match found, at strength "
                    f"{self.strength:.4g} ({len(self.trace)} matches run), has {self.size} against the model's own "
                    f"{self.own}; the clients' units are too far apart to merge into fewer")
        return (f"{self.what} = {self.limit}: strength {self.strength:.4g} ({len(self.trace)} matches run) gives "
                f"{self.size} against the model's own {self.own}")


def parameters_in(states: Iterable[Mapping], parameters: Iterable[str]) -> int:
    """The number of parameters the given states hold together: the entries named in ``parameters`` (a network's
    parameters, not its buffers) of every state (``"ensemble"``: the clients' networks together)."""
    names = list(parameters)
    return sum(int(state[p].numel()) for state in states for p in names)


def minimum_widths(widths: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """Per group, the smallest global width any assignment allows: the most units one client holds there."""
    groups = list(widths[0]) if widths else []
    return {g: max(int(w[g]) for w in widths) for g in groups}


def parameter_count(spec: PermutationSpec, shapes: Mapping[str, Sequence[int]], parameters: Iterable[str],
                    widths: Mapping[str, int], *, heads: int = 1) -> int:
    """The number of parameters of a network of the spec's kind at the given global widths: every entry of
    ``parameters`` (names of the network's parameters, not its buffers) with its shape from ``shapes`` (any one
    client's state) and every axis a group acts on at ``widths[group] * block``; the output layer's weight and bias
    ``heads`` times (J with pooled heads: :func:`~bnpfed.matching.pooled_network` carries every matched client's
    own output layer).

    >>> from bnpfed.matching import derive_spec
    >>> from bnpfed.models import mlp
    >>> net = mlp(4, [3], 2)
    >>> shapes = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    >>> parameter_count(derive_spec(net, (4,)), shapes, [n for n, _ in net.named_parameters()], {"1": 10})
    72
    >>> 4 * 10 + 10 + 10 * 2 + 2    # W1, b1, W2, b2 at 10 hidden units
    72
    >>> parameter_count(derive_spec(net, (4,)), shapes, [n for n, _ in net.named_parameters()], {"1": 10}, heads=5)
    160
    >>> 4 * 10 + 10 + 5 * (10 * 2 + 2)    # five clients' output layers, pooled
    160
    """
    names = spec.group_names
    copies = check_heads(heads)
    outputs = set(spec.params_of_kind("output_weight", "output_bias"))
    total = 0
    for p in parameters:
        shape = list(shapes[p])
        for c, axis in spec.axes_of(p):
            shape[axis.dim] = int(widths[names[c]]) * axis.block
        total += math.prod(shape) * (copies if p in outputs else 1)
    return total


def check_heads(heads) -> int:
    """``heads``: how many output layers the global network carries (an int >= 1: 1 fused, J pooled)."""
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads: expected the number of output layers the global network carries (an int >= 1: 1 "
                         f"for one fused output layer, J for the clients' pooled heads), got {heads!r}")
    return heads


def head_parameters(spec: PermutationSpec, shapes: Mapping[str, Sequence[int]], group: str) -> int:
    """The output-layer parameters one unit of ``group`` owns (its column of the output weight; 0 unless the group
    holds the output layer's input): what every further output layer adds per unit when heads are pooled."""
    names = spec.group_names
    total = 0
    for p in spec.params_of_kind("output_weight"):
        shape = list(shapes[p])
        for c, axis in spec.axes_of(p):
            if names[c] == group:
                shape[axis.dim] = axis.block
                total += math.prod(shape)
    return total


def proportional_widths(spec: PermutationSpec, shapes: Mapping[str, Sequence[int]], parameters: Iterable[str],
                        widths: Sequence[Mapping[str, int]], limit: int, *, matched: Mapping[str, int] | None = None,
                        what: str = "max_params", heads: int = 1) -> dict[str, int] | None:
    """Per group a width limit ``floor(k * m_g)`` (``m_g`` the most units one client holds in group g:
    :func:`minimum_widths`) at the largest ``k >= 1`` whose network has at most ``limit`` parameters (bisection to
    ``1e-6`` in k), the groups in ``matched`` at their given (matched) widths: a parameter budget split over groups that
    are matched one at a time, as FedMA's are, before the widths above are known (called again before each group, the
    budget the groups below left unused goes to the ones above). None when even ``k = J`` (every client's units apart)
    fits. ``heads``: the output layers the network carries (:func:`parameter_count`).

    >>> from bnpfed.matching import derive_spec
    >>> from bnpfed.models import mlp
    >>> net = mlp(4, [3, 5], 2)
    >>> shapes = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    >>> names = [n for n, _ in net.named_parameters()]
    >>> proportional_widths(derive_spec(net, (4,)), shapes, names, [{"1": 3, "3": 5}] * 4, 120)
    {'1': 5, '3': 9}
    >>> (4 * 5 + 5) + (5 * 9 + 9) + (9 * 2 + 2), (4 * 6 + 6) + (6 * 10 + 10) + (10 * 2 + 2)   # k = 2 would not fit
    (99, 122)
    >>> proportional_widths(derive_spec(net, (4,)), shapes, names, [{"1": 3, "3": 5}] * 4, 120, matched={"1": 3})
    {'1': 3, '3': 17}
    >>> (4 * 3 + 3) + (3 * 17 + 17) + (17 * 2 + 2)   # layer "1" came out at 3: layer "3" takes what it left
    119
    """
    parameters = list(parameters)
    matched = dict(matched or {})
    floor = {**minimum_widths(widths), **matched}

    def at(k):
        return {g: m if g in matched else max(m, math.floor(k * m)) for g, m in floor.items()}

    def count(k):
        return parameter_count(spec, shapes, parameters, at(k), heads=heads)

    smallest = count(1.0)
    if limit < smallest:
        raise SizeLimitError(f"{what}: expected at least {smallest} (the parameters at the smallest widths any "
                             f"assignment allows, {floor}), got {limit}")
    hi = float(len(widths))
    if count(hi) <= limit:
        return None
    lo = 1.0
    while hi - lo > 1e-6:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if count(mid) <= limit else (lo, mid)
    return at(lo)


def fit_size(run: Callable[[float], object], size_of: Callable[[object], int], limit: int, what: str, *,
             best_effort: bool = False) -> tuple[object, SizeSearch]:
    """The result of ``run(t)`` at the smallest strength ``t >= 0`` found whose ``size_of`` is at most ``limit``
    (the module docstring's search; ``t`` is ``-log f``, the factor on gamma0), and the :class:`SizeSearch` that
    says what it took. ``run(0.0)`` is the model's own match, returned as it is when it fits. When no strength of
    the bracket fits: :class:`SizeLimitError`, or with ``best_effort`` the smallest match the bracket found
    (``SizeSearch.met`` False, its note saying so)."""
    best = run(0.0)
    own = best_size = int(size_of(best))
    trace = [(0.0, own)]
    if own <= limit:
        return best, SizeSearch(what, limit, own, own, 0.0, trace)
    weak, strong = 0.0, None   # strengths known over the limit / known within it
    smallest = (own, 0.0, best)  # the smallest match run so far (a best effort's result)
    for t in BRACKET:
        result = run(t)
        size = int(size_of(result))
        trace.append((t, size))
        if size <= limit:
            best, best_size, strong = result, size, t
            break
        if size < smallest[0]:
            smallest = (size, t, result)
        weak = t
    if strong is None and best_effort:
        size, t, result = smallest
        return result, SizeSearch(what, limit, own, size, t, trace, met=False)
    if strong is None:
        raise SizeLimitError(f"{what}: expected a limit the matcher can meet, got {limit}: at strength {BRACKET[-1]:g} "
                         f"(gamma0 times exp(-{BRACKET[-1]:g})) the match still has {trace[-1][1]} (the model's own: "
                         f"{own}); the clients' units are too far apart to merge into fewer")
    for _ in range(BISECTIONS):
        if best_size == limit:
            break
        mid = 0.5 * (weak + strong)
        result = run(mid)
        size = int(size_of(result))
        trace.append((mid, size))
        if size <= limit:
            best, best_size, strong = result, size, mid
        else:
            weak = mid
    return best, SizeSearch(what, limit, own, best_size, strong, trace)
