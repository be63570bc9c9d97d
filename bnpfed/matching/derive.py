"""Deriving a network's permutation spec from its module tree (``torch.fx``) and a forward pass, and checking any
spec numerically."""

from __future__ import annotations

import copy
import math
import operator
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bnpfed.matching.assembly import client_slice, network_from_state
from bnpfed.matching.layout import width
from bnpfed.matching.spec import Axis, Group, PermutationSpec

__all__ = ["derive_spec", "verify_spec"]

_ELEMENTWISE_MODULES = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid,
    nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign, nn.Tanhshrink, nn.LogSigmoid, nn.Identity,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.AlphaDropout, nn.Softmax, nn.LogSoftmax,
)
_POOL_MODULES = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
_ELEMENTWISE_FUNCTIONS = {
    torch.relu, torch.relu_, torch.tanh, torch.sigmoid, torch.selu, torch.celu, torch.rrelu, torch.softmax,
    torch.log_softmax, torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.special.expit, F.relu, F.relu_,
    F.relu6, F.leaky_relu, F.elu, F.selu, F.celu, F.gelu, F.silu, F.mish, F.tanh, F.sigmoid, F.hardtanh, F.hardswish,
    F.hardsigmoid, F.softplus, F.softsign, F.tanhshrink, F.logsigmoid, F.dropout, F.dropout1d, F.dropout2d,
    F.alpha_dropout, F.softmax, F.log_softmax,
}
_ELEMENTWISE_METHODS = {"relu", "relu_", "tanh", "tanh_", "sigmoid", "sigmoid_", "softmax", "log_softmax",
                        "contiguous"}
#: torch's own names for the 2-d poolings beside torch.nn.functional's (``torch.max_pool2d`` is not ``F.max_pool2d``)
_POOL_FUNCTIONS = {F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d, torch.max_pool2d}
_RESHAPE_FUNCTIONS = {torch.flatten, torch.reshape}
_RESHAPE_METHODS = {"flatten", "view", "reshape"}
#: a residual connection: two tensors added (``x + f(x)``, ``out += shortcut(x)``, ``torch.add``)
_ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add}
_ADD_METHODS = {"add", "add_"}
#: a global average over the spatial axes, (N, C, H, W) -> (N, C): ``x.mean((2, 3))``
_MEAN = {torch.mean}
_MEAN_METHODS = {"mean"}


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
    'pool' (a 2-d pooling), 'reshape' (checked to be a flatten by shapes), 'add' (a residual addition), 'mean' (a
    spatial average, checked by shapes); raises for anything else."""
    where = _describe(node, net)
    if node.op == "call_module":
        m = net.get_submodule(node.target)
        if type(m) is nn.Linear:
            return "linear"
        if type(m) is nn.Conv2d:
            if m.groups != 1:
                raise ValueError(f"net: expected convolutions with groups=1 (only they have one permutation of their "
                                 f"output channels acting on the next layer's inputs), got {where} with "
                                 f"groups={m.groups}")
            return "conv"
        if type(m) in (nn.BatchNorm1d, nn.BatchNorm2d):
            return "bn"
        if isinstance(m, _ELEMENTWISE_MODULES):
            return "pass"
        if isinstance(m, _POOL_MODULES):
            if getattr(m, "return_indices", False):
                raise ValueError(f"net: expected poolings that return no indices, got {where}, which returns "
                                 f"indices (not supported)")
            return "pool"
        if type(m) is nn.Flatten:
            return "reshape"
        raise ValueError(f"net: expected layers derive_spec understands (Linear, Conv2d, BatchNorm1d/2d, "
                         f"elementwise activations, Dropout, 2-d pooling, Flatten, Sequential), got {where}; "
                         f"write the PermutationSpec by hand (see bnpfed.matching.permutation)")
    if node.op == "call_function":
        if node.target in _ADD_FUNCTIONS:
            return "add"
        if node.target in _MEAN:
            return "mean"
        if node.target in _ELEMENTWISE_FUNCTIONS:
            return "pass"
        if node.target in _POOL_FUNCTIONS:
            return "pool"
        if node.target in _RESHAPE_FUNCTIONS:
            return "reshape"
    if node.op == "call_method":
        if node.target in _ADD_METHODS:
            return "add"
        if node.target in _MEAN_METHODS:
            return "mean"
        if node.target in _ELEMENTWISE_METHODS:
            return "pass"
        if node.target in _RESHAPE_METHODS:
            return "reshape"
    raise ValueError(f"net: expected operations derive_spec understands, got {where}; write the PermutationSpec "
                     f"by hand (see bnpfed.matching.permutation)")


def _trace(net: nn.Module):
    """The torch.fx graph of ``net``: torch's own layers are leaves (an ``nn.Sequential`` excepted), a module of the
    user's own (a residual block) is read through its ``forward``."""
    import torch.fx

    class _Tracer(torch.fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return not isinstance(m, nn.Sequential) and type(m).__module__.startswith("torch.")

    try:
        graph = _Tracer().trace(net)
    except Exception as err:  # noqa: BLE001 - any tracing failure means the same thing to the caller
        raise ValueError(f"net: expected a module torch.fx can trace, got module '' ({type(net).__name__}), which "
                         f"it cannot trace ({err}); write the PermutationSpec by hand (see "
                         f"bnpfed.matching.permutation)") from err
    return torch.fx.GraphModule(net, graph)


def derive_spec(net: nn.Module, input_shape: Sequence[int]) -> PermutationSpec:
    """The permutation spec of a feed-forward network, from its module tree and a forward pass.

    ``net`` is an ``nn.Sequential`` (nested ones allowed) -- or any module whose ``forward`` torch.fx can read, such
    as :class:`~bnpfed.models.LeNet` or a residual network -- of ``Linear``, ``Conv2d`` (groups=1),
    ``BatchNorm1d/2d``, elementwise activations (ReLU, Tanh, Sigmoid, GELU, LeakyReLU, ... and their functional
    forms), ``Dropout``, 2-d max / average / adaptive pooling, spatial means (``x.mean((2, 3))``), ``Flatten`` (or
    ``flatten`` / ``view`` / ``reshape`` to ``(N, features)``), and **residual additions** (``x + f(x)``, ``out +=
    shortcut(x)``, ``torch.add``). Every Linear and Conv2d but the last opens a group (its rows and bias, a batch
    norm after it, and the next Linear's or Conv2d's input columns: in blocks of H*W across a Flatten, H*W traced by
    a forward pass of zeros of shape ``(2, *input_shape)`` in eval mode); the last one is the output layer. An
    addition ties the permutations of the two tensors it joins into one group (Git Re-Basin's residual specs): an
    identity skip ties a block's last convolution to the channels it adds to, a projection skip (a 1x1 convolution,
    with its batch norm) ties the projection to the block's last convolution, and every batch norm on either branch
    joins its layer's group. A merged group is named after its first layer in forward order, and the groups are
    matched in that order.

    Anything else -- a concatenation, an addition to the network's input itself, an LSTM, a Conv1d, a module of
    your own -- raises a ``ValueError`` naming it (qualified name and type): write the spec by hand then
    (``bnpfed match --spec FILE`` reads one from a file: :meth:`PermutationSpec.from_dict`).

    A residual block (the stem's channels and the block's second convolution are one permutation)::

        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.stem, self.bn = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)
        ...         self.conv1, self.conv2 = nn.Conv2d(4, 5, 3, padding=1), nn.Conv2d(5, 4, 3, padding=1)
        ...         self.fc = nn.Linear(4, 2)
        ...     def forward(self, x):
        ...         x = torch.relu(self.bn(self.stem(x)))
        ...         x = torch.relu(x + self.conv2(torch.relu(self.conv1(x))))
        ...         return self.fc(x.mean((2, 3)))
        >>> print(derive_spec(Block(), (1, 6, 6)))  # doctest: +NORMALIZE_WHITESPACE
        PermutationSpec: 2 hidden permutations, matched in this order
          stem: stem.weight[0], stem.bias[0], bn.weight[0], bn.bias[0], bn.running_mean[0], bn.running_var[0],
            conv1.weight[1], conv2.weight[0], conv2.bias[0], fc.weight[1]
          conv1: conv1.weight[0], conv1.bias[0], conv2.weight[1]
          output layer (axis 0 = classes): fc.weight, fc.bias

    >>> from bnpfed.models import LeNet
    >>> print(derive_spec(LeNet(), (1, 28, 28)))
    PermutationSpec: 4 hidden permutations, matched in this order
      conv1: conv1.weight[0], conv1.bias[0], conv2.weight[1]
      conv2: conv2.weight[0], conv2.bias[0], fc1.weight[1] in blocks of 25
      fc1: fc1.weight[0], fc1.bias[0], fc2.weight[1]
      fc2: fc2.weight[0], fc2.bias[0], fc3.weight[1]
      output layer (axis 0 = classes): fc3.weight, fc3.bias
    >>> derive_spec(nn.Sequential(nn.Conv1d(1, 2, 3)), (1, 8))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: net: expected layers derive_spec understands (...), got module '0' (Conv1d); write the ...

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
        raise ValueError(f"net: expected a module that takes one input, got module '' ({type(net).__name__}), which "
                         f"takes {len(placeholders)}")
    for n in nodes:  # the modules first: an unknown one is named before anything runs
        if n.op == "call_module":
            _step_kind(n, net)
        elif n.op == "get_attr":
            raise ValueError(f"net: expected parameters read only inside layers, got {_describe(n, net)}, which "
                             f"reads one outside a layer; write the PermutationSpec by hand")
    # shapes, from a forward pass of the traced graph (the same submodules) in eval mode
    from torch.fx.passes.shape_prop import ShapeProp

    modes = {m: m.training for m in net.modules()}
    param = next(iter(net.parameters()), None)
    x = torch.zeros(2, *input_shape, dtype=param.dtype if param is not None else None)
    failed = None
    try:
        net.eval()
        with torch.no_grad():
            try:   # the module itself first: ShapeProp prints a traceback of its own before it raises
                net(x)
            except Exception as err:  # noqa: BLE001
                failed = err
            if failed is None:
                ShapeProp(gm).propagate(x)
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"input_shape: expected the shape of an input net runs on, got {input_shape}, on which a "
                         f"forward pass failed: {err}") from err
    finally:
        for m, mode in modes.items():
            m.train(mode)
    if failed is not None:
        first = str(failed).strip().splitlines()[0] if str(failed).strip() else ""
        raise ValueError(f"input_shape: expected the shape of an input net runs on, got {input_shape}, on which a "
                         f"forward pass failed ({type(failed).__name__}: {first})")

    def shape(n) -> tuple[int, ...] | None:
        meta = n.meta.get("tensor_meta")
        return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None

    # walk the graph in its (topological) order: every tensor carries the group permuting its channel axis, with
    # its block (entries per unit after a Flatten), or None (the input: no permutation acts on it). A step takes one
    # tensor; a residual addition takes two, whose groups must then be one permutation: they are merged (union-find,
    # as Git Re-Basin ties the permutations a skip connection joins).
    steps = [n for n in nodes if n.op not in ("placeholder", "output") and shape(n) is not None]
    perm: dict = {placeholders[0]: None}
    groups: list[tuple[str, list[Axis]]] = []
    root: list[int] = []   # union-find over groups: a merged group points at the earliest one it was merged with

    def find(c: int) -> int:
        while root[c] != c:
            root[c] = root[root[c]]
            c = root[c]
        return c

    kinds: dict[str, str] = {}
    producers: list[str] = []  # the Linear and Conv2d layers, in order
    produced: dict[str, int] = {}  # a producer's group
    for node in steps:
        kind = _step_kind(node, net)
        tensors = [a for a in node.all_input_nodes if shape(a) is not None]
        where = _describe(node, net)
        if kind == "add" and len(tensors) == 1:   # a tensor plus a number: elementwise
            kind = "pass"
        if kind == "add":
            if len(tensors) != 2:
                raise ValueError(f"net: expected an addition of two tensors, got {where} adding {len(tensors)}")
            first, second = (perm[t] for t in tensors)
            if first is None and second is None:
                perm[node] = None
                continue
            if first is None or second is None:
                raise ValueError(f"net: expected a residual addition of two permuted tensors, got {where} adding the "
                                 f"network's input (which no permutation acts on) to a layer's output (not "
                                 f"supported); write the PermutationSpec by hand")
            if first[1] != second[1] or shape(tensors[0]) != shape(tensors[1]):
                raise ValueError(f"net: expected a residual addition of two tensors of one shape, got {where} adding "
                                 f"shapes {shape(tensors[0])} and {shape(tensors[1])}")
            a, b = sorted((find(first[0]), find(second[0])))
            if a != b:   # one permutation from here on: b's axes join a's
                groups[a][1].extend(groups[b][1])
                groups[b] = (groups[b][0], [])
                root[b] = a
            perm[node] = (a, first[1])
            continue
        if len(tensors) != 1:
            raise ValueError(f"net: expected steps that take one tensor (or a residual addition of two), got {where}, "
                             f"which takes {[t.name for t in tensors]} (a concatenation or a branch?); write the "
                             f"PermutationSpec by hand")
        source = tensors[0]
        current = perm[source]
        if current is not None:
            current = (find(current[0]), current[1])
        s_in, s_out = shape(source), shape(node)
        if kind in ("linear", "conv"):
            name, m = node.target, net.get_submodule(node.target)
            want = 2 if kind == "linear" else 4
            if len(s_in) != want:
                raise ValueError(f"net: expected a tensor of {want} axes (batch first) into {where}, got one of "
                                 f"shape {s_in}")
            if name in producers:
                raise ValueError(f"net: expected every layer called once, got {where} called twice (shared "
                                 f"weights; not supported)")
            if current is not None:
                c, block = current
                if kind == "conv" and block != 1:
                    raise ValueError(f"net: expected a Conv2d on channels, got {where} on flattened channels (not "
                                     f"supported)")
                groups[c][1].append(Axis(f"{name}.weight", 1, block))
            kinds[f"{name}.weight"] = "weight"
            if m.bias is not None:
                kinds[f"{name}.bias"] = "bias"
            producers.append(name)
            groups.append((name, [Axis(f"{name}.weight", 0)] + ([Axis(f"{name}.bias", 0)] if m.bias is not None
                                                                   else [])))
            root.append(len(groups) - 1)
            produced[name] = len(groups) - 1
            current = (len(groups) - 1, 1)
        elif kind == "bn":
            name, m = node.target, net.get_submodule(node.target)
            if current is None:
                raise ValueError(f"net: expected a batch norm after a Linear or Conv2d, got {where} normalising the "
                                 f"network's input, which no permutation acts on (not supported)")
            if len(s_in) not in (2, 4) and not (len(s_in) == 3 and type(m) is nn.BatchNorm1d):
                raise ValueError(f"net: expected a tensor of 2 or 4 axes (3 for a BatchNorm1d) into {where}, got "
                                 f"one of shape {s_in}")
            c, block = current
            for suffix, bn_kind in (("weight", "bn_weight"), ("bias", "bn_bias"), ("running_mean", "running_mean"),
                                    ("running_var", "running_var")):
                if getattr(m, suffix, None) is not None:
                    groups[c][1].append(Axis(f"{name}.{suffix}", 0, block))
                    kinds[f"{name}.{suffix}"] = bn_kind
        elif kind == "pool":
            if len(s_in) != 4:
                raise ValueError(f"net: expected a tensor of shape (N, C, H, W) into {where}, got one of shape "
                                 f"{s_in}")
            if current is not None and current[1] != 1:
                raise ValueError(f"net: expected a pooling of channels, got {where} pooling flattened channels (not "
                                 f"supported)")
        elif kind == "mean":
            if not (len(s_in) == 4 and s_out == s_in[:2] and (current is None or current[1] == 1)):
                raise ValueError(f"net: expected means over the spatial axes, (N, C, H, W) to (N, C) (the only ones "
                                 f"understood), got {where} reducing {s_in} to {s_out}")
        elif kind == "reshape":
            if s_out == s_in:
                pass
            elif len(s_out) == 2 and s_out[0] == s_in[0] and s_out[1] == math.prod(s_in[1:]):
                if current is not None:
                    current = (current[0], current[1] * math.prod(s_in[2:]))
            else:
                raise ValueError(f"net: expected reshapes that flatten to (N, features) (the only ones understood), "
                                 f"got {where} reshaping {s_in} to {s_out}")
        perm[node] = current
    output = [n for n in nodes if n.op == "output"][0]
    returned = [a for a in output.all_input_nodes if shape(a) is not None]
    if not producers:
        raise ValueError(f"net: expected a Linear or Conv2d layer, got module '' ({type(net).__name__}) with none")
    # the last Linear / Conv2d is the output layer: its units are the classes, not permuted
    out_name = producers[-1]
    out_index = produced[out_name]
    if len(returned) != 1 or output.all_input_nodes != returned or perm[returned[0]] is None or \
            find(perm[returned[0]][0]) != out_index:
        raise ValueError(f"net: expected a module that returns its last layer's output, got module '' "
                         f"({type(net).__name__}), which returns something else")
    out_group = groups[out_index]
    foreign = [a.param for a in out_group[1] if a.param.split(".")[:-1] != out_name.split(".")]
    if any(kinds.get(p, "").startswith("bn_") or kinds.get(p) in ("running_mean", "running_var") for p in foreign):
        bn = next(p for p in foreign if kinds[p] not in ("weight", "bias"))
        raise ValueError(f"net: expected no batch norm after the output layer {out_name!r} (not supported), got "
                         f"{bn}")
    if foreign or find(out_index) != out_index:
        raise ValueError(f"net: expected no residual addition joining the output layer {out_name!r} (not "
                         f"supported), got one joining it to {foreign[0] if foreign else 'an earlier layer'}")
    groups = [g for c, g in enumerate(groups) if root[c] == c and c != out_index]
    for name, axes in groups:
        params = [a.param for a in axes]
        twice = next((p for p in params if params.count(p) > 1), None)
        if twice is not None:
            raise ValueError(f"net: expected residual additions that join different layers' channels, got one tying "
                             f"the input and the output channels of one layer ({twice!r}: x + W x, one permutation on "
                             f"both axes of a weight; not supported); write the PermutationSpec by hand")
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
    perms = {grp.name: torch.randperm(width(state, grp, "net"), generator=g) for grp in spec.groups}
    permuted = network_from_state(original, client_slice(spec, state, perms)).eval()
    x = torch.randn(3, *input_shape, generator=g, dtype=torch.float64)
    with torch.no_grad():
        a, b = original(x), permuted(x)
    scale = float(a.abs().max()) or 1.0
    err = float((a - b).abs().max()) / scale
    if not err <= rtol:
        raise ValueError(f"spec: expected symmetries of net (permuting net by the spec keeps its outputs within "
                         f"rtol={rtol}), got a change of its outputs by {err:.3g} (relative to their largest); the "
                         f"spec misses an axis the permutations act on, or names one they do not")
