"""Packing bnpfed's payloads into Flower records and checking clients' replies at the boundary.

Layouts (one ``ArrayRecord`` per message, under the key ``"arrays"``):

* a PFNM network (any architecture: MLP, LeNet, simple CNN, with batch norm or without): its ``state_dict``, one
  array per entry under the entry's name (``"conv1.weight"`` ``(C_out, C_in, k, k)``, ``"bn1.running_mean"``,
  ``"fc1.bias"``, ..., ``"bn1.num_batches_tracked"`` a 0-d int64); the widths of the hidden permutations (conv
  channels, hidden units) may differ between clients and between rounds, every other axis is the architecture's.
  Both sides derive the permutation spec from the configured architecture and the dataset's input shape, and check a
  network against it (:func:`state_from_arrays`);
* batch-norm moments (the re-estimate of a global network's running statistics): ``"{bn}.count"`` (0-d),
  ``"{bn}.sum"`` and ``"{bn}.sum_sq"`` ``(C,)``, float64, per batch norm;
* a posterior network: ``"loc/{site}"`` and ``"variance/{site}"`` for every Bayesian site (mean-field Gaussian,
  variance > 0), and ``"param/{name}"`` for every deterministic parameter; in matched posterior fusion the same
  layout carries networks of any widths (a client's posterior, its slice of the global one, the global one:
  :func:`matched_posterior_to_record`), checked against the architecture's permutation spec as a PFNM network is
  (:func:`matched_posterior_from_arrays`).

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
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord

from bnpfed.data import Preprocessing
from bnpfed.federated import check_tensors
from bnpfed.matching import BatchNormMoments, PermutationSpec
from bnpfed.posterior import GaussianPosterior
from bnpfed.validation import check_names, check_tensor

__all__ = [
    "ARRAYS",
    "CAVITY",
    "CLIENT",
    "CONFIG",
    "ECE_BINS",
    "TEST_CLASS_COUNTS",
    "METHOD_KEY",
    "METRICS",
    "NodeIdentity",
    "ReplyError",
    "to_array_record",
    "tensors_from_arrays",
    "with_cavity",
    "split_cavity",
    "HEADS",
    "POOL_NLL",
    "PREDICTIVE_TEMPERATURE",
    "with_heads",
    "split_heads",
    "with_temperature",
    "split_temperature",
    "from_array_record",
    "state_to_record",
    "state_from_arrays",
    "moments_to_record",
    "moments_from_arrays",
    "posterior_to_record",
    "posterior_from_arrays",
    "matched_posterior_to_record",
    "matched_posterior_from_arrays",
    "array_shapes",
    "reply_parts",
    "read_count",
    "read_class_counts",
    "read_identity",
    "read_partition_id",
    "read_finite",
    "read_gaps",
]

#: Keys of the records in a message's ``RecordDict``.
ARRAYS, CONFIG, METRICS, CLIENT = "arrays", "config", "metrics", "client"
#: The key of a registered federated method's name in a message's config (its ``task`` is this key too).
METHOD_KEY = "federated-method"
#: The bins of the ECE an evaluation reports: Ozer et al.'s 100 (``ece``) and Guo et al.'s 15 (``ece15``); each
#: client sends its shard's per-bin gaps as ``ece-gaps-<bins>``.
ECE_BINS = (100, 15)
#: The metric of an evaluation reply that counts the test shard's labels per class (the server's chance level).
TEST_CLASS_COUNTS = "test-class-counts"

class ReplyError(ValueError):
    """A client's reply the server rejects; the message says which entry is wrong and how."""


def to_array_record(arrays: Mapping[str, Any]) -> ArrayRecord:
    """``{name: tensor or ndarray}`` as an ``ArrayRecord`` (each array keeps its dtype and shape)."""
    record = ArrayRecord()
    for name, value in arrays.items():
        value = value.detach().cpu().numpy() if torch.is_tensor(value) else np.asarray(value)
        record[name] = Array(np.ascontiguousarray(value).reshape(value.shape))  # 0-d stays 0-d
    return record


def from_array_record(record: ArrayRecord) -> dict[str, np.ndarray]:
    """``{name: ndarray}`` from an ``ArrayRecord``; an entry that does not decode raises :class:`ReplyError`."""
    out = {}
    for name, array in record.items():
        try:
            value = array.numpy()
        except Exception as error:  # a client may send any bytes: whatever fails to decode is its fault
            raise ReplyError(f"{name!r}: expected an array that decodes, got one that does not ({error})") from None
        if tuple(value.shape) != tuple(array.shape):
            raise ReplyError(f"{name!r}: expected the shape it declares, {tuple(array.shape)}, got "
                              f"{tuple(value.shape)}")
        out[name] = value
    return out


def tensors_from_arrays(arrays: Mapping[str, np.ndarray], like: Mapping[str, torch.Tensor] | None = None,
                        label: str = "arrays") -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of decoded arrays, each keeping its dtype (a federated method's state or update,
    :mod:`bnpfed.federated.protocol`); with ``like``, exactly its entries, shapes and dtypes, finite
    (:func:`~bnpfed.federated.check_tensors`).

    :raises ReplyError: naming the entry.
    """
    tensors = {name: torch.from_numpy(np.array(value, copy=True)) for name, value in arrays.items()}
    if like is not None:
        try:
            tensors = check_tensors(tensors, like, label)
        except ValueError as error:
            raise ReplyError(str(error)) from None
    return tensors


def array_shapes(record: ArrayRecord) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every entry of ``record``, as the arrays declare them."""
    return {name: tuple(array.shape) for name, array in record.items()}


# ------------------------------------------------------------------------------------------------ PFNM networks


def state_to_record(state: Mapping[str, Any]) -> ArrayRecord:
    """A network's ``state_dict`` (or its slice, or a global one) as an ``ArrayRecord``, entry by entry."""
    return to_array_record(state)


def state_from_arrays(arrays: Mapping[str, np.ndarray], spec: PermutationSpec, template: Mapping[str, torch.Tensor],
                      *, widths: Mapping[str, int] | None = None) -> dict[str, torch.Tensor]:
    """The ``state_dict`` of a network sent as :func:`state_to_record`, checked against the architecture: exactly the
    template's entries; along every axis a hidden permutation of ``spec`` acts on, the same number of units
    throughout (``widths[group]`` when given: a client answers with the widths it was sent), every other axis the
    template's; the spec's parameters finite floating point, the other entries (``num_batches_tracked``) of the
    template's dtype.

    >>> from bnpfed.matching.permutation import derive_spec
    >>> from bnpfed.models import mlp
    >>> net = mlp(4, [3], 2)
    >>> spec, state = derive_spec(net, (4,)), net.state_dict()
    >>> arrays = from_array_record(state_to_record(state))
    >>> sorted(state_from_arrays(arrays, spec, state, widths={"1": 3}))
    ['1.bias', '1.weight', '3.bias', '3.weight']
    >>> state_from_arrays({**arrays, "3.weight": arrays["3.weight"][:, :2]}, spec, state)
    Traceback (most recent call last):
    ...
    bnpfed.flower.records.ReplyError: '3.weight': expected shape (2, 3), got (2, 2)

    :param template: a ``state_dict`` of the architecture (its shapes and dtypes).
    :raises ReplyError: naming the entry.
    """
    try:
        check_names(arrays, {k: torch.Size(v.shape) for k, v in template.items()}, "network", "array")
    except ValueError as error:
        raise ReplyError(str(error)) from None
    tensors = {key: torch.from_numpy(np.asarray(arrays[key])) for key in template}
    sizes = dict(widths or {})
    for group in spec.groups:  # widths not given: read from the group's first axis
        if group.name not in sizes:
            a = group.axes[0]
            t = tensors[a.param]
            if t.dim() <= a.dim:
                raise ReplyError(f"{a.param!r}: expected {len(template[a.param].shape)} axes, got shape "
                                 f"{tuple(t.shape)}")
            sizes[group.name] = t.shape[a.dim] // a.block
    for group, n in sizes.items():
        if n < 1:
            raise ReplyError(f"{spec.group(group).axes[0].param!r}: expected at least one unit of {group!r}, got 0")
    for key, ref in template.items():
        shape = list(ref.shape)
        for c, a in spec.axes_of(key):
            shape[a.dim] = sizes[spec.groups[c].name] * a.block
        value = tensors[key]
        try:
            if key in spec.kinds:
                check_tensor(value, torch.Size(shape), repr(key))
            elif value.dtype != ref.dtype or tuple(value.shape) != tuple(shape):
                raise ValueError(f"{key!r}: expected dtype {ref.dtype} and shape {tuple(shape)}, got {value.dtype} "
                                 f"and {tuple(value.shape)}")
        except ValueError as error:
            raise ReplyError(str(error)) from None
    return tensors


def moments_to_record(moments: Mapping[str, BatchNormMoments]) -> ArrayRecord:
    """A client's batch-norm moments (:func:`~bnpfed.federated.clients.batch_norm_moments_step`) as an
    ``ArrayRecord``: ``"{bn}.count"``, ``"{bn}.sum"``, ``"{bn}.sum_sq"``, float64."""
    arrays = {}
    for name, m in moments.items():
        arrays[f"{name}.count"] = np.asarray(m.count, dtype=np.float64)
        arrays[f"{name}.sum"], arrays[f"{name}.sum_sq"] = m.sum.to(torch.float64), m.sum_sq.to(torch.float64)
    return to_array_record(arrays)


def moments_from_arrays(arrays: Mapping[str, np.ndarray], channels: Mapping[str, int]
                        ) -> dict[str, BatchNormMoments]:
    """The moments sent as :func:`moments_to_record`, checked: exactly the batch norms of ``channels`` (name ->
    number of features of the global network's), float64, finite, a positive count, sums of squares >= 0.

    :raises ReplyError: naming the entry.
    """
    expected = {}
    for name, n in channels.items():
        expected.update({f"{name}.count": torch.Size(()), f"{name}.sum": torch.Size((n,)),
                         f"{name}.sum_sq": torch.Size((n,))})
    try:
        check_names(arrays, expected, "moments", "array")
        tensors = {}
        for key, shape in expected.items():
            tensors[key] = torch.from_numpy(np.asarray(arrays[key]))
            check_tensor(tensors[key], shape, repr(key))
            if tensors[key].dtype != torch.float64:
                raise ValueError(f"{key!r}: expected float64, got {tensors[key].dtype}")
    except ValueError as error:
        raise ReplyError(str(error)) from None
    out = {}
    for name in channels:
        count, sum_sq = float(tensors[f"{name}.count"]), tensors[f"{name}.sum_sq"]
        if count <= 0 or bool((sum_sq < 0).any()):
            raise ReplyError(f"'{name}.count' / '{name}.sum_sq': expected a positive count and sums of squares >= 0, "
                             f"got count {count!r} and smallest sum of squares "
                             f"{sum_sq.min().item() if sum_sq.numel() else None!r}")
        out[name] = BatchNormMoments(count, tensors[f"{name}.sum"], sum_sq)
    return out


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


def matched_posterior_to_record(locs: Mapping[str, Any], variances: Mapping[str, Any]) -> ArrayRecord:
    """A Bayesian network of any widths as ``(locs, variances)`` (every ``state_dict`` entry's posterior mean or
    value; the Bayesian sites' posterior variances: :func:`~bnpfed.matching.posteriors.client_posterior`,
    :meth:`~bnpfed.matching.posteriors.PosteriorMatch.client_slice`) in the posterior layout: the sites of
    ``variances`` as ``"loc/"`` and ``"variance/"``, the other entries of ``locs`` as ``"param/"``; dtypes kept."""
    return posterior_to_record({k: GaussianPosterior(locs[k], v) for k, v in variances.items()},
                               {k: v for k, v in locs.items() if k not in variances})


#: Prefix of a PVI cavity's arrays sent beside a matched slice (``"cavity-loc/<site>"``, ``"cavity-variance/<site>"``).
CAVITY = "cavity-"


def with_cavity(record: ArrayRecord, cavity: tuple[Mapping[str, Any], Mapping[str, Any]]) -> ArrayRecord:
    """``record`` (a slice, :func:`matched_posterior_to_record`) with PVI's cavity ``(means, variances)`` of its
    Bayesian sites added as ``"cavity-loc/<site>"`` and ``"cavity-variance/<site>"``."""
    means, variances = cavity
    extra = to_array_record({**{f"{CAVITY}loc/{k}": v for k, v in means.items()},
                             **{f"{CAVITY}variance/{k}": v for k, v in variances.items()}})
    for name, array in extra.items():
        record[name] = array
    return record


def split_cavity(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], tuple[dict, dict] | None]:
    """``(the other arrays, cavity)`` of what :func:`with_cavity` sent: the cavity as ``(means, variances)`` tensors,
    None when there is none."""
    rest = {k: v for k, v in arrays.items() if not k.startswith(CAVITY)}
    found = {k[len(CAVITY):]: v for k, v in arrays.items() if k.startswith(CAVITY)}
    if not found:
        return rest, None
    means = {k[len("loc/"):]: torch.from_numpy(np.asarray(v)) for k, v in found.items() if k.startswith("loc/")}
    variances = {k[len("variance/"):]: torch.from_numpy(np.asarray(v)) for k, v in found.items()
                 if k.startswith("variance/")}
    if sorted(means) != sorted(variances) or len(means) + len(variances) != len(found):
        raise ReplyError(f"cavity: expected 'cavity-loc/' and 'cavity-variance/' arrays of the same sites, got "
                         f"{sorted(found)}")
    return rest, (means, variances)


#: Prefix of pooled heads' arrays sent beside a global network or posterior: ``"heads/weight"`` (J, C, L),
#: ``"heads/bias"``, ``"heads/pool-weights"`` (J, C), ``"heads/temperature"`` (0-d, the pool's), and for a posterior
#: ``"heads/weight-variance"``, ``"heads/bias-variance"``.
HEADS = "heads/"
_HEAD_ARRAYS = ("weight", "bias", "pool-weights", "temperature")
_HEAD_VARIANCES = ("weight-variance", "bias-variance")
#: A client's reply to the pool-temperature query: its summed NLL at every temperature (``"pool-nll"``, (K,)).
POOL_NLL = "pool-nll"
#: The temperature of a matched global posterior's predictive, sent beside it for evaluation (0-d;
#: ``FusionConfig.temperature``).
PREDICTIVE_TEMPERATURE = "predictive-temperature"


def with_temperature(record: ArrayRecord, temperature: float) -> ArrayRecord:
    """``record`` (a matched global posterior) with its predictive's temperature added as
    :data:`PREDICTIVE_TEMPERATURE`."""
    record[PREDICTIVE_TEMPERATURE] = to_array_record(
        {PREDICTIVE_TEMPERATURE: torch.tensor(float(temperature), dtype=torch.float64)})[PREDICTIVE_TEMPERATURE]
    return record


def split_temperature(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float | None]:
    """``(the other arrays, temperature)`` of what :func:`with_temperature` sent, None when there is none; a
    temperature that is no finite number > 0 is a :class:`ReplyError`."""
    rest = {k: v for k, v in arrays.items() if k != PREDICTIVE_TEMPERATURE}
    if PREDICTIVE_TEMPERATURE not in arrays:
        return rest, None
    value = np.asarray(arrays[PREDICTIVE_TEMPERATURE], dtype=np.float64)
    if value.shape != () or not np.isfinite(value) or value <= 0:
        raise ReplyError(f"{PREDICTIVE_TEMPERATURE}: expected one finite number > 0, got {value!r}")
    return rest, float(value)


def with_heads(record: ArrayRecord, heads: Mapping[str, Any]) -> ArrayRecord:
    """``record`` (a global network or matched posterior) with pooled heads added as ``"heads/<name>"``: ``heads``
    as :func:`~bnpfed.matching.pooled_heads_of` (with the pool's ``temperature`` added) or
    :meth:`~bnpfed.matching.PooledPosterior.heads` give them (``weight``, ``bias``, ``pool_weights``,
    ``temperature``; a posterior's ``weight_variance``, ``bias_variance`` too)."""
    names = {k.replace("-", "_") for k in _HEAD_ARRAYS}
    if not names <= set(heads) or not set(heads) <= names | {k.replace("-", "_") for k in _HEAD_VARIANCES}:
        raise ValueError(f"heads: expected {sorted(names)} and optionally their variances, got {sorted(heads)}")
    for name, array in to_array_record({HEADS + k.replace("_", "-"): v for k, v in heads.items()}).items():
        record[name] = array
    return record


def split_heads(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, torch.Tensor] | None]:
    """``(the other arrays, heads)`` of what :func:`with_heads` sent: ``heads`` as float64 tensors keyed as
    :func:`with_heads` takes them, None when there are none."""
    rest = {k: v for k, v in arrays.items() if not k.startswith(HEADS)}
    found = {k[len(HEADS):]: v for k, v in arrays.items() if k.startswith(HEADS)}
    if not found:
        return rest, None
    if sorted(found) not in (sorted(_HEAD_ARRAYS), sorted(_HEAD_ARRAYS + _HEAD_VARIANCES)):
        raise ReplyError(f"heads: expected the arrays {[HEADS + k for k in _HEAD_ARRAYS]} (and for a posterior "
                         f"{[HEADS + k for k in _HEAD_VARIANCES]}), got {sorted(HEADS + k for k in found)}")
    return rest, {k.replace("-", "_"): torch.from_numpy(np.asarray(v, dtype=np.float64)) for k, v in found.items()}


def _renamed(message: str, names: Mapping[str, str]) -> str:
    """``message`` of :func:`state_from_arrays` (which starts with ``repr(key)``) with the key's record name."""
    for key, name in names.items():
        if message.startswith(repr(key)):
            return repr(name) + message[len(repr(key)):]
    return message


def matched_posterior_from_arrays(arrays: Mapping[str, np.ndarray], spec: PermutationSpec,
                                  template: Mapping[str, torch.Tensor], sites=None, *,
                                  widths: Mapping[str, int] | None = None
                                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(locs, variances)`` of a network sent as :func:`matched_posterior_to_record`, checked: exactly
    ``"loc/"`` and ``"variance/"`` for each of ``sites`` and ``"param/"`` for the template's other entries; the
    means' shapes as :func:`state_from_arrays` checks a network's (any widths of the hidden permutations, the same
    throughout; ``widths[group]`` when given), finite floating point; each variance of its mean's shape, finite,
    > 0. ``locs`` come in the template's order, ``variances`` in the order of ``sites``.

    >>> from bnpfed.matching.permutation import derive_spec
    >>> from bnpfed.models import mlp
    >>> net = mlp(4, [3], 2)
    >>> spec, state = derive_spec(net, (4,)), net.state_dict()
    >>> narrow = {k: v[:2] if k.startswith("1.") else v[:, :2] if k == "3.weight" else v for k, v in state.items()}
    >>> record = matched_posterior_to_record(narrow, {"3.weight": torch.ones(2, 2)})
    >>> locs, variances = matched_posterior_from_arrays(from_array_record(record), spec, state, ["3.weight"])
    >>> tuple(locs["1.weight"].shape), sorted(variances)
    ((2, 4), ['3.weight'])
    >>> matched_posterior_from_arrays(from_array_record(record), spec, state, ["3.weight"], widths={"1": 3})
    Traceback (most recent call last):
    ...
    bnpfed.flower.records.ReplyError: 'param/1.weight': expected shape (3, 4), got (2, 4)

    :param template: a ``state_dict`` of the architecture (its keys, shapes and dtypes).
    :param sites: the Bayesian sites (the keys the variances must have); None: those ``arrays`` carries a
        ``"variance/"`` for (a client reading what its server sent).
    :raises ReplyError: naming the entry.
    """
    if sites is None:
        sites = [k for k in template if f"variance/{k}" in arrays]
    sites = list(sites)
    names = {k: (f"loc/{k}" if k in sites else f"param/{k}") for k in template}
    try:
        check_names(arrays, dict.fromkeys([*names.values(), *(f"variance/{s}" for s in sites)]), "posterior", "array")
    except ValueError as error:
        raise ReplyError(str(error)) from None
    try:
        locs = state_from_arrays({k: arrays[name] for k, name in names.items()}, spec, template, widths=widths)
    except ReplyError as error:
        raise ReplyError(_renamed(str(error), names)) from None
    variances = {}
    for site in sites:
        key = f"variance/{site}"
        value = torch.from_numpy(np.asarray(arrays[key]))
        try:
            check_tensor(value, locs[site].shape, repr(key))
        except ValueError as error:
            raise ReplyError(str(error)) from None
        if not bool((value > 0).all()):
            raise ReplyError(f"{key!r}: expected all entries > 0, got minimum {value.min().item()!r}")
        variances[site] = value
    return locs, variances


# ------------------------------------------------------------------------------------------------ metadata


def reply_parts(reply: Message) -> tuple[dict[str, np.ndarray], MetricRecord, ConfigRecord]:
    """The arrays, metrics and client identity of a training reply; :class:`ReplyError` if one is missing."""
    content = reply.content
    for key, kind in ((ARRAYS, content.array_records), (METRICS, content.metric_records),
                      (CLIENT, content.config_records)):
        if key not in kind:
            raise ReplyError(f"reply: expected its {key!r} record, got none")
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


ACTIVITY_PREFIX = "activity:"


def activity_metrics(activity: Mapping[str, Any]) -> dict[str, list[float]]:
    """A client's report on its units (:func:`~bnpfed.federated.clients.unit_activity_step`) as metric values:
    ``"activity:<group>"`` -> the group's activities."""
    return {ACTIVITY_PREFIX + g: [float(v) for v in np.asarray(a, dtype=np.float64)] for g, a in activity.items()}


def read_activity(record: Mapping[str, Any], groups: Sequence[str]) -> dict[str, torch.Tensor]:
    """The report of :func:`activity_metrics` back, one float64 tensor per group of ``groups``; :class:`ReplyError`
    when a group is missing or an activity is not a finite number >= 0."""
    out = {}
    for g in groups:
        value = record.get(ACTIVITY_PREFIX + g)
        items = value if isinstance(value, list) else None
        if not items or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
                            for v in items):
            raise ReplyError(f"{ACTIVITY_PREFIX + g!r}: expected a list of the units' activities (finite, >= 0), got "
                             f"{value!r}")
        out[g] = torch.tensor(items, dtype=torch.float64)
    return out


def read_partition_id(record: Mapping[str, Any]) -> int:
    """The client's ``partition-id`` (its index j in an in-process run); :class:`ReplyError` if not an int >= 0."""
    value = record.get("partition-id")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ReplyError(f"'partition-id': expected an int >= 0, got {value!r}")
    return value


@dataclass(frozen=True)
class NodeIdentity:
    """What a SuperNode answers to the server's query: its partition, the shape of the data it holds and how its
    inputs are prepared (``mean`` / ``std``: the standardisation constants, empty when not standardised; ``classes``
    their names, empty where the data names none; None: a client of bnpfed 0.2 that does not say)."""

    partition_id: int
    num_partitions: int
    input_shape: tuple[int, ...]
    num_classes: int
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    classes: tuple[str, ...] | None = None

    def record(self) -> ConfigRecord:
        said = {} if self.mean is None else {"input-mean": list(self.mean), "input-std": list(self.std),
                                            "class-names": list(self.classes or ())}
        return ConfigRecord({"partition-id": self.partition_id, "num-partitions": self.num_partitions,
                             "input-shape": list(self.input_shape), "num-classes": self.num_classes, **said})

    def preprocessing(self, dataset: str) -> Preprocessing | None:
        """The :class:`~bnpfed.data.Preprocessing` of the node's inputs (``dataset``: the run's), or None when the
        node did not say."""
        if self.mean is None:
            return None
        return Preprocessing(dataset=dataset, input_shape=self.input_shape, num_classes=self.num_classes,
                             mean=self.mean or None, std=self.std or None, classes=self.classes or None)


def read_identity(reply: Message) -> NodeIdentity:
    """The :class:`NodeIdentity` a reply to a query carries; :class:`ReplyError` if it does not."""
    if CLIENT not in reply.content.config_records:
        raise ReplyError(f"reply: expected its {CLIENT!r} record, got none")
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
    if "input-mean" not in record:   # a client of bnpfed 0.2
        return NodeIdentity(j, num, tuple(shape), classes)
    mean, std, names = record.get("input-mean"), record.get("input-std"), record.get("class-names")
    if not (isinstance(mean, list) and isinstance(std, list) and len(mean) == len(std)
            and all(isinstance(v, float) and math.isfinite(v) for v in mean)
            and all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in std)):
        raise ReplyError(f"'input-mean', 'input-std': expected two lists of as many finite floats (std > 0), got "
                         f"{mean!r}, {std!r}")
    if not (isinstance(names, list) and len(names) in (0, classes) and all(isinstance(n, str) for n in names)):
        raise ReplyError(f"'class-names': expected {classes} names or none, got {names!r}")
    return NodeIdentity(j, num, tuple(shape), classes, tuple(mean), tuple(std), tuple(names))


def read_gaps(record: Mapping[str, Any], bins: int) -> np.ndarray:
    """A client's per-bin calibration gaps ``ece-gaps-<bins>`` (:func:`~bnpfed.metrics.calibration_gaps` of its
    shard): ``bins`` finite numbers; :class:`ReplyError` otherwise."""
    key = f"ece-gaps-{bins}"
    if key not in record:
        raise ReplyError(f"{key!r}: expected the shard's {bins} calibration gaps, got no such metric")
    value = record[key]
    gaps = np.asarray(value if isinstance(value, (list, tuple)) else [value], dtype=float)
    if gaps.shape != (bins,) or not np.isfinite(gaps).all():
        raise ReplyError(f"{key!r}: expected {bins} finite numbers, got {gaps.size} value(s)"
                         + ("" if gaps.shape != (bins,) else " with a NaN or infinity"))
    return gaps
