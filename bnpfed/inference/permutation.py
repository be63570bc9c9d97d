"""Permutation specs: a feed-forward network's hidden-unit symmetries as data, and PFNM matching of any network that
has one.

The hidden units of a network can be reordered without changing what it computes, provided every parameter axis that
indexes them is reordered the same way (Git Re-Basin, Ainsworth et al., ICLR 2023, ``weight_matching.py``). A
:class:`PermutationSpec` lists those symmetries: one :class:`Group` per hidden permutation (the units of a Linear, the
output channels of a Conv2d), each with every (parameter, axis) it acts on, and a kind for every parameter. For LeNet::

    conv1: conv1.weight[0], conv1.bias[0], conv2.weight[1]
    conv2: conv2.weight[0], conv2.bias[0], fc1.weight[1] in blocks of 25
    fc1: fc1.weight[0], fc1.bias[0], fc2.weight[1]
    fc2: fc2.weight[0], fc2.bias[0], fc3.weight[1]

``fc1.weight[1] in blocks of 25``: the Flatten before fc1 lays conv2's 16 channels of 5x5 pixels out channel-major,
so channel c owns fc1's input columns ``25c .. 25c + 24``. Parameters are named by their ``state_dict`` keys; a
batch norm after a layer adds its ``weight``, ``bias``, ``running_mean`` and ``running_var`` (axis 0) to the layer's
group (``num_batches_tracked`` is left alone). :func:`derive_spec` finds all this from the module tree and a forward
pass; :func:`verify_spec` checks any spec numerically.

**Writing a spec by hand.** For a network :func:`derive_spec` does not understand (a residual block, a module of
your own), list the groups yourself, in the order they are to be matched, and a kind for every parameter::

    >>> from torch import nn
    >>> class Residual(nn.Module):                       # stem, then x + conv2(relu(conv1(x))), pool, classifier
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.stem = nn.Conv2d(1, 4, 3, padding=1)
    ...         self.conv1, self.conv2 = nn.Conv2d(4, 5, 3, padding=1), nn.Conv2d(5, 4, 3, padding=1)
    ...         self.fc = nn.Linear(4, 3)
    ...     def forward(self, x):
    ...         x = torch.relu(self.stem(x))
    ...         x = torch.relu(x + self.conv2(torch.relu(self.conv1(x))))
    ...         return self.fc(x.mean((2, 3)))
    >>> spec = PermutationSpec(
    ...     groups=[Group("stem", [Axis("stem.weight", 0), Axis("stem.bias", 0),      # the skip adds stem's channels
    ...                            Axis("conv2.weight", 0), Axis("conv2.bias", 0),    # to conv2's: one permutation
    ...                            Axis("conv1.weight", 1), Axis("fc.weight", 1)]),
    ...             Group("conv1", [Axis("conv1.weight", 0), Axis("conv1.bias", 0), Axis("conv2.weight", 1)])],
    ...     kinds={"stem.weight": "weight", "stem.bias": "bias", "conv1.weight": "weight", "conv1.bias": "bias",
    ...            "conv2.weight": "weight", "conv2.bias": "bias", "fc.weight": "output_weight",
    ...            "fc.bias": "output_bias"})
    >>> verify_spec(Residual(), spec, (1, 6, 6))         # permuting by the spec leaves the outputs unchanged
    >>> print(spec)
    PermutationSpec: 2 hidden permutations, matched in this order
      stem: stem.weight[0], stem.bias[0], conv2.weight[0], conv2.bias[0], conv1.weight[1], fc.weight[1]
      conv1: conv1.weight[0], conv1.bias[0], conv2.weight[1]
      output layer (axis 0 = classes): fc.weight, fc.bias

Kinds: ``"weight"`` and ``"bias"`` (of a Linear or Conv2d), ``"bn_weight"``, ``"bn_bias"``, ``"running_mean"``,
``"running_var"`` (of a batch norm), ``"output_weight"`` and ``"output_bias"`` (of the output layer, whose axis 0
indexes the classes and is not permuted). A ``state_dict`` key without a kind (``num_batches_tracked``) is copied
from the template network. The order of ``kinds`` is the order of the parameters inside a unit's vector.

**A unit's vector** (:func:`unit_vectors`). Groups are matched one at a time in the spec's order (bottom-up for a
derived spec). A parameter belongs to the *last* group (in that order) among those acting on it: once that group is
matched, every other axis of the parameter indexes already matched global units. The vector of a unit u of group g
concatenates, over the parameters belonging to g in ``kinds`` order (running statistics excepted), the parameter's
slice at u along g's axis (``block`` consecutive entries), with every other permuted axis re-indexed to the global
units of its group (a global unit the client lacks contributes 0), flattened in row-major order. For a derived spec
that is PFNM's bottom-up neuron (:func:`~bnpfed.inference.multilayer.match_networks`): a Linear unit's incoming
weights and bias; a conv channel's ``C_in x k x k`` kernel (input channels re-indexed), bias and batch-norm scale and
shift; the last hidden group also carries the output layer's weights ``W_out[:, u]`` (``C x block`` of them after a
Flatten), which are seen at precision ``share_jk / sigma2`` (``share_jk = n_jk / sum_j' n_j'k``, client j's share of
class k's examples), so that a client that never saw class k does not pull that class's weights.

**Batch norm.** A unit's vector holds its batch norm's affine parameters (scale and shift; under fixed
hyper-parameters with prior means 1 and 0, torch's initial values), not the running statistics: those are summaries
of data on scales of their own, which one shared sigma2 would weigh badly. :func:`match_by_spec` gives a global unit
the mean of its members' running mean and variance (its members: the clients' units matched to it). That needs no
data and is exact when the clients hold permuted copies of one network, but a merged unit's weights are averages, and
the statistics of its pre-normalisation activations are not the averages of its members'. **Re-estimate them from
the clients' data after matching** (REPAIR, Jordan et al., ICLR 2023, which for a batch-normalised network is a reset
of the running statistics): each client sends :func:`batch_norm_moments` of its data under the global network (one
pass, batch norms in training mode), the server sums them and calls :func:`set_batch_norm_statistics`
(:func:`reestimate_batch_norm` does both in one process).

Measured: ``simple_cnn_bn(1, 8)`` on the bundled 8x8 digits, J = 5 clients from independent initialisations (40
epochs of Adam each), seeds 0-2, test accuracy of the one-shot global network matched under empirical Bayes with the
atoms' posterior means as the global weights (``global_weights="posterior-mean"``), mean over the seeds (range):

================  ==============  ==================  =================  ===================================
partition         local (mean)    members' mean       re-estimated       BN folded into the conv, then match
================  ==============  ==================  =================  ===================================
homogeneous       0.906           0.234 (0.11-0.30)   0.957 (0.95-0.97)  0.158 (0.10-0.21)
Dirichlet(0.5)    0.678           0.303 (0.22-0.47)   0.910 (0.86-0.94)  0.413 (0.30-0.50)
================  ==============  ==================  =================  ===================================

(Empirical Bayes merged conv1's 30 channels into 18-25 and fc2's 420 units into 312-340.) The members' means alone
leave the merged network near chance; re-estimated statistics put it well above the clients' mean. With the default
global weights under empirical Bayes (the members' average, ``global_weights="average"``) the gap is smaller but
still there: J = 10, 40 epochs, seed 0 (tutorial 04): members' mean statistics 0.887, re-estimated 0.918 (with
posterior means: 0.116 and 0.918). Folding each batch
norm into its convolution before matching (the global network's batch norms then the identity) does no better than
the members' means, and the global network would lose its batch norms for the rounds that follow, so it is not
offered. With fixed hyper-parameters
that merged no unit at all (sigma2 = 0.2, sigma0_2 = 1, gamma0 = 5: the clients' networks side by side) the three were
0.87-0.97, 0.90-0.98 and 0.89-0.97.

From matched atoms back to a network: :func:`state_from_atoms` lays each group's atoms out into the parameters it
owns, :func:`network_from_state` rebuilds the template with the matched widths (Linear features, Conv2d channels,
BatchNorm features; any module type other than those three that holds a resized parameter is an error), and
:func:`client_slice` cuts a client's slice out of a global state (the global units each of its own units was matched
to, in its own order). :func:`match_by_spec` is the whole-network matcher built on these.

**One group at a time** (FedMA's layer-wise scheme, Wang et al., ICLR 2020): :func:`match_group` is
:func:`match_by_spec`'s step for one group (``match_by_spec`` is that step for every group in turn, the groups
matched before re-indexing the next), returning a :class:`GroupMatch`; :func:`align_to_group` gives a client the
matched group (every global unit, the next layer's input columns re-indexed to them, zeros for units it lacks), so
that after it every client holds the same units below the next group, which :func:`match_group` then takes as the
identity. Between two groups FedMA's clients retrain the layers above with the matched ones frozen
(:mod:`bnpfed.federated.pfnm`).
"""

from __future__ import annotations

import copy
import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bnpfed.inference.matching import average_atoms, averaging_weights, match_layer
from bnpfed.validation import check_choice

__all__ = [
    "Axis",
    "Group",
    "PermutationSpec",
    "KINDS",
    "BN_FIXED_PRIOR_MEANS",
    "derive_spec",
    "resolve_spec",
    "verify_spec",
    "VectorLayout",
    "UnitVectors",
    "unit_vectors",
    "state_from_atoms",
    "network_from_state",
    "network_from_atoms",
    "client_slice",
    "SpecMatch",
    "match_by_spec",
    "GroupMatch",
    "match_group",
    "align_to_group",
    "BatchNormMoments",
    "batch_norm_moments",
    "batch_norm_statistics",
    "set_batch_norm_statistics",
    "reestimate_batch_norm",
]

#: The kinds of parameters a spec names (see the module docstring).
KINDS = ("weight", "bias", "bn_weight", "bn_bias", "running_mean", "running_var", "output_weight", "output_bias")
_STATISTICS = ("running_mean", "running_var")

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
            raise ValueError(f"Group {self.name!r}: expected a non-empty sequence of Axis, got {self.axes!r}")
        params = [a.param for a in self.axes]
        twice = sorted({p for p in params if params.count(p) > 1})
        if twice:
            raise ValueError(f"Group {self.name!r}: acts on {twice[0]!r} along two axes; a permutation that acts on "
                             f"both axes of one parameter (e.g. x + W x) is not supported")


@dataclass(frozen=True)
class PermutationSpec:
    """A network's hidden permutations and the kind of each of its parameters (see the module docstring for the
    format, how to write one by hand and what matching does with it).

    Usage::

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
                    raise ValueError(f"PermutationSpec: group {g.name!r} acts on {a.param!r}, which has no kind in "
                                     f"kinds")
                acted.setdefault(a.param, []).append(a.dim)
        for param, kind in self.kinds.items():
            dims = acted.get(param, [])
            if kind == "output_bias" and dims:
                raise ValueError(f"PermutationSpec: {param!r} is an output bias (one entry per class) but group(s) "
                                 f"act on it")
            if kind != "output_bias" and not dims:
                raise ValueError(f"PermutationSpec: {param!r} ({kind}) is acted on by no group; give it a group "
                                 f"or leave it out of kinds (it is then copied from the template)")
            if kind == "output_weight" and 0 in dims:
                raise ValueError(f"PermutationSpec: {param!r} is an output weight, whose axis 0 indexes the classes, "
                                 f"but a group acts on its axis 0")
            if len(set(dims)) != len(dims):
                raise ValueError(f"PermutationSpec: two groups act on axis {dims} of {param!r}")

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

    def params_of_kind(self, *kinds: str) -> list[str]:
        return [p for p, k in self.kinds.items() if k in kinds]

    def __str__(self) -> str:
        n = len(self.groups)
        lines = [f"PermutationSpec: {n} hidden permutation{'s' if n != 1 else ''}, matched in this order"]
        lines += [f"  {g.name}: " + ", ".join(str(a) for a in g.axes) for g in self.groups]
        outputs = self.params_of_kind("output_weight", "output_bias")
        if outputs:
            lines.append("  output layer (axis 0 = classes): " + ", ".join(outputs))
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------------
# deriving a spec from a module tree

_ELEMENTWISE_MODULES = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid,
    nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.LogSigmoid, nn.Identity,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.AlphaDropout, nn.Softmax, nn.LogSoftmax,
)
_POOL_MODULES = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
_ELEMENTWISE_FUNCTIONS = {
    torch.relu, torch.tanh, torch.sigmoid, torch.softmax, torch.log_softmax, F.relu, F.relu6, F.leaky_relu, F.elu,
    F.selu, F.celu, F.gelu, F.silu, F.mish, F.tanh, F.sigmoid, F.hardtanh, F.hardswish, F.hardsigmoid, F.softplus,
    F.softsign, F.tanhshrink, F.logsigmoid, F.dropout, F.dropout1d, F.dropout2d, F.alpha_dropout, F.softmax,
    F.log_softmax,
}
_ELEMENTWISE_METHODS = {"relu", "tanh", "sigmoid", "softmax", "log_softmax", "contiguous"}
_POOL_FUNCTIONS = {F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d}
_RESHAPE_FUNCTIONS = {torch.flatten, torch.reshape}
_RESHAPE_METHODS = {"flatten", "view", "reshape"}


def _describe(node, net: nn.Module) -> str:
    if node.op == "call_module":
        return f"module {node.target!r} ({type(net.get_submodule(node.target)).__name__})"
    if node.op == "call_function":
        return f"function {getattr(node.target, '__name__', node.target)!r} (graph node {node.name!r})"
    if node.op == "call_method":
        return f"method {node.target!r} (graph node {node.name!r})"
    return f"{node.op} {node.target!r} (graph node {node.name!r})"


def _step_kind(node, net: nn.Module) -> str:
    """What a graph node does to the channel axis: 'linear', 'conv', 'bn', 'pass' (elementwise or pooling: keeps it),
    'pool' (a 2-d pooling), 'reshape' (checked to be a flatten by shapes); raises for anything else."""
    where = _describe(node, net)
    if node.op == "call_module":
        m = net.get_submodule(node.target)
        if type(m) is nn.Linear:
            return "linear"
        if type(m) is nn.Conv2d:
            if m.groups != 1:
                raise ValueError(f"derive_spec: {where} has groups={m.groups}; only groups=1 convolutions have one "
                                 f"permutation of their output channels acting on the next layer's inputs")
            return "conv"
        if type(m) in (nn.BatchNorm1d, nn.BatchNorm2d):
            return "bn"
        if isinstance(m, _ELEMENTWISE_MODULES):
            return "pass"
        if isinstance(m, _POOL_MODULES):
            if getattr(m, "return_indices", False):
                raise ValueError(f"derive_spec: {where} returns indices; not supported")
            return "pool"
        if type(m) is nn.Flatten:
            return "reshape"
        raise ValueError(f"derive_spec: {where} is not a layer derive_spec understands (Linear, Conv2d, "
                         f"BatchNorm1d/2d, elementwise activations, Dropout, 2-d pooling, Flatten, Sequential); "
                         f"write the PermutationSpec by hand (see bnpfed.inference.permutation)")
    if node.op == "call_function":
        if node.target in _ELEMENTWISE_FUNCTIONS:
            return "pass"
        if node.target in _POOL_FUNCTIONS:
            return "pool"
        if node.target in _RESHAPE_FUNCTIONS:
            return "reshape"
    if node.op == "call_method":
        if node.target in _ELEMENTWISE_METHODS:
            return "pass"
        if node.target in _RESHAPE_METHODS:
            return "reshape"
    raise ValueError(f"derive_spec: {where} is not an operation derive_spec understands; write the PermutationSpec "
                     f"by hand (see bnpfed.inference.permutation)")


def _trace(net: nn.Module):
    """The torch.fx graph of ``net``, with every submodule other than an ``nn.Sequential`` a leaf."""
    import torch.fx

    class _Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return not isinstance(m, nn.Sequential)

    try:
        graph = _Tracer().trace(net)
    except Exception as err:  # noqa: BLE001 - any tracing failure means the same thing to the caller
        raise ValueError(f"derive_spec: cannot trace module '' ({type(net).__name__}) with torch.fx ({err}); write "
                         f"the PermutationSpec by hand (see bnpfed.inference.permutation)") from err
    return torch.fx.GraphModule(net, graph)


def derive_spec(net: nn.Module, input_shape: Sequence[int]) -> PermutationSpec:
    """The permutation spec of a feed-forward network, from its module tree and a forward pass.

    ``net`` is an ``nn.Sequential`` (nested ones allowed) -- or any module whose ``forward`` is one chain of such
    steps, such as :class:`~bnpfed.models.LeNet` (read with ``torch.fx``) -- of ``Linear``, ``Conv2d`` (groups=1),
    ``BatchNorm1d/2d``, elementwise activations (ReLU, Tanh, Sigmoid, GELU, LeakyReLU, ... and their functional
    forms), ``Dropout``, 2-d max / average / adaptive pooling, and ``Flatten`` (or ``flatten`` / ``view`` /
    ``reshape`` to ``(N, features)``). Every Linear and Conv2d but the last opens a group (its rows and bias, a batch
    norm after it, and the next Linear's or Conv2d's input columns: in blocks of H*W across a Flatten, H*W traced by
    a forward pass of zeros of shape ``(2, *input_shape)`` in eval mode); the last one is the output layer.

    Anything else -- a residual connection (two tensors combined), an LSTM, a Conv1d, a module of your own -- raises
    a ``ValueError`` naming it (qualified name and type): write the spec by hand then.

    >>> from bnpfed.models import LeNet
    >>> print(derive_spec(LeNet(), (1, 28, 28)))
    PermutationSpec: 4 hidden permutations, matched in this order
      conv1: conv1.weight[0], conv1.bias[0], conv2.weight[1]
      conv2: conv2.weight[0], conv2.bias[0], fc1.weight[1] in blocks of 25
      fc1: fc1.weight[0], fc1.bias[0], fc2.weight[1]
      fc2: fc2.weight[0], fc2.bias[0], fc3.weight[1]
      output layer (axis 0 = classes): fc3.weight, fc3.bias
    >>> derive_spec(nn.Sequential(nn.Conv1d(1, 2, 3)), (1, 8))
    Traceback (most recent call last):
    ...
    ValueError: derive_spec: module '0' (Conv1d) is not a layer derive_spec understands (...); write the PermutationSpec by hand (see bnpfed.inference.permutation)

    :param net: the network (not modified: traced in eval mode, its training flags restored).
    :param input_shape: the shape of one input, without the batch axis, e.g. ``(1, 28, 28)`` or ``(784,)``.
    :returns: :class:`PermutationSpec`, groups in forward order, named by the layers whose units they permute.
    """
    if not isinstance(net, nn.Module):
        raise ValueError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
    try:
        input_shape = tuple(int(s) for s in input_shape)
    except TypeError:
        raise ValueError(f"input_shape: expected the shape of one input, e.g. (1, 28, 28), got {input_shape!r}")
    if not input_shape or min(input_shape) < 1:
        raise ValueError(f"input_shape: expected positive sizes, e.g. (1, 28, 28), got {input_shape!r}")
    gm = _trace(net)
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise ValueError(f"derive_spec: module '' ({type(net).__name__}) takes {len(placeholders)} inputs; expected "
                         f"one")
    for n in nodes:  # the modules first: an unknown one is named before anything runs
        if n.op == "call_module":
            _step_kind(n, net)
        elif n.op == "get_attr":
            raise ValueError(f"derive_spec: {_describe(n, net)} reads a parameter outside a layer; write the "
                             f"PermutationSpec by hand")
    # shapes, from a forward pass of the traced graph (the same submodules) in eval mode
    from torch.fx.passes.shape_prop import ShapeProp

    modes = {m: m.training for m in net.modules()}
    param = next(iter(net.parameters()), None)
    x = torch.zeros(2, *input_shape, dtype=param.dtype if param is not None else None)
    try:
        net.eval()
        with torch.no_grad():
            ShapeProp(gm).propagate(x)
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"derive_spec: a forward pass of an input of shape {input_shape} (input_shape) failed: "
                         f"{err}") from err
    finally:
        for m, mode in modes.items():
            m.train(mode)

    def shape(n) -> tuple[int, ...] | None:
        meta = n.meta.get("tensor_meta")
        return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None

    # walk the chain: each step takes the previous step's tensor and nothing else (steps that give no tensor,
    # such as x.size(0) for a view, are read by the reshape they feed)
    steps = [n for n in nodes if n.op not in ("placeholder", "output") and shape(n) is not None]
    prev = placeholders[0]
    current: tuple[int, int] | None = None  # (index of the group on axis 1, block) or None: the input, not permuted
    groups: list[tuple[str, list[Axis]]] = []
    kinds: dict[str, str] = {}
    producers: list[str] = []  # the Linear and Conv2d layers, in order
    for node in steps:
        kind = _step_kind(node, net)
        tensors = [a for a in node.all_input_nodes if shape(a) is not None]
        if tensors != [prev]:
            raise ValueError(f"derive_spec: {_describe(node, net)} is not one step of a chain (it takes "
                             f"{[t.name for t in tensors]} where the chain holds {prev.name!r}: a residual "
                             f"connection or a branch?); write the PermutationSpec by hand")
        where = _describe(node, net)
        s_in, s_out = shape(prev), shape(node)
        if kind in ("linear", "conv"):
            name, m = node.target, net.get_submodule(node.target)
            want = 2 if kind == "linear" else 4
            if len(s_in) != want:
                raise ValueError(f"derive_spec: {where} gets a tensor of shape {s_in}; expected {want} axes "
                                 f"(batch first)")
            if name in producers:
                raise ValueError(f"derive_spec: {where} is called twice (shared weights); not supported")
            if current is not None:
                c, block = current
                if kind == "conv" and block != 1:
                    raise ValueError(f"derive_spec: {where} takes flattened channels; not supported")
                groups[c][1].append(Axis(f"{name}.weight", 1, block))
            kinds[f"{name}.weight"] = "weight"
            if m.bias is not None:
                kinds[f"{name}.bias"] = "bias"
            producers.append(name)
            groups.append((name, [Axis(f"{name}.weight", 0)] + ([Axis(f"{name}.bias", 0)] if m.bias is not None
                                                                   else [])))
            current = (len(groups) - 1, 1)
        elif kind == "bn":
            name, m = node.target, net.get_submodule(node.target)
            if current is None:
                raise ValueError(f"derive_spec: {where} normalises the network's input, which no permutation acts "
                                 f"on; not supported")
            if len(s_in) not in (2, 4) and not (len(s_in) == 3 and type(m) is nn.BatchNorm1d):
                raise ValueError(f"derive_spec: {where} gets a tensor of shape {s_in}")
            c, block = current
            for suffix, bn_kind in (("weight", "bn_weight"), ("bias", "bn_bias"), ("running_mean", "running_mean"),
                                    ("running_var", "running_var")):
                if getattr(m, suffix, None) is not None:
                    groups[c][1].append(Axis(f"{name}.{suffix}", 0, block))
                    kinds[f"{name}.{suffix}"] = bn_kind
        elif kind == "pool":
            if len(s_in) != 4:
                raise ValueError(f"derive_spec: {where} gets a tensor of shape {s_in}; expected (N, C, H, W)")
            if current is not None and current[1] != 1:
                raise ValueError(f"derive_spec: {where} pools flattened channels; not supported")
        elif kind == "reshape":
            if s_out == s_in:
                pass
            elif len(s_out) == 2 and s_out[0] == s_in[0] and s_out[1] == math.prod(s_in[1:]):
                if current is not None:
                    current = (current[0], current[1] * math.prod(s_in[2:]))
            else:
                raise ValueError(f"derive_spec: {where} reshapes {s_in} to {s_out}; only a flatten to (N, "
                                 f"features) is understood")
        prev = node
    output = [n for n in nodes if n.op == "output"][0]
    if output.all_input_nodes != [prev]:
        raise ValueError(f"derive_spec: module '' ({type(net).__name__}) returns something other than its last step's "
                         f"tensor")
    if not producers:
        raise ValueError(f"derive_spec: module '' ({type(net).__name__}) has no Linear or Conv2d layer")
    # the last Linear / Conv2d is the output layer: its units are the classes, not permuted
    out_name = producers[-1]
    out_group = groups.pop()
    if any(a.param.split(".")[:-1] != out_name.split(".") for a in out_group[1]):
        bn = next(a.param for a in out_group[1] if a.param.split(".")[:-1] != out_name.split("."))
        raise ValueError(f"derive_spec: a batch norm after the output layer {out_name!r} ({bn}) is not supported")
    kinds[f"{out_name}.weight"] = "output_weight"
    if f"{out_name}.bias" in kinds:
        kinds[f"{out_name}.bias"] = "output_bias"
    # order the parameters as the network's state_dict does
    order = {k: i for i, k in enumerate(net.state_dict())}
    kinds = dict(sorted(kinds.items(), key=lambda kv: order[kv[0]]))
    return PermutationSpec(groups=[Group(name, axes) for name, axes in groups], kinds=kinds)


def verify_spec(net: nn.Module, spec: PermutationSpec, input_shape: Sequence[int], *, seed: int = 0,
                rtol: float = 1e-5) -> None:
    """Check numerically that ``spec`` describes symmetries of ``net``: permute every group at random
    (:func:`client_slice` with every unit), run both networks in eval mode in float64 on a random input, and raise a
    ``ValueError`` if the outputs differ (relative to their scale) by more than ``rtol``. The running statistics of
    batch norms are randomised in the copies first (fresh ones, all 0 and 1, would hide a missing axis).

    >>> from bnpfed.models import LeNet
    >>> verify_spec(LeNet(image_size=8), derive_spec(LeNet(image_size=8), (1, 8, 8)), (1, 8, 8))
    """
    g = torch.Generator().manual_seed(seed)
    original = copy.deepcopy(net).double().eval()
    with torch.no_grad():
        for m in original.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g, dtype=torch.float64))
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g, dtype=torch.float64) + 0.5)
    state = original.state_dict()
    perms = {grp.name: torch.randperm(_width(state, grp, "verify_spec: net"), generator=g) for grp in spec.groups}
    permuted = network_from_state(original, client_slice(spec, state, perms)).eval()
    x = torch.randn(3, *input_shape, generator=g, dtype=torch.float64)
    with torch.no_grad():
        a, b = original(x), permuted(x)
    scale = float(a.abs().max()) or 1.0
    err = float((a - b).abs().max()) / scale
    if not err <= rtol:
        raise ValueError(f"verify_spec: permuting net by the spec changes its outputs by {err:.3g} (relative to their "
                         f"largest, > rtol={rtol}); the spec misses an axis the permutations act on, or names one "
                         f"they do not")


# --------------------------------------------------------------------------------------------------------------------
# unit vectors and their layout


def _width(state: Mapping[str, Tensor], group: Group, who: str) -> int:
    """The number of units of ``group`` in ``state``, checked to agree across its axes."""
    widths = {}
    for a in group.axes:
        if a.param not in state:
            raise ValueError(f"{who}: has no {a.param!r}, which group {group.name!r} acts on")
        t = state[a.param]
        if a.dim >= t.dim() or t.shape[a.dim] % a.block:
            raise ValueError(f"{who}: {a.param!r} has shape {tuple(t.shape)}; group {group.name!r} expects axis "
                             f"{a.dim} made of blocks of {a.block}")
        widths[str(a)] = t.shape[a.dim] // a.block
    if len(set(widths.values())) != 1:
        raise ValueError(f"{who}: group {group.name!r} has different numbers of units along its axes: {widths}")
    return next(iter(widths.values()))


def _reindex(t: Tensor, dim: int, block: int, ids: Tensor, size: int) -> Tensor:
    """Scatter axis ``dim`` of ``t`` (units in blocks) into ``size`` global units: client unit l goes to ``ids[l]``;
    a global unit the client lacks gets zeros (two client units on one global unit add)."""
    idx = (ids[:, None] * block + torch.arange(block)).reshape(-1)
    shape = list(t.shape)
    shape[dim] = size * block
    return torch.zeros(shape, dtype=t.dtype).index_add_(dim, idx, t)


def _select(t: Tensor, dim: int, block: int, ids: Tensor) -> Tensor:
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
        """(D,) prior means for :func:`~bnpfed.inference.match_layer`: ``mu0`` on weight coordinates (incoming and
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

    def to_params(self, atoms: Tensor) -> dict[str, Tensor]:
        """The parameters held in ``atoms`` (L, D), each with the group's axis at L units (float64)."""
        atoms = torch.as_tensor(atoms, dtype=torch.float64)
        if atoms.dim() != 2 or atoms.shape[1] != self.D:
            raise ValueError(f"atoms of group {self.group!r}: expected shape (L, {self.D}), got "
                             f"{tuple(atoms.shape)}")
        L = atoms.shape[0]
        out = {}
        for s in self.segments:
            t = atoms[:, s.start:s.stop].reshape(L * s.block, *s.unit_shape[1:])
            out[s.param] = t.movedim(0, s.dim).contiguous()
        return out


def _layout(spec: PermutationSpec, shapes: Mapping[str, tuple[int, ...]], group: str, sizes: Mapping[str, int],
            *, statistics: bool = False) -> VectorLayout:
    """The layout of ``group``'s vectors: the parameters it owns (the running statistics instead, with
    ``statistics``), with the other groups' axes at ``sizes``."""
    index = spec.group_names.index(group)
    segments, classes, start = [], [], 0
    for param in spec.owned(group):
        kind = spec.kinds[param]
        if (kind in _STATISTICS) != statistics:
            continue
        shape = list(shapes[param])
        own = None
        for c, a in spec.axes_of(param):
            if c == index:
                own = a
            else:
                name = spec.groups[c].name
                if name not in sizes:
                    raise ValueError(f"below: group {group!r} needs the global ids of group {name!r} (matched "
                                     f"before it), got none")
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
        raise ValueError(f"spec: group {group!r} owns no parameter to match (each parameter is matched in the last "
                         f"group acting on it); put it later in the spec's order")
    cls = torch.cat(classes) if classes else torch.zeros(0, dtype=torch.long)
    return VectorLayout(group, tuple(segments), cls)


def _rows(state: Mapping[str, Tensor], spec: PermutationSpec, layout: VectorLayout,
          below: Mapping[str, tuple[Tensor, int]]) -> Tensor:
    """A client's (L_j, D) unit vectors under ``layout``."""
    index = spec.group_names.index(layout.group)
    parts = []
    for s in layout.segments:
        t = torch.as_tensor(state[s.param]).detach().to(torch.float64)
        for c, a in spec.axes_of(s.param):
            if c != index:
                ids, size = below[spec.groups[c].name]
                t = _reindex(t, a.dim, a.block, torch.as_tensor(ids, dtype=torch.long), size)
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


def _below(below, spec: PermutationSpec) -> dict[str, tuple[Tensor, int]]:
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
    """One client's vectors of the units of ``group``, for :func:`~bnpfed.inference.match_layer` (see the module
    docstring for what they hold).

    Two channels of a conv over 1 input channel with 2x2 kernels; the next conv's input columns belong to the next
    group, so the vector of a channel is its 4 kernel weights and its bias::

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
    below = _below(below, spec)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    _width(state, g, "state")
    for name, (ids, _) in below.items():
        other = spec.group(name)
        n = _width(state, other, "state")
        if ids.numel() != n:
            raise ValueError(f"below[{name!r}]: expected {n} ids (the client has {n} units in group {name!r}), got "
                             f"{ids.numel()}")
    layout = _layout(spec, shapes, group, {n: s for n, (_, s) in below.items()})
    return UnitVectors(_rows(state, spec, layout, below), layout)


# --------------------------------------------------------------------------------------------------------------------
# from atoms back to a network, and a client's slice


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
        raise ValueError(f"atoms: expected atoms of every group {spec.group_names}, missing {missing}")
    shapes = {k: tuple(v.shape) for k, v in template.items()}
    sizes = {g: int(torch.as_tensor(atoms[g]).shape[0]) for g in spec.group_names}
    values: dict[str, Tensor] = {}
    for g in spec.group_names:
        values.update(_layout(spec, shapes, g, sizes).to_params(atoms[g]))
    extra = dict(extra or {})
    out = {}
    for key, t in template.items():
        t = torch.as_tensor(t)
        if key in values:
            v = values[key]
        elif key in extra:
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
        out[key] = v.detach().to(t.dtype).clone()
    return out


def client_slice(spec: PermutationSpec, state: Mapping[str, Tensor], ids: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The slice of a (global) ``state`` made of the units ``ids[g]`` of every group g, in that order: along every
    axis a group acts on, the blocks of those units; every other entry unchanged. A client's slice of the global
    network takes its assignments (``ids[g][l]`` the global unit its unit l was matched to); with a permutation of
    every group's units it permutes the network (:func:`verify_spec`).

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
        raise ValueError(f"ids: expected global unit ids for every group {spec.group_names}, missing {missing}")
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
            t = _select(t, a.dim, a.block, chosen)
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
        raise ValueError(f"network_from_state: module {name!r} ({type(module).__name__}) holds a resized parameter; "
                         f"only Linear, Conv2d and BatchNorm1d/2d can be rebuilt with other widths")
    return new.train(module.training)


def network_from_state(template: nn.Module, state: Mapping[str, Tensor]) -> nn.Module:
    """A copy of ``template`` carrying ``state``, every Linear, Conv2d and BatchNorm whose parameters changed shape
    rebuilt with the new widths (its other settings kept). The template is not modified; its ``forward`` runs on the
    rebuilt modules (it must not hard-code widths, as none of bnpfed's networks does).

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
        raise ValueError(f"state: expected the keys of the template's state_dict; missing {missing}, unexpected "
                         f"{unexpected}")
    resized = {key.rpartition(".")[0] for key, t in state.items() if tuple(torch.as_tensor(t).shape) !=
               tuple(current[key].shape)}
    for name in sorted(resized):
        if not name:
            raise ValueError("network_from_state: a parameter of the template's own (not of a submodule) changed "
                             "shape")
        net.set_submodule(name, _resized(name, net.get_submodule(name), state))
    net.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
    return net


def network_from_atoms(template: nn.Module, spec: PermutationSpec, atoms: Mapping[str, Tensor],
                       extra: Mapping[str, Tensor] | None = None) -> nn.Module:
    """The network of ``template``'s kind carrying the matched atoms, with the matched widths:
    ``network_from_state(template, state_from_atoms(spec, template.state_dict(), atoms, extra))``.

    >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    >>> spec = derive_spec(net, (2,))
    >>> atoms = torch.arange(20.0).reshape(5, 4)          # 5 global units: 2 incoming weights, bias, output weight
    >>> wide = network_from_atoms(net, spec, {"0": atoms})
    >>> wide[0].out_features, wide[2].weight.tolist()
    (5, [[3.0, 7.0, 11.0, 15.0, 19.0]])
    """
    return network_from_state(template, state_from_atoms(spec, template.state_dict(), atoms, extra))


# --------------------------------------------------------------------------------------------------------------------
# whole-network matching


@dataclass
class SpecMatch:
    """Result of :func:`match_by_spec`.

    :param PermutationSpec spec: the spec the networks were matched by.
    :param dict state: the global network's ``state_dict`` (posterior-mean weights, members' mean running statistics,
        the class-share posterior mean of the output bias, the template's keys without a kind).
    :param dict assignments: group name -> J long tensors mapping each client's units to global units.
    :param dict layer_results: group name -> the :class:`MatchResult` of that group's matching.
    :param nn.Module template: the network the global one is built from (client 0's, or the one given).
    :param float seconds: wall time of all the matching.
    :param Tensor class_shares: (J, C) ``share_jk = n_jk / sum_j' n_j'k`` (0 for a class nobody holds).
    :param dict hyperparameters: group name -> the ``hyperparameters`` of its result (``{}`` when it has none).
    :param float output_bias_mu0: the prior mean the output bias was shrunk towards (given or estimated).
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

    @property
    def widths(self) -> dict[str, int]:
        """Group name -> number of global units."""
        return {g.name: _width(self.state, g, "state") for g in self.spec.groups}

    @property
    def hidden_sizes(self) -> list[int]:
        """The global widths in the spec's order (an MLP's hidden widths, as ``NetworkMatch.hidden_sizes``)."""
        return list(self.widths.values())

    def network(self) -> nn.Module:
        """The global network, of the template's kind with the matched widths."""
        if self.template is None:
            raise ValueError("network: this match has no template network; pass template= to match_by_spec")
        return network_from_state(self.template, self.state)

    def client_slice(self, j: int) -> dict[str, Tensor]:
        """Client j's slice of the global state: for every group, the global units its own units were matched to, in
        its own order (:func:`client_slice`)."""
        return client_slice(self.spec, self.state, {g: a[j] for g, a in self.assignments.items()})

    def client_network(self, j: int) -> nn.Module:
        """Client j's slice as a network of the template's kind."""
        return network_from_state(self.template, self.client_slice(j))


def _accepts(fn, name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name`` (by name or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


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


def _client_states(client_nets, template):
    if not isinstance(client_nets, Sequence) or isinstance(client_nets, (str, bytes)) or not client_nets:
        raise ValueError("client_nets: expected a non-empty sequence of networks (nn.Module) or state dicts")
    states = []
    for j, net in enumerate(client_nets):
        if isinstance(net, nn.Module):
            template = net if template is None else template
            state = net.state_dict()
        elif isinstance(net, Mapping):
            state = dict(net)
        else:
            raise ValueError(f"client_nets[{j}]: expected an nn.Module or a state dict, got {type(net).__name__}")
        states.append({k: torch.as_tensor(v).detach() for k, v in state.items()})
    return states, template


def _check_state(state, spec: PermutationSpec, ref, j: int) -> dict[str, int]:
    who = f"client_nets[{j}]"
    for key, kind in spec.kinds.items():
        if key not in state:
            raise ValueError(f"{who}: has no {key!r} ({kind}), which the spec names")
        t = state[key]
        if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise ValueError(f"{who}: {key!r} must be a finite floating-point tensor")
    widths = {g.name: _width(state, g, who) for g in spec.groups}
    if ref is not None:
        for key in spec.kinds:
            permuted = {a.dim for _, a in spec.axes_of(key)}
            a, b = state[key].shape, ref[key].shape
            if len(a) != len(b) or any(x != y for d, (x, y) in enumerate(zip(a, b)) if d not in permuted):
                raise ValueError(f"{who}: {key!r} has shape {tuple(a)} but client 0's is {tuple(b)} (only the axes "
                                 f"a group acts on may differ)")
    return widths


def _warm_start(warm_start, names: list[str], widths: list[dict[str, int]]) -> dict | None:
    if warm_start is None:
        return None
    if isinstance(warm_start, SpecMatch):
        previous = warm_start.assignments
    elif isinstance(warm_start, Mapping):
        previous = dict(warm_start)
    elif isinstance(warm_start, Sequence) and not isinstance(warm_start, (str, bytes)):
        if len(warm_start) != len(names):
            raise ValueError(f"warm_start: expected assignments of {len(names)} group(s), got {len(warm_start)}")
        previous = dict(zip(names, warm_start))
    else:
        raise ValueError(f"warm_start: expected a SpecMatch, assignments per group (a mapping by name or a sequence "
                         f"in spec order), or None, got {type(warm_start).__name__}")
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
    """``spec`` checked, or when None derived from ``template`` (:func:`derive_spec`) with ``input_shape``, which
    defaults to ``(in_features,)`` for a network whose first layer is a Linear. ``missing``: the error when there is
    neither a spec nor a template."""
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
    sweeps: int | None = None,
    seed: int | None = None,
    warm_start=None,
    layer_fn: Callable | Sequence[Callable] = match_layer,
    global_weights: Literal["average", "posterior-mean"] | None = None,
    **matcher_kwargs,
) -> SpecMatch:
    """Match J clients' networks of one kind into one global network (PFNM's server step), group by group in the
    spec's order, every group through ``layer_fn`` (:func:`~bnpfed.inference.match_layer`).

    For each group: every client's :func:`unit_vectors` (the groups before it re-indexed to their matched global
    units), the output-weight coordinates at precision ``share_jk``, prior means from ``mu0`` / ``bias_mu0`` (and
    :data:`BN_FIXED_PRIOR_MEANS` under fixed hyper-parameters); the atoms are the owned parameters' global values,
    and each running statistic is the mean of the members' of its unit. The output bias is the class-share-weighted
    posterior mean of the clients' output biases, with the variances of the group holding the output weights
    (``sigma2_scaled`` / ``sigma0_2_scaled`` when it has them), and prior mean
    ``bias_mu0`` or, when None, the mean over the classes of the precision-weighted means. This is
    :func:`~bnpfed.inference.multilayer.match_networks`'s bottom-up rule for an MLP, with the same result.

    Two clients hold one conv net with its channels and units permuted differently; matching puts it back together::

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
    :param spec: the :class:`PermutationSpec`; default :func:`derive_spec` of client 0's network.
    :param input_shape: the shape of one input, for :func:`derive_spec` (default: ``(in_features,)`` when the
        network's first layer is a Linear; required for a convolutional network).
    :param template: the network the global one is built from; default client 0's.
    :param sigma2: noise variance, ``sigma0_2`` prior variance, ``gamma0`` IBP mass, ``mu0`` prior mean of the
        weight coordinates, ``bias_mu0`` of the bias coordinates and of the output bias: None (estimated per group
        under empirical Bayes; sigma2, sigma0_2 and gamma0 required with ``"fixed"``, mu0 0 and bias_mu0 0.1 as
        published), a scalar (every group), one value per group in the spec's order, or a mapping by group name.
    :param str hyperparameters: ``"empirical-bayes"`` (default) or ``"fixed"``.
    :param int sweeps: remove-and-rematch passes per group (None: :func:`match_layer`'s default).
    :param int seed: seed of the sweeps' client order; the group at position c uses ``seed + c``.
    :param warm_start: a previous :class:`SpecMatch` of the same J clients (each client's network then being its
        :meth:`~SpecMatch.client_slice`, trained further), or per group J label arrays (a mapping by name or a
        sequence in spec order): the initial assignments (``init_assignments`` of :func:`match_layer`). Default
        None: match from scratch.
    :param layer_fn: the one-group matcher (default :func:`match_layer`), or one per group; it is called as in
        :func:`~bnpfed.inference.multilayer.match_networks` (``hyperparameters`` only if it takes it,
        ``init_assignments`` only with ``warm_start``).
    :param str global_weights: ``"average"`` (each global unit's owned parameters the average of its members', the
        output layer the clients' logits averaged class by class: :func:`~bnpfed.inference.matching.average_atoms`)
        or ``"posterior-mean"`` (the atoms' posterior means, as published); None (default): ``"average"`` under
        empirical Bayes, ``"posterior-mean"`` with fixed hyper-parameters -- as
        :func:`~bnpfed.inference.multilayer.match_networks`.
    :param matcher_kwargs: passed to ``layer_fn``.
    :returns: :class:`SpecMatch`.
    """
    t0 = time.perf_counter()
    mode = check_choice(hyperparameters, ("empirical-bayes", "fixed"), "hyperparameters")
    combine = _global_weights(global_weights, mode)
    states, template = _client_states(client_nets, template)
    spec = resolve_spec(spec, template, input_shape,
                        missing="spec: expected a PermutationSpec when client_nets are state dicts (or a template)")
    names = spec.group_names
    K, J = len(names), len(states)
    if K == 0:
        raise ValueError("spec: has no hidden permutation; PFNM needs at least one hidden layer")
    widths = [_check_state(s, spec, states[0] if j else None, j) for j, s in enumerate(states)]
    out_w, out_b = _outputs(spec)
    shares = _class_shares(class_counts, J, int(states[0][out_w].shape[0]))
    init = _warm_start(warm_start, names, widths)
    if callable(layer_fn):
        layer_fns = [layer_fn] * K
    elif isinstance(layer_fn, Sequence) and len(layer_fn) == K and all(callable(f) for f in layer_fn):
        layer_fns = list(layer_fn)
    else:
        raise ValueError(f"layer_fn: expected a one-layer matcher or one per group ({K}), got {layer_fn!r}")
    values = _group_values(names, mode, sigma2, sigma0_2, gamma0, mu0, bias_mu0)
    shapes = {k: tuple(v.shape) for k, v in states[0].items()}
    below: dict[str, tuple[list[Tensor], int]] = {}
    matches: dict[str, GroupMatch] = {}
    for c, name in enumerate(names):
        matches[name] = _match_one(states, spec, shapes, name, below, shares, layer_fns[c], values[c], mode=mode,
                                   sweeps=sweeps, seed=None if seed is None else seed + c,
                                   init=None if init is None else init[name], matcher_kwargs=matcher_kwargs,
                                   combine=combine)
        below[name] = (matches[name].assignments, matches[name].size)
    extra = {k: v for m in matches.values() for k, v in m.statistics.items()}
    owner = matches[spec.owner(out_w)]
    b_mu0 = None
    if out_b is not None:
        bias, b_mu0 = _output_bias(states, out_b, shares, owner.hyperparameters, values[names.index(owner.group)],
                                   combine)
        extra[out_b] = bias
    state = state_from_atoms(spec, states[0], {n: m.atoms for n, m in matches.items()}, extra)
    return SpecMatch(spec=spec, state=state, assignments={n: m.assignments for n, m in matches.items()},
                     layer_results={n: m.result for n, m in matches.items()}, template=template,
                     seconds=time.perf_counter() - t0, class_shares=shares,
                     hyperparameters={n: m.hyperparameters for n, m in matches.items()}, output_bias_mu0=b_mu0)


# --------------------------------------------------------------------------------------------------------------------
# one group at a time (FedMA's layer-wise scheme)


@dataclass
class GroupMatch:
    """One group of a spec matched: what :func:`match_group` returns (and :func:`match_by_spec` computes for every
    group in turn).

    :param str group: the group's name.
    :param result: the one-group matcher's :class:`~bnpfed.inference.MatchResult`.
    :param list assignments: J long tensors: client j's unit l went to global unit ``assignments[j][l]``.
    :param Tensor atoms: (L, D) float64, the global units' vectors, laid out as ``layout`` says.
    :param VectorLayout layout: the coordinates of the vectors.
    :param dict statistics: the running statistics the group owns (the mean of each global unit's members'), float64.
    :param dict hyperparameters: the result's ``hyperparameters`` (``{}`` when it has none).
    :param dict output_bias: ``{key: (C,) tensor}`` when the group holds the output weights and the spec has an output
        bias (its class-share posterior mean), else empty.
    :param float output_bias_mu0: the prior mean that bias was shrunk towards.
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

    @property
    def size(self) -> int:
        """L, the number of global units."""
        return int(self.atoms.shape[0])

    def values(self) -> dict[str, Tensor]:
        """The global value of every parameter the group owns (float64, the group's axis at L units; running
        statistics the members' mean), and the output bias when the group holds the output weights."""
        return {**self.layout.to_params(self.atoms), **self.statistics, **self.output_bias}


def _outputs(spec: PermutationSpec) -> tuple[str, str | None]:
    out_w = spec.params_of_kind("output_weight")
    out_b = spec.params_of_kind("output_bias")
    if len(out_w) != 1 or len(out_b) > 1:
        raise ValueError(f"spec: expected one output weight and at most one output bias, got {out_w} and {out_b}")
    return out_w[0], (out_b[0] if out_b else None)


def _group_values(names: list[str], mode: str, sigma2, sigma0_2, gamma0, mu0, bias_mu0) -> list[tuple]:
    """Per group, its (sigma2, sigma0_2, gamma0, mu0, bias_mu0): None where estimated; with fixed hyper-parameters
    the published prior means (0 for weights, 0.1 for biases) where not given."""
    sig, sig0, gam, mus, bias_mus = (_per_group(v, names, n) for v, n in (
        (sigma2, "sigma2"), (sigma0_2, "sigma0_2"), (gamma0, "gamma0"), (mu0, "mu0"), (bias_mu0, "bias_mu0")))
    if mode == "fixed":
        mus = [0.0 if m is None else m for m in mus]
        bias_mus = [0.1 if m is None else m for m in bias_mus]
    return list(zip(sig, sig0, gam, mus, bias_mus))


def _match_one(states, spec: PermutationSpec, shapes, name: str, below: Mapping[str, tuple[list[Tensor], int]],
               shares: Tensor, fn, values: tuple, *, mode: str, sweeps, seed, init, matcher_kwargs,
               combine: str = "posterior-mean") -> GroupMatch:
    """Group ``name`` of every client matched through ``fn``, the groups in ``below`` ((per-client global ids,
    global size)) re-indexing the parameters it owns."""
    sigma2, sigma0_2, gamma0, mu0, bias_mu0 = values
    sizes = {h: size for h, (_, size) in below.items()}
    layout = _layout(spec, shapes, name, sizes)
    neurons = [_rows(states[j], spec, layout, {h: (ids[j], size) for h, (ids, size) in below.items()})
               for j in range(len(states))]
    kwargs = {} if init is None else {"init_assignments": init}
    if _accepts(fn, "hyperparameters"):
        kwargs["hyperparameters"] = mode
    r = fn(neurons, sigma2=sigma2, sigma0_2=sigma0_2, gamma0=gamma0,
           mu0=layout.prior_mean(mu0, bias_mu0, fixed=mode == "fixed"), precisions=layout.precisions(shares),
           sweeps=sweeps, seed=seed, **kwargs, **matcher_kwargs)
    assignments = [torch.as_tensor(a, dtype=torch.long) for a in r.assignments]
    if combine == "average":
        atoms = average_atoms(neurons, assignments, precisions=layout.precisions(shares))
    else:
        atoms = torch.as_tensor(r.global_atoms).to(torch.float64)
    L = int(atoms.shape[0])
    # running statistics: the mean of the members' (see the module docstring)
    statistics = {}
    stats = _layout(spec, shapes, name, {**sizes, name: L}, statistics=True)
    if stats.segments:
        total = torch.zeros(L, stats.D, dtype=torch.float64)
        count = torch.zeros(L, 1, dtype=torch.float64)
        for j in range(len(states)):
            rows = _rows(states[j], spec, stats, {**{h: (ids[j], size) for h, (ids, size) in below.items()},
                                                  name: (assignments[j], L)})
            total.index_add_(0, assignments[j], rows)
            count.index_add_(0, assignments[j], torch.ones(rows.shape[0], 1, dtype=torch.float64))
        statistics = stats.to_params(total / count.clamp(min=1))
    return GroupMatch(group=name, result=r, assignments=assignments, atoms=atoms, layout=layout,
                      statistics=statistics, hyperparameters=dict(getattr(r, "hyperparameters", None) or {}))


def _global_weights(global_weights, mode: str) -> str:
    if global_weights is None:
        return "average" if mode == "empirical-bayes" else "posterior-mean"
    return check_choice(global_weights, ("average", "posterior-mean"), "global_weights")


def _output_bias(states, key: str, shares: Tensor, hypers: Mapping, values: tuple,
                 combine: str = "posterior-mean") -> tuple[Tensor, float | None]:
    """The output bias, ``(bias, bias_mu0)``. ``combine="average"``: the clients' biases averaged class by class
    (weights :func:`~bnpfed.inference.matching.averaging_weights` of the class shares), bias_mu0 None. Otherwise the
    posterior mean under N(bias_mu0, sigma0_2) with client j's bias seen at precision share_jk / sigma2, the variances
    those of the group holding the output weights."""
    if combine == "average":
        omega = averaging_weights(shares)
        return (omega * torch.stack([states[j][key].to(torch.float64) for j in range(len(states))])).sum(0), None
    sigma2, sigma0_2, _, _, bias_mu0 = values
    s2 = hypers.get("sigma2", sigma2 if sigma2 is not None else 1.0)
    s02 = hypers.get("sigma0_2", sigma0_2 if sigma0_2 is not None else 1.0)
    s2_out = hypers.get("sigma2_scaled", s2)
    s02 = hypers.get("sigma0_2_scaled", s02)
    b_out = torch.stack([states[j][key].to(torch.float64) for j in range(len(states))])
    weighted, precision = (shares * b_out).sum(0) / s2_out, shares.sum(0) / s2_out
    if bias_mu0 is not None:
        b_mu0 = float(bias_mu0)
    else:  # the mean over the classes of each class's precision-weighted mean of the clients' biases
        held = precision > 0
        b_mu0 = float((weighted[held] / precision[held]).mean())
    return (b_mu0 / s02 + weighted) / (1.0 / s02 + precision), b_mu0


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
    **matcher_kwargs,
) -> GroupMatch:
    """Match one group of J clients' networks: :func:`match_by_spec`'s step for that group, on its own. FedMA's
    layer-wise scheme (Wang et al., ICLR 2020) calls it once per group, the clients retraining in between: after a
    group is matched every client takes its global units (:func:`align_to_group`), so the groups before the next one
    are the same in every client, unit for unit.

    Two clients holding permuted copies of one network, its first layer matched, then aligned::

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
    :returns: :class:`GroupMatch`.
    """
    mode = check_choice(hyperparameters, ("empirical-bayes", "fixed"), "hyperparameters")
    combine = _global_weights(global_weights, mode)
    if not isinstance(spec, PermutationSpec):
        raise ValueError(f"spec: expected a PermutationSpec, got {type(spec).__name__}")
    names = spec.group_names
    if group not in names:
        raise ValueError(f"group: expected one of {names}, got {group!r}")
    if not callable(layer_fn):
        raise ValueError(f"layer_fn: expected a one-layer matcher, got {layer_fn!r}")
    c = names.index(group)
    states, _ = _client_states(client_nets, None)
    J = len(states)
    widths = [_check_state(s, spec, states[0] if j else None, j) for j, s in enumerate(states)]
    out_w, out_b = _outputs(spec)
    shares = _class_shares(class_counts, J, int(states[0][out_w].shape[0]))
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
                raise ValueError(f"below: the clients hold {sizes} units of group {h!r}, matched before {group!r}; "
                                 f"pass below[{h!r}] (their global ids), or align them first (align_to_group)")
            resolved[h] = ([torch.arange(sizes[0])] * J, sizes[0])
    unknown = sorted(set(below or {}) - set(names[:c]))
    if unknown:
        raise ValueError(f"below: expected groups matched before {group!r} ({names[:c]}), got {unknown}")
    init = None
    if init_assignments is not None:
        init = _warm_start({group: init_assignments}, [group], [{group: w[group]} for w in widths])[group]
    values = _group_values(names, mode, sigma2, sigma0_2, gamma0, mu0, bias_mu0)[c]
    shapes = {k: tuple(v.shape) for k, v in states[0].items()}
    match = _match_one(states, spec, shapes, group, resolved, shares, layer_fn, values, mode=mode, sweeps=sweeps,
                       seed=seed, init=init, matcher_kwargs=matcher_kwargs, combine=combine)
    if out_b is not None and spec.owner(out_w) == group:
        bias, match.output_bias_mu0 = _output_bias(states, out_b, shares, match.hyperparameters, values, combine)
        match.output_bias = {out_b: bias}
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
                t = _reindex(t, a.dim, a.block, ids, size)
        out[key] = t.clone()
    return out


# --------------------------------------------------------------------------------------------------------------------
# batch-norm statistics from data (REPAIR's reset, federated)


@dataclass(frozen=True)
class BatchNormMoments:
    """Sufficient statistics of one batch norm's inputs over some examples: ``count`` values per feature (examples
    times spatial positions), their ``sum`` and ``sum_sq`` per feature, (C,) float64. Moments add over clients."""

    count: float
    sum: Tensor
    sum_sq: Tensor

    def __add__(self, other: BatchNormMoments) -> BatchNormMoments:
        return BatchNormMoments(self.count + other.count, self.sum + other.sum, self.sum_sq + other.sum_sq)


def batch_norm_moments(net: nn.Module, batches) -> dict[str, BatchNormMoments]:
    """A client's step of re-estimating the running statistics: the moments of every batch norm's inputs over the
    given batches, with the batch norms in training mode (normalising by the batch's statistics, as in training and
    as ``torch.optim.swa_utils.update_bn`` does) and everything else in eval mode. ``net`` is not modified.

    :param net: the (global) network.
    :param batches: an iterable of input tensors ``(N, *input_shape)`` (e.g. the client's training inputs in batches).
    :returns: batch norm's qualified name -> :class:`BatchNormMoments`.
    """
    net = copy.deepcopy(net).eval()
    norms = {n: m for n, m in net.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    moments: dict[str, BatchNormMoments] = {}

    def hook(name):
        def record(module, args):
            x = args[0].detach().to(torch.float64)
            x = x.transpose(0, 1).reshape(x.shape[1], -1)  # (C, N * spatial)
            m = BatchNormMoments(float(x.shape[1]), x.sum(1), (x * x).sum(1))
            moments[name] = moments[name] + m if name in moments else m
        return record

    for name, m in norms.items():
        m.train()
        m.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        for x in batches:
            net(x)
    return moments


def set_batch_norm_statistics(net: nn.Module, moments: Mapping[str, BatchNormMoments]) -> nn.Module:
    """The server's step: set every batch norm's running mean and (unbiased) variance from pooled moments (the sum of
    the clients' :func:`batch_norm_moments`), in place. Returns ``net``."""
    statistics = batch_norm_statistics(moments)
    with torch.no_grad():
        for name, m in net.named_modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                if name not in statistics:
                    raise ValueError(f"moments: expected the moments of batch norm {name!r}, got none")
                mean, var = statistics[name]
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
    return net


def batch_norm_statistics(moments: Mapping[str, BatchNormMoments]) -> dict[str, tuple[Tensor, Tensor]]:
    """The running mean and (unbiased) variance, float64, of every batch norm from pooled moments: batch norm's
    name -> ``(mean, var)`` (what :func:`set_batch_norm_statistics` writes)."""
    out = {}
    for name, mo in moments.items():
        if mo.count <= 0:
            raise ValueError(f"moments[{name!r}]: expected a positive count, got {mo.count}")
        mean = mo.sum / mo.count
        out[name] = (mean, (mo.sum_sq / mo.count - mean * mean).clamp(min=0) * (mo.count / max(mo.count - 1.0, 1.0)))
    return out


def reestimate_batch_norm(net: nn.Module, client_batches: Sequence) -> nn.Module:
    """Re-estimate a (global) network's batch-norm running statistics from the clients' data in one process: every
    client's :func:`batch_norm_moments`, pooled (summed), set in place (:func:`set_batch_norm_statistics`). This is
    REPAIR's reset (Jordan et al., ICLR 2023) with the statistics pooled over the clients' examples; after a match it
    lifts a batch-normalised global network above what the members' mean statistics give (from near chance with
    posterior-mean weights; module docstring, *Batch norm*). The first batch norm's running mean is then the mean of its inputs over all the
    clients' examples::

        >>> from bnpfed.models import simple_cnn_bn
        >>> x = torch.randn(32, 1, 8, 8)
        >>> net = reestimate_batch_norm(simple_cnn_bn(1, 8), [[x[:16]], [x[16:24], x[24:]]])   # two clients
        >>> torch.allclose(net.bn1.running_mean, net.conv1(x).mean((0, 2, 3)), atol=1e-6)
        True

    :param net: the network, modified in place and returned.
    :param client_batches: one iterable of input batches per client.
    """
    pooled: dict[str, BatchNormMoments] = {}
    for batches in client_batches:
        for name, m in batch_norm_moments(net, batches).items():
            pooled[name] = pooled[name] + m if name in pooled else m
    return set_batch_norm_statistics(net, pooled)
