"""The settings of a federated run, one small frozen dataclass per concern, shared by the in-process federations,
the experiment harness, the command line and the Flower apps.

* :class:`PartitionConfig`: how the training data is split among the J clients;
* :class:`NetworkConfig`: the clients' network and its initialisation;
* :class:`TrainingConfig`: what a client does locally in a round (epochs, optimiser, the per-round schedule);
* :class:`BayesianConfig`: what makes a client Bayesian (prior, guide initialisation, local reparameterisation);
* :class:`PFNMConfig`: the PFNM server (Beta-Bernoulli matching hyper-parameters, client sampling);
* :class:`FusionConfig`: the posterior-fusion server (rule, client weights, pooling draws, variance floor, client
  sampling);
and the harness around them, :class:`~bnpfed.federated.experiment.ExperimentConfig` (which methods, rounds, seed,
hyper-parameter selection, evaluation), lives beside the method registry it validates against
(:mod:`bnpfed.federated.methods`). Flower takes everything but that one (its run has ``rounds`` and ``seed`` of its
own).

Every field is checked in ``__post_init__``; a bad value raises ``ValueError("<field>: expected <what>, got
<value>")``, so a command can name the flag. The words are the same everywhere: partitions are ``"iid"`` and
``"dirichlet"`` (``"homogeneous"``/``"homo"`` and ``"hetero"``/``"heterogeneous"`` are accepted aliases), ``epochs``
are local epochs, ``fraction`` is the share of clients sampled per round.

Usage::

    >>> PartitionConfig(clients=5, partition="hetero").partition
    'dirichlet'
    >>> PFNM_TRAINING.schedule(3)                # the reference code's schedule: round 3 retrains 5 epochs
    LocalSchedule(epochs=5, lr=0.009801)
    >>> TrainingConfig(lr=0)
    Traceback (most recent call last):
    ...
    ValueError: lr: expected a positive finite number, got 0
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple, Optional, Sequence, Union

import numpy as np

from bnpfed.clients import check_augment
from bnpfed.matching import ATOM_POSTERIOR, MATCH_ON, PVI, matched_rules
from bnpfed.matching import SCHEDULES, STARTS, STOPS
from bnpfed.matching import REFERENCE_CONSTANTS
from bnpfed.clients import check_optimizer
from bnpfed.federated.partition import holdout_split, partition_dirichlet, partition_homogeneous
from bnpfed.models import (LIKELIHOODS, PRIOR_VARIANCES, PRIORS, Categorical, Likelihood, Prior,
                           available_likelihoods, available_priors, build_likelihood, build_prior)
from bnpfed.seeding import Stream, derive_seed
from bnpfed.validation import (check_bool, check_choice, check_device, check_float, check_fraction, check_int,
                               check_ints, check_positive)

__all__ = [
    "ALIGNMENTS",
    "EB_DEFAULTS",
    "ARCHITECTURES",
    "CLIENT_KINDS",
    "PVI_DAMPING",
    "CLIENT_WEIGHTS",
    "FUSION_TRAINING",
    "INITIALISATIONS",
    "PARTITIONS",
    "PARTITION_ALIASES",
    "PFNM_NETWORK",
    "PAPER_MIN_VARIANCE",
    "PFNM_TRAINING",
    "PRIORS",
    "PRIOR_VARIANCES",
    "LIKELIHOODS",
    "ROUND_PRIORS",
    "LATER_ROUNDS",
    "HEADS",
    "BayesianConfig",
    "FusionConfig",
    "LocalSchedule",
    "NetworkConfig",
    "PFNMConfig",
    "PartitionConfig",
    "TrainingConfig",
    "config_dict",
    "holdout_split",
]

#: Partition schemes, and the older spellings accepted for them.
PARTITIONS = ("iid", "dirichlet")
PARTITION_ALIASES = {"homogeneous": "iid", "homo": "iid", "hetero": "dirichlet", "heterogeneous": "dirichlet"}
#: Networks a client can hold (:func:`~bnpfed.federated.clients.build_network`): a ReLU MLP, our LeNet-5 (conv1
#: padded by 2, 400 features into fc1 on 28x28 images), LeNet-5 as Ozer et al.'s code has it (no padding on conv1,
#: ``"lenet-paper"``), FedMA's simple CNN and the same with batch norm after each convolution.
ARCHITECTURES = ("mlp", "lenet", "lenet-paper", "simple-cnn", "simple-cnn-bn")
#: ``"torch"``: PyTorch's default initialisation; ``"reference"``: the PFNM reference code's (weights N(0, 0.1^2),
#: biases 0.1).
INITIALISATIONS = ("torch", "reference")
# PRIORS (the built-in named priors of BayesianConfig: N(0, prior_scale^2) on the nn.Linear weight matrices only,
# Ozer et al.'s choice, or on every parameter), PRIOR_VARIANCES and LIKELIHOODS live in bnpfed.models beside the
# registry of names that plugins add to (available_priors, available_likelihoods); they are re-exported here.
#: PVI's default damping: on MNIST (J = 10, Dirichlet(0.5), 10 rounds, clients at the tempered optimum) the parallel
#: update diverged at 1, 0.5 and 0.25 and rose every round at 0.1 (benchmarks/README.md, "PVI rounds").
PVI_DAMPING = 0.1
#: How a Bayesian client gets its posterior: by SVI on the ELBO (:class:`~bnpfed.clients.BayesianClient`), or by
#: training its network as a PFNM client does and a diagonal Laplace approximation after the fact
#: (:class:`~bnpfed.clients.LaplaceClient`, prior precision per site by the marginal likelihood).
CLIENT_KINDS = ("variational", "laplace")
#: A Laplace client's prior precision: each weight matrix's evidence maximiser, or those scaled by the factor a
#: held-out tenth of the client's data prefers (:class:`~bnpfed.clients.LaplaceClient`'s ``prior_precision``).
LAPLACE_PRIORS = ("marglik", "held-out")
#: What a variational client's prior is in the rounds after the first (:class:`BayesianConfig`'s ``round_prior``):
#: the configured prior, the global posterior only where its SVI starts (the default), or the global posterior (its
#: slice under matched fusion) as its prior too (posterior as prior: it counts the client's data once more a round).
ROUND_PRIORS = ("prior", "posterior")
#: Matched fusion's rounds after the first (:class:`FusionConfig`'s ``later_rounds``): each client from its slice and
#: the units matched again, or every client from the whole global posterior with the assignment fixed.
LATER_ROUNDS = ("rematch", "fixed")
#: Matched fusion's output layer (:class:`FusionConfig`'s ``heads``): the rule's fusion of the clients' output layers,
#: or the clients' own output layers pooled log-linearly with the class shares.
HEADS = ("fused", "pooled")
#: ``pool_temperature="fit"``: the pool's temperature chosen by the clients' data.
FIT = "fit"


def check_pool_temperature(value, name: str = "pool_temperature") -> None:
    """``pool_temperature``: a number > 0 or ``"fit"`` (read by pooled heads only: ``heads="pooled"``, or the
    methods ``pfnm-pooled``, ``fedma-pooled``, ``match-<rule>-pooled``; a federation or an experiment with neither
    refuses a value other than 1: :func:`check_pool_temperature_applies`). ``name``: the argument checked (also
    :class:`FusionConfig`'s ``temperature``)."""
    if isinstance(value, str):
        if value != FIT:
            raise ValueError(f"{name}: expected a number > 0 or {FIT!r}, got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a number > 0 or {FIT!r}, got {value!r}")


def check_pool_temperature_applies(config, pooled: bool) -> None:
    """Refuse ``config.pool_temperature`` other than 1 unless ``pooled`` (something pools heads with it)."""
    if config.pool_temperature != 1 and not pooled:
        raise ValueError(f"pool_temperature: the temperature of pooled heads; expected 1 without them (heads="
                         f"{config.heads!r}), got {config.pool_temperature!r}")


#: Client weights ``b_k`` of posterior fusion: proportional to the local data size, or uniform.
CLIENT_WEIGHTS = ("size", "uniform")


def config_dict(config) -> dict:
    """A config as plain JSON-ready values (a prior or likelihood object becomes its ``repr``)."""
    out = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if isinstance(value, (Prior, Likelihood)):
            value = repr(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


# ------------------------------------------------------------------------------------------------ partitioning


@dataclass(frozen=True)
class PartitionConfig:
    """How the training split is divided among the clients.

    :param int clients: J, the number of clients. Default 10.
    :param str partition: ``"iid"`` (shuffle and cut into J near-equal parts) or ``"dirichlet"`` (label-Dirichlet
        with concentration ``alpha``; see :func:`~bnpfed.federated.partition.partition_dirichlet`). Default
        ``"iid"``.
    :param float alpha: Dirichlet concentration (``"dirichlet"`` only), > 0. Default 0.5.
    :param int min_size: fewest examples a client may hold (``"dirichlet"`` only), >= 0. Default 10.
    """

    clients: int = 10
    partition: str = "iid"
    alpha: float = 0.5
    min_size: int = 10

    def __post_init__(self):
        check_int(self.clients, "clients", low=1)
        object.__setattr__(self, "partition", check_choice(self.partition, PARTITIONS, "partition",
                                                           aliases=PARTITION_ALIASES))
        check_positive(self.alpha, "alpha")
        check_int(self.min_size, "min_size", low=0)

    def check_fits(self, num_examples: int) -> None:
        """Raise if ``num_examples`` training examples cannot be split this way (before anything trains)."""
        if self.clients > num_examples:
            raise ValueError(f"clients: expected at most the {num_examples} training examples, got {self.clients}")
        if self.partition == "dirichlet" and self.min_size * self.clients > num_examples:
            raise ValueError(f"min_size: expected at most {num_examples // self.clients} ({num_examples} training "
                             f"examples over {self.clients} clients), got {self.min_size}")

    def split(self, labels, seed: int) -> list[np.ndarray]:
        """The J clients' sorted index arrays into ``labels``, drawn from the stream ``(seed, PARTITION)``."""
        labels = np.asarray(labels)
        self.check_fits(len(labels))
        rng = derive_seed(seed, Stream.PARTITION)
        if self.partition == "iid":
            return partition_homogeneous(labels, self.clients, seed=rng)
        return partition_dirichlet(labels, self.clients, alpha=self.alpha, min_size=self.min_size, seed=rng)


# ------------------------------------------------------------------------------------------------ clients


@dataclass(frozen=True)
class NetworkConfig:
    """The clients' network.

    :param str arch: ``"mlp"`` (ReLU MLP on flattened inputs, widths ``hidden``), ``"lenet"`` (LeNet-5, conv1
        padded by 2), ``"lenet-paper"`` (LeNet-5 as Ozer et al.'s code has it, no padding), ``"simple-cnn"``
        (FedMA's CIFAR-10 network: conv 6, conv 16, fc 120, 84) or ``"simple-cnn-bn"`` (the same with a batch norm
        after each convolution). The convolutional ones take images ``(C, H, H)`` as they come (any channels, at
        least 8x8; 4x4 for ``"lenet"``) and are not flattened. Default ``"mlp"``.
    :param tuple hidden: hidden widths of the MLP (the convolutional networks' widths are fixed). Default ``(100,)``.
    :param str init: ``"torch"`` (PyTorch's default initialisation) or ``"reference"`` (the PFNM reference code's:
        weights N(0, 0.1^2), biases 0.1). Default ``"torch"``.
    :param bool shared_init: every client starts from one initialisation (FedAvg needs it to mean anything;
        PFNM does not). Default False; the posterior-fusion federations always share it (the global model).
    """

    arch: str = "mlp"
    hidden: tuple[int, ...] = (100,)
    init: str = "torch"
    shared_init: bool = False

    def __post_init__(self):
        check_choice(self.arch, ARCHITECTURES, "arch")
        object.__setattr__(self, "hidden", check_ints(self.hidden, "hidden", low=1))
        check_choice(self.init, INITIALISATIONS, "init")
        check_bool(self.shared_init, "shared_init")


class LocalSchedule(NamedTuple):
    """What every client does in one round: ``epochs`` passes of its optimiser at learning rate ``lr``."""

    epochs: int
    lr: float


@dataclass(frozen=True)
class TrainingConfig:
    """A client's local training: Adam (or SGD) on mini-batches, round after round.

    Round 1 trains ``epochs`` epochs at ``lr``; a later round r trains ``round_epochs`` epochs (``epochs`` when
    None) at ``lr * lr_decay ** (r - 1)``.

    :param int epochs: local epochs of round 1 (of every round when ``round_epochs`` is None). Default 2.
    :param int batch_size: mini-batch size. Default 32.
    :param float lr: the learning rate. Default ``1e-2``.
    :param float weight_decay: L2 strength (coupled, as ``torch.optim.Adam``'s and ``SGD``'s), >= 0. Default 0.
    :param bool amsgrad: the AMSGrad variant of Adam. Default False.
    :param str optimizer: ``"adam"`` (default) or ``"sgd"``: the deterministic clients' optimiser (PFNM's, FedAvg's,
        FedMA's retraining, Laplace clients'; NIID-Bench's FedAvg runs SGD). The variational clients' SVI runs Adam
        only.
    :param float momentum: SGD's momentum in [0, 1) (None: none); with ``optimizer="sgd"`` only. Default None.
    :param int round_epochs: local epochs of rounds 2, 3, ...; None: ``epochs``. Default None.
    :param float lr_decay: learning-rate factor per round, in (0, 1]. Default 1.
    :param str device: where the deterministic clients train (PFNM's, FedAvg's, FedMA's retraining): ``"cpu"``
        (default) or a CUDA device torch sees (``"cuda"``, ``"cuda:1"``); the trained networks come back on the CPU,
        where the server matches and averages them (the matcher is numpy and scipy). The Bayesian clients' SVI runs
        on the CPU only: another device is refused there. The same seed gives the same mini-batches on every device;
        the floating-point results of another device differ in the last digits.
    :param str augment: each mini-batch's images drawn through a random transform before the step (data
        augmentation, :mod:`bnpfed.clients.augment`): ``"none"`` (default), ``"crop"`` (reflect-pad 4 pixels, a
        random crop back to size) or ``"crop-flip"`` (and a left-right flip with probability 1/2: CIFAR-10's usual
        transforms, NIID-Bench's). Images ``(C, H, W)`` only (:meth:`check_inputs`); every client and every kind
        of client (deterministic, variational, Laplace) trains with it; evaluation, matching and the clients'
        reports see the images as they are.

    :data:`PFNM_TRAINING` is the PFNM reference code's (10 epochs of AMSGrad at 0.01, batch 32, L2 1e-6; later
    rounds 5 epochs with the rate decayed by 0.99 a round); :data:`FUSION_TRAINING` (the defaults) suits posterior
    fusion on the bundled digits (see :mod:`bnpfed.federated.fusion`).
    """

    epochs: int = 2
    batch_size: int = 32
    lr: float = 1e-2
    weight_decay: float = 0.0
    amsgrad: bool = False
    round_epochs: Optional[int] = None
    lr_decay: float = 1.0
    device: str = "cpu"
    optimizer: str = "adam"
    momentum: Optional[float] = None
    augment: str = "none"

    def __post_init__(self):
        check_device(self.device, "device")
        check_optimizer(self.optimizer, self.momentum, self.amsgrad)
        check_augment(self.augment)
        check_int(self.epochs, "epochs", low=1)
        check_int(self.batch_size, "batch_size", low=1)
        check_positive(self.lr, "lr")
        check_float(self.weight_decay, "weight_decay", low=0.0)
        check_bool(self.amsgrad, "amsgrad")
        if self.round_epochs is not None:
            check_int(self.round_epochs, "round_epochs", low=1)
        check_float(self.lr_decay, "lr_decay", low=0.0, high=1.0, low_open=True, what="a number in (0, 1]")

    def amsgrad_for(self, optimizer: str) -> bool:
        """AMSGrad for ``optimizer`` when a user leaves it to this schedule's default: ``amsgrad`` with Adam, off with
        SGD (AMSGrad is a variant of Adam, so an Adam schedule's default gives way to ``"sgd"``; ``amsgrad=True``
        set with SGD is still refused). ``bnpfed pfnm`` / ``bnpfed fuse`` and the Flower run config both resolve
        an unset ``amsgrad`` here."""
        return self.amsgrad and optimizer == "adam"

    def check_inputs(self, input_shape: Sequence[int]) -> None:
        """Raises unless the settings apply to inputs of ``input_shape`` (one example's shape): ``augment``'s
        crops need images ``(C, H, W)``."""
        check_augment(self.augment, input_shape)

    def schedule(self, round: int) -> LocalSchedule:
        """The local training of round ``round`` (1-based)."""
        check_int(round, "round", low=1)
        if round == 1:
            return LocalSchedule(self.epochs, self.lr)
        epochs = self.epochs if self.round_epochs is None else self.round_epochs
        return LocalSchedule(epochs, self.lr * self.lr_decay ** (round - 1))


#: The PFNM reference code's local training (``experiment.py``).
PFNM_TRAINING = TrainingConfig(epochs=10, batch_size=32, lr=0.01, weight_decay=1e-6, amsgrad=True, round_epochs=5,
                               lr_decay=0.99)
#: Posterior fusion's defaults on the bundled digits (the :class:`TrainingConfig` defaults).
FUSION_TRAINING = TrainingConfig()
#: PFNM's clients: MLPs in the reference initialisation, each from its own.
PFNM_NETWORK = NetworkConfig(init="reference")


@dataclass(frozen=True)
class BayesianConfig:
    """What makes a client Bayesian: a prior over (some of) the network's parameters and a mean-field Gaussian guide.

    :param prior: a :class:`~bnpfed.models.Prior` object (any prior at all; every client built from this config
        shares it, so ``Prior.update_`` on it reaches them all), or the name of one
        (:func:`~bnpfed.models.available_priors`: ``"linear-weights"``, N(0, prior_scale^2) on the ``nn.Linear``
        weight matrices only, Ozer et al.'s choice; ``"all"``, on every parameter; and any a plugin registered with
        :func:`~bnpfed.models.register_prior`), built anew for each client. Default ``"linear-weights"``.
    :param float prior_scale: the standard deviation of a named prior (unused with a prior object). Default 1.
    :param float init_scale: the guide's initial posterior standard deviation. Default ``1e-2``.
    :param bool local_reparameterization: train and predict with the local reparameterisation trick (the paper
        does). Default True.
    :param str prior_variance: a named prior's variance: ``"fixed"`` (``prior_scale^2``, the paper's) or
        ``"empirical-bayes"`` (each client's own type-II maximum-likelihood estimate per weight matrix, re-estimated
        after every step, starting at ``prior_scale^2``: :class:`~bnpfed.models.EmpiricalBayesPrior`). With a prior
        object, only ``"fixed"`` (the object says what it is). Default ``"fixed"``.
    :param float kl_weight: lambda, the weight of the KL term in the clients' loss, > 0: 1 is the ELBO; lambda < 1 a
        tempered ("cold") posterior, each example's likelihood counted 1/lambda times
        (:class:`~bnpfed.clients.MeanFieldELBO`). Default 1.
    :param float scale_lr_factor: the guide's scales learn at ``scale_lr_factor`` times the schedule's learning rate
        (:meth:`~bnpfed.clients.BayesianClient.fit`'s ``scale_lr``), > 0. Default 1: one rate for all, the
        recorded behaviour, where the scales barely leave ``init_scale`` in a round's few hundred steps. 10 reaches
        the variational optimum; under the paper's N(0, 1) prior that optimum underfits (784-100-10 on 6,000 MNIST
        digits, 10 epochs: accuracy 0.873 against 0.932 at factor 1; benchmarks/README.md), so 1 stays the default
        until a prior that does not swamp the data is.
    :param str client: ``"variational"`` (default; SVI) or ``"laplace"``: each client trains its network by maximum
        likelihood, exactly as a PFNM client does (the same seeds give the same networks), and takes the diagonal
        Laplace posterior of the sites ``prior`` makes Bayesian, with each site's prior precision by the marginal
        likelihood (:class:`~bnpfed.clients.LaplaceClient`). For matched fusion (the clients' posteriors are
        matched and fused; the global network is then a mean-field Gaussian network like any other); in later
        rounds a client starts from its slice's means, its prior the zero-mean evidence one (the slice is no prior).
        The settings of SVI (``prior_scale``, ``init_scale``, ``prior_variance``, ``kl_weight``,
        ``scale_lr_factor``, ``round_prior``) do not apply and must keep their defaults.
    :param str round_prior: a variational client's prior in the rounds after the first, where it starts from the
        global posterior (weight-wise fusion) or its slice of it (matched fusion): ``"prior"`` (the configured prior;
        the global posterior is only where its SVI starts, so each round fuses J posteriors that hold each client's
        data once, as Ozer et al.'s rounds do) or ``"posterior"`` (the global posterior, or its slice, is its prior
        too: posterior as prior; it already holds the client's own likelihood, which the next fit multiplies in
        again, so its data counts once more every round and matched rounds level off: MNIST, J = 10,
        Dirichlet(0.5), 10 rounds, matched conflation 0.9581 against 0.9708 with ``"prior"``; benchmarks/README.md).
        None (default): ``"prior"``. Rule ``"pvi"`` trains every client against its cavity and takes None only
        (:meth:`FusionConfig.client_prior`).
    :param likelihood: the clients' observation model: a :class:`~bnpfed.models.Likelihood` object or the name of
        one (:func:`~bnpfed.models.available_likelihoods`: ``"categorical"``, and any a plugin registered with
        :func:`~bnpfed.models.register_likelihood`). The federations classify (accuracy, NLL, calibration of class
        probabilities), so it must be a :class:`~bnpfed.models.Categorical` (or a subclass). Variational clients
        only: a Laplace client trains by cross-entropy. Default ``"categorical"``.
    :param str laplace_prior: ``client="laplace"`` only: each weight matrix's prior precision ``"marglik"`` (default:
        its evidence maximiser) or ``"held-out"`` (those scaled by one factor, chosen by the held-out negative
        log-likelihood of the linearised predictive on a tenth of the client's data held out from its training;
        the evidence of the diagonal posterior leaves the predictive under-confident: benchmarks/README.md).
    """

    prior: Union[str, Prior] = "linear-weights"
    prior_scale: float = 1.0
    init_scale: float = 1e-2
    local_reparameterization: bool = True
    prior_variance: str = "fixed"
    kl_weight: float = 1.0
    scale_lr_factor: float = 1.0
    client: str = "variational"
    round_prior: Optional[str] = None
    laplace_prior: str = "marglik"
    likelihood: Union[str, Likelihood] = "categorical"

    def __post_init__(self):
        if not isinstance(self.prior, Prior):
            check_choice(self.prior, available_priors(), "prior")
        check_positive(self.prior_scale, "prior_scale")
        check_positive(self.init_scale, "init_scale")
        check_bool(self.local_reparameterization, "local_reparameterization")
        check_choice(self.prior_variance, PRIOR_VARIANCES, "prior_variance")
        if isinstance(self.prior, Prior) and self.prior_variance != "fixed":
            raise ValueError(f"prior_variance: sets a named prior's variance; with a prior object "
                             f"({type(self.prior).__name__}) the object decides (EmpiricalBayesPrior for empirical "
                             f"Bayes), got prior_variance={self.prior_variance!r}")
        check_positive(self.kl_weight, "kl_weight")
        check_positive(self.scale_lr_factor, "scale_lr_factor")
        check_choice(self.client, CLIENT_KINDS, "client")
        if self.round_prior is not None:
            check_choice(self.round_prior, ROUND_PRIORS, "round_prior")
        check_choice(self.laplace_prior, LAPLACE_PRIORS, "laplace_prior")
        if self.laplace_prior != "marglik" and self.client != "laplace":
            raise ValueError(f"laplace_prior: a Laplace client's prior precision; expected its default 'marglik' with "
                             f"client={self.client!r}, got {self.laplace_prior!r}")
        if not isinstance(self.likelihood, Likelihood):
            check_choice(self.likelihood, available_likelihoods(), "likelihood")
        if not isinstance(self.build_likelihood(), Categorical):
            raise ValueError(f"likelihood: expected a classification likelihood (a Categorical or a subclass: the "
                             f"federations score class probabilities), got {self.likelihood!r}")
        if not isinstance(self.prior, Prior):
            self.build_prior()   # a plugin's prior without an empirical-Bayes form says so here, before any work
        if self.client == "laplace" and self.likelihood != "categorical":
            raise ValueError(f"likelihood: a variational client's observation model; Laplace clients "
                             f"(client='laplace') train by cross-entropy, expected 'categorical', got "
                             f"{self.likelihood!r}")
        if self.client == "laplace":
            defaults = {f.name: f.default for f in fields(self)}
            for name in ("prior_scale", "init_scale", "prior_variance", "kl_weight", "scale_lr_factor",
                         "round_prior"):
                default = defaults[name]
                if getattr(self, name) != default:
                    raise ValueError(f"{name}: a setting of the variational clients' SVI, which Laplace clients "
                                     f"(client='laplace') do not run; expected its default {default!r}, got "
                                     f"{getattr(self, name)!r}")

    def check_training(self, training: "TrainingConfig") -> None:
        """``training`` can train these clients: the variational clients' SVI runs Adam only (a ``training``
        with ``optimizer="sgd"`` serves deterministic and Laplace clients)."""
        if self.client == "variational" and training.optimizer != "adam":
            raise ValueError(f"training.optimizer: the variational clients' SVI runs Adam; expected 'adam' with "
                             f"client='variational', got {training.optimizer!r}")

    def build_prior(self) -> Prior:
        """The prior object (a new one for a named prior: :func:`~bnpfed.models.build_prior` at ``prior_scale`` and
        ``prior_variance``)."""
        if isinstance(self.prior, Prior):
            return self.prior
        return build_prior(self.prior, scale=float(self.prior_scale), variance=self.prior_variance)

    def build_likelihood(self) -> Likelihood:
        """The likelihood object (a new one for a named likelihood: :func:`~bnpfed.models.build_likelihood`)."""
        if isinstance(self.likelihood, Likelihood):
            return self.likelihood
        return build_likelihood(self.likelihood)


# ------------------------------------------------------------------------------------------------ servers


#: The settings of :class:`PFNMConfig` that apply under empirical Bayes only, at their defaults: a config derived with
#: fixed hyper-parameters from one that estimates them (a grid of fixed values) takes these.
EB_DEFAULTS = dict(starts="even-split", stop="result")


@dataclass(frozen=True)
class PFNMConfig:
    """The PFNM server: Beta-Bernoulli matching of the clients' neurons (Yurochkin et al. 2019).

    By default nothing is set by hand: every hidden layer's hyper-parameters (the atoms' prior mean ``mu0`` and
    variance ``sigma0_2``, the local noise variance ``sigma2``, the IBP mass ``gamma0``) are estimated from the
    clients' weights alone while matching (empirical Bayes, as SPAHM does; see
    :func:`~bnpfed.matching.match_layer`), with the marginal objective. A value given here fixes that
    hyper-parameter and turns its estimation off.

    :param sigma2: local noise variance, > 0: one value, one per hidden layer, or None (estimated). Default None.
    :param sigma0_2: prior variance of the global atoms, as ``sigma2``. Default None.
    :param gamma0: IBP mass, as ``sigma2``. Default None.
    :param str hyperparameters: ``"empirical-bayes"`` (the hyper-parameters left None are estimated per layer) or
        ``"fixed"`` (none is estimated; those left None take the reference code's value 1, and the atoms' prior mean
        is 0 for weights and 0.1 for biases). Default ``"empirical-bayes"``.
    :param str constants: ``"bnpfed"`` (the exact objective: popularity factor 2, no caps) or ``"reference"`` (the
        published code's constants and fixed hyper-parameters, :data:`~bnpfed.matching.REFERENCE_CONSTANTS`).
        Default ``"bnpfed"``.
    :param str objective: ``"map"`` (published) or ``"marginal"`` (atoms integrated out); None: marginal under
        empirical Bayes (the only objective it uses), MAP with fixed hyper-parameters. Default None.
    :param str direction: layer order, ``"bottom-up"`` or ``"top-down"`` (published). Default ``"bottom-up"``.
    :param int sweeps: at most this many remove-and-rematch sweeps after the first assignment, >= 0; None: the
        matcher's default (5 with fixed hyper-parameters; under empirical Bayes it stops when the assignment and the
        estimates stop changing). Default None.
    :param bool warm_start: in rounds after the first, start the matching from the assignment the clients' networks
        came from (each client retrained its slice of the global network), as the published code does; False
        re-matches from scratch (greedy pass). Default True.
    :param float fraction: share of the clients sampled each round, in (0, 1]. Default 1.
    :param str global_weights: how the global network's weights are built from the matching: ``"average"`` (each
        global unit the average of its members, the logits the clients' averaged class by class) or
        ``"posterior-mean"`` (the atoms' posterior means, as published); None: ``"average"`` under empirical Bayes
        (its posterior means blur rarely shared units towards the estimated prior mean), ``"posterior-mean"`` with
        fixed hyper-parameters (:func:`~bnpfed.matching.match_by_spec`). Default None.
    :param int layerwise_retrain: 0 (PFNM: every layer matched at once) or E >= 1: FedMA's layer-wise scheme (Wang et
        al., ICLR 2020): match the lowest group (layer), give every client the matched units, freeze them, let the
        clients retrain the layers above for E epochs on their own data, match the next group, and so on (the
        ``fedma`` method; :class:`~bnpfed.federated.pfnm.PFNMFederation` with this config). Bottom-up only.
        Default 0.
    :param str stop: under empirical Bayes, when a layer's sweeps stop: ``"result"`` (once a sweep moved at most 2 %
        of the neurons and no estimate by more than 1 %; on trained MNIST layers widths within 3 % and accuracy within
        0.001 of the exact fixed point at 0.3-0.8 of its sweeps) or ``"fixed-point"`` (until nothing changes). Default
        ``"result"``.
    :param str starts: under empirical Bayes, ``"even-split"`` (each layer's estimation from the even split),
        ``"both"`` (from the small-noise start as well, the assignment of higher marginal likelihood kept per layer:
        about twice the time) or ``"small-noise"`` (that start only, bnpfed before 2026-12). Default
        ``"even-split"``.
    :param str schedule: how a layer's sweeps re-match the clients: ``"gauss-seidel"`` (one after the other, each
        given the moves of those before it) or ``"jacobi"`` (all against the assignment at the sweep's start, moved
        at once; on trained MNIST layers it does not settle: benchmarks/README.md). Default ``"gauss-seidel"``.
    :param str matcher_device: where the matcher's shared-coordinate products run: None (default: numpy on the
        CPU) or a torch device (``"cuda"``, ``"cuda:1"``; ``"cpu"``: torch on the CPU); the scores and the assignment
        problems stay on the CPU (:func:`~bnpfed.matching.match_layer`'s ``device``). Where the clients train is
        :class:`TrainingConfig`'s ``device``.
    :param str inactive: what the server does with the units a client reports inactive on its own data (exactly 0
        wherever they enter the next layer: dead ReLU units; :mod:`bnpfed.matching.activity`): ``"drop"`` (left out
        before matching: the client's network computes the same without them) or ``"keep"`` (matched like any
        other, bnpfed before 2026-12). Default ``"drop"``.
    :param max_width: the most global units per hidden layer (group): an int (every group), one per group in the
        spec's order (None: no limit), or None (default: the model's own widths). Met inside the model by lowering the
        group's IBP mass (:mod:`bnpfed.matching.size`), never by truncating.
    :param max_params: the most parameters of the global network: an int, ``"ensemble"`` (no more than the
        clients' networks together: what it replaces), None (the model's own size) or ``"auto"`` (default:
        ``"ensemble"`` under FedMA's layer-wise scheme, None for PFNM: :attr:`parameter_limit`). Met by pricing
        every parameter in the prior (each group's IBP mass times ``exp(-lambda D_g)``, ``D_g`` the parameters one of
        its units owns: :mod:`bnpfed.matching.size`). FedMA's layer-wise scheme, which matches one group at a time,
        splits it into a ``max_width`` per group first (:func:`~bnpfed.federated.server.fedma_width_limits`). A
        budget the matcher cannot meet is refused in round 1 and met as far as it can in every later round
        (:meth:`best_effort_in`: the smallest match found, ``SizeSearch.met`` False). Why
        the defaults differ (benchmarks/README.md, LeNet on MNIST and Fashion-MNIST, J = 10, seeds 0-2): FedMA at
        the ensemble's size is 0.2-0.4 points below FedMA at its own (1.9-2.5 M parameters; 0.9 above on
        Fashion-MNIST Dirichlet) with 5-8x fewer parameters, its retraining between groups repairing what a merge
        costs; one-shot PFNM under the same budget loses 10-70 points (independently trained conv channels cannot be
        merged without retraining).
    :param int limit_from_round: the first round of PFNM's whole-network step (``pfnm_step``, in process and on
        Flower) that ``max_width`` / ``max_params`` apply to; the rounds before it match at the model's own size.
        Default 1 (every round). 2 keeps round 1 one-shot PFNM and holds the later rounds, whose clients retrain
        slices of one global network, to the limit: on LeNet (J = 10, seeds 0-1, 6 rounds, ``max_params="ensemble"``)
        0.88-1.00x the ensemble's parameters within half a point of its accuracy on MNIST (IID, Dirichlet(0.5)),
        where the model's own size ends at 2.2-3.4x; on Fashion-MNIST within a point in one of four settings (IID
        seed 0), 1.9 to 9.6 points below it in the others. Not the default: the first limited round dips
        (0.38-0.92) before retraining repairs it, and on clients of a few hundred examples it does not recover
        (benchmarks/README.md, *PFNM rounds held to the ensemble's size*). Such a later round's clients hold slices
        of the global network or, when not sampled the round before, all of it, so its ``max_params`` is met as far
        as the matcher can (``SpecMatch.size_searches["parameters"].met`` says whether it was); a ``max_width`` below
        what such a client holds is still refused. Needs a limit; not with ``layerwise_retrain``.
    :param str heads: the global network's output layer, ``"fused"`` (default: PFNM's class-share average of the
        clients' output layers) or ``"pooled"`` (every matched client's own output layer on the global units its
        units were matched to, log-probabilities pooled with the class shares:
        :func:`~bnpfed.matching.pooled_network`; J output layers instead of one; the method ``pfnm`` then gives the
        row ``pfnm-pooled``, the federations' names end in ``-pooled``, and Flower's clients score the pooled
        network). Under label skew the averaged layer sums the clients' logits class by class and loses 10-11 points
        on Fashion-MNIST Dirichlet(0.5) that the pool keeps (benchmarks/README.md, "The output layer under label
        skew"). The clients start the next round from their slices either way. ``max_params`` prices the J output
        layers the pooled network carries (each unit of the group they read with its J columns:
        :func:`~bnpfed.matching.match_by_spec`'s ``heads``; FedMA's budget split likewise); ``max_width`` and the
        hyper-parameter selection see the hidden layers, which the heads do not change.
    :param pool_temperature: ``heads="pooled"``: the pool's temperature, a number > 0 (default 1: the pool itself)
        or ``"fit"``: each matched client scores the pooled network on its own training data at every temperature
        of :data:`~bnpfed.matching.pooled_heads.TEMPERATURES` and the server keeps the one of least summed negative
        log-likelihood (:func:`~bnpfed.matching.pooled_heads.fit_temperature`; on Flower a query to the matched
        clients, ``step`` ``"pool-nll"``). Under label skew the pool is under-confident at 1 (benchmarks/README.md,
        "Pooled heads in matched fusion, and their temperature").

    Over communication rounds each global neuron is a posterior mean, ``sum v / (m + sigma2 / sigma0_2)``: a neuron few
    clients hold comes back to them shrunk towards the prior mean. With too little retraining per round (say 2 local
    epochs instead of the reference's 5) the slices shrink round after round, merge, and the global width collapses
    with the accuracy (tutorial 03 measures it).
    """

    sigma2: Union[None, float, tuple[Optional[float], ...]] = None
    sigma0_2: Union[None, float, tuple[Optional[float], ...]] = None
    gamma0: Union[None, float, tuple[Optional[float], ...]] = None
    hyperparameters: str = "empirical-bayes"
    constants: str = "bnpfed"
    objective: Optional[str] = None
    direction: str = "bottom-up"
    sweeps: Optional[int] = None
    warm_start: bool = True
    fraction: float = 1.0
    global_weights: Optional[str] = None
    layerwise_retrain: int = 0
    stop: str = "result"
    starts: str = "even-split"
    schedule: str = "gauss-seidel"
    matcher_device: Optional[str] = None
    inactive: str = "drop"
    max_width: Union[None, int, tuple[Optional[int], ...]] = None
    max_params: Union[None, int, str] = "auto"
    limit_from_round: int = 1
    heads: str = "fused"
    pool_temperature: Union[float, str] = 1.0

    def __post_init__(self):
        check_choice(self.hyperparameters, ("empirical-bayes", "fixed"), "hyperparameters")
        check_choice(self.heads, HEADS, "heads")
        check_pool_temperature(self.pool_temperature)
        if isinstance(self.max_width, (tuple, list)):
            if not self.max_width:
                raise ValueError(f"max_width: expected an int, one per hidden layer, or None, got {self.max_width!r}")
            object.__setattr__(self, "max_width", tuple(None if v is None else check_int(v, f"max_width[{i}]", low=1)
                                                        for i, v in enumerate(self.max_width)))
        elif self.max_width is not None:
            check_int(self.max_width, "max_width", low=1)
        if isinstance(self.max_params, str):
            check_choice(self.max_params, ("auto", "ensemble"), "max_params")
        elif self.max_params is not None:
            check_int(self.max_params, "max_params", low=1)
        check_choice(self.constants, ("bnpfed", "reference"), "constants")
        for name in ("sigma2", "sigma0_2", "gamma0"):
            value = getattr(self, name)
            if isinstance(value, (tuple, list)):
                if not value:
                    raise ValueError(f"{name}: expected a number, one per hidden layer, or None, got {value!r}")
                object.__setattr__(self, name, tuple(
                    None if v is None and not self.fixed else check_positive(v, f"{name}[{i}]")
                    for i, v in enumerate(value)))
            elif value is not None:
                check_positive(value, name)
        if self.objective is not None:
            check_choice(self.objective, ("map", "marginal"), "objective")
            if self.objective == "map" and not self.fixed:
                raise ValueError("objective: expected 'marginal' (or None) under empirical Bayes, which integrates "
                                 "the atoms out to estimate their prior; got 'map' (use hyperparameters='fixed' for "
                                 "the published MAP objective)")
        check_choice(self.direction, ("bottom-up", "top-down"), "direction")
        if self.sweeps is not None:
            check_int(self.sweeps, "sweeps", low=0)
        check_bool(self.warm_start, "warm_start")
        check_fraction(self.fraction, "fraction")
        if self.global_weights is not None:
            check_choice(self.global_weights, ("average", "posterior-mean"), "global_weights")
        check_int(self.layerwise_retrain, "layerwise_retrain", low=0)
        check_choice(self.stop, STOPS, "stop")
        check_choice(self.starts, STARTS, "starts")
        check_choice(self.schedule, SCHEDULES, "schedule")
        if self.matcher_device is not None:
            check_device(self.matcher_device, "matcher_device")
        check_choice(self.inactive, ("drop", "keep"), "inactive")
        if self.fixed and self.stop != "result":
            raise ValueError(f"stop: applies under empirical Bayes only (with fixed hyper-parameters the sweeps stop "
                             f"at a fixed point of the assignment or at the sweep limit); got {self.stop!r} with "
                             f"{'constants=reference' if self.constants == 'reference' else 'hyperparameters=fixed'}")
        if self.fixed and self.starts != "even-split":
            raise ValueError(f"starts: applies under empirical Bayes only (with fixed hyper-parameters there is one "
                             f"start, the greedy pass at the given values); got {self.starts!r} with "
                             f"{'constants=reference' if self.constants == 'reference' else 'hyperparameters=fixed'}")
        if self.layerwise_retrain and self.direction != "bottom-up":
            raise ValueError(f"layerwise_retrain: expected 0 unless direction is 'bottom-up' (FedMA's layer-wise "
                             f"scheme matches bottom-up), got {self.layerwise_retrain} with direction "
                             f"{self.direction!r}")
        check_int(self.limit_from_round, "limit_from_round", low=1)
        if self.limit_from_round > 1 and self.layerwise_retrain:
            raise ValueError(f"limit_from_round: expected 1 with layerwise_retrain (FedMA's layer-wise rounds split "
                             f"their budget into widths in every round), got {self.limit_from_round}")
        if self.limit_from_round > 1 and self.max_width is None and self.parameter_limit is None:
            raise ValueError(f"limit_from_round: expected 1 unless max_width or max_params sets a limit (there is "
                             f"nothing to start later), got {self.limit_from_round} with max_width None and "
                             f"max_params {self.max_params!r}")

    @property
    def fixed(self) -> bool:
        """Whether no hyper-parameter is estimated (``hyperparameters="fixed"``, or the reference constants)."""
        return self.hyperparameters == "fixed" or self.constants == "reference"

    @property
    def parameter_limit(self) -> Union[None, int, str]:
        """``max_params`` with ``"auto"`` resolved: ``"ensemble"`` under FedMA's layer-wise scheme
        (``layerwise_retrain`` >= 1), None (the model's own size) for PFNM."""
        if self.max_params == "auto":
            return "ensemble" if self.layerwise_retrain else None
        return self.max_params

    def in_round(self, round: int) -> "PFNMConfig":
        """The config of PFNM's whole-network step in round ``round`` (1-based): without its size limits before
        ``limit_from_round`` (the model's own size), as it is from then on."""
        check_int(round, "round", low=1)
        if round < self.limit_from_round:
            return replace(self, max_width=None, max_params=None, limit_from_round=1)
        return self

    @property
    def best_effort_budget(self) -> bool:
        """Whether the parameter budget is the default one (``max_params="auto"``), met as far as the matcher can
        (:func:`~bnpfed.federated.server.fedma_width_limits`) rather than refused when it cannot be."""
        return self.max_params == "auto"

    def best_effort_in(self, round: int) -> bool:
        """Whether round ``round`` (1-based) meets its size limits as far as the matcher can (the smallest match found,
        ``SizeSearch.met`` False) rather than refusing them: under the default budget, and after round 1 (whose
        clients' slices may merge no further; a refusal there would end the federation mid-way)."""
        check_int(round, "round", low=1)
        return self.best_effort_budget or round > 1

    def matcher_kwargs(self) -> dict[str, Any]:
        """Keywords of :func:`~bnpfed.matching.match_by_spec` (hyper-parameters, objective, order,
        sweeps, and the reference constants when asked for)."""
        kwargs: dict[str, Any] = dict(direction=self.direction)
        if self.fixed:
            def value(v):
                return 1.0 if v is None else v

            kwargs.update(hyperparameters="fixed", sigma2=value(self.sigma2), sigma0_2=value(self.sigma0_2),
                          gamma0=value(self.gamma0), objective=self.objective or "map")
        else:
            kwargs.update(hyperparameters="empirical-bayes", sigma2=self.sigma2, sigma0_2=self.sigma0_2,
                          gamma0=self.gamma0, objective="marginal", stop=self.stop, starts=self.starts)
        if self.sweeps is not None:
            kwargs["sweeps"] = self.sweeps
        if self.schedule != "gauss-seidel":
            kwargs["schedule"] = self.schedule
        if self.matcher_device is not None:
            kwargs["device"] = self.matcher_device
        if self.global_weights is not None:
            kwargs["global_weights"] = self.global_weights
        if self.max_width is not None:
            kwargs["max_width"] = self.max_width
        if self.parameter_limit is not None:
            kwargs["max_params"] = self.parameter_limit
            if self.heads == "pooled":
                kwargs["heads"] = "pooled"
        if self.constants == "reference":
            kwargs.update(REFERENCE_CONSTANTS)
        return kwargs


#: The published code's clamp of log sigma^2 at -8 (Ozer et al. 2022), as a variance floor.
PAPER_MIN_VARIANCE = math.exp(-8.0)


#: How posterior fusion lines the clients' weights up: ``"none"`` (weight by weight) or ``"match"`` (hidden units
#: matched first).
ALIGNMENTS = ("none", "match")


@dataclass(frozen=True)
class FusionConfig:
    """The posterior-fusion server (Ozer et al. 2022).

    :param str rule: a rule of :mod:`bnpfed.combine` (``"eaa"``, ``"gaa"``, ``"log_variance"``, ``"pooling"``,
        ``"conflation"``, or a registered one), or with ``align="match"`` ``"atom-posterior"`` (the matching model's
        own posterior of each matched unit's atom) or ``"pvi"`` (partitioned variational inference: the prior times
        the members' approximate-likelihood factors, and in later rounds every client trains against its cavity
        instead of its slice, so that its data is not counted twice; every client in every round): see
        :mod:`bnpfed.matching.posteriors`. Default ``"conflation"``.
    :param str weights: client weights ``b_k``: ``"size"`` (``n_k / sum_j n_j`` over the clients of the round, the
        paper's) or ``"uniform"``. Default ``"size"``.
    :param int pooling_samples: N of the pooling rule (client k contributes ``floor(b_k N)`` draws), >= 2.
        Default 1000.
    :param float min_variance: floor on every fused variance, >= 0 (0: none). GAA and conflation divide the variance
        by about the number of clients a round; after a few dozen rounds it would leave float32 (the closed-form
        KL's gradient, ``2 sigma_p^2 / sigma_q^3``, overflows below about 1e-26, and a variance below 1e-45 is 0).
        The default 1e-16 (sigma = 1e-8) keeps every rule finite for any number of rounds and is far below any
        variance that matters to a prediction; how many weights sit at the floor is reported every round.
        :data:`PAPER_MIN_VARIANCE` (``exp(-8)``) is the published code's clamp of log sigma^2 at -8.
    :param float fraction: share of the clients sampled each round, in (0, 1]. Default 1.
    :param str align: ``"none"`` (weight i of one client fused with weight i of the others: meaningful when the
        clients share an initialisation) or ``"match"`` (the clients' hidden units matched first, each global unit's
        members fused: :func:`~bnpfed.matching.posteriors.match_posteriors`). Default ``"none"``.
    :param tau2: ``align="match"``: the extra variance between two clients' copies of a unit, > 0, one value or one
        per hidden permutation; None (default) estimates it per group (empirical Bayes, with the atoms' prior and the
        IBP mass).
    :param bool own_init: ``align="none"``: each client starts round 1 from its own initialisation (True: the
        one-shot baseline, on MNIST 0.41-0.60, far below matched fusion) instead of one shared initialisation (False,
        default: weight-wise fusion means something only then). ``align="match"`` always starts each client from its
        own.
    :param str stop: ``align="match"``: when the matcher's empirical-Bayes sweeps stop, ``"result"`` (default) or
        ``"fixed-point"`` (:class:`PFNMConfig`'s ``stop``).
    :param str starts: ``align="match"``: where the matcher's empirical Bayes starts, ``"even-split"`` (default),
        ``"both"`` or ``"small-noise"`` (:class:`PFNMConfig`'s ``starts``).
    :param float pvi_damping: ``rule="pvi"``: rho in (0, 1], each client's factor moves ``rho`` of the way to its new
        value from the second round on (:class:`~bnpfed.federated.rounds.PVIFactors`). Default None: 0.1
        (:data:`PVI_DAMPING`). Read by ``rule="pvi"`` only.
    :param str match_on: ``align="match"``: what the assignment is computed from: ``"posteriors"`` (the
        heteroscedastic model, every unit seen with its posterior variances plus tau2), ``"means"`` (PFNM's model on
        the posterior means, the units a client reports dead on its own data left out first, as PFNM leaves them out)
        or ``"auto"`` (default: ``"means"`` for Laplace clients, whose post-hoc posteriors keep most weights at their
        prior variance so that on the posteriors nothing merges; ``"posteriors"`` for variational clients:
        :meth:`matches_on`). The posteriors are fused along the assignment either way
        (:func:`~bnpfed.matching.posteriors.match_posteriors`).
    :param str matcher_device: ``align="match"``: where the matcher's cross products run, None (default: numpy on the
        CPU) or a torch device (:class:`PFNMConfig`'s ``matcher_device``); the Bayesian clients train on the CPU.
    :param str later_rounds: ``align="match"``: the rounds after the first. ``"rematch"``: each client starts from
        its slice of the global posterior and the server matches the units again, warm-started from the assignment
        they came from (PFNM's rounds; the width can change). ``"fixed"``: every client starts from the *whole*
        global posterior and the server fuses global unit by global unit, the assignment fixed at what each client
        was sent (no matching: round 1's matched network is from then on the shared starting point that weight-wise
        fusion needs; the matching model's estimates are still made, for ``rule="atom-posterior"``); not with
        ``rule="pvi"``, whose factors live in each client's own units. ``"auto"`` (default): ``"rematch"`` for
        ``rule="pvi"``, ``"fixed"`` for every other rule (:meth:`rounds_after_first`; MNIST and Fashion-MNIST, J =
        10, Dirichlet(0.5), 10 rounds, seeds 0-2: matched conflation 0.9699 and 0.8623 fixed against 0.9663 and
        0.8393 re-matched, benchmarks/README.md).
    :param str heads: ``align="match"``: the global network's output layer, ``"fused"`` (default: the rule fuses the
        clients' output layers like every other layer) or ``"pooled"`` (the clients' own posterior output layers of
        the last round on the fused body, their log-probabilities pooled with the class shares inside every weight
        draw: :class:`~bnpfed.matching.PooledPosterior`; J output layers instead of one; under label skew the
        fused layer averages the clients' logits class by class, which the pool does not: benchmarks/README.md,
        "The output layer under label skew"). The clients start their next round from their slices of the fused
        posterior either way.
    :param pool_temperature: ``heads="pooled"``: the pool's temperature in every draw, a number > 0 (default 1) or
        ``"fit"`` (each matched client scores the pooled predictive on its own training data at every temperature of
        :data:`~bnpfed.matching.pooled_heads.TEMPERATURES`, the server keeps the best summed one; on Flower too),
        as :class:`PFNMConfig`'s.
    :param temperature: ``align="match"`` with the fused output layer: the global posterior predictive's
        temperature, ``p(y | x) = 1/S sum_s softmax(f(x; w_s) / T)`` (the global client's likelihood
        ``Categorical(temperature=T)``), a number > 0 (default 1: the posterior's own predictive) or ``"fit"``:
        each matched client scores the predictive's draws on its own training data at every temperature of
        :data:`~bnpfed.matching.pooled_heads.TEMPERATURES` and the server keeps the least summed NLL, as for the
        pool. The fused predictive is under-confident on its clients' data (MNIST IID, 784-100-10, J = 10, seeds
        0-2: matched conflation's ECE 0.0247 -> 0.0128, its floor 0.0125, at the fitted 0.86; OOD AUROC -0.002;
        benchmarks/README.md, "Every matched rule one shot"); after ten rounds the clients' training data, fitted
        better than the test split, over-sharpen it (ECE +0.002). With Laplace clients the draws are those of the
        global model's linearised predictive (:attr:`~bnpfed.clients.LaplaceClient.temperature`). In process,
        ``bnpfed fuse --temperature`` and on Flower (run-config key ``temperature``). With ``heads="pooled"`` the
        pool's temperature is ``pool_temperature``.
    """

    rule: str = "conflation"
    weights: str = "size"
    pooling_samples: int = 1000
    min_variance: float = 1e-16
    fraction: float = 1.0
    align: str = "none"
    tau2: Union[None, float, tuple[float, ...]] = None
    own_init: bool = False
    stop: str = "result"
    starts: str = "even-split"
    pvi_damping: Optional[float] = None
    match_on: str = "auto"
    matcher_device: Optional[str] = None
    later_rounds: str = "auto"
    heads: str = "fused"
    pool_temperature: Union[float, str] = 1.0
    temperature: Union[float, str] = 1.0

    def __post_init__(self):
        check_choice(self.rule, matched_rules(), "rule")
        check_choice(self.heads, HEADS, "heads")
        check_pool_temperature(self.pool_temperature)
        check_pool_temperature(self.temperature, "temperature")
        if self.temperature != 1 and self.align != "match":
            raise ValueError(f"temperature: the predictive temperature of matched fusion's global posterior; expected "
                             f"1 with align={self.align!r}, got {self.temperature!r}")
        if self.temperature != 1 and self.heads != "fused":
            raise ValueError(f"temperature: the fused output layer's predictive temperature; with heads="
                             f"{self.heads!r} the pool's is pool_temperature; expected 1, got {self.temperature!r}")
        if self.heads != "fused" and self.align != "match":
            raise ValueError(f"heads: the output layer of matched fusion (the clients' own heads placed at the global "
                             f"units their units were matched to); expected 'fused' with align={self.align!r}, got "
                             f"{self.heads!r}")
        if self.rule in (ATOM_POSTERIOR, PVI) and self.align != "match":
            raise ValueError(f"rule: {self.rule!r} fuses matched units ({ATOM_POSTERIOR!r}: the matching model's "
                             f"posterior of each atom; {PVI!r}: the prior times the members' PVI factors); expected "
                             f"align='match' with it, got align={self.align!r}")
        if self.pvi_damping is not None:   # read by rule "pvi" only, as pooling_samples by "pooling"
            check_fraction(self.pvi_damping, "pvi_damping")
        if self.rule == PVI and self.fraction != 1:
            raise ValueError(f"fraction: rule {PVI!r} keeps every client's factor in its own units from round to "
                             f"round, so every client takes part in every round; expected 1, got {self.fraction!r}")
        check_choice(self.weights, CLIENT_WEIGHTS, "weights")
        check_int(self.pooling_samples, "pooling_samples", low=2)
        check_float(self.min_variance, "min_variance", low=0.0)
        check_fraction(self.fraction, "fraction")
        check_choice(self.align, ALIGNMENTS, "align")
        check_bool(self.own_init, "own_init")
        check_choice(self.stop, STOPS, "stop")
        check_choice(self.starts, STARTS, "starts")
        if self.matcher_device is not None:
            check_device(self.matcher_device, "matcher_device")
        check_choice(self.match_on, ("auto",) + MATCH_ON, "match_on")
        if self.match_on != "auto" and self.align != "match":
            raise ValueError(f"match_on: what matched fusion's assignment is computed from; expected 'auto' with "
                             f"align={self.align!r} (nothing is matched), got {self.match_on!r}")
        check_choice(self.later_rounds, ("auto",) + LATER_ROUNDS, "later_rounds")
        if self.later_rounds != "auto" and self.align != "match":
            raise ValueError(f"later_rounds: matched fusion's rounds after the first; expected 'auto' with "
                             f"align={self.align!r} (nothing is matched), got {self.later_rounds!r}")
        if self.later_rounds == "fixed" and self.rule == PVI:
            raise ValueError(f"later_rounds: rule {PVI!r} keeps each client's factor in its own units, which the "
                             f"whole global posterior of 'fixed' rounds would change; expected 'rematch' with it, got "
                             f"'fixed'")
        if self.match_on == "means" and self.rule == PVI:
            raise ValueError(f"match_on: rule {PVI!r} keeps each client's factor in the client's own units from round "
                             f"to round, which leaving its dead units out (match_on='means') would change; expected "
                             f"'posteriors' or 'auto' with it, got 'means'")
        if isinstance(self.tau2, (tuple, list)):
            if not self.tau2:
                raise ValueError(f"tau2: expected a number, one per hidden permutation, or None, got {self.tau2!r}")
            object.__setattr__(self, "tau2", tuple(check_positive(v, f"tau2[{i}]") for i, v in enumerate(self.tau2)))
        elif self.tau2 is not None:
            check_positive(self.tau2, "tau2")

    def matches_on(self, client: str) -> str:
        """``match_on`` with ``"auto"`` resolved for the clients' kind (:class:`BayesianConfig`'s ``client``):
        ``"means"`` for ``"laplace"``, ``"posteriors"`` for ``"variational"``."""
        if self.match_on != "auto":
            return self.match_on
        return "means" if client == "laplace" else "posteriors"

    def rounds_after_first(self) -> str:
        """``later_rounds`` with ``"auto"`` resolved: ``"rematch"`` for rule ``"pvi"``, else ``"fixed"``."""
        if self.later_rounds != "auto":
            return self.later_rounds
        return "rematch" if self.rule == PVI else "fixed"

    def client_prior(self, bayesian: BayesianConfig) -> str:
        """What a client of ``bayesian`` trains against in the rounds after the first under this fusion:
        ``"cavity"`` (rule ``"pvi"``: the global posterior's slice divided by the client's own factor), ``"prior"``
        (the configured prior; ``bayesian.round_prior`` None or ``"prior"``, and always for Laplace clients, whose
        slice is no prior) or ``"posterior"`` (the global posterior it starts from, or its slice of a matched one).
        Raises when ``bayesian.round_prior`` is set with rule ``"pvi"``, where it does not apply."""
        if not isinstance(bayesian, BayesianConfig):
            raise ValueError(f"bayesian: expected a BayesianConfig, got {type(bayesian).__name__}")
        if self.rule == PVI:
            if bayesian.round_prior is not None:
                raise ValueError(f"round_prior: rule {PVI!r} trains every client against its cavity (the slice "
                                 f"less its own factor); expected None with it, got {bayesian.round_prior!r}")
            return "cavity"
        return bayesian.round_prior or "prior"
