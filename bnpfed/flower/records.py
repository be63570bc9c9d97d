"""Packing bnpfed's payloads into Flower records and checking clients' replies at the boundary.

Layouts (one ``ArrayRecord`` per message, under the key ``"arrays"``):

* a PFNM network, layer c = 0, 1, ... (hidden layers, then the output layer): ``"{c}.weight"`` ``(out, in)`` and
  ``"{c}.bias"`` ``(out,)``, torch's layout; widths may differ between clients and between rounds;
* a posterior network: ``"loc/{site}"`` and ``"variance/{site}"`` for every Bayesian site (mean-field Gaussian,
  variance > 0), and ``"param/{name}"`` for every deterministic parameter.

Per-client numbers travel in a ``MetricRecord`` under ``"metrics"`` (``num-examples``, ``train-loss``,
``class-counts`` for PFNM) and the client's identity in a ``ConfigRecord`` under ``"client"``
(``partition-id``, and in a reply to the server's query ``num-partitions``, ``input-shape``, ``num-classes``). A
reply that does not follow its layout, has the wrong shapes, non-finite values or a variance <= 0 raises
:class:`ReplyError` naming the entry; the strategies log it and drop that client's reply.

Usage::

    >>> import torch
    >>> from bnpfed.posterior import GaussianPosterior
    >>> record = posterior_to_record({"1.weight": GaussianPosterior(torch.zeros(2, 3), torch.ones(2, 3))},
    ...                              {"1.bias": torch.zeros(2)})
    >>> sorted(record)
    ['loc/1.weight', 'param/1.bias', 'variance/1.weight']
    >>> posterior, params = posterior_from_arrays(from_array_record(record), array_shapes(record))
    >>> posterior["1.weight"].variance.shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord

from bnpfed.posterior import GaussianPosterior
from bnpfed.validation import check_names, check_tensor

__all__ = [
    "ARRAYS",
    "CLIENT",
    "CONFIG",
    "METRICS",
    "NodeIdentity",
    "ReplyError",
    "to_array_record",
    "from_array_record",
    "network_to_record",
    "network_from_arrays",
    "posterior_to_record",
    "posterior_from_arrays",
    "array_shapes",
    "reply_parts",
    "read_count",
    "read_class_counts",
    "read_identity",
    "read_partition_id",
    "read_finite",
]

#: Keys of the records in a message's ``RecordDict``.
ARRAYS, CONFIG, METRICS, CLIENT = "arrays", "config", "metrics", "client"

_LAYER_KEY = re.compile(r"^(\d+)\.(weight|bias)$")


class ReplyError(ValueError):
    """A client's reply the server rejects; the message says which entry is wrong and how."""


def to_array_record(arrays: Mapping[str, Any]) -> ArrayRecord:
    """``{name: tensor or ndarray}`` as an ``ArrayRecord`` (each array keeps its dtype and shape)."""
    record = ArrayRecord()
    for name, value in arrays.items():
        value = value.detach().cpu().numpy() if torch.is_tensor(value) else np.asarray(value)
        record[name] = Array(np.ascontiguousarray(value))
    return record


def from_array_record(record: ArrayRecord) -> dict[str, np.ndarray]:
    """``{name: ndarray}`` from an ``ArrayRecord``; an entry that does not decode raises :class:`ReplyError`."""
    out = {}
    for name, array in record.items():
        try:
            value = array.numpy()
        except Exception as error:  # a client may send any bytes: whatever fails to decode is its fault
            raise ReplyError(f"array {name!r} does not decode: {error}") from None
        if tuple(value.shape) != tuple(array.shape):
            raise ReplyError(f"array {name!r} declares shape {tuple(array.shape)} but holds {tuple(value.shape)}")
        out[name] = value
    return out


def array_shapes(record: ArrayRecord) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every entry of ``record``, as the arrays declare them."""
    return {name: tuple(array.shape) for name, array in record.items()}


# ------------------------------------------------------------------------------------------------ PFNM networks


def network_to_record(layers: Sequence[tuple[Any, Any]]) -> ArrayRecord:
    """An MLP's ``[(weight (out, in), bias (out,)), ...]`` (hidden layers, then output) as an ``ArrayRecord``."""
    arrays = {}
    for c, (w, b) in enumerate(layers):
        arrays[f"{c}.weight"], arrays[f"{c}.bias"] = w, b
    return to_array_record(arrays)


def network_from_arrays(arrays: Mapping[str, np.ndarray], *, in_features: int | None = None,
                        num_classes: int | None = None, widths: Sequence[int] | None = None
                        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``[(weight, bias), ...]`` layers of an MLP sent as :func:`network_to_record`, checked.

    :param in_features: expected input size (columns of layer 0), if known.
    :param num_classes: expected output size (rows of the last layer), if known.
    :param widths: expected hidden widths, if known (a client retrains the slice it was sent, so it must answer with
        the same widths).
    :raises ReplyError: on missing or extra keys, fewer than two layers, shapes that do not chain, the wrong
        input / output / hidden sizes, non-floating or non-finite values.
    """
    depth = 0
    for key in arrays:
        m = _LAYER_KEY.match(key)
        if not m:
            raise ReplyError(f"unexpected array {key!r}; a network has only '<layer>.weight' and '<layer>.bias'")
        depth = max(depth, int(m.group(1)) + 1)
    if depth < 2:
        raise ReplyError(f"a network needs at least one hidden layer and the output layer, got {depth} layer(s)")
    expected = {f"{c}.{kind}": None for c in range(depth) for kind in ("weight", "bias")}
    try:
        check_names(arrays, expected, "network", "array")
    except ValueError as error:
        raise ReplyError(str(error)) from None
    if widths is not None and len(widths) != depth - 1:
        raise ReplyError(f"network has {depth - 1} hidden layer(s), expected {len(widths)}")
    for c in range(depth):
        if np.ndim(arrays[f"{c}.weight"]) != 2:
            raise ReplyError(f"'{c}.weight': expected an (out, in) matrix, got shape "
                             f"{tuple(np.shape(arrays[f'{c}.weight']))}")
    layers = []
    fan_in = in_features if in_features is not None else np.shape(arrays["0.weight"])[1]
    for c in range(depth):
        w, b = torch.from_numpy(np.asarray(arrays[f"{c}.weight"])), torch.from_numpy(np.asarray(arrays[f"{c}.bias"]))
        last = c == depth - 1
        if last and num_classes is not None:
            fan_out = num_classes
        elif not last and widths is not None:
            fan_out = int(widths[c])
        else:
            fan_out = w.shape[0]
        if fan_out < 1:
            raise ReplyError(f"'{c}.weight': expected a non-empty (out, in) matrix, got shape {tuple(w.shape)}")
        try:
            check_tensor(w, torch.Size((fan_out, fan_in)), f"'{c}.weight'")
            check_tensor(b, torch.Size((fan_out,)), f"'{c}.bias'")
        except ValueError as error:
            raise ReplyError(str(error)) from None
        layers.append((w, b))
        fan_in = fan_out
    return layers


# ------------------------------------------------------------------------------------------------ posteriors


def posterior_to_record(posterior: Mapping[str, GaussianPosterior], deterministic: Mapping[str, Any]) -> ArrayRecord:
    """A Bayesian network as an ``ArrayRecord``: ``{site: GaussianPosterior}`` and ``{name: parameter}``."""
    arrays = {}
    for site, (loc, variance) in posterior.items():
        arrays[f"loc/{site}"], arrays[f"variance/{site}"] = loc, variance
    for name, value in deterministic.items():
        arrays[f"param/{name}"] = value
    return to_array_record(arrays)


def posterior_from_arrays(arrays: Mapping[str, np.ndarray], expected: Mapping[str, tuple[int, ...]]
                          ) -> tuple[dict[str, GaussianPosterior], dict[str, torch.Tensor]]:
    """``({site: GaussianPosterior}, {name: parameter})`` of a network sent as :func:`posterior_to_record`, checked
    against ``expected`` (``{key: shape}`` of the global model, e.g. :func:`array_shapes` of what was sent).

    :raises ReplyError: on missing or extra keys, other shapes, non-floating or non-finite values, or a variance
        <= 0 (naming the site and the smallest value).
    """
    try:
        check_names(arrays, {k: torch.Size(s) for k, s in expected.items()}, "posterior", "array")
        tensors = {}
        for key, shape in expected.items():
            tensors[key] = torch.from_numpy(np.asarray(arrays[key]))
            check_tensor(tensors[key], torch.Size(shape), repr(key))
    except ValueError as error:
        raise ReplyError(str(error)) from None
    posterior, deterministic = {}, {}
    for key, value in tensors.items():
        kind, _, name = key.partition("/")
        if kind == "loc":
            variance = tensors[f"variance/{name}"]
            if not (variance > 0).all():
                raise ReplyError(f"'variance/{name}': expected all entries > 0, got minimum "
                                 f"{variance.min().item()!r}")
            posterior[name] = GaussianPosterior(value, variance)
        elif kind == "param":
            deterministic[name] = value
    return posterior, deterministic


# ------------------------------------------------------------------------------------------------ metadata


def reply_parts(reply: Message) -> tuple[dict[str, np.ndarray], MetricRecord, ConfigRecord]:
    """The arrays, metrics and client identity of a training reply; :class:`ReplyError` if one is missing."""
    content = reply.content
    for key, kind in ((ARRAYS, content.array_records), (METRICS, content.metric_records),
                      (CLIENT, content.config_records)):
        if key not in kind:
            raise ReplyError(f"reply lacks its {key!r} record")
    return (from_array_record(content.array_records[ARRAYS]), content.metric_records[METRICS],
            content.config_records[CLIENT])


def read_finite(record: Mapping[str, Any], key: str) -> float:
    """``record[key]`` as a finite float; :class:`ReplyError` if missing or not finite."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ReplyError(f"{key!r}: expected a finite number, got {value!r}")
    return float(value)


def read_count(record: Mapping[str, Any], key: str = "num-examples") -> int:
    """``record[key]`` as a positive int (an example count); :class:`ReplyError` otherwise."""
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1 \
            or value != int(value):
        raise ReplyError(f"{key!r}: expected a positive integer count, got {value!r}")
    return int(value)


def read_class_counts(record: Mapping[str, Any], num_classes: int | None, key: str = "class-counts") -> np.ndarray:
    """``record[key]``, a client's number of training examples per class, as an int64 ``(C,)`` array (the dtype of
    :func:`bnpfed.federated.partition.class_counts`): ints >= 0 with a positive total, ``num_classes`` long when
    given; :class:`ReplyError` otherwise."""
    value = record.get(key)
    items = value if isinstance(value, list) else []
    if not items or (num_classes is not None and len(items) != num_classes):
        raise ReplyError(f"{key!r}: expected a list of {num_classes or 'C'} class counts, got {value!r}")
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in items) or sum(items) <= 0:
        raise ReplyError(f"{key!r}: expected ints >= 0, not all 0, got {value!r}")
    return np.asarray(items, dtype=np.int64)


def read_partition_id(record: Mapping[str, Any]) -> int:
    """The client's ``partition-id`` (its index j in an in-process run); :class:`ReplyError` if not an int >= 0."""
    value = record.get("partition-id")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ReplyError(f"'partition-id': expected an int >= 0, got {value!r}")
    return value


@dataclass(frozen=True)
class NodeIdentity:
    """What a SuperNode answers to the server's query: its partition, and the shape of the data it holds."""

    partition_id: int
    num_partitions: int
    input_shape: tuple[int, ...]
    num_classes: int

    def record(self) -> ConfigRecord:
        return ConfigRecord({"partition-id": self.partition_id, "num-partitions": self.num_partitions,
                             "input-shape": list(self.input_shape), "num-classes": self.num_classes})


def read_identity(reply: Message) -> NodeIdentity:
    """The :class:`NodeIdentity` a reply to a query carries; :class:`ReplyError` if it does not."""
    if CLIENT not in reply.content.config_records:
        raise ReplyError(f"reply lacks its {CLIENT!r} record")
    record = reply.content.config_records[CLIENT]
    j = read_partition_id(record)
    num, classes, shape = record.get("num-partitions"), record.get("num-classes"), record.get("input-shape")
    for key, value in (("num-partitions", num), ("num-classes", classes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ReplyError(f"{key!r}: expected an int >= 1, got {value!r}")
    if j >= num:
        raise ReplyError(f"'partition-id': expected an int in [0, num-partitions={num}), got {j}")
    if not isinstance(shape, list) or not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1
                                                         for s in shape):
        raise ReplyError(f"'input-shape': expected a list of ints >= 1, got {shape!r}")
    return NodeIdentity(j, num, tuple(shape), classes)
