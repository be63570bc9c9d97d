"""A fused global network as one file, and back: what ``bnpfed match`` writes and :func:`load_global` reads.

The file is a ``torch.save`` of a plain dict (:data:`FORMAT` ``"bnpfed-global/1"``)::

    {"format": "bnpfed-global/1", "method": "pfnm", "module": <the global nn.Module>,
     "state_dict": {...its tensors...}, "architecture": "bnpfed.models.networks.LeNet", "spec": "<the spec, as text>",
     "widths": {group: units}, "hyperparameters": {group: {name: value}}, "class_shares": [[...]] (J, C) or None,
     "class_shares_estimated": false, "notes": [...], "versions": {...}}

so that ``torch.load(path, weights_only=False)["module"]`` is the network with torch alone (its class must be
importable: bnpfed's networks, or the user's own), and ``state_dict`` with ``architecture`` rebuilds it without the
pickle. :func:`load_global` returns the network in eval mode; :func:`read_global` everything.

Usage::

    >>> import tempfile, torch
    >>> from bnpfed.models import mlp
    >>> net = mlp(4, [3], 2)
    >>> path = save_global(tempfile.mkdtemp() + "/global.pt", net, method="pfnm", widths={"1": 3})
    >>> again = load_global(path)
    >>> x = torch.randn(5, 4)
    >>> bool(torch.equal(again(x), net.eval()(x))), read_global(path).widths
    (True, {'1': 3})
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import Tensor, nn

from bnpfed.report import json_safe, versions

__all__ = ["FORMAT", "SavedGlobal", "load_global", "load_torch_file", "read_global", "save_global"]

#: The layout of a saved global network (the module docstring); a file of another layout is refused.
FORMAT = "bnpfed-global/1"


def _plain(value):
    """Tensors as (nested) lists, everything else as JSON-ready plain values."""
    if isinstance(value, Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return json_safe(value)


def save_global(path: str | Path, network: nn.Module, *, method: str, spec=None, widths: Mapping | None = None,
                hyperparameters: Mapping | None = None, class_shares=None, class_shares_estimated: bool = False,
                notes: Sequence[str] = ()) -> Path:
    """Write ``network`` (a copy on the CPU, in eval mode) and what describes it to ``path`` (its folder made if
    needed); return the path.

    :param str method: the method that built it (``"pfnm"``, ``"fedma"``, ...).
    :param spec: the :class:`~bnpfed.inference.PermutationSpec` it was matched by (stored as its text).
    :param dict widths: group name -> global units.
    :param dict hyperparameters: group name -> the matching's hyper-parameters (tensors become lists).
    :param class_shares: (J, C) the clients' class shares the matching used.
    :param bool class_shares_estimated: whether those shares were estimated (no class counts were given).
    :param notes: anything the result should say (e.g. what the matching had to give up).
    """
    if not isinstance(network, nn.Module):
        raise ValueError(f"network: expected a torch.nn.Module, got {type(network).__name__}")
    if not isinstance(method, str) or not method:
        raise ValueError(f"method: expected the name of the method that built the network, got {method!r}")
    module = copy.deepcopy(network).cpu().eval()
    record = {
        "format": FORMAT,
        "method": method,
        "module": module,
        "state_dict": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "architecture": f"{type(module).__module__}.{type(module).__qualname__}",
        "spec": None if spec is None else str(spec),
        "widths": {str(k): int(v) for k, v in (widths or {}).items()},
        "hyperparameters": _plain(dict(hyperparameters or {})),
        "class_shares": None if class_shares is None else _plain(torch.as_tensor(class_shares)),
        "class_shares_estimated": bool(class_shares_estimated),
        "notes": [str(n) for n in notes],
        "versions": versions(),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(record, path)
    return path


@dataclass(frozen=True)
class SavedGlobal:
    """What :func:`read_global` reads: the fields of the file (module docstring), ``network`` in eval mode."""

    network: nn.Module
    method: str
    architecture: str
    spec: str | None = None
    widths: dict = field(default_factory=dict)
    hyperparameters: dict = field(default_factory=dict)
    class_shares: list | None = None
    class_shares_estimated: bool = False
    notes: list = field(default_factory=list)
    versions: dict = field(default_factory=dict)


def load_torch_file(path: str | Path, *, name: str, what: str):
    """What ``torch.load(path, weights_only=False)`` reads (on the CPU), or a ``ValueError`` starting ``name:``
    when ``path`` is no file (``what``: the file expected) or no file ``torch.save`` wrote. It unpickles: only for
    files the user trusts."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{name}: expected {what}, got {str(path)!r}, which "
                         f"{'is a folder' if path.is_dir() else 'does not exist'}")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # a zip that is no torch file, a text file, a truncated download: one message
        raise ValueError(f"{name}: {str(path)!r} is not a file torch.save wrote ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''})") from None


def read_global(path: str | Path) -> SavedGlobal:
    """Read a file :func:`save_global` wrote, or raise a ``ValueError`` naming the path and what is wrong with it.

    The file holds a pickled module: read only files you trust (as with any ``torch.load(weights_only=False)``).
    """
    path = Path(path)
    record = load_torch_file(path, name="path", what="a global model file written by bnpfed (save_global, bnpfed "
                             "match)")
    if not isinstance(record, Mapping) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, Mapping) else type(record).__name__
        raise ValueError(f"path: expected a bnpfed global model (format {FORMAT!r}) in {str(path)!r}, got "
                         f"{found!r}" + (" (a whole network: load it with torch.load)" if isinstance(record, nn.Module)
                                         else ""))
    network = record["module"]
    network.load_state_dict(record["state_dict"])
    return SavedGlobal(network=network.eval(), method=record["method"], architecture=record["architecture"],
                       spec=record["spec"], widths=dict(record["widths"]),
                       hyperparameters=dict(record["hyperparameters"]), class_shares=record["class_shares"],
                       class_shares_estimated=bool(record["class_shares_estimated"]), notes=list(record["notes"]),
                       versions=dict(record["versions"]))


def load_global(path: str | Path) -> nn.Module:
    """The global network a file of :func:`save_global` holds, ready to use (eval mode, on the CPU)."""
    return read_global(path).network
