"""The Flower ServerApp: reads the run config, builds :class:`~bnpfed.flower.strategies.PFNMStrategy` or
:class:`~bnpfed.flower.strategies.PosteriorFusionStrategy`, runs its rounds and writes what came out.

The run config is one flat namespace (``[tool.flwr.app.config]`` of the app, then ``flwr run --run-config``):

* the keys of :class:`FlowerRun` (method, rule, dataset, model shape, sampling, deadlines, output);
* for ``method = "pfnm"`` the fields of :class:`bnpfed.federated.pfnm.PFNMSettings` (``hidden``, ``epochs``,
  ``sigma2``, ``sigma0-2``, ``gamma0``, ``rounds``, ``round-epochs``, ``seed``, ...);
* for ``method = "fusion"`` the fields of :class:`bnpfed.federated.fusion.FusionConfig` (``hidden``,
  ``local-epochs``, ``lr``, ``weights``, ``rounds``, ``seed``, ...) plus ``rule``.

Keys are the field names with ``-`` for ``_``; tuples are comma-separated strings (``hidden = "100,100"``). A
key none of them knows is an error (a typo would otherwise be ignored). The same settings give the same global
model as the in-process run (``bnpfed pfnm`` / ``bnpfed fuse``) when every client answers.

Usage::

    from bnpfed.flower.server import app                       # [tool.flwr.app.components] serverapp = "...:app"
    result = run_federation(grid, {"method": "pfnm", "rounds": 2, "hidden": "32"})   # any Grid, e.g. LocalGrid
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from bnpfed.federated.fusion import FusionConfig
from bnpfed.federated.pfnm import PFNMSettings, local_schedule
from bnpfed.flower.config import config_from_dataclass, dataclass_from_config, known_keys
from bnpfed.flower.records import from_array_record
from bnpfed.flower.strategies import LOGGER, PFNMStrategy, PosteriorFusionStrategy
from bnpfed.report import write_json

__all__ = ["FlowerRun", "FederationResult", "run_federation", "make_server_app", "app"]

METHODS = ("pfnm", "fusion")


@dataclass(frozen=True)
class FlowerRun:
    """How a Flower run goes, besides the method's own settings.

    :param str method: ``"pfnm"`` or ``"fusion"``. Default ``"pfnm"``.
    :param str rule: the fusion rule (``method = "fusion"``), from :func:`bnpfed.combine.available_rules`.
    :param str dataset: the dataset every client loads (:func:`bnpfed.data.load_dataset`). Default ``"digits"``.
    :param str standardize: ``"true"``, ``"false"`` or ``"auto"`` (as the method's command does: PFNM keeps pixels
        in [0, 1], fusion standardises).
    :param tuple input_shape: shape of one input, e.g. ``"1,8,8"`` (digits, the default) or ``"1,28,28"``: the
        server builds and checks models without loading data.
    :param int num_classes: number of classes. Default 10.
    :param str partition: ``"homogeneous"`` or ``"dirichlet"`` (with ``alpha``, ``min-size``): how the clients
        split the training data by ``partition-id`` (PFNM takes these from its own settings, same keys).
    :param float fraction_train: share of the connected nodes sampled per round. Default 1.
    :param float fraction_evaluate: share that scores the global model on its test shard after each round.
        Default 0 (no evaluation round trip).
    :param int min_nodes: nodes that must be connected before a round starts (and the fewest sampled). Default 2.
    :param int min_replies: usable replies a round needs; fewer stops the run with a message naming every
        dropped and missing client. Default 1.
    :param float node_timeout: seconds to wait for ``min_nodes`` nodes before a round. Default 120.
    :param float round_timeout: seconds to wait for the replies of a round; late nodes are left out. Default 600.
    :param str output_dir: if set, write ``<method>-summary.json`` (settings, per-round record) and
        ``<method>-global.npz`` (the final global model's arrays) there.
    """

    method: str = "pfnm"
    rule: str = "conflation"
    dataset: str = "digits"
    standardize: str = "auto"
    input_shape: tuple[int, ...] = (1, 8, 8)
    num_classes: int = 10
    partition: str = "homogeneous"
    alpha: float = 0.5
    min_size: int = 10
    fraction_train: float = 1.0
    fraction_evaluate: float = 0.0
    min_nodes: int = 2
    min_replies: int = 1
    node_timeout: float = 120.0
    round_timeout: float = 600.0
    output_dir: str = ""

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {self.method!r}")
        if self.standardize not in ("true", "false", "auto"):
            raise ValueError(f"standardize: expected 'true', 'false' or 'auto', got {self.standardize!r}")
        if not self.input_shape or min(self.input_shape) < 1:
            raise ValueError(f"input-shape: expected positive sizes such as '1,8,8', got {self.input_shape!r}")
        if not self.round_timeout > 0:
            raise ValueError(f"round-timeout: expected a positive number of seconds, got {self.round_timeout!r}")


@dataclass
class FederationResult:
    """What a Flower run produced: the final global model's arrays (``{name: ndarray}``, the layout of
    :mod:`bnpfed.flower.records`), the per-round record of the strategy, and the client-side evaluations."""

    method: str
    settings: dict
    arrays: dict[str, np.ndarray] = field(repr=False)
    rounds: list[dict]
    evaluation: dict[int, dict] = field(default_factory=dict)

    def as_dict(self) -> dict:
        """JSON-ready: method, settings, rounds, evaluation (arrays left out)."""
        return {"method": self.method, "settings": self.settings, "rounds": self.rounds,
                "evaluation": {str(k): v for k, v in self.evaluation.items()}}


def _standardize(run: FlowerRun) -> bool:
    if run.standardize == "auto":
        return run.method == "fusion"
    return run.standardize == "true"


def run_federation(grid: Grid, config: Mapping[str, Any]) -> FederationResult:
    """Run the method ``config`` asks for on ``grid`` (a Flower ``Grid``: the SuperLink's, a simulation's, or a
    :class:`~bnpfed.flower.local.LocalGrid`) and return the result; see the module docstring for the keys.

    :raises ValueError: on an unknown key or a bad value (naming it).
    :raises RuntimeError: when a round cannot go on (too few nodes, too few usable replies).
    """
    unknown = sorted(set(config) - known_keys(FlowerRun) - known_keys(PFNMSettings) - known_keys(FusionConfig))
    if unknown:
        raise ValueError(f"unknown run config key(s) {unknown}; see `bnpfed flower --help` for the keys")
    run = dataclass_from_config(FlowerRun, config)
    common = dict(fraction_train=run.fraction_train, fraction_evaluate=run.fraction_evaluate,
                  min_train_nodes=run.min_nodes, min_available_nodes=run.min_nodes, min_replies=run.min_replies,
                  node_timeout=run.node_timeout)
    data = {"dataset": run.dataset, "standardize": _standardize(run), "partition": run.partition,
            "alpha": run.alpha, "min-size": run.min_size}
    if run.method == "pfnm":
        settings = dataclass_from_config(PFNMSettings, config)
        strategy = PFNMStrategy(sigma2=settings.sigma2, sigma0_2=settings.sigma0_2, gamma0=settings.gamma0,
                                match_kwargs=settings.matcher_kwargs(), in_features=math.prod(run.input_shape),
                                num_classes=run.num_classes, schedule=lambda r: asdict(local_schedule(settings, r)),
                                client_config={**data, **config_from_dataclass(settings)}, seed=settings.seed,
                                **common)
        initial = ArrayRecord()
    else:
        from bnpfed.flower.client import initial_global_model  # the model is a Pyro program: built on demand

        settings = dataclass_from_config(FusionConfig, config, rules=(run.rule,), fedavg=False)
        strategy = PosteriorFusionStrategy(run.rule, weights=settings.weights,
                                           pooling_samples=settings.pooling_samples, seed=settings.seed,
                                           client_config={**data, **config_from_dataclass(settings)}, **common)
        initial = initial_global_model(settings, run.input_shape, run.num_classes)
    LOGGER.info("bnpfed %s: %d round(s), dataset %s", run.method, settings.rounds, run.dataset)
    outcome = strategy.start(grid, initial, num_rounds=settings.rounds, timeout=run.round_timeout)
    result = FederationResult(
        method=run.method, settings={**asdict(run), **asdict(settings)}, arrays=from_array_record(outcome.arrays),
        rounds=strategy.rounds,
        evaluation={r: dict(m) for r, m in outcome.evaluate_metrics_clientapp.items()})
    if run.output_dir:
        out = Path(run.output_dir)
        write_json(out / f"{run.method}-summary.json", result.as_dict())
        np.savez(out / f"{run.method}-global.npz", **result.arrays)
    return result


def make_server_app(defaults: Mapping[str, Any] | None = None,
                    on_result: Callable[[FederationResult], None] | None = None) -> ServerApp:
    """A ``ServerApp`` whose ``main`` calls :func:`run_federation` with ``defaults`` overridden by the run config
    (under ``run_simulation`` the run config is empty, so ``defaults`` is how a script sets things), then
    ``on_result(result)`` if given."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        result = run_federation(grid, {**(defaults or {}), **context.run_config})
        if on_result is not None:
            on_result(result)

    return server_app


#: The ServerApp a SuperLink runs (``bnpfed.flower.server:app``).
app = make_server_app()
