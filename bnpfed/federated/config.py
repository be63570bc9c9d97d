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

These classes are the schema of every option (:mod:`bnpfed.schema`): each field is declared once, with its help, and
the ``:param`` lines below, the commands' flags (``bnpfed pfnm --help``) and the Flower run-config keys
(``bnpfed flower keys``) are generated from it. Every field is checked in ``__post_init__``; a bad value raises
``ValueError("<field>: expected <what>, got <value>")``, so a command can name the flag and Flower the key. The words
are the same everywhere: partitions are ``"iid"`` and ``"dirichlet"`` (``"homogeneous"``/``"homo"`` and
``"hetero"``/``"heterogeneous"`` are accepted aliases), ``epochs`` are local epochs, ``fraction`` is the share of
clients sampled per round. Settings measured worse than the defaults live in :mod:`bnpfed.experimental`, passed
explicitly as ``experimental=ExperimentalOptions(...)``.

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
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple, Optional, Sequence, Union

import numpy as np
from torch import nn

from bnpfed.clients import AUGMENTATIONS, OPTIMIZERS, SCALE_LR_FACTOR, check_augment, check_optimizer
from bnpfed.experimental import (LATER_ROUNDS, PVI_DAMPING, ROUND_PRIORS, ExperimentalOptions,
                                 reads_experimental)
from bnpfed.matching import (ATOM_POSTERIOR, HEAD_CHOICES, MATCH_ON, PVI, REFERENCE_CONSTANTS, chosen_heads,
                             matched_rules)
from bnpfed.federated.partition import holdout_split, partition_dirichlet, partition_homogeneous
from bnpfed.models import (LIKELIHOODS, PRIOR_VARIANCES, PRIORS, Categorical, Likelihood, Prior,
                           available_likelihoods, available_priors, available_programs, build_likelihood, build_prior,
                           build_program)
from bnpfed.schema import documented, option
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
    "CNN_LR",
    "training_for",
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
#: How a Bayesian client gets its posterior: by SVI on the ELBO (:class:`~bnpfed.clients.BayesianClient`), or by
#: training its network as a PFNM client does and a diagonal Laplace approximation after the fact
#: (:class:`~bnpfed.clients.LaplaceClient`, prior precision per site by the marginal likelihood).
CLIENT_KINDS = ("variational", "laplace")
#: A Laplace client's prior precision: each weight matrix's evidence maximiser, or those scaled by the factor a
#: held-out tenth of the client's data prefers (:class:`~bnpfed.clients.LaplaceClient`'s ``prior_precision``).
LAPLACE_PRIORS = ("marglik", "held-out")
#: Matched fusion's output layer (:class:`FusionConfig`'s ``heads``) and PFNM's (:class:`PFNMConfig`'s): ``"auto"``
#: (pooled when the clients' class shares differ, :func:`~bnpfed.matching.chosen_heads`), the fusion (or average) of
#: the clients' output layers, or the clients' own output layers pooled log-linearly with the class shares.
HEADS = HEAD_CHOICES
#: ``pool_temperature="fit"``: the pool's temperature chosen by the clients' data.
FIT = "fit"
#: Client weights ``b_k`` of posterior fusion: proportional to the local data size, or uniform.
CLIENT_WEIGHTS = ("size", "uniform")
#: How posterior fusion lines the clients' weights up: ``"none"`` (weight by weight) or ``"match"`` (hidden units
#: matched first).
ALIGNMENTS = ("none", "match")
#: The published code's clamp of log sigma^2 at -8 (Ozer et al. 2022), as a variance floor.
PAPER_MIN_VARIANCE = math.exp(-8.0)


def check_pool_temperature(value, name: str = "pool_temperature") -> None:
    """``pool_temperature``: a number > 0 or ``"fit"`` (read by pooled heads only: ``heads="pooled"`` in the config
    or a method's option; a federation or an experiment with neither refuses a value other than 1:
    :func:`check_pool_temperature_applies`). ``name``: the argument checked (also :class:`FusionConfig`'s
    ``temperature``)."""
    if isinstance(value, str):
        if value != FIT:
            raise ValueError(f"{name}: expected a number > 0 or {FIT!r}, got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a number > 0 or {FIT!r}, got {value!r}")


def check_pool_temperature_applies(config, pooled: bool) -> None:
    """Refuse ``config.pool_temperature`` other than 1 unless ``pooled`` (something pools heads with it, or may:
    ``heads="auto"``)."""
    if config.pool_temperature != 1 and not pooled and config.heads != "auto":
        raise ValueError(f"pool_temperature: the temperature of pooled heads; expected 1 without them (heads="
                         f"{config.heads!r}), got {config.pool_temperature!r}")


def config_dict(config) -> dict:
    """A config as plain JSON-ready values (a prior or likelihood object becomes its ``repr``, a program's factory
    its ``module.qualname``; the probes a config
    reads from its ``experimental`` options stand beside its fields, as they did before they moved there, so that a
    record reads the same)."""
    out = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if isinstance(value, ExperimentalOptions):
            out.update({name: getattr(value, name) for name in type(config).EXPERIMENTAL})
            continue
        if isinstance(value, (Prior, Likelihood)):
            value = repr(value)
        elif callable(value):   # a program's factory: its name
            value = f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}"
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def _check_experimental(config) -> None:
    """``config.experimental`` is an :class:`~bnpfed.experimental.ExperimentalOptions` that sets only the probes
    ``type(config).EXPERIMENTAL`` reads."""
    if not isinstance(config.experimental, ExperimentalOptions):
        raise ValueError(f"experimental: expected a bnpfed.experimental.ExperimentalOptions, got "
                         f"{type(config.experimental).__name__}")
    config.experimental.check_read_by(type(config).EXPERIMENTAL, type(config).__name__)


def _experimental(reads: str) -> Any:
    """A config's ``experimental`` field, ``reads`` the probes it reads (not a flag or key of its own: the flag
    ``--experimental`` and the Flower key ``experimental`` hold the text form for every config of a run at once)."""
    return option(ExperimentalOptions(), cli=False, key=False, default_text="none set", help=(
        f"probes measured worse than the defaults, passed explicitly (:class:`~bnpfed.experimental."
        f"ExperimentalOptions`); this config reads {reads}."))


# ------------------------------------------------------------------------------------------------ partitioning


@documented
@dataclass(frozen=True)
class PartitionConfig:
    """How the training split is divided among the clients (:func:`~bnpfed.federated.partition.partition_dirichlet`
    for the Dirichlet split)."""

    clients: int = option(10, metavar="J", key="the number of clients J is the SuperNodes' num-partitions (their "
                          "--node-config; a simulation's number of SuperNodes), not a run config key",
                          help="J, the number of clients, >= 1.")
    partition: str = option("iid", choices=PARTITIONS, help=(
        'how the training split is divided: ``"iid"`` or ``"dirichlet"``. ``"iid"`` shuffles it and cuts it into J '
        'near-equal parts; ``"dirichlet"`` gives each client label-Dirichlet shares of concentration ``alpha``. '
        '``"homogeneous"``/``"homo"`` and ``"hetero"``/``"heterogeneous"`` are aliases.'))
    alpha: float = option(0.5, metavar="ALPHA", help=(
        'the Dirichlet concentration of ``partition="dirichlet"``, > 0 (small: few classes per client).'))
    min_size: int = option(10, metavar="N", shown=False, help=(
        'the fewest examples a client may hold under ``partition="dirichlet"`` (redrawn until each holds as many), '
        '>= 0.'))

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
        """The J clients' sorted index arrays into ``labels``, drawn from the stream ``(seed, PARTITION)``. A
        regression's targets (real values) have no classes to skew: ``"iid"`` only."""
        labels = np.asarray(labels)
        if labels.dtype.kind == "f":
            if self.partition != "iid":
                raise ValueError(f"partition: {self.partition!r} draws each client's share of every class; a "
                                 "regression's targets have none: expected 'iid'")
            labels = np.zeros(len(labels), dtype=np.int64)   # only their number counts
        self.check_fits(len(labels))
        rng = derive_seed(seed, Stream.PARTITION)
        if self.partition == "iid":
            return partition_homogeneous(labels, self.clients, seed=rng)
        return partition_dirichlet(labels, self.clients, alpha=self.alpha, min_size=self.min_size, seed=rng)


# ------------------------------------------------------------------------------------------------ clients


@documented
@dataclass(frozen=True)
class NetworkConfig:
    """The clients' network (:func:`~bnpfed.federated.clients.build_network`)."""

    arch: str = option("mlp", choices=ARCHITECTURES, help=(
        'the clients\' network. ``"mlp"``: a ReLU MLP of widths ``hidden`` on flattened inputs; ``"lenet"`` '
        '(LeNet-5, conv1 padded by 2), ``"lenet-paper"`` (LeNet-5 as Ozer et al.\'s code has it, no padding), '
        '``"simple-cnn"`` (FedMA\'s CIFAR-10 network: conv 6, conv 16, fc 120, 84) or ``"simple-cnn-bn"`` (the '
        'same with batch norm after each convolution); the convolutional ones take images ``(C, H, H)`` as they come '
        '(any channels, square; at least 4x4 for lenet, 8x8 for the others).'))
    hidden: tuple[int, ...] = option((100,), metavar="H[,H...]", help=(
        'the hidden widths of the MLP, e.g. ``100`` or ``200,100`` (the convolutional networks\' widths are fixed).'))
    init: str = option("torch", choices=INITIALISATIONS, shown=False, help=(
        '``"torch"`` (PyTorch\'s default initialisation) or ``"reference"`` (the PFNM reference code\'s: weights '
        'N(0, 0.1^2), biases 0.1).'))
    shared_init: bool = option(False, shown=False, help=(
        'every client starts from one initialisation (FedAvg needs it to mean anything; PFNM does not; the '
        'posterior-fusion federations always share it: the global model).'))

    def __post_init__(self):
        check_choice(self.arch, ARCHITECTURES, "arch")
        object.__setattr__(self, "hidden", check_ints(self.hidden, "hidden", low=1))
        default = next(f.default for f in fields(self) if f.name == "hidden")
        if self.arch != "mlp" and self.hidden != default:   # a width nothing would read
            raise ValueError(f"hidden: expected only with arch='mlp' (the widths of {self.arch} are fixed), got "
                             f"{','.join(map(str, self.hidden))} with arch={self.arch!r}")
        check_choice(self.init, INITIALISATIONS, "init")
        check_bool(self.shared_init, "shared_init")


class LocalSchedule(NamedTuple):
    """What every client does in one round: ``epochs`` passes of its optimiser at learning rate ``lr``."""

    epochs: int
    lr: float


@documented
@dataclass(frozen=True)
class TrainingConfig:
    """A client's local training: Adam (or SGD) on mini-batches, round after round.

    Round 1 trains ``epochs`` epochs at ``lr``; a later round r trains ``round_epochs`` epochs (``epochs`` when
    None) at ``lr * lr_decay ** (r - 1)``. :data:`PFNM_TRAINING` is the PFNM reference code's (10 epochs of AMSGrad
    at 0.01, batch 32, L2 1e-6; later rounds 5 epochs with the rate decayed by 0.99 a round); :data:`FUSION_TRAINING`
    (the defaults) suits posterior fusion on the bundled digits.
    """

    epochs: int = option(2, metavar="E", help=(
        'local epochs of round 1 (of every round when ``round_epochs`` is None).'))
    batch_size: int = option(32, metavar="N", help="the mini-batch size.")
    lr: float = option(1e-2, metavar="LR", help="the learning rate.")
    weight_decay: float = option(0.0, metavar="L2", shown=False, help=(
        'L2 strength, >= 0 (coupled, as ``torch.optim.Adam``\'s and ``SGD``\'s).'))
    amsgrad: bool = option(False, shown=False, help=(
        'the AMSGrad variant of Adam (left unset on a command line or a run config: the schedule\'s own with Adam, '
        'off with SGD: :meth:`amsgrad_for`).'))
    round_epochs: Optional[int] = option(None, metavar="E", default_text="None (``epochs``)", help=(
        'local epochs of rounds 2, 3, ...'))
    lr_decay: float = option(1.0, metavar="FACTOR", shown=False, help=(
        'the learning-rate factor per round, in (0, 1]: round r trains at ``lr * lr_decay ** (r - 1)``.'))
    device: str = option("cpu", metavar="DEVICE", help=(
        'where the deterministic clients train (PFNM\'s, FedAvg\'s, FedMA\'s retraining): ``"cpu"`` or a CUDA device '
        'torch sees (``"cuda"``, ``"cuda:1"``). The trained networks come back to the CPU, where the server matches '
        'and averages them. The Bayesian clients\' SVI runs on the CPU only. The same seed gives the same '
        'mini-batches on every device; another device\'s numbers differ in the last digits.'))
    optimizer: str = option("adam", choices=OPTIMIZERS, shown=False, help=(
        '``"adam"`` or ``"sgd"``: the deterministic clients\' optimiser (PFNM\'s, FedAvg\'s, FedMA\'s retraining, '
        'Laplace clients\'; NIID-Bench\'s FedAvg runs SGD); the variational clients\' SVI runs Adam only.'))
    momentum: Optional[float] = option(None, metavar="M", shown=False, default_text="None (no momentum)", help=(
        'SGD\'s momentum, in [0, 1); with ``optimizer="sgd"`` only.'))
    augment: str = option("none", choices=AUGMENTATIONS, shown=False, help=(
        'each mini-batch\'s images through a random transform before the step (:mod:`bnpfed.clients.augment`): '
        '``"none"``, ``"crop"`` (reflect-pad 4 pixels, a random crop back to size) or ``"crop-flip"`` (and a '
        'left-right flip half the time: CIFAR-10\'s usual transforms); images ``(C, H, W)`` only, every kind of '
        'client; evaluation, matching and the clients\' reports see the images as they are.'))

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


def _check_groups(config, names: Sequence[str], groups: Sequence[str]) -> None:
    """Every field of ``names`` given as several values has one per matched group ``groups`` (the spec's order)."""
    for name in names:
        values = getattr(config, name)
        if isinstance(values, tuple) and len(values) != len(groups):
            raise ValueError(f"{name}: expected one value or one per matched group ({len(groups)}: "
                             f"{', '.join(groups)}), got {len(values)}")


#: The PFNM reference code's local training (``experiment.py``).
PFNM_TRAINING = TrainingConfig(epochs=10, batch_size=32, lr=0.01, weight_decay=1e-6, amsgrad=True, round_epochs=5,
                               lr_decay=0.99)
#: Posterior fusion's defaults on the bundled digits (the :class:`TrainingConfig` defaults).
FUSION_TRAINING = TrainingConfig()
#: PFNM's clients: MLPs in the reference initialisation, each from its own.
PFNM_NETWORK = NetworkConfig(init="reference")
#: The learning rate the convolutional networks (every ``arch`` but ``"mlp"``) train at by default in the commands and
#: on Flower: Adam's usual 1e-3 (also the rate of Ozer et al.'s code for its LeNet), where the MLPs keep PFNM's 1e-2.
#: At 1e-2 FedMA's simple CNN leaves many CIFAR-10 clients at chance, and LeNet ends behind after the commands' 10
#: epochs (the docs' benchmark page on one-shot matching, "Training defaults per architecture").
CNN_LR = 1e-3


def training_for(arch: str, base: TrainingConfig) -> TrainingConfig:
    """``base`` (a command's or a method's local training) for clients of ``arch``: ``base`` itself for the MLP, at
    :data:`CNN_LR` for the convolutional networks (LeNet, FedMA's simple CNN, with or without batch norm).

    >>> training_for("lenet", PFNM_TRAINING).lr, training_for("mlp", PFNM_TRAINING).lr
    (0.001, 0.01)
    """
    check_choice(arch, ARCHITECTURES, "arch")
    return base if arch == "mlp" else replace(base, lr=CNN_LR)


@reads_experimental("round_prior")
@documented
@dataclass(frozen=True)
class BayesianConfig:
    """What makes a client Bayesian: a prior over (some of) the network's parameters and a mean-field Gaussian guide
    fitted by SVI (:class:`~bnpfed.clients.BayesianClient`), or a diagonal Laplace posterior after the fact
    (``client="laplace"``, :class:`~bnpfed.clients.LaplaceClient`)."""

    prior: Union[str, Prior] = option("linear-weights", choices=available_priors, help=(
        'the prior: the name of a standard one, ``"linear-weights"`` (N(0, prior_scale^2) on the ``nn.Linear`` '
        'weight matrices only, Ozer et al.\'s choice) or ``"all"`` (on every parameter), or one a plugin registered '
        '(:func:`~bnpfed.models.register_prior`), or a :class:`~bnpfed.models.Prior` object. A named prior is built '
        'anew for each client; a prior object is shared by every client built from this config, so '
        '``Prior.update_`` on it reaches them all.'))
    prior_scale: float = option(1.0, metavar="SCALE", help=(
        'the standard deviation of a named prior (unused with a prior object).'))
    init_scale: float = option(1e-2, metavar="SCALE", shown=False, help=(
        'the guide\'s initial posterior standard deviation.'))
    local_reparameterization: bool = option(True, shown=False, help=(
        'train and predict with the local reparameterisation trick (sample pre-activations rather than weights, as '
        'the paper does).'))
    prior_variance: str = option("fixed", choices=PRIOR_VARIANCES, shown=False, help=(
        'a named prior\'s variance: ``"fixed"`` (``prior_scale^2``, the paper\'s) or ``"empirical-bayes"`` (each '
        'client\'s own type-II maximum-likelihood estimate per weight matrix, re-estimated after every step, starting '
        'at ``prior_scale^2``: :class:`~bnpfed.models.EmpiricalBayesPrior`); with a prior object only ``"fixed"`` '
        '(the object says what it is).'))
    kl_weight: float = option(1.0, metavar="LAMBDA", shown=False, help=(
        'lambda, the weight of the KL term in the clients\' loss, > 0: 1 is the ELBO; lambda < 1 a tempered ("cold") '
        'posterior, each example\'s likelihood counted 1/lambda times (:class:`~bnpfed.clients.MeanFieldELBO`).'))
    scale_lr_factor: float = option(SCALE_LR_FACTOR, metavar="F", shown=False, help=(
        'the guide\'s scales learn at this multiple of the schedule\'s learning rate, > 0 '
        '(:meth:`~bnpfed.clients.BayesianClient.fit`\'s ``scale_lr``): 10 reaches the variational optimum of the '
        'ELBO (the default since 0.2); 1 is one rate for all, where the scales barely leave ``init_scale`` in a '
        'round\'s few hundred steps (the recorded behaviour before 0.2).'))
    client: str = option("variational", choices=CLIENT_KINDS, help=(
        'how a client gets its posterior: ``"variational"`` (SVI on the ELBO) or ``"laplace"`` (matched fusion '
        'only). A Laplace client trains its network by maximum likelihood as a PFNM client does (the same seeds '
        'give the same networks) and takes the diagonal Laplace posterior of the sites ``prior`` makes Bayesian, '
        'each site\'s prior precision by the marginal likelihood; for matched fusion, where a later round\'s client '
        'starts from its slice\'s means under the zero-mean evidence prior. The '
        'settings of SVI (``prior_scale``, ``init_scale``, ``prior_variance``, ``kl_weight``, ``scale_lr_factor``) '
        'keep their defaults with it.'))
    laplace_prior: str = option("marglik", choices=LAPLACE_PRIORS, shown=False, help=(
        '``client="laplace"`` only: each weight matrix\'s prior precision, ``"marglik"`` (its evidence maximiser) or '
        '``"held-out"`` (those scaled by one factor, chosen by the held-out negative log-likelihood of the linearised '
        'predictive on a tenth of the client\'s data, held out from its training).'))
    likelihood: Union[str, Likelihood] = option("categorical", choices=available_likelihoods, shown=False, help=(
        'the clients\' observation model: the name of one (``"categorical"``, or one a plugin registered with '
        ':func:`~bnpfed.models.register_likelihood`) or a :class:`~bnpfed.models.Likelihood` object. A '
        'classification\'s is a :class:`~bnpfed.models.Categorical` (or a subclass); a regression\'s (``--dataset '
        'diabetes``) ``"gaussian"`` or ``"student-t"`` (each noise scale learned). Variational clients only: a '
        'Laplace client trains by cross-entropy.'))
    program: Union[str, Callable, None] = option(None, metavar="NAME", shown=False, choices=available_programs,
                                                 help=(
        'a user\'s Pyro program as every client\'s model, instead of a network with a prior and a likelihood: the '
        'name of one a plugin registered (:func:`~bnpfed.models.register_program`) or, in Python, a factory '
        '``factory() -> PyroModule`` or ``factory() -> (model, guide)`` that each client calls (its ``PyroSample`` '
        'statements are the prior, its observed site the likelihood, its guide ``AutoNormal`` unless it gives one). '
        'Weight-wise posterior fusion only; what the program says itself (``prior``, ``prior_scale``, '
        '``prior_variance``, ``likelihood``, ``init_scale``, ``local_reparameterization``, ``scale_lr_factor``: its '
        'guide trains at one rate, as Pyro\'s SVI trains it) keeps its default, '
        'and ``kl_weight`` stays 1 (its ELBO is Pyro\'s ``Trace_ELBO``).'))
    experimental: ExperimentalOptions = _experimental("``round_prior``")

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
        _check_experimental(self)
        check_choice(self.laplace_prior, LAPLACE_PRIORS, "laplace_prior")
        if self.laplace_prior != "marglik" and self.client != "laplace":
            raise ValueError(f"laplace_prior: a Laplace client's prior precision; expected its default 'marglik' with "
                             f"client={self.client!r}, got {self.laplace_prior!r}")
        if not isinstance(self.likelihood, Likelihood):
            check_choice(self.likelihood, available_likelihoods(), "likelihood")
        self.build_likelihood()
        if not isinstance(self.prior, Prior):
            self.build_prior()   # a plugin's prior without an empirical-Bayes form says so here, before any work
        if self.client == "laplace" and self.likelihood != "categorical":
            raise ValueError(f"likelihood: a variational client's observation model; Laplace clients "
                             f"(client='laplace') train by cross-entropy, expected 'categorical', got "
                             f"{self.likelihood!r}")
        if self.program is not None:
            self._check_program()
        if self.client == "laplace":
            defaults = {f.name: f.default for f in fields(self)}
            for name in ("prior_scale", "init_scale", "prior_variance", "kl_weight", "scale_lr_factor"):
                default = defaults[name]
                if getattr(self, name) != default:
                    raise ValueError(f"{name}: a setting of the variational clients' SVI, which Laplace clients "
                                     f"(client='laplace') do not run; expected its default {default!r}, got "
                                     f"{getattr(self, name)!r}")
            if self.round_prior is not None:
                raise ValueError(f"experimental: round_prior: a setting of the variational clients' SVI, which "
                                 f"Laplace clients (client='laplace') do not run; expected it unset, got "
                                 f"{self.round_prior!r}")

    #: The settings a Pyro program says itself (its sample statements, its observed site, its guide), which keep
    #: their defaults with ``program``.
    PROGRAM_DEFINES = ("prior", "prior_scale", "prior_variance", "likelihood", "init_scale",
                       "local_reparameterization", "client", "laplace_prior", "scale_lr_factor")

    def _check_program(self) -> None:
        if isinstance(self.program, str):
            if self.program not in available_programs():
                raise ValueError(f"program: expected one of {available_programs()} (a plugin registers them with "
                                 f"register_program), or in Python a factory, got {self.program!r}")
        elif not callable(self.program) or isinstance(self.program, nn.Module):
            raise ValueError(f"program: expected a registered program's name or a factory() -> PyroModule or (model, "
                             f"guide) that every client calls (not a program itself: each client needs its own), "
                             f"got {self.program!r}")
        defaults = {f.name: f.default for f in fields(self)}
        for name in self.PROGRAM_DEFINES:
            if getattr(self, name) is not defaults[name] and getattr(self, name) != defaults[name]:
                raise ValueError(f"{name}: a setting of a network's clients that a Pyro program says itself (its "
                                 f"sample statements, observed site and guide); expected its default "
                                 f"{defaults[name]!r} with program={self.program!r}, got {getattr(self, name)!r}")
        if self.kl_weight != 1:
            raise ValueError(f"kl_weight: tempers a network's ELBO; a Pyro program's clients run Pyro's Trace_ELBO, "
                             f"expected 1 with program={self.program!r}, got {self.kl_weight!r}")
        if self.round_prior == "posterior":
            raise ValueError(f"experimental: round_prior: 'posterior' makes a network's prior object the global "
                             f"posterior; a Pyro program's priors are its own sample statements, which every round "
                             f"keeps; expected None or 'prior' with program={self.program!r}")

    def build_program(self) -> tuple:
        """A fresh ``(model, guide)`` of ``program`` (:func:`~bnpfed.models.build_program`; ``guide`` None for the
        client's default); a ``ValueError`` without a program."""
        if self.program is None:
            raise ValueError("program: expected a Pyro program (a registered name or a factory), got None")
        return build_program(self.program)

    def check_task(self, task: str) -> None:
        """The likelihood fits the dataset's task (:data:`~bnpfed.data.TASKS`): a classification's is a
        :class:`~bnpfed.models.Categorical` (or a subclass: the federations score class probabilities), a
        regression's any other (``"gaussian"``, ``"student-t"``), for variational clients. With ``program`` the
        program's observed site decides (:func:`~bnpfed.federated.clients.check_program_task`, on the program)."""
        if self.program is not None:
            return
        classifies = isinstance(self.build_likelihood(), Categorical)
        if task == "classification" and not classifies:
            raise ValueError(f"likelihood: expected a classification likelihood (a Categorical or a subclass: the "
                             f"federations score class probabilities), got {self.likelihood!r}")
        if task == "regression" and (classifies or self.client != "variational"):
            raise ValueError(f"likelihood: a regression's clients are variational with a likelihood of real "
                             f"values ('gaussian', 'student-t', a Gaussian or StudentT object); got "
                             f"likelihood={self.likelihood!r}, client={self.client!r}")

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


#: The probes of :class:`PFNMConfig` that apply under empirical Bayes only, at their defaults: a config derived with
#: fixed hyper-parameters from one that estimates them (a grid of fixed values) takes these
#: (``replace(config.experimental, **EB_DEFAULTS)``).
EB_DEFAULTS = dict(starts="even-split", stop="result")

_PER_LAYER = ' one value, one per hidden layer (None for a layer estimated), or None, estimated per layer.'


@reads_experimental("starts", "stop", "schedule", "inactive")
@documented
@dataclass(frozen=True)
class PFNMConfig:
    """The PFNM server: Beta-Bernoulli matching of the clients' neurons (Yurochkin et al. 2019).

    By default nothing is set by hand: every hidden layer's hyper-parameters (the atoms' prior mean ``mu0`` and
    variance ``sigma0_2``, the local noise variance ``sigma2``, the IBP mass ``gamma0``) are estimated from the
    clients' weights alone while matching (empirical Bayes, as SPAHM does; see :func:`~bnpfed.matching.match_layer`),
    with the marginal objective. A value given here fixes that hyper-parameter and turns its estimation off.

    Over communication rounds each global neuron is a posterior mean, ``sum v / (m + sigma2 / sigma0_2)``: a neuron few
    clients hold comes back to them shrunk towards the prior mean. With too little retraining per round (say 2 local
    epochs instead of the reference's 5) the slices shrink round after round, merge, and the global width collapses
    with the accuracy (tutorial 03 shows it).
    """

    sigma2: Union[None, float, tuple[Optional[float], ...]] = option(
        None, metavar="S[,S...]", null=("none", "auto"), default_text="None (estimated)", help=(
            'the local noise variance, > 0:' + _PER_LAYER + ' How far a client\'s neuron may sit from its global '
            'neuron: larger values give a narrower global network.'))
    sigma0_2: Union[None, float, tuple[Optional[float], ...]] = option(
        None, metavar="S[,S...]", null=("none", "auto"), default_text="None (estimated)", help=(
            'the prior variance of the global atoms, > 0, as ``sigma2``.'))
    gamma0: Union[None, float, tuple[Optional[float], ...]] = option(
        None, metavar="G[,G...]", null=("none", "auto"), default_text="None (estimated)", help=(
            'the IBP mass, > 0, as ``sigma2``. How readily new global neurons open.'))
    hyperparameters: str = option("empirical-bayes", choices=("empirical-bayes", "fixed"), shown=False, help=(
        '``"empirical-bayes"`` (those left None are estimated per layer, and the atoms\' prior mean per coordinate) '
        'or ``"fixed"`` (none is estimated: those left None take the reference code\'s value 1, and the atoms\' prior '
        'mean is 0 for weights and 0.1 for biases).'))
    constants: str = option("bnpfed", choices=("bnpfed", "reference"), shown=False, help=(
        '``"bnpfed"`` (the exact objective: popularity factor 2, no caps) or ``"reference"`` (the published code\'s '
        'constants and fixed hyper-parameters, :data:`~bnpfed.matching.REFERENCE_CONSTANTS`).'))
    objective: Optional[str] = option(None, choices=("map", "marginal"), shown=False, default_text=(
        "None (marginal under empirical Bayes, MAP with fixed hyper-parameters)"), help=(
        '``"map"`` (published) or ``"marginal"`` (atoms integrated out; the only objective of empirical Bayes).'))
    direction: str = option("bottom-up", choices=("bottom-up", "top-down"), shown=False, help=(
        'the order of the layers, ``"bottom-up"`` or ``"top-down"`` (published).'))
    sweeps: Optional[int] = option(None, metavar="N", shown=False, default_text="None (the matcher's)", help=(
        'at most this many remove-and-rematch sweeps after the first assignment, >= 0; the matcher\'s default is 5 '
        'with fixed hyper-parameters and, under empirical Bayes, until the assignment and the estimates settle.'))
    warm_start: bool = option(True, shown=False, help=(
        'in rounds after the first, start matching from the assignment the clients\' networks came from (each client '
        'retrained its slice of the global network), as the published code does; off: re-match from scratch.'))
    fraction: float = option(1.0, metavar="F", help='the share of the clients sampled each round, in (0, 1].')
    global_weights: Optional[str] = option(None, choices=("average", "posterior-mean"), shown=False, default_text=(
        'None (``"average"`` under empirical Bayes, ``"posterior-mean"`` with fixed hyper-parameters)'), help=(
        'how the global network\'s weights are built from the matching: ``"average"`` (each global unit the average '
        'of its members, the logits the clients\' averaged class by class) or ``"posterior-mean"`` (the atoms\' '
        'posterior means, as published; under empirical Bayes they blur rarely shared units towards the estimated '
        'prior mean).'))
    layerwise_retrain: int = option(0, metavar="EPOCHS", help=(
        'FedMA\'s layer-wise scheme (the ``fedma`` method; Wang et al., ICLR 2020): 0 (PFNM: every layer matched at '
        'once) or E >= 1 retraining epochs. The server matches the lowest group (layer), freezes it, lets the clients '
        'retrain the layers above for E epochs, matches the next group, and so on; bottom-up only.'))
    matcher_device: Optional[str] = option(None, metavar="DEVICE", shown=False, default_text=(
        "None (numpy on the CPU)"), help=(
        'where the matcher\'s shared-coordinate products run: a torch device (``"cuda"``, ``"cuda:1"``; ``"cpu"``: '
        'torch on the CPU); the scores and the assignment problems stay on the CPU. Where the clients train is '
        ':class:`TrainingConfig`\'s ``device``.'))
    max_width: Union[None, int, tuple[Optional[int], ...]] = option(
        None, metavar="W[,W...]", default_text="None (the model's own widths)", help=(
            'the most global units per hidden layer (group): an int, one per group in the spec\'s order (None: no '
            'limit there), or None. Met inside the model by lowering the group\'s IBP mass '
            '(:mod:`bnpfed.matching.size`), never by truncating.'))
    max_params: Union[None, int, str] = option("auto", metavar="N|ensemble|none|auto", help=(
        'the most parameters of the global network: an int, ``"ensemble"`` (no more than the clients\' networks '
        'together), None (the model\'s own size) or ``"auto"`` (``"ensemble"`` for FedMA, None for PFNM). '
        '``"auto"`` is ``"ensemble"`` under FedMA\'s layer-wise scheme, whose retraining between groups repairs what a '
        'merge costs, and None for PFNM (:attr:`parameter_limit`). Met by pricing every parameter in the prior '
        '(each group\'s IBP mass times ``exp(-lambda D_g)``, ``D_g`` the parameters one of its units owns); FedMA '
        'splits it into a ``max_width`` per group first. A budget the matcher cannot meet is refused in round 1 and '
        'met as far as it can in every later round (:meth:`best_effort_in`).'))
    limit_from_round: int = option(1, metavar="R", shown=False, help=(
        'the first round of PFNM\'s whole-network step (in process and on Flower) that ``max_width`` / '
        '``max_params`` apply to; the rounds before match at the model\'s own size. 2 keeps round 1 one-shot PFNM and '
        'holds the later rounds, whose clients retrain slices of one global network, to the limit, met as far as the '
        'matcher can (a ``max_width`` below what a client holds is still refused). Needs a limit; not with '
        '``layerwise_retrain``.'))
    heads: str = option("auto", choices=HEADS, help=(
        'the global network\'s output layer: ``"fused"`` (the class-share average of the clients\' output layers), '
        '``"pooled"`` (the clients\' own, pooled; rows ``pfnm-pooled``, ...) or ``"auto"``: pooled when the clients\' '
        'class shares differ (a chi-squared test of their class counts, :func:`~bnpfed.matching.chosen_heads`: label '
        'skew), else fused, which the pool equals for equal shares (a ``pool_temperature`` other than 1 asks for the '
        'pool). Pooled: every matched client\'s own output layer sits on the global units its units were matched to, '
        'their log-probabilities pooled with the class shares (:func:`~bnpfed.matching.pooled_network`): J output '
        'layers instead of one. The clients start the next round from their slices either way; ``max_params`` '
        'prices the J output layers.'))
    pool_temperature: Union[float, str] = option(1.0, metavar="T|fit", shown=False, help=(
        '``heads="pooled"``: the pool\'s temperature, a number > 0 (1: the pool itself) or ``"fit"``: each matched '
        'client scores the pooled network on its own training data at every temperature of '
        ':data:`~bnpfed.matching.pooled_heads.TEMPERATURES` and the server keeps the one of least summed negative '
        'log-likelihood (on Flower a query to the matched clients).'))
    experimental: ExperimentalOptions = _experimental("``starts``, ``stop``, ``schedule``, ``inactive``")

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
        _check_experimental(self)
        if self.matcher_device is not None:
            check_device(self.matcher_device, "matcher_device")
        fixed = 'constants=reference' if self.constants == 'reference' else 'hyperparameters=fixed'
        if self.fixed and self.stop != "result":
            raise ValueError(f"experimental: stop: applies under empirical Bayes only (with fixed hyper-parameters "
                             f"the sweeps stop at a fixed point of the assignment or at the sweep limit); got "
                             f"{self.stop!r} with {fixed}")
        if self.fixed and self.starts != "even-split":
            raise ValueError(f"experimental: starts: applies under empirical Bayes only (with fixed hyper-parameters "
                             f"there is one start, the greedy pass at the given values); got {self.starts!r} with "
                             f"{fixed}")
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

    def with_heads(self, class_counts) -> "PFNMConfig":
        """This config with ``heads="auto"`` resolved for clients of these ``(J, C)`` class counts: ``"pooled"`` with a
        ``pool_temperature`` other than 1, else :func:`~bnpfed.matching.chosen_heads` (pooled when the class shares
        differ); the config itself when ``heads`` is given."""
        if self.heads != "auto":
            return self
        return replace(self, heads="pooled" if self.pool_temperature != 1 else chosen_heads("auto", class_counts))

    def check_groups(self, groups: Sequence[str]) -> None:
        """Raises unless ``sigma2``, ``sigma0_2``, ``gamma0`` and ``max_width``, where given as several values, give
        one per matched group (``groups``: the names of the network's permutation spec, in order), before anything
        trains.

        :param groups: the spec's group names (:attr:`~bnpfed.matching.PermutationSpec.group_names`)."""
        _check_groups(self, ("sigma2", "sigma0_2", "gamma0", "max_width"), groups)

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


@reads_experimental("starts", "stop", "later_rounds", "pvi_damping")
@documented
@dataclass(frozen=True)
class FusionConfig:
    """The posterior-fusion server (Ozer et al. 2022): every round the clients' posteriors are fused weight by weight
    (``align="none"``) or unit by unit after matching their hidden units (``align="match"``:
    :func:`~bnpfed.matching.posteriors.match_posteriors`, :class:`~bnpfed.federated.MatchedFusionFederation`)."""

    rule: str = option("conflation", choices=matched_rules, help=(
        'a rule of :mod:`bnpfed.combine` (``"eaa"``, ``"gaa"``, ``"log_variance"``, ``"pooling"``, ``"conflation"``, '
        'or a registered one), or with ``align="match"`` ``"atom-posterior"`` (the matching model\'s own posterior of '
        'each matched unit\'s atom) or ``"pvi"`` (partitioned variational inference: the prior times the members\' '
        'approximate-likelihood factors; in later rounds every client trains against its cavity instead of its '
        'slice, so that its data is not counted twice; every client in every round).'))
    weights: str = option("size", choices=CLIENT_WEIGHTS, shown=False, help=(
        'client weights ``b_k``: ``"size"`` (``n_k / sum_j n_j`` over the clients of the round, the paper\'s) or '
        '``"uniform"``.'))
    pooling_samples: int = option(1000, metavar="N", shown=False, help=(
        'N of the pooling rule (client k contributes ``floor(b_k N)`` draws), >= 2.'))
    min_variance: float = option(1e-16, metavar="V", shown=False, help=(
        'a floor on every fused variance, >= 0 (0: none). GAA and conflation divide the variance by about the number '
        'of clients a round; without a floor it would leave float32 after a few dozen rounds. 1e-16 (sigma 1e-8) '
        'keeps every rule finite for any number of rounds, far below any variance that matters to a prediction; how '
        'many weights sit at the floor is reported every round. :data:`PAPER_MIN_VARIANCE` (``exp(-8)``) is the '
        'published code\'s clamp of log sigma^2 at -8.'))
    fraction: float = option(1.0, metavar="F", help=(
        'the share of the clients sampled each round, in (0, 1] (``max(1, floor(fraction * J))`` clients).'))
    align: str = option("none", choices=ALIGNMENTS, help=(
        'how the clients\' weights are lined up: ``"none"`` (weight i of one client fused with weight i of the '
        'others: meaningful when the clients share an initialisation) or ``"match"`` (the clients\' hidden units '
        'matched first, each global unit\'s members fused).'))
    tau2: Union[None, float, tuple[float, ...]] = option(None, metavar="V[,V...]", shown=False, default_text=(
        "None (estimated per group)"), help=(
        '``align="match"``: the extra variance between two clients\' copies of a unit, > 0, one value or one per '
        'hidden permutation; None estimates it per group (empirical Bayes, with the atoms\' prior and the IBP mass).'))
    own_init: bool = option(False, shown=False, help=(
        '``align="none"``: each client starts round 1 from its own initialisation (the one-shot baseline without a '
        'shared initialisation) instead of one shared initialisation (weight-wise fusion means something only then). '
        '``align="match"`` always starts each client from its own.'))
    match_on: str = option("auto", choices=("auto",) + MATCH_ON, shown=False, help=(
        '``align="match"``: what the assignment is computed from: ``"posteriors"`` (the heteroscedastic model, every '
        'unit seen with its posterior variances plus ``tau2``), ``"means"`` (PFNM\'s model on the posterior means, '
        'the units a client reports dead on its own data left out first) or ``"auto"`` (``"means"`` for Laplace '
        'clients, whose post-hoc posteriors keep most weights at their prior variance; ``"posteriors"`` for '
        'variational clients: :meth:`matches_on`). The posteriors are fused along the assignment either way.'))
    matcher_device: Optional[str] = option(None, metavar="DEVICE", shown=False, default_text=(
        "None (numpy on the CPU)"), help=(
        '``align="match"``: where the matcher\'s cross products run, a torch device (:class:`PFNMConfig`\'s '
        '``matcher_device``); the Bayesian clients train on the CPU.'))
    heads: str = option("auto", choices=HEADS, help=(
        '``align="match"``: the global network\'s output layer, ``"fused"`` (the rule fuses the clients\' output '
        'layers like every other layer), ``"pooled"`` (the clients\' own posterior output layers of the last round '
        'on the fused body, their log-probabilities pooled with the class shares inside every weight draw: '
        ':class:`~bnpfed.matching.PooledPosterior`; J output layers instead of one) or ``"auto"``: pooled when the '
        'clients\' class shares differ (label skew, :func:`~bnpfed.matching.chosen_heads`), else fused; fused '
        'without ``align="match"`` or with a ``temperature`` other than 1, pooled with a ``pool_temperature`` other '
        'than 1. The clients start their next round from their slices of the fused posterior either way.'))
    pool_temperature: Union[float, str] = option(1.0, metavar="T|fit", shown=False, help=(
        '``heads="pooled"``: the pool\'s temperature in every draw, a number > 0 or ``"fit"`` (chosen by the matched '
        'clients\' training data, as :class:`PFNMConfig`\'s).'))
    temperature: Union[float, str] = option(1.0, metavar="T|fit", shown=False, help=(
        '``align="match"`` with the fused output layer: the global posterior predictive\'s temperature, '
        '``p(y | x) = 1/S sum_s softmax(f(x; w_s) / T)``, a number > 0 (1: the posterior\'s own predictive) or '
        '``"fit"``: each matched client scores the predictive\'s draws on its own training data at every temperature '
        'of :data:`~bnpfed.matching.pooled_heads.TEMPERATURES` and the server keeps the least summed NLL. With Laplace '
        'clients the draws are those of the linearised predictive.'))
    experimental: ExperimentalOptions = _experimental(
        "``starts``, ``stop`` (its matcher, ``align=\"match\"``), ``later_rounds``, ``pvi_damping``")

    def __post_init__(self):
        check_choice(self.rule, matched_rules(), "rule")
        check_choice(self.heads, HEADS, "heads")
        check_pool_temperature(self.pool_temperature)
        check_pool_temperature(self.temperature, "temperature")
        if self.temperature != 1 and self.align != "match":
            raise ValueError(f"temperature: the predictive temperature of matched fusion's global posterior; expected "
                             f"1 with align={self.align!r}, got {self.temperature!r}")
        if self.temperature != 1 and self.heads == "pooled":
            raise ValueError(f"temperature: the fused output layer's predictive temperature; with heads="
                             f"{self.heads!r} the pool's is pool_temperature; expected 1, got {self.temperature!r}")
        if self.temperature != 1 and self.pool_temperature != 1:
            raise ValueError(f"temperature, pool_temperature: the fused output layer's temperature and the pooled "
                             f"one's; expected one of them 1, got {self.temperature!r} and {self.pool_temperature!r}")
        if self.heads == "pooled" and self.align != "match":
            raise ValueError(f"heads: the output layer of matched fusion (the clients' own heads placed at the global "
                             f"units their units were matched to); expected 'fused' with align={self.align!r}, got "
                             f"{self.heads!r}")
        if self.rule in (ATOM_POSTERIOR, PVI) and self.align != "match":
            raise ValueError(f"rule: {self.rule!r} fuses matched units ({ATOM_POSTERIOR!r}: the matching model's "
                             f"posterior of each atom; {PVI!r}: the prior times the members' PVI factors); expected "
                             f"align='match' with it, got align={self.align!r}")
        _check_experimental(self)
        if self.rule == PVI and self.fraction != 1:
            raise ValueError(f"fraction: rule {PVI!r} keeps every client's factor in its own units from round to "
                             f"round, so every client takes part in every round; expected 1, got {self.fraction!r}")
        check_choice(self.weights, CLIENT_WEIGHTS, "weights")
        check_int(self.pooling_samples, "pooling_samples", low=2)
        check_float(self.min_variance, "min_variance", low=0.0)
        check_fraction(self.fraction, "fraction")
        check_choice(self.align, ALIGNMENTS, "align")
        check_bool(self.own_init, "own_init")
        if self.matcher_device is not None:
            check_device(self.matcher_device, "matcher_device")
        check_choice(self.match_on, ("auto",) + MATCH_ON, "match_on")
        if self.match_on != "auto" and self.align != "match":
            raise ValueError(f"match_on: what matched fusion's assignment is computed from; expected 'auto' with "
                             f"align={self.align!r} (nothing is matched), got {self.match_on!r}")
        if self.later_rounds != "auto" and self.align != "match":
            raise ValueError(f"experimental: later_rounds: matched fusion's rounds after the first; expected 'auto' "
                             f"with align={self.align!r} (nothing is matched), got {self.later_rounds!r}")
        if self.later_rounds == "fixed" and self.rule == PVI:
            raise ValueError(f"experimental: later_rounds: rule {PVI!r} keeps each client's factor in its own units, "
                             f"which the whole global posterior of 'fixed' rounds would change; expected 'rematch' "
                             f"with it, got 'fixed'")
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

    def check_groups(self, groups: Sequence[str]) -> None:
        """Raises unless ``tau2``, where given as several values, gives one per matched group (``groups``: the
        names of the network's permutation spec, in order), before anything trains.

        :param groups: the spec's group names (:attr:`~bnpfed.matching.PermutationSpec.group_names`)."""
        _check_groups(self, ("tau2",), groups)

    def with_heads(self, class_counts) -> "FusionConfig":
        """This config with ``heads="auto"`` resolved for clients of these ``(J, C)`` class counts: ``"fused"`` without
        ``align="match"`` or with a ``temperature`` other than 1 (the fused layer's), ``"pooled"`` with a
        ``pool_temperature`` other than 1, else :func:`~bnpfed.matching.chosen_heads` (pooled when the class shares
        differ); the config itself when ``heads`` is given."""
        if self.heads != "auto":
            return self
        if self.align != "match" or self.temperature != 1:
            return replace(self, heads="fused")
        return replace(self, heads="pooled" if self.pool_temperature != 1 else chosen_heads("auto", class_counts))

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
        (the configured prior, or a Pyro program's own sample statements, ``bayesian.program``;
        ``bayesian.round_prior`` None or ``"prior"``, and always for Laplace clients, whose slice is no prior) or
        ``"posterior"`` (the global posterior it starts from, or its slice of a matched one).
        Raises when ``bayesian.round_prior`` is set with rule ``"pvi"``, where it does not apply."""
        if not isinstance(bayesian, BayesianConfig):
            raise ValueError(f"bayesian: expected a BayesianConfig, got {type(bayesian).__name__}")
        if self.rule == PVI:
            if bayesian.round_prior is not None:
                raise ValueError(f"round_prior: rule {PVI!r} trains every client against its cavity (the slice "
                                 f"less its own factor); expected None with it, got {bayesian.round_prior!r}")
            return "cavity"
        return bayesian.round_prior or "prior"
