"""The Flower ClientApp: one app that runs a PFNM client or a Bayesian (posterior fusion) client, as the server's
message says (``config["task"]``). Torch, Pyro and the data live here, not in the strategies.

A client is a SuperNode started with ``--node-config "partition-id=<j> num-partitions=<J>"`` (a simulation
fills both in) and optionally ``data-dir=<path>`` (torchvision datasets). It loads the dataset the server names,
keeps its share ``j`` of the training split -- the same share client ``j`` has in the in-process run with the same
settings -- and its share of the test split for evaluation. Every setting of the local step (architecture,
epochs, learning rate, seeds) comes from the server's message; nothing is read from the run config, so the server
alone decides.

* ``train``, task ``"pfnm"``: start from the MLP sent (its slice of the global network) or, when the message has no
  arrays, from this client's own initialisation (:func:`bnpfed.federated.pfnm.initial_network`); train it
  (:func:`bnpfed.federated.pfnm.train_client`) with the round's ``schedule-epochs`` / ``schedule-lr`` /
  ``schedule-seed`` (or :func:`bnpfed.federated.pfnm.local_schedule` of the settings); reply with its layers,
  ``num-examples`` and ``class-counts``.
* ``train``, task ``"fusion"``: load the global posterior and deterministic parameters into a
  :class:`~bnpfed.inference.BayesianClient`, fit it with seed ``derive_seed(seed, FIT, round, j)`` (as
  :class:`~bnpfed.federated.fusion.FusionFederation`), reply with its posterior, parameters, ``num-examples`` and
  ``train-loss``.
* ``evaluate``: accuracy and NLL of the global model on this client's test shard.

Usage (the example app under ``examples/flower_app`` does exactly this)::

    from bnpfed.flower.client import app          # [tool.flwr.app.components] clientapp = "...:app"
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from bnpfed.data import Dataset, load_dataset
from bnpfed.federated import class_counts, partition_dirichlet, partition_homogeneous
from bnpfed.federated.fusion import FIT, INIT, PREDICT, FusionConfig, build_network, derive_seed
from bnpfed.federated.fusion import bayesian_client as _fusion_client
from bnpfed.federated.pfnm import (LocalSchedule, PFNMSettings, client_split, initial_network, local_schedule,
                                  train_client)
from bnpfed.flower.config import dataclass_from_config
from bnpfed.flower.records import (
    ARRAYS,
    CLIENT,
    CONFIG,
    METRICS,
    array_shapes,
    from_array_record,
    network_from_arrays,
    network_to_record,
    posterior_from_arrays,
    posterior_to_record,
)
from bnpfed.inference import BayesianClient
from bnpfed.inference.multilayer import linear_layers, network_from_layers
from bnpfed.metrics import classification_report
from bnpfed.models.bayesian import seeded

__all__ = ["app", "make_client_app", "bayesian_client", "initial_global_model", "node_partition", "client_data"]


def node_partition(context: Context) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` of this SuperNode, from its node config."""
    config = context.node_config
    try:
        j, num = int(config["partition-id"]), int(config["num-partitions"])
    except (KeyError, TypeError, ValueError):
        raise ValueError("this SuperNode has no partition: start it with --node-config "
                         f"\"partition-id=<j> num-partitions=<J>\" (got node config {dict(config)})") from None
    if not 0 <= j < num:
        raise ValueError(f"partition-id must be in [0, num-partitions), got {j} of {num}")
    return j, num


@lru_cache(maxsize=4)
def _dataset(name: str, standardize: bool, data_dir: str | None) -> Dataset:
    """Loaded once per process (a simulation's actors and a test's in-process clients reuse it)."""
    return load_dataset(name, data_dir=data_dir, standardize=standardize)


def client_data(config, context: Context) -> tuple[Dataset, int, int]:
    """The dataset the server names (``dataset``, ``standardize``; ``data-dir`` from the node config) and this
    node's ``(j, J)``."""
    j, num = node_partition(context)
    data_dir = context.node_config.get("data-dir")
    ds = _dataset(str(config["dataset"]), bool(config["standardize"]), None if data_dir is None else str(data_dir))
    return ds, j, num


def _train_indices(config, y_train: np.ndarray, j: int, num: int) -> np.ndarray:
    """Client j's training indices for posterior fusion: a homogeneous or label-Dirichlet partition."""
    seed = int(config["seed"])
    if config["partition"] == "homogeneous":
        return partition_homogeneous(y_train, num, seed=seed)[j]
    return partition_dirichlet(y_train, num, alpha=float(config["alpha"]), min_size=int(config["min-size"]),
                               seed=seed)[j]


def _test_shard(ds: Dataset, config, j: int, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.as_tensor(partition_homogeneous(ds.y_test.numpy(), num, seed=int(config["seed"]))[j])
    return ds.x_test[idx], ds.y_test[idx]


def bayesian_client(config: FusionConfig, input_shape, num_classes: int) -> BayesianClient:
    """A Bayesian client of the experiment's network, built as :class:`~bnpfed.federated.fusion.FusionFederation`
    builds its clients (the network from seed ``derive_seed(seed, INIT)``, the prior, the initial scale)."""
    with seeded(derive_seed(config.seed, INIT)):
        network = build_network(config.arch, input_shape, num_classes, config.hidden)
    return _fusion_client(config, network)


def initial_global_model(config: FusionConfig, input_shape, num_classes: int) -> ArrayRecord:
    """The global model before round 1: the initial posterior and deterministic parameters of
    :func:`bayesian_client`, packed for :class:`~bnpfed.flower.strategies.PosteriorFusionStrategy`."""
    client = bayesian_client(config, input_shape, num_classes)
    return posterior_to_record(client.posterior(), client.deterministic_state())


def _reply(msg: Message, arrays: ArrayRecord, metrics: dict, j: int) -> Message:
    content = RecordDict({ARRAYS: arrays, METRICS: MetricRecord(metrics),
                          CLIENT: ConfigRecord({"partition-id": j})})
    return Message(content=content, reply_to=msg)


def _train_pfnm(msg: Message, context: Context) -> Message:
    config = msg.content.config_records[CONFIG]
    ds, j, num = client_data(config, context)
    ds = ds.flat()
    settings = dataclass_from_config(PFNMSettings, config, clients=num)
    idx = client_split(settings, ds.y_train.numpy())[0][j]
    x, y = ds.x_train[torch.as_tensor(idx)], ds.y_train[torch.as_tensor(idx)]
    sent = msg.content.array_records[ARRAYS]
    if len(sent) == 0:
        net = initial_network(settings, j, ds.input_shape[0], ds.num_classes, shared=settings.shared_init)
    else:
        net = network_from_layers(network_from_arrays(from_array_record(sent), in_features=ds.input_shape[0],
                                                      num_classes=ds.num_classes))
    if "schedule-epochs" in config:
        schedule = LocalSchedule(int(config["schedule-epochs"]), float(config["schedule-lr"]),
                                 int(config["schedule-seed"]))
    else:  # a server that sends no schedule leaves it to the settings
        schedule = local_schedule(settings, int(config["server-round"]))
    trained = train_client(net, x, y, settings, j, schedule)
    counts = class_counts(ds.y_train.numpy(), [idx], ds.num_classes)[0]
    metrics = {"num-examples": int(len(idx)), "class-counts": [int(c) for c in counts]}
    return _reply(msg, network_to_record(linear_layers(trained)), metrics, j)


def _fusion_config(config) -> FusionConfig:
    return dataclass_from_config(FusionConfig, config)


def _load_global(client: BayesianClient, record: ArrayRecord) -> None:
    posterior, params = posterior_from_arrays(from_array_record(record), array_shapes(record))
    client.load_posterior(posterior)
    client.load_deterministic(params)


def _train_fusion(msg: Message, context: Context) -> Message:
    config = msg.content.config_records[CONFIG]
    ds, j, num = client_data(config, context)
    fusion = _fusion_config(config)
    idx = torch.as_tensor(_train_indices(config, ds.y_train.numpy(), j, num))
    client = bayesian_client(fusion, ds.input_shape, ds.num_classes)
    _load_global(client, msg.content.array_records[ARRAYS])
    seed = derive_seed(fusion.seed, FIT, int(config["server-round"]), j)
    client.fit(ds.x_train[idx], ds.y_train[idx], epochs=fusion.local_epochs, batch_size=fusion.batch_size,
               lr=fusion.lr, seed=seed)
    metrics = {"num-examples": int(len(idx)), "train-loss": float(client.losses_[-1])}
    return _reply(msg, posterior_to_record(client.posterior(), client.deterministic_state()), metrics, j)


def _evaluate(msg: Message, context: Context) -> Message:
    config = msg.content.config_records[CONFIG]
    ds, j, num = client_data(config, context)
    x, y = _test_shard(ds, config, j, num)
    record = msg.content.array_records[ARRAYS]
    if config["task"] == "pfnm":
        net = network_from_layers(network_from_arrays(from_array_record(record)))
        with torch.no_grad():
            probs = net.eval()(x.reshape(len(x), -1)).softmax(-1)
    else:
        fusion = _fusion_config(config)
        client = bayesian_client(fusion, ds.input_shape, ds.num_classes)
        _load_global(client, record)
        probs = client.predict_proba(x, num_samples=fusion.num_predictive_samples,
                                     seed=derive_seed(fusion.seed, PREDICT, int(config["server-round"])))
    report = classification_report(probs, y)
    metrics = {"num-examples": int(len(y)), "accuracy": float(report["accuracy"]), "nll": float(report["nll"])}
    return Message(content=RecordDict({METRICS: MetricRecord(metrics), CLIENT: ConfigRecord({"partition-id": j})}),
                   reply_to=msg)


_TRAIN = {"pfnm": _train_pfnm, "fusion": _train_fusion}


def make_client_app() -> ClientApp:
    """A ``ClientApp`` with ``train`` (PFNM or posterior fusion, by the message's ``task``) and ``evaluate``."""
    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        task = msg.content.config_records[CONFIG].get("task")
        if task not in _TRAIN:
            raise ValueError(f"unknown task {task!r}; this client runs {sorted(_TRAIN)}")
        return _TRAIN[task](msg, context)

    @client_app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return _evaluate(msg, context)

    return client_app


#: The ClientApp a SuperNode runs (``bnpfed.flower.client:app``).
app = make_client_app()
