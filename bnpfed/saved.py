"""A fused global network as one file, and back: what ``bnpfed match`` writes and :func:`load_global` reads.

The file is a ``torch.save`` of a plain dict (:data:`FORMAT` ``"bnpfed-global/1"``)::

    {"format": "bnpfed-global/1", "method": "pfnm", "module": <the global nn.Module>,
     "state_dict": {...its tensors...}, "architecture": "bnpfed.models.networks.LeNet", "spec": "<the spec, as text>",
     "widths": {group: units}, "hyperparameters": {group: {name: value}}, "class_shares": [[...]] (J, C) or None,
     "class_shares_estimated": false, "notes": [...], "versions": {...},
     "inputs": {"dataset": "mnist", "input_shape": [1, 28, 28], "num_classes": 10, "mean": null, "std": null,
                "classes": [...]} or None}

so that ``torch.load(path, weights_only=False)["module"]`` is the network with torch alone (its class must be
importable: bnpfed's networks, or the user's own), and ``state_dict`` with ``architecture`` rebuilds it without the
pickle. :func:`load_global` returns the network in eval mode; :func:`read_global` everything.

``inputs`` is how the model's inputs were prepared (a :class:`~bnpfed.data.Preprocessing`: the dataset, the
standardisation constants or none, the input shape, the classes), or None where the saver did not know it (a file of
bnpfed 0.2 or before, ``bnpfed match`` on networks saved without it). ``bnpfed evaluate`` prepares its inputs by it;
``read_global(path).inputs.load(data_dir=...)`` gives a dataset prepared the same way, and ``load_global(path,
dataset=ds)`` refuses a ``ds`` prepared otherwise.

A Bayesian global network (a :class:`~bnpfed.clients.BayesianClient`: ``bnpfed fuse --save-global``, ``bnpfed match
--posteriors``) adds ``"kind": "bayesian"`` and what rebuilds the client::

    {..., "kind": "bayesian", "module": <its posterior-mean network>,
     "posterior": {site: {"loc": tensor, "variance": tensor}}, "prior": <the Prior object>,
     "likelihood": <the Likelihood object>, "local_reparameterization": false,
     "predictive": {"samples": 10, "seed": ...}   # optional: the draws its method scored it with}

``module`` is then the posterior-mean network (plain torch, usable without bnpfed), and :func:`load_global` returns
the :class:`~bnpfed.clients.BayesianClient` (default mean-field guide at the saved posterior, the saved prior), whose
``predict_proba(x, num_samples, seed)`` gives the same predictive as the client that was saved. A matched posterior
with the clients' own posterior output layers pooled (a :class:`~bnpfed.matching.PooledPosterior`: ``FusionConfig(
heads="pooled")``, ``bnpfed fuse --heads pooled --save-global``, ``bnpfed match --posteriors --heads pooled``) has
``"kind": "pooled-posterior"``, ``module`` its posterior-mean network with the J heads pooled
(:class:`~bnpfed.matching.PooledHeads`), ``"predictive"`` likewise, and::

    "pooled_posterior": {"template": <the body's network kind>, "locs": {...}, "variances": {...}, "output": name,
                         "weight": (J, C, L), "weight_variance", "bias": (J, C), "bias_variance",
                         "pool_weights": (J, C), "temperature": T}

which :func:`load_global` returns as the :class:`~bnpfed.matching.PooledPosterior` (the same predictive). A global
network fused from Laplace clients (a :class:`~bnpfed.clients.LaplaceClient`) has ``"kind": "laplace"``, its
``"posterior"``, ``"prior"`` and ``"predictive"`` likewise and ``"temperature"`` (its predictive's: 1 unless fused
with ``FusionConfig(temperature=...)``), and loads as a LaplaceClient holding that posterior (its linearised
predictive at that temperature). The deterministic files have ``"kind": "deterministic"`` (files without the key, from
bnpfed 0.x before it, are read as such).

Usage::

    >>> import tempfile, torch
    >>> from bnpfed.models import mlp
    >>> net = mlp(4, [3], 2)
    >>> path = save_global(tempfile.mkdtemp() + "/global.pt", net, method="pfnm", widths={"1": 3})
    >>> again = load_global(path)
    >>> x = torch.randn(5, 4)
    >>> bool(torch.equal(again(x), net.eval()(x))), read_global(path).widths
    (True, {'1': 3})

A Bayesian client the same way::

    >>> from bnpfed.clients import BayesianClient
    >>> from bnpfed.models import only_linear_weights
    >>> client = BayesianClient(mlp(4, [3], 2), only_linear_weights())
    >>> again = load_global(save_global(tempfile.mkdtemp() + "/client.pt", client, method="client"))
    >>> bool(torch.equal(again.predict_proba(x, num_samples=4, seed=0), client.predict_proba(x, num_samples=4, seed=0)))
    True
"""

from __future__ import annotations

import copy
import pickle
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import Tensor, nn

from bnpfed.clients import LaplaceClient
from bnpfed.matching import PooledPosterior
from bnpfed.clients import BayesianClient
from bnpfed.data import Dataset, Preprocessing
from bnpfed.posterior import GaussianPosterior
from bnpfed.report import json_safe, versions

__all__ = ["BAYESIAN", "FORMAT", "KINDS", "SavedGlobal", "check_inputs", "global_from_record", "load_global",
           "load_torch_file", "read_global", "save_global"]

#: The layout of a saved global network (the module docstring); a file of another layout is refused.
FORMAT = "bnpfed-global/1"
#: What a file holds: a plain network, or a Bayesian one (a BayesianClient's posterior, prior and likelihood; a
#: LaplaceClient's; a PooledPosterior's body and heads).
KINDS = ("deterministic", "bayesian", "laplace", "pooled-posterior")
#: The Bayesian global models a file can hold (each has ``predict_proba(x, num_samples, seed)``).
BAYESIAN = (BayesianClient, LaplaceClient, PooledPosterior)


def _plain(value):
    """Tensors as (nested) lists, everything else as JSON-ready plain values."""
    if isinstance(value, Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return json_safe(value)


def save_global(path: str | Path, network, *, method: str, spec=None, widths: Mapping | None = None,
                hyperparameters: Mapping | None = None, class_shares=None, class_shares_estimated: bool = False,
                notes: Sequence[str] = (), predictive: Mapping | None = None,
                inputs: Preprocessing | Dataset | None = None) -> Path:
    """Write ``network`` (a copy on the CPU, in eval mode) and what describes it to ``path`` (its folder made if
    needed); return the path.

    :param network: an ``nn.Module``, or a :class:`~bnpfed.clients.BayesianClient` (its posterior-mean network,
        posterior, prior, likelihood and local reparameterisation are written; its guide must be mean-field Gaussian,
        as the default one is: ``posterior()`` gives ``{site: GaussianPosterior}``), a
        :class:`~bnpfed.clients.LaplaceClient`, or a :class:`~bnpfed.matching.PooledPosterior` (its tensors).
    :param str method: the method that built it (``"pfnm"``, ``"fedma"``, ...).
    :param spec: the :class:`~bnpfed.matching.PermutationSpec` it was matched by (stored as its text).
    :param dict widths: group name -> global units.
    :param dict hyperparameters: group name -> the matching's hyper-parameters (tensors become lists).
    :param class_shares: (J, C) the clients' class shares the matching used.
    :param bool class_shares_estimated: whether those shares were estimated (no class counts were given).
    :param notes: anything the result should say (e.g. what the matching had to give up).
    :param dict predictive: a Bayesian network only: ``{"samples": S, "seed": s}``, the posterior predictive its
        method scored it with (``bnpfed evaluate`` then draws the same by default).
    :param inputs: how the network's inputs were prepared: a :class:`~bnpfed.data.Preprocessing`, or the
        :class:`~bnpfed.data.Dataset` it was trained on (its :meth:`~bnpfed.data.Dataset.preprocessing`); None when
        unknown (``bnpfed evaluate`` then says so).
    """
    if not isinstance(method, str) or not method:
        raise ValueError(f"method: expected the name of the method that built the network, got {method!r}")
    bayesian = {}
    if predictive is not None and not isinstance(network, BAYESIAN):
        raise ValueError(f"predictive: expected only with a Bayesian network (a BayesianClient, LaplaceClient or "
                         f"PooledPosterior), got a {type(network).__name__}")
    if isinstance(network, BAYESIAN):
        bayesian = _pooled_record(network) if isinstance(network, PooledPosterior) else _bayesian_record(network)
        if predictive is not None:
            if not (isinstance(predictive, Mapping) and set(predictive) == {"samples", "seed"}):
                raise ValueError(f"predictive: expected {{'samples': S, 'seed': s}}, got {predictive!r}")
            bayesian["predictive"] = {"samples": int(predictive["samples"]), "seed": int(predictive["seed"])}
        module = network.mean_network().cpu()
    elif isinstance(network, nn.Module):
        module = copy.deepcopy(network).cpu().eval()
    else:
        raise ValueError(f"network: expected a torch.nn.Module or a bnpfed BayesianClient, LaplaceClient or "
                         f"PooledPosterior, got {type(network).__name__}")
    if isinstance(inputs, Dataset):
        inputs = inputs.preprocessing()
    if inputs is not None and not isinstance(inputs, Preprocessing):
        raise ValueError(f"inputs: expected a bnpfed.data.Preprocessing, a Dataset or None, got "
                         f"{type(inputs).__name__}")
    kind = ("laplace" if isinstance(network, LaplaceClient) else "pooled-posterior"
            if isinstance(network, PooledPosterior) else "bayesian") if bayesian else "deterministic"
    record = {
        "format": FORMAT,
        "kind": kind,
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
        "inputs": None if inputs is None else inputs.as_dict(),
        **bayesian,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(record, path)
    return path


def _bayesian_record(client: BayesianClient | LaplaceClient) -> dict:
    posterior = client.posterior()
    bad = [site for site, p in posterior.items() if not isinstance(p, GaussianPosterior)]
    if bad:
        raise ValueError(f"network: expected a client whose posterior() is {{site: GaussianPosterior}} (a mean-field "
                         f"Gaussian guide, the default), got {type(posterior[bad[0]]).__name__} at {bad[0]!r}")
    for site, p in posterior.items():
        if not (bool(torch.isfinite(p.loc).all()) and bool(torch.isfinite(p.variance).all())):
            raise ValueError(f"network: the posterior of {site!r} holds NaN or infinite values")
    laplace = isinstance(client, LaplaceClient)
    try:
        prior = copy.deepcopy(client.prior if laplace else client.bnn.prior)
        pickle.dumps(prior)
        if not laplace:
            pickle.dumps(client.bnn.likelihood)
    except Exception as error:  # a selector that is a lambda or a local function: it cannot be pickled
        raise ValueError(f"network: its prior or likelihood cannot be saved (pickled): {type(error).__name__}: "
                         f"{error}; use selectors that are module-level functions, patterns or classes") from None
    record = {"posterior": {site: {"loc": p.loc.detach().cpu().clone(), "variance": p.variance.detach().cpu().clone()}
                            for site, p in posterior.items()}, "prior": prior}
    if laplace:   # its predictive's temperature (a fused global model's, 1 otherwise)
        return {**record, "temperature": float(client.temperature)}
    return {**record, "likelihood": client.bnn.likelihood,
            "local_reparameterization": bool(client.bnn.local_reparameterization)}


def _cpu(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().cpu().clone() for k, v in tensors.items()}


def _pooled_record(posterior: PooledPosterior) -> dict:
    """What rebuilds a :class:`PooledPosterior` (:meth:`~PooledPosterior.of_heads` of its body and heads)."""
    heads = {k: v for k, v in posterior.heads().items() if k != "temperature"}
    for name, value in [*posterior.locs.items(), *posterior.variances.items(), *heads.items()]:
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ValueError(f"network: the pooled posterior's {name!r} holds NaN or infinite values")
    return {"pooled_posterior": {"template": copy.deepcopy(posterior.template).cpu(), "locs": _cpu(posterior.locs),
                                 "variances": _cpu(posterior.variances), "output": posterior.output,
                                 **_cpu(heads), "temperature": float(posterior.temperature)}}


@dataclass(frozen=True)
class SavedGlobal:
    """What :func:`read_global` reads: the fields of the file (module docstring), ``network`` in eval mode (for a
    Bayesian file its posterior-mean network; ``client`` the :class:`~bnpfed.clients.BayesianClient`,
    :class:`~bnpfed.clients.LaplaceClient` or :class:`~bnpfed.matching.PooledPosterior`, None otherwise)."""

    network: nn.Module
    method: str
    architecture: str
    kind: str = "deterministic"
    client: BayesianClient | LaplaceClient | PooledPosterior | None = None
    predictive: dict | None = None
    spec: str | None = None
    widths: dict = field(default_factory=dict)
    hyperparameters: dict = field(default_factory=dict)
    class_shares: list | None = None
    class_shares_estimated: bool = False
    notes: list = field(default_factory=list)
    versions: dict = field(default_factory=dict)
    inputs: Preprocessing | None = None


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
    return global_from_record(record, path)


def global_from_record(record, path: str | Path = "<record>") -> SavedGlobal:
    """:func:`read_global` of what ``torch.load`` already read from ``path`` (named in the errors), for a caller
    that loaded the file itself to see what it holds."""
    if not isinstance(record, Mapping) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, Mapping) else type(record).__name__
        raise ValueError(f"path: expected a bnpfed global model (format {FORMAT!r}) in {str(path)!r}, got "
                         f"{found!r}" + (" (a whole network: load it with torch.load)" if isinstance(record, nn.Module)
                                         else ""))
    kind = record.get("kind", "deterministic")
    if kind not in KINDS:
        raise ValueError(f"path: expected a global model of kind {' or '.join(map(repr, KINDS))} in {str(path)!r}, "
                         f"got {kind!r}")
    try:
        inputs = None if record.get("inputs") is None else Preprocessing.from_dict(record["inputs"])
    except (ValueError, TypeError) as error:
        raise ValueError(f"path: {str(path)!r} holds a record of its inputs that does not read ({error})") from None
    network = record["module"]
    network.load_state_dict(record["state_dict"])
    client = None
    if kind == "bayesian":
        # in train mode, as a new client is (the saved module is in eval mode)
        client = BayesianClient(copy.deepcopy(network).train(), record["prior"], likelihood=record["likelihood"],
                                local_reparameterization=record["local_reparameterization"])
        try:
            client.load_posterior({site: GaussianPosterior(p["loc"], p["variance"])
                                   for site, p in record["posterior"].items()})
        except ValueError as error:
            raise ValueError(f"path: {str(path)!r} holds a posterior that does not load ({error})") from None
    elif kind == "laplace":
        try:
            client = LaplaceClient.holding(network, {site: GaussianPosterior(p["loc"], p["variance"])
                                                     for site, p in record["posterior"].items()}, record["prior"],
                                           temperature=record.get("temperature", 1.0))   # none before 2026-12-06
        except ValueError as error:
            raise ValueError(f"path: {str(path)!r} holds a posterior that does not load ({error})") from None
    elif kind == "pooled-posterior":
        saved = record["pooled_posterior"]
        try:
            client = PooledPosterior.of_heads(saved["template"], saved["locs"], saved["variances"], saved["output"],
                                              saved)
        except (ValueError, TypeError) as error:
            raise ValueError(f"path: {str(path)!r} holds a pooled posterior that does not load ({error})") from None
    return SavedGlobal(network=network.eval(), method=record["method"], architecture=record["architecture"],
                       kind=kind, client=client, predictive=record.get("predictive"), spec=record["spec"],
                       widths=dict(record["widths"]),
                       hyperparameters=dict(record["hyperparameters"]), class_shares=record["class_shares"],
                       class_shares_estimated=bool(record["class_shares_estimated"]), notes=list(record["notes"]),
                       versions=dict(record["versions"]), inputs=inputs)


def check_inputs(saved: SavedGlobal, dataset: Dataset, name: str = "dataset") -> None:
    """Refuse (``ValueError`` naming ``name``) a ``dataset`` the saved model cannot take as it was trained: inputs
    of another shape, another class count, prepared otherwise (standardised or not, other constants). Another
    dataset or other class names (a shift of domain) is a ``UserWarning``. A model that records no preprocessing (a
    file of bnpfed 0.2) cannot be checked.

    :param SavedGlobal saved: what :func:`read_global` read.
    :param Dataset dataset: the data to use the model on.
    :param str name: what the errors call ``dataset``."""
    if not isinstance(dataset, Dataset):
        raise ValueError(f"{name}: expected a bnpfed.data.Dataset, got {type(dataset).__name__}")
    if saved.inputs is None:
        return
    problems = saved.inputs.mismatches(dataset)
    if problems:
        raise ValueError(f"{name}: expected inputs prepared as the model's ({saved.inputs.dataset}: "
                         f"{saved.inputs.describe()}), got {'; '.join(problems)}; read_global(path).inputs.load(...) "
                         f"loads a dataset prepared the model's way")
    for difference in saved.inputs.differences(dataset):
        warnings.warn(f"{name}: {difference}", UserWarning, stacklevel=3)


def load_global(path: str | Path, *, dataset: Dataset | None = None):
    """The global model a file of :func:`save_global` holds, ready to use: the network (eval mode, on the CPU), or
    for a Bayesian file the :class:`~bnpfed.clients.BayesianClient` (:class:`~bnpfed.clients.LaplaceClient`,
    :class:`~bnpfed.matching.PooledPosterior`).

    :param dataset: the data it is to be used on, checked against the preprocessing the file records
        (:func:`check_inputs`): a :class:`~bnpfed.data.Dataset` standardised otherwise than the model's training
        inputs, of another input shape or class count is refused (``ValueError``), before the model is used."""
    saved = read_global(path)
    if dataset is not None:
        check_inputs(saved, dataset)
    return saved.network if saved.client is None else saved.client
