"""The run config of a Flower run, and the settings the server sends its clients: the configs of
:mod:`bnpfed.federated.config`, one flat namespace of Flower keys.

Flower carries configuration in two flat forms: the run config (``[tool.flwr.app.config]`` of the app's
``pyproject.toml`` plus ``flwr run --run-config 'k=v'``: ints, floats, strings, bools) and the ``ConfigRecord`` the
server puts into every message (the same scalars and homogeneous lists of them, no ``None``). Both use the same
keys: a config field's name with ``-`` for ``_`` (``sigma0_2`` is ``sigma0-2``, ``round_epochs`` is
``round-epochs``). The keys are those of

* :class:`FlowerRun`, the run itself: ``method``, ``dataset``, ``standardize``, ``rounds``, ``seed``,
  ``fraction-evaluate``, ``predictive-samples``, ``min-nodes``, ``min-replies``, ``node-timeout``,
  ``round-timeout``, ``output-dir``, ``plugins``;
* :class:`~bnpfed.federated.config.PartitionConfig` (but ``clients``: J is the SuperNodes' ``num-partitions``),
  :class:`~bnpfed.federated.config.NetworkConfig`, :class:`~bnpfed.federated.config.TrainingConfig`,
  :class:`~bnpfed.federated.config.BayesianConfig` (what the clients need);
* :class:`~bnpfed.federated.config.PFNMConfig` and :class:`~bnpfed.federated.config.FusionConfig` (the servers;
  their ``fraction``, the share of clients a round trains, is one key);
* :class:`SecureAggregationConfig`: weight-wise posterior fusion under SecAgg+ (``secure-aggregation``,
  ``secagg-*``).

The keys, their defaults and their checks are generated from the configs' schema (:mod:`bnpfed.schema`): a field
declared once is a key here, a flag of the commands and a ``:param`` line of its class; ``bnpfed flower keys`` lists
them and :func:`app_config_toml` writes the ``[tool.flwr.app.config]`` table of an app (the example app's
``pyproject.toml`` is that table, which a test checks). The probes of :mod:`bnpfed.experimental` are one key,
``experimental = "starts=both,later-rounds=rematch"``, split among the configs that read them; their bnpfed 0.1 keys
(``starts``, ``stop``, ``later-rounds``, ...) keep working for one release with a ``DeprecationWarning``.

Values are converted to the field's type (:func:`bnpfed.schema.coerce`): a tuple is a list or a comma-separated string
(``hidden = "100,100"``, ``sigma2 = "0.3,1"``), a bool may be ``"true"`` / ``"false"``, an optional int may be
``"none"``. ``plugins`` (comma-separated module names, :mod:`bnpfed.plugins`) is read first: the server imports them
before it checks any other key (a ``method``, ``rule``, ``prior`` or ``likelihood`` a plugin registers is then
known), and sends them with every message, so that every client imports them before it reads its settings. The
network and
training keys whose defaults differ between the methods (PFNM's are the reference code's,
:data:`~bnpfed.federated.config.PFNM_TRAINING` and :data:`~bnpfed.federated.config.PFNM_NETWORK`; posterior
fusion's the config defaults) take ``"auto"``: the method's default. Every key and value is checked before anything
starts; a bad one raises ``ValueError("<key>: expected ..., got ...")``, an unknown key ``ValueError("<key>: not a
run config key ...")``.

Usage::

    >>> settings = parse_run_config({"method": "pfnm", "hidden": "32,16", "sigma0-2": 2, "fraction": 0.5})
    >>> settings.network.hidden, settings.pfnm.sigma0_2, settings.pfnm.fraction, settings.training.epochs
    ((32, 16), 2.0, 0.5, 10)
    >>> parse_run_config({"method": "fusion"}).training.epochs      # "auto": the method's default
    2
    >>> parse_run_config({"lr": "fast"})
    Traceback (most recent call last):
    ...
    ValueError: lr: expected a number, got 'fast'
    >>> parse_run_config({"sigma": 1.0})
    Traceback (most recent call last):
    ...
    ValueError: sigma: not a run config key (`bnpfed flower keys` lists them)
"""

from __future__ import annotations

import dataclasses
import os
import math
import textwrap
import typing
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping

from bnpfed.data import DATASET_NAMES, NPZ_PREFIX, dataset_task
from bnpfed.experimental import ExperimentalOptions, keyed
from bnpfed.federated import (FUSION_TRAINING, PFNM_NETWORK, PFNM_TRAINING, BayesianConfig, FusionConfig, NetworkConfig,
                              PartitionConfig, PFNMConfig, TrainingConfig, config_dict)
from bnpfed.federated import CNN_LR, training_for
from bnpfed.federated import available_federated_methods, check_fusion_network, check_program_fusion
from bnpfed.combine import SECURE_RULES
from bnpfed.matching import PVI
from bnpfed.plugins import PluginError, load_plugins, plugin_names
from bnpfed.schema import METADATA, coerce, documented, key_of, option, options, render, summary
from bnpfed.validation import check_choice, check_fraction, check_int, check_positive

__all__ = [
    "AUTO",
    "EXPERIMENTAL",
    "ClientSettings",
    "CONFIGS",
    "SecureAggregationConfig",
    "METHODS",
    "FlowerRun",
    "FlowerSettings",
    "app_config_toml",
    "auto_keys",
    "client_settings",
    "config_key",
    "describe_keys",
    "parse_run_config",
    "run_config_defaults",
]

#: The built-in methods of a Flower run: PFNM's neuron matching, posterior fusion (``align`` ``"none"`` or
#: ``"match"``), FedAvg (the baseline, from one shared initialisation). Besides them, every federated method
#: registered (:func:`~bnpfed.federated.register_federated_method`, a plugin's too) is a method.
METHODS = ("pfnm", "fusion", "fedavg")
#: The value of a method-dependent key that asks for the method's default.
AUTO = "auto"


def flower_methods() -> tuple[str, ...]:
    """The methods a run can name: :data:`METHODS` and every registered federated method (a plugin's too)."""
    return METHODS + tuple(available_federated_methods())


def config_key(field_name: str) -> str:
    """The Flower key of a config field: ``sigma0_2`` -> ``sigma0-2``."""
    return key_of(field_name)


@documented
@dataclass(frozen=True)
class FlowerRun:
    """The run: which method, on which data, for how many rounds, how long to wait for whom, where to write."""

    method: str = option("pfnm", choices=flower_methods, help=(
        '``"pfnm"``, ``"fusion"`` (posterior fusion: weight by weight from one shared initialisation, or with '
        '``align="match"`` matched posterior fusion, each client from its own initialisation), ``"fedavg"`` '
        '(FedAvg from one shared initialisation, with fusion\'s network, schedule, ``weights`` and ``fraction``), or '
        'the name of a registered federated method (:func:`~bnpfed.federated.available_federated_methods`, run as '
        'FedAvg\'s: fusion\'s network and schedule, ``weights`` and ``fraction``).'))
    dataset: str = option("digits", help=(
        'the dataset every client loads (:func:`bnpfed.data.load_dataset`: the bundled ``"digits"``; ``mnist`` and '
        'the other torchvision sets from each SuperNode\'s ``data-dir`` node config).'))
    standardize: str = option(AUTO, choices=("true", "false", AUTO), help=(
        '``"true"``, ``"false"`` or ``"auto"``: as the method\'s command does (PFNM keeps pixels in [0, 1] as the '
        'reference code, posterior fusion and FedAvg standardise).'))
    rounds: int = option(1, help="communication rounds.")
    seed: int = option(0, help="the experiment's seed, every random stream's root (:mod:`bnpfed.seeding`).")
    fraction_evaluate: float = option(1.0, help=(
        'the share of the clients that score the global model on their test shards after each round, in [0, 1] (0: '
        'no evaluation; 1: every shard, the whole test split).'))
    predictive_samples: int = option(10, help=(
        'weight draws S of a Bayesian posterior predictive (fusion\'s evaluation).'))
    min_nodes: int = option(0, help=(
        'SuperNodes with a partition that must be connected before round 1; 0: every partition (all J).'))
    min_replies: int = option(1, help=(
        'usable replies a round needs; fewer stops the run with a message naming every rejected and missing client.'))
    node_timeout: float = option(120.0, help="seconds to wait for ``min_nodes`` SuperNodes.")
    round_timeout: float = option(600.0, help=(
        'seconds to wait for the replies of a round (and of a partition query); clients that have not answered by '
        'then are left out.'))
    output_dir: str = option("", help=(
        'if set, the ServerApp writes ``<method>-summary.json``, ``<method>-global.npz`` (the final global model\'s '
        'arrays) and ``<method>-global.pt`` (the global model as :func:`bnpfed.saved.save_global` writes it) there.'))
    plugins: str = option("", help=(
        'comma-separated modules the server and every client import first (:mod:`bnpfed.plugins`; '
        ':func:`parse_run_config` loads them); each must be importable on every machine of the federation. Empty: '
        'none (the entry points of the group ``bnpfed.plugins`` are loaded anyway).'))

    def __post_init__(self):
        check_choice(self.method, METHODS + tuple(available_federated_methods()), "method")
        if not isinstance(self.dataset, str) or not (self.dataset in DATASET_NAMES or (
                self.dataset.startswith(NPZ_PREFIX) and len(self.dataset) > len(NPZ_PREFIX))):
            raise ValueError(f"dataset: expected one of {list(DATASET_NAMES)} or {NPZ_PREFIX}PATH, got "
                             f"{self.dataset!r}")
        check_choice(self.standardize, ("true", "false", AUTO), "standardize")
        check_int(self.rounds, "rounds", low=1)
        check_int(self.seed, "seed", low=0)
        check_fraction(self.fraction_evaluate, "fraction_evaluate", allow_zero=True)
        check_int(self.predictive_samples, "predictive_samples", low=1)
        check_int(self.min_nodes, "min_nodes", low=0)
        check_int(self.min_replies, "min_replies", low=1)
        check_positive(self.node_timeout, "node_timeout")
        check_positive(self.round_timeout, "round_timeout")
        if not isinstance(self.output_dir, str):
            raise ValueError(f"output_dir: expected a path (a string), got {self.output_dir!r}")
        if not isinstance(self.plugins, str):
            raise ValueError(f"plugins: expected comma-separated module names (a string), got {self.plugins!r}")

    @property
    def plugin_modules(self) -> list[str]:
        """The modules of ``plugins``, in order."""
        return plugin_names(self.plugins)

    @property
    def federated(self) -> bool:
        """Whether ``method`` is a registered federated method (:class:`~bnpfed.flower.method_strategy.
        MethodStrategy`), not a built-in one."""
        return self.method not in METHODS

    @property
    def standardized(self) -> bool:
        """Whether the clients standardise their inputs."""
        return (self.method != "pfnm") if self.standardize == AUTO else self.standardize == "true"


@documented
@dataclass(frozen=True)
class SecureAggregationConfig:
    """Weight-wise posterior fusion under secure aggregation (SecAgg+, Flower's ``SecAggPlusWorkflow`` and
    ``secaggplus_mod``): the server learns the sums over the clients of their statistics
    (:mod:`bnpfed.combine.secure`) and their example counts, never one client's posterior
    (:class:`~bnpfed.flower.secure.SecureFusionStrategy`)."""

    secure_aggregation: bool = option(False, help=(
        'fuse under SecAgg+ (``method="fusion"``, a rule of :data:`~bnpfed.combine.secure.SECURE_RULES`; with '
        '``align="match"``, round 1 matches the clients\' units in the clear and later rounds fuse at the matched '
        'widths under SecAgg+, :class:`~bnpfed.flower.secure.SecureMatchedFusionStrategy`).'))
    secagg_clipping_range: float = option(65536.0, help=(
        '``c``, a power of two: every statistic, centred and scaled at the global posterior sent (shifts in its '
        'standard deviations, ratios of variances; deterministic parameters\' weighted shifts unscaled), must lie in '
        '``[-c, c]``; a client whose does not fails its round with a message naming this key, rather than be clipped. '
        'Each travels in two limbs of ``Q = 2^32 / 2^ceil(log2(K + 1))`` levels, so the sums are off by less than '
        '``K (2c / Q)^2 / 2c`` (:func:`~bnpfed.combine.secure.quantisation_bound`).'))
    secagg_shares: float = option(1.0, help=(
        'the share of a round\'s clients each client splits its secret keys among (SecAgg+\'s ``num_shares`` as a '
        'proportion), in (0, 1].'))
    secagg_threshold: float = option(0.5, help=(
        'the share of those shares needed to reconstruct a dropped client\'s masks (``reconstruction_threshold``), '
        'in (0, 1]; a round in which fewer clients remain fails.'))

    def __post_init__(self):
        if not isinstance(self.secure_aggregation, bool):
            raise ValueError(f"secure_aggregation: expected true or false, got {self.secure_aggregation!r}")
        check_positive(self.secagg_clipping_range, "secagg_clipping_range")
        if math.frexp(self.secagg_clipping_range)[0] != 0.5:
            raise ValueError(f"secagg_clipping_range: expected a power of two (its levels are then exact in floating "
                             f"point), got {self.secagg_clipping_range!r}")
        check_fraction(self.secagg_shares, "secagg_shares")
        check_fraction(self.secagg_threshold, "secagg_threshold")


#: The configs of a run, by name, as :class:`FlowerSettings` holds them (``run`` first).
CONFIGS = {"run": FlowerRun, "partition": PartitionConfig, "network": NetworkConfig, "training": TrainingConfig,
           "bayesian": BayesianConfig, "pfnm": PFNMConfig, "fusion": FusionConfig, "secure": SecureAggregationConfig}
#: The one key of the probes (:class:`~bnpfed.experimental.ExperimentalOptions`), ``"key=value,..."``; each config
#: that reads some of them gets those.
EXPERIMENTAL = "experimental"
#: The configs whose ``experimental`` field the key fills, each with the probes it reads.
_READ_BY = ("pfnm", "fusion", "bayesian")


def _not_key(name: str, f: dataclasses.Field):
    """Why field ``f`` of config ``name`` is not a run config key (a sentence), or None when it is one."""
    opt = f.metadata.get(METADATA)
    if opt is None or opt.key is True:
        return None
    return opt.key if isinstance(opt.key, str) else "not a run config key"
#: Each method's defaults of the configs whose defaults depend on the method.
_METHOD_DEFAULTS = {"pfnm": {"network": PFNM_NETWORK, "training": PFNM_TRAINING},
                    "fusion": {"network": NetworkConfig(), "training": FUSION_TRAINING}}
_METHOD_DEFAULTS["fedavg"] = _METHOD_DEFAULTS["fusion"]   # bnpfed fuse's baseline: its network and schedule


def _method_defaults(method: str) -> dict:
    """The defaults of ``method``'s method-dependent configs: a registered federated method's are FedAvg's."""
    return _METHOD_DEFAULTS.get(method, _METHOD_DEFAULTS["fedavg"])


@dataclass(frozen=True)
class FlowerSettings:
    """Every setting of a Flower run, one config per concern. ``partition.clients`` is the config's default until
    the server has asked the SuperNodes for J (:meth:`with_clients`)."""

    run: FlowerRun
    partition: PartitionConfig
    network: NetworkConfig
    training: TrainingConfig
    bayesian: BayesianConfig
    pfnm: PFNMConfig
    fusion: FusionConfig
    secure: SecureAggregationConfig = SecureAggregationConfig()

    def with_clients(self, clients: int) -> "FlowerSettings":
        return replace(self, partition=replace(self.partition, clients=clients))

    def as_dict(self) -> dict[str, dict]:
        """Every config as plain values (JSON-ready)."""
        return {name: config_dict(getattr(self, name)) for name in CONFIGS}

    def client_record(self) -> dict[str, Any]:
        """What every message to a client carries (as ``ConfigRecord`` values): the data, the seed, and the
        partition, network, training and Bayesian configs. The client rebuilds them with :func:`client_settings`."""
        out = {"dataset": self.run.dataset, "standardize": self.run.standardized, "seed": self.run.seed,
               "predictive-samples": self.run.predictive_samples}
        if self.run.plugin_modules:   # every client imports them first (bnpfed.flower.client)
            out["plugins"] = self.run.plugin_modules
        for name in ("partition", "network", "training", "bayesian"):
            for f in fields(CONFIGS[name]):
                value = getattr(getattr(self, name), f.name)
                if _not_key(name, f) is not None or value is None:  # None travels as an absent key
                    continue
                if not isinstance(value, (bool, int, float, str, tuple)):
                    raise ValueError(f"{config_key(f.name)}: expected one of the named choices (a value that can "
                                     f"travel to Flower clients), got a {type(value).__name__}")
                out[config_key(f.name)] = list(value) if isinstance(value, tuple) else value
        if self.bayesian.experimental.set_fields():   # the clients' probe (round-prior) travels in its text form
            out[EXPERIMENTAL] = self.bayesian.experimental.spec()
        return out


def _keys() -> dict[str, list[tuple[str, dataclasses.Field]]]:
    """``{key: [(config name, field), ...]}`` (``fraction`` belongs to two configs), in the configs' order; the
    configs' ``experimental`` fields are one key, :data:`EXPERIMENTAL`."""
    out: dict[str, list] = {}
    for name, cls in CONFIGS.items():
        for f, _ in options(cls):
            if _not_key(name, f) is None:
                out.setdefault(config_key(f.name), []).append((name, f))
    return out


#: bnpfed 0.1's keys of the probes, now in :data:`EXPERIMENTAL`: accepted until 0.3 with a DeprecationWarning.
_OLD_PROBE_KEYS = {key_of(f.name): f.name for f in fields(ExperimentalOptions)}


#: Keys whose default depends on the network's ``arch`` (:func:`~bnpfed.federated.config.training_for`).
ARCH_KEYS = {"lr": f"{CNN_LR:g} for a CNN"}


def auto_keys() -> set[str]:
    """The keys whose default depends on the method or the architecture (they take ``"auto"``)."""
    out = set(ARCH_KEYS)
    for name in ("network", "training"):
        pfnm, fusion = _METHOD_DEFAULTS["pfnm"][name], _METHOD_DEFAULTS["fusion"][name]
        out |= {config_key(f.name) for f in fields(CONFIGS[name]) if getattr(pfnm, f.name) != getattr(fusion, f.name)}
    return out


def run_config_defaults() -> dict[str, Any]:
    """Every run config key with its default as a run config holds it (``"auto"`` for the method-dependent keys,
    tuples comma-separated, ``""`` for no probe): what ``[tool.flwr.app.config]`` of an app lists."""
    auto = auto_keys()
    out = {}
    for key, owners in _keys().items():
        name, f = owners[0]
        if key in auto:
            out[key] = AUTO
            continue
        value = getattr(CONFIGS[name](), f.name)
        if value is None:
            out[key] = "none"   # TOML has no null; "none" reads back as None
        else:
            out[key] = ",".join(map(str, value)) if isinstance(value, tuple) else value
    out[EXPERIMENTAL] = ""
    return out


def describe_keys() -> list[dict[str, str]]:
    """One row per run config key: ``key``, ``default`` (a method-dependent one with each method's value) and
    ``config`` (the classes it sets)."""
    auto = auto_keys()
    rows = []
    for key, value in run_config_defaults().items():
        if key == EXPERIMENTAL:
            rows.append({"key": key, "default": '""', "config": "ExperimentalOptions (bnpfed.experimental)"})
            continue
        owners = _keys()[key]
        if key in auto:
            name, f = owners[0]
            each = []
            for method in METHODS:
                v = getattr(_METHOD_DEFAULTS[method][name], f.name)
                each.append(f"{method}: {','.join(map(str, v)) if isinstance(v, tuple) else v}")
            value = f"{AUTO} ({', '.join(each)}{'; ' + ARCH_KEYS[key] if key in ARCH_KEYS else ''})"
        rows.append({"key": key, "default": str(value), "config": ", ".join(CONFIGS[n].__name__ for n, _ in owners)})
    return rows


# ------------------------------------------------------------------------------------------------ the app's table


#: What each config's part of ``[tool.flwr.app.config]`` is headed with.
_TITLES = {"run": "the run", "partition": "the partition (J is the SuperNodes' num-partitions)",
           "network": "the network", "training": "local training", "bayesian": "Bayesian clients, posterior fusion",
           "pfnm": "the PFNM server", "fusion": "the posterior-fusion server",
           "secure": "secure aggregation: weight-wise fusion under SecAgg+"}


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def app_config_toml() -> str:
    """The ``[tool.flwr.app.config]`` table of a Flower app: every key with its default, each under the first
    sentence of its help (:func:`~bnpfed.schema.summary`; ``bnpfed flower keys --toml`` prints it). ``flwr run
    --run-config`` overrides only the keys an app lists, so an app lists them all."""
    defaults = run_config_defaults()
    names = {key_of(f.name): key_of(f.name) for cls in CONFIGS.values() for f, _ in options(cls)}
    names.update({f.name: key_of(f.name) for cls in CONFIGS.values() for f, _ in options(cls)})
    lines = ["[tool.flwr.app.config]"]
    done = set()
    for name, cls in CONFIGS.items():
        keys = [(config_key(f.name), opt) for f, opt in options(cls)
                if _not_key(name, f) is None and config_key(f.name) not in done]
        if not keys:
            continue
        lines.append(f"# --- {_TITLES[name]} ({cls.__name__})")
        for key, opt in keys:
            text = render(summary(opt.help), names, "{name}={value}")
            if key in auto_keys():
                text += ' "auto": the method\'s default' + (f" ({ARCH_KEYS[key]})." if key in ARCH_KEYS else ".")
            lines += textwrap.wrap(text, 118, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False)
            lines.append(f"{key} = {_toml(defaults[key])}")
            done.add(key)
    text = render(option_of_experimental_help(), names, "{name}={value}")
    lines.append("# --- probes measured worse than the defaults (bnpfed.experimental.ExperimentalOptions)")
    lines += textwrap.wrap(text, 118, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False)
    lines.append(f'{EXPERIMENTAL} = ""')
    return "\n".join(lines) + "\n"


def option_of_experimental_help() -> str:
    """The comment of the :data:`EXPERIMENTAL` key: its form and the probes it takes."""
    keys = ", ".join(key_of(f.name) for f in fields(ExperimentalOptions))
    return (f'the probes to set, "key=value,..." (keys: {keys}); each config that reads one gets it '
            f'(:class:`~bnpfed.experimental.ExperimentalOptions`).')


# ------------------------------------------------------------------------------------------------ conversion


def _build(cls, values: Mapping[str, Any], base=None):
    """``cls`` from ``{field: value}`` (over ``base``'s values if given); its own check's message names the key."""
    try:
        return replace(base, **values) if base is not None else cls(**values)
    except ValueError as error:
        message = keyed(str(error))   # a probe as the key experimental spells it
        for f in fields(cls):
            if message.startswith(f.name) and message[len(f.name):len(f.name) + 1] in (":", "["):
                message = config_key(f.name) + message[len(f.name):]
                break
        raise ValueError(message) from None


#: The configs holding a ``heads`` field and the method whose server reads it (the key ``heads`` goes to that one).
_HEADS_OF = {"pfnm": "pfnm", "fusion": "fusion"}


def _config_values(config: Mapping[str, Any], name: str, *, auto: bool) -> dict[str, Any]:
    """The fields of config ``name`` given in ``config``, converted (``"auto"`` left out when ``auto``)."""
    cls = CONFIGS[name]
    hints = typing.get_type_hints(cls)
    out = {}
    for f, opt in options(cls):
        key = config_key(f.name)
        if key not in config or _not_key(name, f) is not None:
            continue
        value = config[key]
        if auto and isinstance(value, str) and value.strip().lower() == AUTO and key in auto_keys():
            continue
        out[f.name] = coerce(value, hints[f.name], key, opt.null)
    return out


def _experimental(config: Mapping[str, Any]) -> ExperimentalOptions:
    """The probes of a run config: its :data:`EXPERIMENTAL` key, and bnpfed 0.1's keys of them (a
    ``DeprecationWarning`` naming the new form)."""
    probes = ExperimentalOptions.from_text(_scalar_text(config.get(EXPERIMENTAL, "")))
    old = {field: config[key] for key, field in _OLD_PROBE_KEYS.items() if key in config}
    if old:
        hints = typing.get_type_hints(ExperimentalOptions)
        values = {field: coerce(value, hints[field], key_of(field)) for field, value in old.items()}
        try:
            probes = replace(probes, **values)
        except ValueError as error:
            raise ValueError(key_of(str(error).split(":", 1)[0]) + ":" + str(error).split(":", 1)[1]) from None
        warnings.warn(f"run config keys {', '.join(key_of(f) for f in old)}: moved to the key {EXPERIMENTAL} in bnpfed "
                      f"0.2, write {EXPERIMENTAL} = \"{probes.only(tuple(old)).spec()}\" (the old keys go in 0.3)",
                      DeprecationWarning, stacklevel=3)
    return probes


def _scalar_text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{EXPERIMENTAL}: expected \"key=value,...\" (a string), got {value!r}")
    return value


def _check_output_dir(folder: str) -> None:
    """``output-dir`` is a folder that exists or can be made, and can be written: a ``ValueError`` naming the key
    otherwise."""
    path = Path(folder).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"output-dir: expected a folder, got {folder!r}, which is a file")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"output-dir: expected a folder that can be written, got {folder!r} ({str(parent)!r} is not "
                         "a writable folder)")


def parse_run_config(config: Mapping[str, Any]) -> FlowerSettings:
    """Every setting of a run from its run config (keys absent take their defaults), each key and value checked.

    :raises ValueError: ``"<key>: ..."`` for an unknown key or a bad value.
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"run config: expected a mapping of keys to values, got {type(config).__name__}")
    try:   # first: a method, rule, prior or likelihood a plugin registers is then known
        load_plugins(coerce(config.get("plugins", ""), str, "plugins"))
    except PluginError as error:
        raise ValueError(f"plugins: {error}") from None
    known = _keys()
    for key in config:
        if key not in known and key != EXPERIMENTAL and key not in _OLD_PROBE_KEYS:
            for name, cls in CONFIGS.items():
                for f in fields(cls):
                    why = _not_key(name, f)
                    if why is not None and key == config_key(f.name) and f.name != EXPERIMENTAL:
                        raise ValueError(f"{key}: {why}")
            raise ValueError(f"{key}: not a run config key (`bnpfed flower keys` lists them)")
    run = _build(FlowerRun, _config_values(config, "run", auto=False))
    built = {"run": run}
    probes = _experimental(config)
    read = set()
    for name in ("partition", "network", "training", "bayesian", "pfnm", "fusion", "secure"):
        base = _method_defaults(run.method).get(name)
        values = _config_values(config, name, auto=True)
        if name in _READ_BY:   # each config its own probes
            values["experimental"] = probes.only(CONFIGS[name].EXPERIMENTAL)
            read |= set(CONFIGS[name].EXPERIMENTAL)
        if name in _HEADS_OF and _HEADS_OF[name] != run.method:   # heads: the output layer of the method's server
            values.pop("heads", None)
            values.pop("pool_temperature", None)
        if name == "training":   # the method's schedule, at the CNNs' rate for a convolutional arch
            base = training_for(built["network"].arch, base or TrainingConfig())
        if name == "training" and "amsgrad" not in values:   # left to the method: its Adam default gives way to SGD
            schedule = base or TrainingConfig()
            values["amsgrad"] = schedule.amsgrad_for(values.get("optimizer", schedule.optimizer))
        built[name] = _build(CONFIGS[name], values, base)
    probes.check_read_by(sorted(read), "a Flower run")
    if built["pfnm"].layerwise_retrain:
        raise ValueError(f"layerwise-retrain: expected 0 on Flower (FedMA's layer-wise scheme runs in process: "
                         f"bnpfed pfnm --layerwise-retrain), got {built['pfnm'].layerwise_retrain}")
    built["bayesian"].check_task(dataset_task(run.dataset))   # the likelihood fits the dataset's targets
    if dataset_task(run.dataset) == "regression" and (run.method != "fusion" or built["fusion"].align != "none"):
        raise ValueError(f"method: {run.dataset!r} is a regression, fused weight by weight (method=\"fusion\", "
                         f"align=\"none\"); got method={run.method!r}, align={built['fusion'].align!r}")
    if run.method == "fusion":
        _check_fusion(built["fusion"], built["network"], built["bayesian"], built["secure"])
        built["bayesian"].check_training(built["training"])   # optimizer: SVI runs Adam
        built["fusion"].client_prior(built["bayesian"])   # round-prior: raises where it does not apply
    elif built["bayesian"].round_prior is not None:
        raise ValueError(f"experimental: round-prior, a Bayesian client's prior in later rounds (method=\"fusion\"); "
                         f"expected it unset with method={run.method!r}, got {built['bayesian'].round_prior!r}")
    if built["bayesian"].client != "variational" and (run.method != "fusion" or built["fusion"].align != "match"):
        raise ValueError(f"client: Laplace clients serve matched posterior fusion (method=\"fusion\", "
                         f"align=\"match\"), got client={built['bayesian'].client!r} with method={run.method!r}, "
                         f"align={built['fusion'].align!r}")
    if built["fusion"].temperature != 1 and (run.method != "fusion" or built["secure"].secure_aggregation):
        raise ValueError(f"temperature: the predictive temperature of matched posterior fusion's global posterior "
                         f"(method=\"fusion\", align=\"match\", in the clear); expected 1 with method={run.method!r}, "
                         f"secure-aggregation={str(built['secure'].secure_aggregation).lower()}, got "
                         f"{built['fusion'].temperature!r}")
    _check_secure(built["secure"], run.method, built["fusion"])
    _check_read(built, run.method, config)
    if run.output_dir:   # where the server writes at the end: checked before anything is sent
        _check_output_dir(run.output_dir)
    heads = built["pfnm"].heads if run.method == "pfnm" else built["fusion"].heads
    if "heads" in config and str(config["heads"]).strip() != heads:   # the key went to no config the method reads
        raise ValueError(f"heads: the output layer of PFNM's or matched posterior fusion's global network "
                         f"(method=\"pfnm\", or \"fusion\" with align=\"match\"); expected it left out (or "
                         f"{heads!r}) with method={run.method!r}, got {config['heads']!r}")
    temperature = built["pfnm"].pool_temperature if run.method == "pfnm" else built["fusion"].pool_temperature
    given = str(config.get("pool-temperature", "1")).strip()
    if heads == "fused" and (temperature != 1 or given not in ("1", "1.0")):
        raise ValueError(f"pool-temperature: the temperature of pooled heads; expected 1 without them (heads = "
                         f"'fused', method={run.method!r}), got {config['pool-temperature']!r}")
    if run.method == "fusion" and heads == "auto" and built["secure"].secure_aggregation:
        # the pool needs the clients' own output layers in the clear: "auto" is the fused layer under SecAgg+
        built["fusion"] = dataclasses.replace(built["fusion"], heads="fused")
    elif run.method == "fusion" and heads == "pooled":
        if built["secure"].secure_aggregation:
            raise ValueError(f"heads: the output layer of matched posterior fusion in the clear; expected 'fused' "
                             f"with secure-aggregation = true, got {heads!r}")
    return FlowerSettings(**built)


#: The configs each built-in method reads (a registered federated method reads FedAvg's): a key of none of them
#: set to another value than its default is refused, as the method's command has no such flag.
_READS = {"pfnm": ("run", "partition", "network", "training", "pfnm"),
          "fusion": ("run", "partition", "network", "training", "bayesian", "fusion", "secure"),
          "fedavg": ("run", "partition", "network", "training", "fusion")}
#: Of the fusion config, what weight-wise fusion (``align = "none"``) does not read: matched fusion's.
_MATCHED_ONLY = ("tau2", "matcher_device")


def _check_read(built: Mapping[str, Any], method: str, config: Mapping[str, Any]) -> None:
    """Refuse a key the run's method does not read (another config's, e.g. ``rule`` with ``method = "pfnm"``, or
    matched fusion's ``tau2`` with ``align = "none"``) set to another value than its default: the commands have no
    such flag, and a run would ignore it."""
    reads = _READS.get(method, _READS["fedavg"])
    owners = _keys()
    for name in CONFIGS:
        if name in reads or name == "secure":   # the secure keys have their own check (_check_secure)
            continue
        default = _method_defaults(method).get(name) or CONFIGS[name]()
        for f, _ in options(CONFIGS[name]):
            key = config_key(f.name)
            if (_not_key(name, f) is not None or key not in config or f.name == EXPERIMENTAL
                    or any(other in reads for other, _ in owners.get(key, []))):
                continue
            if getattr(built[name], f.name) != getattr(default, f.name):
                raise ValueError(f"{key}: a setting of {CONFIGS[name].__name__}, which method={method!r} does not "
                                 f"read; expected it left out (or at its default, {_shown(getattr(default, f.name))}), "
                                 f"got {config[key]!r}")
    fusion = built["fusion"]
    if method == "fusion" and fusion.experimental.pvi_damping is not None and fusion.rule != PVI:
        raise ValueError(f"experimental: pvi-damping: expected only with rule=\"{PVI}\", got rule={fusion.rule!r}")
    if method == "fusion" and fusion.align == "none":
        default = FusionConfig()
        for name in _MATCHED_ONLY:
            if config_key(name) in config and getattr(fusion, name) != getattr(default, name):
                raise ValueError(f"{config_key(name)}: matched fusion's (align=\"match\"); expected it left out with "
                                 f"align=\"none\", got {config[config_key(name)]!r}")


def _shown(value: Any) -> str:
    if value is None:
        return '"none"'
    return ",".join(map(str, value)) if isinstance(value, tuple) else repr(value)


def _check_secure(secure: SecureAggregationConfig, method: str, fusion: FusionConfig) -> None:
    """Secure aggregation runs weight-wise fusion with a rule of sums; its other keys need it on."""
    if not secure.secure_aggregation:
        default = SecureAggregationConfig()
        for f in fields(SecureAggregationConfig):
            if getattr(secure, f.name) != getattr(default, f.name):
                raise ValueError(f"{config_key(f.name)}: applies only with secure-aggregation = true, got "
                                 f"{getattr(secure, f.name)!r} without it")
        return
    if method != "fusion":
        raise ValueError(f"secure-aggregation: expected method=\"fusion\" (weight-wise posterior fusion needs only "
                         f"sums over clients; with align=\"match\" round 1 matches in the clear, then fuses under "
                         f"SecAgg+), got method={method!r}")
    if fusion.rule not in SECURE_RULES:
        raise ValueError(f"rule: expected one of {list(SECURE_RULES)} with secure-aggregation (pooling draws from "
                         f"each client's posterior: not a sum of fixed statistics), got {fusion.rule!r}")


def _check_fusion(fusion: FusionConfig, network: NetworkConfig, bayesian: BayesianConfig,
                  secure: SecureAggregationConfig) -> None:
    """What posterior fusion on Flower does not run: a network with batch norm (the rule of every posterior fusion,
    :func:`~bnpfed.federated.fusion.check_fusion_network`), weight-wise fusion from the clients' own
    initialisations; with a Pyro program (``program``), what does not apply to one
    (:func:`~bnpfed.federated.fusion.check_program_fusion`) and secure aggregation (its sums are laid out by a
    network's layers)."""
    if bayesian.program is not None:
        check_program_fusion(network, fusion)
        if secure.secure_aggregation:
            raise ValueError("secure-aggregation: its masked sums are laid out by a network's layers; expected false "
                             "with a Pyro program (program), got true")
        return
    check_fusion_network(network)
    if fusion.align == "none" and fusion.own_init:
        raise ValueError("own-init: expected false, or align=\"match\", on Flower (weight-wise fusion from each "
                         "client's own initialisation, the one-shot baseline, runs in process: bnpfed fuse "
                         "--own-init), got true")


@dataclass(frozen=True)
class ClientSettings:
    """What a client reads from a message (see :meth:`FlowerSettings.client_record`)."""

    dataset: str
    standardize: bool
    seed: int
    predictive_samples: int
    partition: PartitionConfig
    network: NetworkConfig
    training: TrainingConfig
    bayesian: BayesianConfig


def client_settings(record: Mapping[str, Any], clients: int) -> ClientSettings:
    """The settings a server sent (a message's ``ConfigRecord``) for a client of a federation of ``clients``."""
    for key in ("dataset", "standardize", "seed", "predictive-samples"):
        if key not in record:
            raise ValueError(f"{key}: missing from the server's message")
    configs = {name: _build(CONFIGS[name], _config_values(record, name, auto=False))
               for name in ("network", "training")}
    configs["bayesian"] = _build(BayesianConfig, {**_config_values(record, "bayesian", auto=False),
                                                  "experimental": _experimental(record)})
    partition = _build(PartitionConfig, {**_config_values(record, "partition", auto=False), "clients": clients})
    return ClientSettings(dataset=coerce(record["dataset"], str, "dataset"),
                          standardize=coerce(record["standardize"], bool, "standardize"),
                          seed=check_int(record["seed"], "seed", low=0),
                          predictive_samples=check_int(record["predictive-samples"], "predictive-samples", low=1),
                          partition=partition, **configs)
