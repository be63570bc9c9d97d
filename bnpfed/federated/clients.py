"""The clients' steps, written once: what client j of a federation does, in process or as a Flower ClientApp.

* :func:`build_network`: the network of a :class:`~bnpfed.federated.config.NetworkConfig` for the data's input shape;
* :func:`initial_network`: the network a client starts from (its own initialisation, or the shared one);
* :func:`train_network`: a deterministic client's local training in a round (PFNM's clients, FedAvg's), optionally
  with some parameters frozen (FedMA's retraining of the layers above the matched ones);
* :func:`batch_norm_moments_step`: the moments of a (global) network's batch-norm inputs on the client's data, from
  which the server re-estimates the running statistics after a match or an average;
* :func:`bayesian_client`: a variational Bayesian client of a network (posterior fusion's clients);
* :func:`program_client`: a client of ``BayesianConfig.program``, a user's Pyro program (posterior fusion's clients
  when a config names one), :func:`server_program_client` the server's, and :func:`check_program_task`: its observed
  site fits the dataset's task;
* :func:`posterior_client`: the client of ``BayesianConfig.client``'s kind (variational, or Laplace) that matched
  fusion's clients are;
* :func:`fit_bayesian`: its local step in a round (SVI; or, for a Laplace client, PFNM's training and the Laplace
  posterior).

Every random step draws from a stream of :mod:`bnpfed.seeding`: client j's own initialisation from
``(seed, INIT, 0, j + 1)``, the shared one from ``(seed, INIT, 0, 0)``, its fit in round r from ``(seed, FIT, r, j)``.

Usage::

    >>> from bnpfed.federated.config import NetworkConfig, TrainingConfig
    >>> net = initial_network(NetworkConfig(hidden=(8,)), (1, 8, 8), 10, seed=0, client=3)
    >>> import torch
    >>> x, y = torch.randn(20, 1, 8, 8), torch.arange(20) % 10
    >>> trained = train_network(net, x, y, TrainingConfig(epochs=1), seed=0, round=1, client=3)
    >>> sum(p.numel() for p in trained.parameters())
    610
"""

from __future__ import annotations

import math
from typing import Callable, Collection, Optional, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from bnpfed.federated.config import BayesianConfig, NetworkConfig, TrainingConfig
from bnpfed.clients import SCALE_LR_FACTOR, BayesianClient, DeterministicClient, LaplaceClient, MeanFieldELBO
from bnpfed.matching import derive_spec
from bnpfed.matching import unit_activity
from bnpfed.matching import PooledPosterior, pool_nll, pooled_heads_layer
from bnpfed.matching import BatchNormMoments, batch_norm_moments
from bnpfed.models import LeNet, mlp, reference_init_, simple_cnn
from bnpfed.seeding import Stream, derive_seed, seeded, torch_generator

__all__ = ["batch_norm_moments_step", "bayesian_client", "build_network", "check_program_task", "fit_bayesian",
           "initial_network", "pool_nll_step", "pooled_posterior_nll_step", "posterior_client", "posterior_nll_step",
           "program_client", "server_program_client", "start_round_prior_", "train_network"]


def build_network(network: NetworkConfig, input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """The plain network of ``network.arch`` for inputs of ``input_shape`` (PyTorch's initialisation, from Torch's
    global generator: use :func:`initial_network` for a seeded one). An MLP flattens any input; the convolutional
    networks take square images ``(C, H, H)`` of any channels (a dataset's ``input_shape``: ``(1, 8, 8)`` digits,
    ``(1, 28, 28)`` MNIST, ``(3, 32, 32)`` CIFAR-10).

    >>> build_network(NetworkConfig(arch="simple-cnn-bn"), (3, 32, 32), 10).fc1.in_features
    400
    >>> build_network(NetworkConfig(arch="lenet-paper"), (1, 6, 6), 10)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: arch: expected an architecture that fits images of shape (1, 6, 6), got 'lenet-paper' (image_size: ...)

    :raises ValueError: ``"arch: ..."`` when the images do not fit the architecture.
    """
    input_shape = tuple(int(s) for s in input_shape)
    if network.arch == "mlp":
        return mlp(math.prod(input_shape), list(network.hidden), num_classes)
    if len(input_shape) != 3 or input_shape[1] != input_shape[2]:
        raise ValueError(f"arch: expected square images, input shape (C, H, H), for {network.arch!r}, got "
                         f"{input_shape} (use arch 'mlp' for flat data)")
    channels, size = input_shape[0], input_shape[1]
    try:
        if network.arch in ("lenet", "lenet-paper"):
            return LeNet(in_channels=channels, image_size=size, num_classes=num_classes,
                         conv1_padding=0 if network.arch == "lenet-paper" else 2)
        return simple_cnn(channels, size, num_classes, batch_norm=network.arch == "simple-cnn-bn")
    except ValueError as error:
        raise ValueError(f"arch: expected an architecture that fits images of shape {input_shape}, got "
                         f"{network.arch!r} ({error})") from None


def initial_network(network: NetworkConfig, input_shape: Sequence[int], num_classes: int, *, seed: int,
                    client: Optional[int] = None) -> nn.Module:
    """Client ``client`` 's network before any training, or the shared initial network when ``client`` is None or
    ``network.shared_init`` holds: built from the stream ``(seed, INIT, 0, client + 1)`` (shared: ``(seed, INIT, 0,
    0)``) in ``network.init``'s initialisation."""
    key = 0 if client is None or network.shared_init else int(client) + 1
    stream = derive_seed(seed, Stream.INIT, 0, key)
    with seeded(stream):
        net = build_network(network, input_shape, num_classes)
    if network.init == "reference":
        reference_init_(net, generator=torch_generator(seed, Stream.INIT, 0, key))
    return net


def train_network(net: nn.Module, x: Tensor, y: Tensor, training: TrainingConfig, *, seed: int, round: int,
                  client: int, epochs: Optional[int] = None, frozen: Collection[str] = (),
                  step: Optional[int] = None) -> nn.Module:
    """Client ``client`` 's local step of round ``round`` on a deterministic network: a copy of ``net`` trained in
    training mode (batch norms normalise by the batch and update their running statistics) on ``(x, y)`` with
    ``training.schedule(round)``, drawing from ``(seed, FIT, round, client)``; returned in eval mode (``net`` is not
    changed).

    :param int epochs: local epochs instead of the schedule's (FedMA's retraining); its learning rate is kept.
    :param frozen: names of parameters no step may change (FedMA's matched layers); a batch norm whose scale or
        shift is frozen stays in eval mode, so its running statistics are kept too.
    :param int step: FedMA's layer step within the round, >= 1: the fit draws from the stream spawned from
        ``(seed, FIT, round, client)`` with this key, so every step of a round shuffles anew.
    """
    schedule = training.schedule(round)
    stream = derive_seed(seed, Stream.FIT, round, client)
    if step is not None:
        stream = int(np.random.SeedSequence(stream, spawn_key=(int(step),)).generate_state(1, dtype=np.uint64)[0])
    device = torch.device(training.device)
    client_model = DeterministicClient(net)
    model = client_model.net.to(device).train()
    x, y = x.to(device), y.to(device)
    frozen = set(frozen)
    params = dict(model.named_parameters())
    unknown = sorted(frozen - set(params))
    if unknown:
        raise ValueError(f"frozen: expected parameter names of the network, got {unknown}")
    for name in frozen:
        params[name].requires_grad_(False)
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and (
                {f"{name}.weight", f"{name}.bias"} & frozen):
            module.eval()
    try:
        client_model.fit(x, y, epochs=schedule.epochs if epochs is None else int(epochs),
                         batch_size=training.batch_size, lr=schedule.lr, seed=stream, amsgrad=training.amsgrad,
                         weight_decay=training.weight_decay, optimizer=training.optimizer, momentum=training.momentum,
                         augment=training.augment)
    finally:
        for name in frozen:
            params[name].requires_grad_(True)
    return model.to("cpu").eval()


def batch_norm_moments_step(net: nn.Module, x: Tensor, batch_size: int, layer: Optional[str] = None
                            ) -> dict[str, BatchNormMoments]:
    """A client's step of re-estimating the global network's batch-norm statistics: the moments of batch norm
    ``layer``'s inputs (None: every batch norm's) of ``net`` over the client's training inputs ``x``, the network in
    eval mode, in consecutive batches of ``batch_size`` in the order it holds them
    (:func:`~bnpfed.matching.permutation.batch_norm_moments`; the server sums them over the clients and sets the
    layers one at a time, front to back, :func:`~bnpfed.federated.server.batch_norm_steps`). Empty for a network
    without batch norm."""
    return batch_norm_moments(net, [x[i:i + batch_size] for i in range(0, len(x), batch_size)],
                              None if layer is None else [layer])


def unit_activity_step(net: nn.Module, x: Tensor, input_shape: Sequence[int], batch_size: int = 1024
                       ) -> dict[str, Tensor]:
    """A client's report on its own hidden units: per group of the network's permutation spec, each unit's largest
    absolute contribution to the next layer over the client's training inputs ``x``
    (:func:`~bnpfed.matching.activity.unit_activity`; 0 exactly: a unit dead on the client's data, which the server
    leaves out of matching unless ``PFNMConfig.inactive="keep"``; the one-shot harness adds the client's held-out
    inputs under ``"drop"``, :meth:`~bnpfed.federated.experiment.Experiment.activity`)."""
    return unit_activity(net, x, derive_spec(net, input_shape), batch_size=batch_size)


@torch.no_grad()
def pool_nll_step(net: nn.Module, x: Tensor, y: Tensor, batch_size: int = 1024) -> Tensor:
    """A client's scores of a network with pooled heads on its own data: the summed negative log-likelihood of its
    labels at every temperature of :data:`~bnpfed.matching.pooled_heads.TEMPERATURES`
    (:func:`~bnpfed.matching.pooled_heads.pool_nll` of the network's outputs at temperature 1), what the server adds
    up to choose the pool's temperature (:func:`~bnpfed.matching.pooled_heads.fit_temperature`)."""
    net = net.eval()
    scale = float(pooled_heads_layer(net).temperature)   # its outputs are the pool over its temperature
    return _summed_pool_nll(lambda xb: net(xb) * scale, x, y, batch_size)


def _summed_pool_nll(outputs: Callable[[Tensor], Tensor], x: Tensor, y: Tensor, batch_size: int) -> Tensor:
    """:func:`~bnpfed.matching.pooled_heads.pool_nll` of ``outputs`` (at temperature 1) over ``x`` batch by batch,
    summed: one client's reply to a temperature fit."""
    return sum(pool_nll(outputs(x[i:i + batch_size]), y[i:i + batch_size]) for i in range(0, len(x), batch_size))


def pooled_posterior_nll_step(pooled: PooledPosterior, x: Tensor, y: Tensor, num_samples: int, seed: int,
                              batch_size: int = 1000) -> Tensor:
    """:func:`pool_nll_step` for a :class:`~bnpfed.matching.PooledPosterior`: the predictive of ``num_samples``
    draws from ``seed`` (the same draws on every client and batch) on the client's own data, at every temperature."""
    return _summed_pool_nll(lambda xb: pooled.log_pools(xb, num_samples, seed), x, y, batch_size)


def posterior_nll_step(client: BayesianClient, x: Tensor, y: Tensor, num_samples: int, seed: int,
                       batch_size: int = 1000) -> Tensor:
    """:func:`pool_nll_step` for a global Bayesian client: its posterior predictive of ``num_samples`` draws from
    ``seed`` (:meth:`~bnpfed.clients.BayesianClient.sample_outputs`, batch by batch as its ``predict_proba`` runs)
    on the client's own data, at every temperature of :data:`~bnpfed.matching.pooled_heads.TEMPERATURES` (the
    network's logits, whatever temperature its likelihood holds): what the server adds up to choose the predictive's
    temperature (``FusionConfig(temperature="fit")``)."""
    return _summed_pool_nll(lambda xb: client.sample_outputs(xb, num_samples, seed), x, y, batch_size)


def bayesian_client(net: nn.Module, bayesian: BayesianConfig) -> BayesianClient:
    """A variational Bayesian client of (a copy of) ``net`` with ``bayesian``'s prior, likelihood, initial posterior
    scale and local reparameterisation; the in-process federation and the Flower client app build their clients
    here."""
    return BayesianClient(net, bayesian.build_prior(), likelihood=bayesian.build_likelihood(),
                          init_scale=bayesian.init_scale,
                          local_reparameterization=bayesian.local_reparameterization,
                          elbo=MeanFieldELBO(kl_weight=bayesian.kl_weight))


def program_client(bayesian: BayesianConfig, x: Tensor, y: Tensor, *, seed: int) -> BayesianClient:
    """A variational client of ``bayesian.program``, a user's Pyro program: the factory called afresh under the
    stream ``(seed, INIT, 0, 0)`` (the same for every client and the server: a program's own parameters, if it has
    any, start equal on every client, as a shared initialisation does; Torch's global random state is left as it
    was), the client built as :class:`~bnpfed.clients.BayesianClient` builds a program (its guide the factory's, or
    ``AutoNormal``; Pyro's ``Trace_ELBO``) and its guide set up on the first examples of ``(x, y)``
    (:meth:`~bnpfed.clients.BayesianClient.prepare`: its initial values from seed 0, the same on every client).
    The in-process federation and the Flower client app build their program clients here."""
    if bayesian.program is None:
        raise ValueError("bayesian.program: expected a Pyro program (a registered name or a factory), got None")
    with seeded(derive_seed(seed, Stream.INIT, 0, 0)):
        model, guide = bayesian.build_program()
    return BayesianClient(model, guide=guide).prepare(x, y)


def server_program_client(bayesian: BayesianConfig, input_shape: Sequence[int], task: str, *,
                          seed: int) -> BayesianClient:
    """The server's model of ``bayesian.program`` before round 1, holding the initial global posterior: a
    :func:`program_client` set up on two all-zero examples of ``input_shape`` (targets 0: integers for a
    ``"classification"``, reals for a ``"regression"``), so that the server needs no data; the guide's initial values
    are drawn from seed 0 whatever the examples (an autoguide's from the program's priors), so each client set up on
    its own data and the server start from the same posterior. The in-process federation and the Flower server both
    start from it.

    :raises ValueError: ``"program: ..."`` when the program's observed site does not fit ``task``
        (:func:`check_program_task`), before any training."""
    x = torch.zeros(2, *(int(s) for s in input_shape))
    y = torch.zeros(2, dtype=torch.long if task == "classification" else torch.get_default_dtype())
    client = program_client(bayesian, x, y, seed=seed)
    check_program_task(client, task, x)
    return client


def check_program_task(client: BayesianClient, task: str, x: Tensor) -> None:
    """A program client's observed site fits the dataset's ``task`` (:data:`~bnpfed.data.TASKS`): a classification's
    is a ``Categorical`` (its predictive is class probabilities), a regression's a ``Normal`` or ``StudentT`` (its
    predictive a mean and a variance); checked on one draw of the predictive on ``x[:1]``, before any training.

    :raises ValueError: ``"program: ..."`` naming the task and what the program's observed site gives.
    """
    try:
        predicted = client.predict(x[:1], num_samples=1, seed=0)
    except ValueError as error:
        raise ValueError(f"program: its observed site {client.bnn.observed_site!r} has no predictive bnpfed "
                         f"aggregates ({error})") from None
    classifies = torch.is_tensor(predicted)
    if (task == "classification") != classifies:
        raise ValueError(f"program: a {task}'s clients need an observed site of "
                         f"{'a Categorical' if task == 'classification' else 'a Normal or StudentT'} distribution; "
                         f"the program's {client.bnn.observed_site!r} gives "
                         f"{'class probabilities' if classifies else 'real values'}")


def posterior_client(net: nn.Module, bayesian: BayesianConfig) -> BayesianClient | LaplaceClient:
    """A client of (a copy of) ``net`` of ``bayesian.client`` 's kind: :func:`bayesian_client` (variational), or a
    :class:`~bnpfed.clients.LaplaceClient` whose Bayesian sites are those ``bayesian`` 's prior makes Bayesian."""
    if bayesian.client == "laplace":
        return LaplaceClient(net, bayesian.build_prior(), prior_precision=bayesian.laplace_prior)
    return bayesian_client(net, bayesian)


def start_round_prior_(client: BayesianClient, bayesian: BayesianConfig, round: int) -> BayesianClient:
    """Weight-wise fusion's client of round ``round``, holding the global posterior it starts from: with
    ``bayesian.round_prior == "posterior"`` and from round 2 on, that posterior becomes its prior too
    (:meth:`~bnpfed.clients.BayesianClient.update_prior_`); else it keeps the configured prior. The in-process
    federation and the Flower client app both call it. Returns ``client``."""
    if round > 1 and bayesian.round_prior == "posterior":
        client.update_prior_(client.posterior())
    return client


def fit_bayesian(client: BayesianClient | LaplaceClient, x: Tensor, y: Tensor, training: TrainingConfig, *,
                 seed: int, round: int, index: int, scale_lr_factor: float = SCALE_LR_FACTOR) -> float:
    """Client ``index`` 's local step of round ``round``: ``training.schedule(round)`` epochs, drawing from ``(seed,
    FIT, round, index)``. A variational client runs SVI, the guide's scales at ``scale_lr_factor`` times the
    schedule's rate (``BayesianConfig.scale_lr_factor``; default :data:`~bnpfed.clients.SCALE_LR_FACTOR`; a Pyro
    program's guide at :meth:`~bnpfed.clients.BayesianClient.fit`'s own default, one rate for all), and the
    loss returned is its last epoch's negative ELBO per example. A :class:`~bnpfed.clients.LaplaceClient` trains
    its network exactly as :func:`train_network` does (the same network, to the bit), then fits its Laplace
    posterior on the same data (with ``laplace_prior="held-out"`` on all but a held-out tenth, which chooses the
    prior precision); the loss returned is its last epoch's mean cross-entropy. On the CPU only (``training.device``
    must be ``"cpu"``)."""
    if torch.device(training.device).type != "cpu":
        raise ValueError(f"training.device: expected 'cpu' for the Bayesian clients' SVI (it runs on the CPU only), "
                         f"got {training.device!r}")
    schedule = training.schedule(round)
    common = dict(epochs=schedule.epochs, batch_size=training.batch_size, lr=schedule.lr,
                  seed=derive_seed(seed, Stream.FIT, round, index), amsgrad=training.amsgrad)
    if isinstance(client, LaplaceClient):
        if scale_lr_factor != SCALE_LR_FACTOR:
            raise ValueError(f"scale_lr_factor: a setting of the variational clients' SVI; expected its default "
                             f"{SCALE_LR_FACTOR!r} for a Laplace client, got {scale_lr_factor!r}")
        client.fit(x, y, **common, weight_decay=training.weight_decay, optimizer=training.optimizer,
                   momentum=training.momentum, augment=training.augment)
    else:
        if training.optimizer != "adam":
            raise ValueError(f"training.optimizer: the variational clients' SVI runs Adam; expected 'adam' with a "
                             f"variational client, got {training.optimizer!r}")
        # a Pyro program's guide is the user's: fit's own default, one rate for all (scale_lr_factor keeps its default)
        scale_lr = None if client.is_program else scale_lr_factor * schedule.lr
        client.fit(x, y, **common, scale_lr=scale_lr, augment=training.augment)
    return float(client.losses_[-1])
