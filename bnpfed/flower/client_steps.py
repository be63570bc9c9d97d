"""What a Flower client does with each message: one set of steps that runs a PFNM or a Bayesian (posterior fusion,
matched or weight by weight, plain or under SecAgg+) client, as the server's message says (``config["task"]``).
Torch, Pyro and the data live here, not in the strategies, nor in the ClientApp module
(:mod:`bnpfed.flower.client`), which imports this one only when a message needs it.

A client is a SuperNode started with ``--node-config "partition-id=<j> num-partitions=<J>"`` (a simulation fills
both in) and optionally ``data-dir=<path>`` (torchvision datasets). It loads the dataset the server names and holds
its part of the training split, ``PartitionConfig.split(labels, seed)[j]`` -- the part client j has in the
in-process run with the same settings -- and its test shard, the j-th of J contiguous near-equal slices of the test
split (the shards together are the test split). Every setting comes from the server's message
(:meth:`~bnpfed.flower.config.FlowerSettings.client_record`); nothing is read from the run config, so the server
alone decides. The steps are :mod:`bnpfed.federated.clients`' (the in-process federations call them too):

* ``query``: tell the server the partition ``(j, J)``, the input shape and the number of classes; or, with
  ``step`` ``"batch-norm-moments"``, reply with the moments of the inputs of batch norm ``layer`` (every batch norm
  without one) of the global network sent, on this client's training inputs
  (:func:`~bnpfed.federated.clients.batch_norm_moments_step`; the server asks for one layer at a time, front to
  back); or, with ``step`` ``"pool-nll"``, reply with its summed NLL on its training data of the global network or
  posterior with pooled heads sent, at every temperature (``pool-nll``,
  :func:`~bnpfed.federated.clients.pool_nll_step`, :func:`~bnpfed.federated.clients.pooled_posterior_nll_step`); or,
  with ``step`` ``"posterior-nll"``, the same of the matched global posterior's predictive
  (:func:`~bnpfed.federated.clients.posterior_nll_step`, for ``FusionConfig.temperature="fit"``);
* ``train``, task ``"pfnm"``: start from the network sent (its slice of the global network, a ``state_dict`` of
  the configured architecture, checked against its permutation spec) or, when the message has no arrays (round 1),
  from :func:`~bnpfed.federated.clients.initial_network` (its own initialisation); train it with
  :func:`~bnpfed.federated.clients.train_network`; reply with its state, ``num-examples``, ``class-counts`` and
  its units' activity on its data (``activity:<group>``, :func:`~bnpfed.federated.clients.unit_activity_step`;
  the server leaves the inactive units out unless ``inactive = "keep"``);
* ``train``, task ``"fedavg"``: the global network sent (round 1 the shared initialisation), trained with
  :func:`~bnpfed.federated.clients.train_network`; reply with its state and ``num-examples``;
* ``train``, task ``"fusion"``: a :func:`~bnpfed.federated.clients.bayesian_client` of the shared initial network
  with the global posterior and deterministic parameters loaded (from round 2 with ``round-prior = "posterior"``
  that posterior its prior too: :func:`~bnpfed.federated.clients.start_round_prior_`), fitted by
  :func:`~bnpfed.federated.clients.fit_bayesian`; reply with its posterior, parameters, ``num-examples``,
  ``train-loss``;
* ``train``, task ``"secure-fusion"`` (``secure-aggregation = true``): as ``"fusion"`` (at the widths of the
  global model sent: after a round of matching, the matched network's), but the posterior stays in
  ``context.state`` and the reply carries only ``num-examples`` and ``train-loss``; then the stages of SecAgg+
  (``secaggplus_mod``), in which the client sends its statistics masked
  (:func:`~bnpfed.flower.secure.secure_fit`, :mod:`bnpfed.flower.secure`);
* ``train``, task ``"matched-fusion"`` (``method = "fusion"``, ``align = "match"``): round 1 (no arrays) a Bayesian
  client of its own initial network (:func:`~bnpfed.federated.clients.initial_network` with its partition id),
  later one holding what the server sent -- its slice of the global posterior, or the whole of it -- as posterior,
  its prior the configured one or (``round-prior = "posterior"``) that slice, or the cavity sent beside it under
  PVI (:func:`~bnpfed.federated.matched_fusion.client_from_slice`); fitted by
  :func:`~bnpfed.federated.clients.fit_bayesian`; reply with its posterior
  (:func:`~bnpfed.matching.posteriors.client_posterior`), ``num-examples``, ``class-counts``,
  ``train-loss`` and its posterior-mean network's units' activity on its data (``activity:<group>``; read when the
  server matches on the means, ``match-on``);
* ``train``, task ``"federated-method"`` (a registered federated method, ``method = "<name>"``): the method named by
  the message's ``federated-method`` runs its client step on the global state sent
  (:func:`~bnpfed.federated.client_step`; its network the shared initial network's architecture carrying the state),
  with what this client kept from its last round (in ``context.state``); reply with the update, ``num-examples`` and
  the step's metrics, and keep what the step keeps;
* ``evaluate``: accuracy, NLL and Brier score of the global model on the test shard, and the per-bin calibration
  gaps of ECE with 100 and 15 bins (:func:`~bnpfed.metrics.calibration_gaps`: sums over the shard, from which the
  server computes the test split's ECE exactly); fusion and matched fusion: the posterior predictive drawn from
  ``(seed, PREDICT, round)``, as in process. A regression (``dataset = "diabetes"``): the predictive's mean
  squared error, NLL, coverage and width of its central 90 % interval on the shard
  (:func:`~bnpfed.metrics.regression_scores`), means the server weighs by the shards' sizes.

:func:`query`, :func:`train` and :func:`evaluate` are the handlers of the ClientApp (:mod:`bnpfed.flower.client`).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Optional, Sequence

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from bnpfed.data import Dataset, load_dataset
from bnpfed.federated import (batch_norm_moments_step, bayesian_client, fit_bayesian, initial_network, pool_nll_step,
                              pooled_posterior_nll_step, posterior_client, posterior_nll_step, program_client,
                              server_program_client, start_round_prior_, train_network, unit_activity_step)
from bnpfed.federated import BayesianConfig, NetworkConfig, PartitionConfig
from bnpfed.federated import client_from_slice, tempered
from bnpfed.federated import class_counts
from bnpfed.federated import Architecture
from bnpfed.federated import client_step, federated_method
from bnpfed.flower.config import ClientSettings, client_settings
from bnpfed.flower.secure import client_at_widths, keep_for_secure_sum
from bnpfed.flower.records import (
    ARRAYS,
    CLIENT,
    CONFIG,
    ECE_BINS,
    TEST_CLASS_COUNTS,
    METHOD_KEY,
    METRICS,
    NodeIdentity,
    activity_metrics,
    array_shapes,
    from_array_record,
    matched_posterior_from_arrays,
    matched_posterior_to_record,
    moments_to_record,
    posterior_from_arrays,
    posterior_to_record,
    state_from_arrays,
    state_to_record,
    split_cavity,
    split_heads,
    split_temperature,
    tensors_from_arrays,
    to_array_record,
    POOL_NLL,
)
from bnpfed.clients import BayesianClient
from bnpfed.matching import PooledPosterior
from bnpfed.matching import attach_heads
from bnpfed.matching import client_posterior
from bnpfed.metrics import calibration_gaps, classification_report, regression_scores
from bnpfed.seeding import Stream, derive_seed

__all__ = ["evaluate", "evaluation_shard", "initial_global_model", "node_partition", "query", "train"]


def node_partition(context: Context) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` of this SuperNode, from its node config."""
    config = context.node_config
    try:
        j, num = int(config["partition-id"]), int(config["num-partitions"])
    except (KeyError, TypeError, ValueError):
        raise ValueError("--node-config: expected \"partition-id=<j> num-partitions=<J>\" (this SuperNode has no "
                         f"partition: start it with them), got {dict(config)}") from None
    if not 0 <= j < num:
        raise ValueError(f"partition-id: expected an int in [0, num-partitions={num}), got {j}")
    return j, num


@lru_cache(maxsize=4)
def _dataset(name: str, standardize: bool, data_dir: Optional[str]) -> Dataset:
    """Loaded once per process (a simulation's actors and a test's in-process clients reuse it)."""
    return load_dataset(name, data_dir=data_dir, standardize=standardize)


@lru_cache(maxsize=8)
def _architecture(network: NetworkConfig, input_shape: tuple, num_classes: int, seed: int) -> Architecture:
    """The configured architecture (template network, permutation spec), as the server builds it (once per
    process)."""
    return Architecture.of(network, input_shape, num_classes, seed=seed)


@lru_cache(maxsize=8)
def _parts(name: str, standardize: bool, data_dir: Optional[str], partition: PartitionConfig, seed: int
           ) -> tuple[np.ndarray, ...]:
    return tuple(partition.split(_dataset(name, standardize, data_dir).y_train.numpy(), seed))


def _output(arch: Architecture) -> str:
    """The module name of the architecture's output layer."""
    (weight,) = arch.spec.params_of_kind("output_weight")
    return weight.rpartition(".")[0]


def _data_dir(context: Context) -> Optional[str]:
    value = context.node_config.get("data-dir")
    return None if value is None else str(value)


#: Where a federated method's client keeps its state between rounds, in its node's ``context.state``.
_KEPT = f"{METHOD_KEY}:client-state"


def evaluation_shard(num_test: int, j: int, num_clients: int) -> np.ndarray:
    """Client j's indices into a test split of ``num_test`` examples: the j-th of J contiguous near-equal slices.

    >>> [len(evaluation_shard(450, j, 4)) for j in range(4)]
    [113, 113, 112, 112]
    """
    return np.array_split(np.arange(num_test), num_clients)[j]


class _Client:
    """This node's view of a message: the settings, the data, its part of it."""

    def __init__(self, msg: Message, context: Context):
        self.config = msg.content.config_records[CONFIG]
        self.j, self.num = node_partition(context)
        self.settings: ClientSettings = client_settings(self.config, self.num)
        s = self.settings
        key = (s.dataset, s.standardize, _data_dir(context))
        self.ds = _dataset(*key)
        self.idx = torch.as_tensor(_parts(*key, s.partition, s.seed)[self.j])
        self.round = int(self.config.get("server-round", 0))

    @property
    def train_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ds.x_train[self.idx], self.ds.y_train[self.idx]

    @property
    def test_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(evaluation_shard(len(self.ds.y_test), self.j, self.num))
        return self.ds.x_test[idx], self.ds.y_test[idx]

    def network(self, record: ArrayRecord) -> torch.nn.Module:
        """The network of the configured architecture carrying the ``state_dict`` in ``record``."""
        arch = _architecture(self.settings.network, tuple(self.ds.input_shape), self.ds.num_classes,
                             self.settings.seed)
        return arch.network(state_from_arrays(from_array_record(record), arch.spec, arch.template.state_dict()))

    def global_client(self, record: ArrayRecord) -> BayesianClient:
        """A Bayesian client of the configured architecture carrying the global model in ``record`` (the layout of
        :func:`~bnpfed.flower.records.posterior_to_record`), at its widths: the shared initial network's, or a
        matched global network's (secure fusion after a round of matching); its prior the configured one. With a
        Pyro program (``program``), a :func:`~bnpfed.federated.clients.program_client` holding it, its prior the
        program's own."""
        posterior, params = posterior_from_arrays(from_array_record(record), array_shapes(record))
        if self.settings.bayesian.program is not None:   # a user's Pyro program, set up on this node's data
            x, y = self.train_data
            client = program_client(self.settings.bayesian, x[:2], y[:2], seed=self.settings.seed)
            client.load_posterior(posterior)
            client.load_deterministic(params)
            return client
        arch = _architecture(self.settings.network, tuple(self.ds.input_shape), self.ds.num_classes,
                             self.settings.seed)
        return client_at_widths(arch.template, posterior, params, self.settings.bayesian)

    def matched_client(self, record: ArrayRecord, *, as_prior: bool) -> BayesianClient:
        """A Bayesian client of the configured architecture holding the posterior in ``record`` (a slice of a
        matched global posterior, or the whole of it); with ``as_prior`` a client to train, its prior as the
        settings' ``round_prior`` says or the cavity sent beside it
        (:func:`~bnpfed.federated.matched_fusion.client_from_slice`)."""
        arch = _architecture(self.settings.network, tuple(self.ds.input_shape), self.ds.num_classes,
                             self.settings.seed)
        arrays, temperature = split_temperature(from_array_record(record))   # the global predictive's
        arrays, cavity = split_cavity(arrays)   # PVI: the cavity to train against
        locs, variances = matched_posterior_from_arrays(arrays, arch.spec, arch.template.state_dict())
        if cavity is not None and sorted(cavity[1]) != sorted(variances):
            raise ValueError(f"cavity: expected the Bayesian sites {sorted(variances)}, got {sorted(cavity[1])}")
        if temperature is not None and as_prior:
            raise ValueError("predictive-temperature: the global posterior's, sent for evaluation; expected none "
                             "beside a posterior to train from")
        client = client_from_slice(arch.template, locs, variances, self.settings.bayesian, as_prior=as_prior,
                                   prior=cavity)
        return client if temperature is None else tempered(client, temperature)

    def pooled_posterior(self, record: ArrayRecord) -> Optional[PooledPosterior]:
        """The matched global posterior in ``record`` with the clients' pooled heads sent beside it
        (:func:`~bnpfed.flower.records.with_heads`), None when none were sent."""
        arrays, heads = split_heads(from_array_record(record))
        if heads is None:
            return None
        arch = _architecture(self.settings.network, tuple(self.ds.input_shape), self.ds.num_classes,
                             self.settings.seed)
        locs, variances = matched_posterior_from_arrays(arrays, arch.spec, arch.template.state_dict())
        return PooledPosterior.of_heads(arch.template, locs, variances, _output(arch), heads)

    def evaluation_network(self, record: ArrayRecord) -> torch.nn.Module:
        """The global network in ``record`` (:meth:`network`), with the pooled heads sent beside it
        (:func:`~bnpfed.flower.records.with_heads`) in place of its output layer when there are any."""
        arrays, heads = split_heads(from_array_record(record))
        arch = _architecture(self.settings.network, tuple(self.ds.input_shape), self.ds.num_classes,
                             self.settings.seed)
        net = arch.network(state_from_arrays(arrays, arch.spec, arch.template.state_dict()))
        if heads is None:
            return net
        if "weight_variance" in heads:
            raise ValueError("heads: expected a network's heads (means only), got variances too")
        return attach_heads(net, _output(arch), heads["weight"], heads["bias"], heads["pool_weights"],
                            float(heads["temperature"]))

    def class_counts(self) -> list[int]:
        """This client's training examples per class."""
        counts = class_counts(self.ds.y_train.numpy(), [self.idx.numpy()], self.ds.num_classes)[0]
        return [int(k) for k in counts]

    def reply(self, msg: Message, arrays: Optional[ArrayRecord], metrics: dict) -> Message:
        content = RecordDict({METRICS: MetricRecord(metrics), CLIENT: ConfigRecord({"partition-id": self.j})})
        if arrays is not None:
            content[ARRAYS] = arrays
        return Message(content=content, reply_to=msg)


def initial_global_model(network: NetworkConfig, bayesian: BayesianConfig, input_shape: Sequence[int],
                         num_classes: int, *, seed: int, task: str = "classification") -> ArrayRecord:
    """Posterior fusion's global model before round 1 (the initial posterior and deterministic parameters of a
    Bayesian client of the shared initial network, or with ``bayesian.program`` of the program's
    :func:`~bnpfed.federated.clients.server_program_client` for the dataset's ``task``), packed for
    :class:`~bnpfed.flower.strategies.PosteriorFusionStrategy`.

    >>> record = initial_global_model(NetworkConfig(hidden=(8,)), BayesianConfig(), (1, 8, 8), 10, seed=0)
    >>> sorted(record)
    ['loc/1.weight', 'loc/3.weight', 'param/1.bias', 'param/3.bias', 'variance/1.weight', 'variance/3.weight']
    """
    if bayesian.program is not None:   # a user's Pyro program, its initial posterior as in process
        client = server_program_client(bayesian, input_shape, task, seed=seed)
    else:
        client = bayesian_client(initial_network(network, input_shape, num_classes, seed=seed), bayesian)
    return posterior_to_record(client.posterior(), client.deterministic_state())


def query(msg: Message, context: Context) -> Message:
    """A ``query``: this node's partition, input shape and classes, the batch-norm moments step, or the pool
    temperature step."""
    if msg.content.config_records[CONFIG].get("step") == "batch-norm-moments":
        return _moments(msg, context)
    if msg.content.config_records[CONFIG].get("step") == "pool-nll":
        return _pool_nll(msg, context)
    if msg.content.config_records[CONFIG].get("step") == "posterior-nll":
        return _posterior_nll(msg, context)
    j, num = node_partition(context)
    config = msg.content.config_records[CONFIG]
    ds = _dataset(str(config["dataset"]), bool(config["standardize"]), _data_dir(context))
    identity = NodeIdentity(j, num, tuple(int(s) for s in ds.input_shape), int(ds.num_classes),
                            tuple(ds.mean or ()), tuple(ds.std or ()), tuple(ds.classes or ()))
    return Message(content=RecordDict({CLIENT: identity.record()}), reply_to=msg)


def _train_pfnm(msg: Message, context: Context) -> Message:
    c = _Client(msg, context)
    s, ds = c.settings, c.ds
    x, y = c.train_data
    sent = msg.content.array_records[ARRAYS]
    if len(sent) == 0:  # round 1: this client's own initialisation
        net = initial_network(s.network, ds.input_shape, ds.num_classes, seed=s.seed, client=c.j)
    else:
        net = c.network(sent)
    trained = train_network(net, x, y, s.training, seed=s.seed, round=c.round, client=c.j)
    metrics = {"num-examples": int(len(y)), "class-counts": c.class_counts(),
               **activity_metrics(unit_activity_step(trained, x, ds.input_shape, s.training.batch_size))}
    return c.reply(msg, state_to_record(trained.state_dict()), metrics)


def _moments(msg: Message, context: Context) -> Message:
    c = _Client(msg, context)
    x, _ = c.train_data
    net = c.network(msg.content.array_records[ARRAYS])
    layer = msg.content.config_records[CONFIG].get("layer")   # one batch norm at a time (the server's order)
    if layer is not None and layer not in dict(net.named_modules()):
        raise ValueError(f"layer: expected a batch norm of the network, got {layer!r}")
    moments = batch_norm_moments_step(net, x, c.settings.training.batch_size, layer=layer)
    return c.reply(msg, moments_to_record(moments), {"num-examples": int(len(x))})


def _pool_nll(msg: Message, context: Context) -> Message:
    """The pool-temperature step: this client's summed NLL, on its own training data, of the global network (or
    posterior predictive) with pooled heads it was sent (at temperature 1), at every temperature of
    :data:`~bnpfed.matching.pooled_heads.TEMPERATURES`, as the in-process federation computes it."""
    c = _Client(msg, context)
    x, y = c.train_data
    record = msg.content.array_records[ARRAYS]
    if c.config["task"] == "matched-fusion":
        pooled = c.pooled_posterior(record)
        if pooled is None:
            raise ValueError("heads: expected pooled heads beside the global posterior of the pool-temperature step")
        sums = pooled_posterior_nll_step(pooled, x, y, c.settings.predictive_samples,
                                         derive_seed(c.settings.seed, Stream.PREDICT, c.round))
    else:
        sums = pool_nll_step(c.evaluation_network(record), x, y)
    return c.reply(msg, to_array_record({POOL_NLL: sums}), {"num-examples": int(len(x))})


def _posterior_nll(msg: Message, context: Context) -> Message:
    """The predictive-temperature step: this client's summed NLL, on its own training data, of the matched global
    posterior's predictive it was sent, at every temperature of :data:`~bnpfed.matching.pooled_heads.TEMPERATURES`
    (:func:`~bnpfed.federated.clients.posterior_nll_step`, the draws of the round's evaluation), as the in-process
    federation computes it."""
    c = _Client(msg, context)
    if c.config["task"] != "matched-fusion":
        raise ValueError(f"step: 'posterior-nll' scores a matched global posterior, got task {c.config['task']!r}")
    x, y = c.train_data
    model = c.matched_client(msg.content.array_records[ARRAYS], as_prior=False)
    sums = posterior_nll_step(model, x, y, c.settings.predictive_samples,
                              derive_seed(c.settings.seed, Stream.PREDICT, c.round))
    return c.reply(msg, to_array_record({POOL_NLL: sums}), {"num-examples": int(len(x))})


def _train_fedavg(msg: Message, context: Context) -> Message:
    c = _Client(msg, context)
    s = c.settings
    x, y = c.train_data
    trained = train_network(c.network(msg.content.array_records[ARRAYS]), x, y, s.training, seed=s.seed,
                            round=c.round, client=c.j)
    return c.reply(msg, state_to_record(trained.state_dict()), {"num-examples": int(len(y))})


def _train_fusion(msg: Message, context: Context) -> Message:
    """Weight-wise posterior fusion: start from the global model sent, train, reply with the posterior; under
    secure aggregation (task ``"secure-fusion"``) keep the posterior and the global model sent in ``context.state``
    for the secure sum (:func:`~bnpfed.flower.secure.secure_fit`) and reply with the count and the loss only."""
    c = _Client(msg, context)
    s = c.settings
    x, y = c.train_data
    sent = msg.content.array_records[ARRAYS]
    client = start_round_prior_(c.global_client(sent), s.bayesian, c.round)
    loss = fit_bayesian(client, x, y, s.training, seed=s.seed, round=c.round, index=c.j,
                        scale_lr_factor=s.bayesian.scale_lr_factor)
    metrics = {"num-examples": int(len(y)), "train-loss": float(loss)}
    if c.config["task"] == "secure-fusion":
        keep_for_secure_sum(context, client.posterior(), client.deterministic_state(), sent)
        return c.reply(msg, ArrayRecord(), metrics)
    return c.reply(msg, posterior_to_record(client.posterior(), client.deterministic_state()), metrics)


def _train_matched(msg: Message, context: Context) -> Message:
    c = _Client(msg, context)
    s, ds = c.settings, c.ds
    x, y = c.train_data
    sent = msg.content.array_records[ARRAYS]
    if len(sent) == 0:  # round 1: this client's own initialisation
        net = initial_network(replace(s.network, shared_init=False), ds.input_shape, ds.num_classes, seed=s.seed,
                              client=c.j)
        client = posterior_client(net, s.bayesian)
    else:  # its slice of the global posterior (or the whole of it); its prior: round-prior's, or its cavity
        client = c.matched_client(sent, as_prior=True)
    loss = fit_bayesian(client, x, y, s.training, seed=s.seed, round=c.round, index=c.j,
                        scale_lr_factor=s.bayesian.scale_lr_factor)
    # its units' activity on its data, as PFNM's clients send it (read when the server matches on the means)
    metrics = {"num-examples": int(len(y)), "class-counts": c.class_counts(), "train-loss": float(loss),
               **activity_metrics(unit_activity_step(client.mean_network(), x, ds.input_shape,
                                                     s.training.batch_size))}
    return c.reply(msg, matched_posterior_to_record(*client_posterior(client)), metrics)


def _method_of(c: _Client):
    """The federated method the message names, and the shared initial network of its architecture."""
    method = federated_method(c.config.get(METHOD_KEY))
    arch = _architecture(c.settings.network, tuple(c.ds.input_shape), c.ds.num_classes, c.settings.seed)
    return method, arch.template


def _train_method(msg: Message, context: Context) -> Message:
    """A registered federated method's client step on the global state sent, with what this client kept from its
    last round (``context.state``); reply with the update and the step's metrics, keep what the step keeps."""
    c = _Client(msg, context)
    method, template = _method_of(c)
    x, y = c.train_data
    state = tensors_from_arrays(from_array_record(msg.content.array_records[ARRAYS]), label="state")
    kept = context.state.array_records.get(_KEPT)
    kept = None if kept is None else tensors_from_arrays(from_array_record(kept), label="client_state")
    update = client_step(method, template, state, x, y, c.settings.training, seed=c.settings.seed, round=c.round,
                         client=c.j, client_state=kept)
    context.state[_KEPT] = to_array_record(update.client_state)
    return c.reply(msg, to_array_record(update.update), {"num-examples": int(len(y)), **update.metrics})


def evaluate(msg: Message, context: Context) -> Message:
    """An ``evaluate``: the global model's scores on this node's test shard."""
    c = _Client(msg, context)
    x, y = c.test_data
    record = msg.content.array_records[ARRAYS]
    if c.config["task"] == METHOD_KEY:
        method, template = _method_of(c)
        state = tensors_from_arrays(from_array_record(record), label="state")
        with torch.no_grad():
            probs = method.global_network(state, template).eval()(x).softmax(-1)
    elif c.config["task"] in ("pfnm", "fedavg"):
        net = c.evaluation_network(record)
        with torch.no_grad():
            probs = net.eval()(x).softmax(-1)
    elif c.ds.task == "regression":   # weight-wise fusion's global posterior, its predictive of real values
        draws = c.global_client(record).sample_observations(
            x, num_samples=c.settings.predictive_samples, seed=derive_seed(c.settings.seed, Stream.PREDICT, c.round))
        scores = regression_scores(draws, y)
        inside = (scores["lower"] <= y.double()) & (y.double() <= scores["upper"])
        return c.reply(msg, None, {"num-examples": int(len(y)),
                                   "squared-error": float((scores["mean"] - y.double()).square().mean()),
                                   "nll": float(-scores["log_density"].mean()),
                                   "coverage": float(inside.double().mean()),
                                   "interval-width": float((scores["upper"] - scores["lower"]).mean())})
    else:
        model = c.pooled_posterior(record) if c.config["task"] == "matched-fusion" else None
        if model is None:
            model = (c.matched_client(record, as_prior=False) if c.config["task"] == "matched-fusion"
                     else c.global_client(record))
        probs = model.predict_proba(
            x, num_samples=c.settings.predictive_samples, seed=derive_seed(c.settings.seed, Stream.PREDICT, c.round))
    report = classification_report(probs, y)
    metrics = {"num-examples": int(len(y)), "accuracy": float(report["accuracy"]), "nll": float(report["nll"]),
               "brier": float(report["brier"]),
               TEST_CLASS_COUNTS: [int(n) for n in torch.bincount(y, minlength=c.ds.num_classes)]}
    for bins in ECE_BINS:  # sums over the shard's examples: the server adds them up into the test split's ECE
        metrics[f"ece-gaps-{bins}"] = [float(g) for g in calibration_gaps(probs, y, bins)]
    return c.reply(msg, None, metrics)


_TRAIN = {"pfnm": _train_pfnm, "fedavg": _train_fedavg, "fusion": _train_fusion, "matched-fusion": _train_matched,
          METHOD_KEY: _train_method,
          "secure-fusion": _train_fusion}


def train(msg: Message, context: Context) -> Message:
    """A ``train`` message: the step of its ``task``."""
    task = msg.content.config_records[CONFIG].get("task")
    if task not in _TRAIN:
        raise ValueError(f"task: expected one of {sorted(_TRAIN)}, got {task!r}")
    return _TRAIN[task](msg, context)
