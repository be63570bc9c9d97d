"""Datasets for every experiment command, loaded into memory as normalised tensors.

One entry point, :func:`load_dataset`, returns a :class:`Dataset` whatever the source:

- ``"digits"`` (the default everywhere): scikit-learn's bundled 8x8 handwritten digits, no files needed.
- ``"diabetes"``: scikit-learn's bundled diabetes data, a regression (10 features, a real-valued target), no files
  needed.
- ``"mnist"``, ``"fashion-mnist"`` (also ``"fashion_mnist"``), ``"cifar10"``: torchvision's datasets, read from
  ``data_dir`` in torchvision's on-disk layout (the optional extra ``bnpfed[vision]``), e.g.
  ``load_dataset("mnist", data_dir="data/mnist", download=True)``. ``"cifar10"`` is read from the JPEG container
  :data:`CIFAR10_JPEG` in ``data_dir`` when torchvision's pickles are not there (``Dataset.source`` says which).
- ``"npz:PATH"``: a ``.npz`` file of your own; :data:`NPZ_FORMAT` says what it must hold.

Usage::

    >>> ds = load_dataset("digits")
    >>> ds.x_train.shape
    torch.Size([1347, 1, 8, 8])
    >>> ds.flat().x_train.shape             # for MLPs
    torch.Size([1347, 64])
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import io
import math
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bnpfed.validation import check_bool, check_int

__all__ = ["CIFAR10_JPEG", "DATASET_NAMES", "NPZ_FORMAT", "NPZ_PREFIX", "TASKS", "Dataset", "Preprocessing",
           "dataset_task", "load_dataset", "standardize_together"]

#: Names accepted by :func:`load_dataset` (besides the ``"npz:PATH"`` form); the CLI offers these as choices.
DATASET_NAMES = ("digits", "mnist", "fashion-mnist", "cifar10", "diabetes")

#: What a dataset's targets are: class labels, or real numbers.
TASKS = ("classification", "regression")

#: Prefix of the ``"npz:PATH"`` dataset name.
NPZ_PREFIX = "npz:"

#: What the ``.npz`` file of an ``"npz:PATH"`` dataset must hold, in words (the commands' ``--help`` quotes it; the
#: docstring of :func:`load_dataset` says the same).
NPZ_FORMAT = (
    "an .npz file (numpy.savez) holding four arrays: x_train (N_train, *input_shape) and x_test "
    "(N_test, *input_shape) with the same input_shape, either images stored channels-first (N, C, H, W), or "
    "(N, H, W) for one channel, or feature vectors (N, F); of an unsigned integer dtype (pixels: uint8 values are "
    "divided by 255, uint16 by 65535, ..., the dtype's maximum) or a float dtype (used as stored), all finite; "
    "y_train (N_train,) and y_test (N_test,) of an integer dtype, class labels 0 .. C-1 (C is the largest label "
    "+ 1, and every class has an example, unless num_classes says there are more); neither split empty."
)

_ALIASES = {"fashion_mnist": "fashion-mnist"}

#: The file name of CIFAR-10 as a JPEG container (where the original pickles cannot be had): ``train_jpeg`` /
#: ``test_jpeg`` (uint8, the JPEG files' bytes one after another), ``train_offsets`` / ``test_offsets`` (int64, N + 1
#: entries: image i is ``jpeg[offsets[i]:offsets[i + 1]]``), ``y_train`` / ``y_test`` (int64 labels), ``classes``.
#: Decoded once per process (PIL) and cached; a lossy copy (quality 75): accuracies come near, not equal to, figures
#: published on the original images.
CIFAR10_JPEG = "cifar10_jpeg.npz"

#: CIFAR-10's class names, in label order (torchvision's ``CIFAR10.classes``).
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")

#: The images of the JPEG container come grouped by class; they are put in one fixed random order (this seed) once
#: decoded, so that contiguous slices (a Flower client's test shard) hold every class.
CIFAR10_JPEG_ORDER_SEED = 0

#: The seeded stratified split of the digits data (it ships as one set of 1797 images).
DIGITS_TEST_FRACTION = 0.25
DIGITS_SPLIT_SEED = 0

#: The seeded split of the diabetes data (it ships as one set of 442 patients).
DIABETES_TEST_FRACTION = 0.25
DIABETES_SPLIT_SEED = 0

_NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


@dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test split held in memory as tensors.

    Construction checks the split (cheaply): shapes agree with ``input_shape``, ``x`` is finite floating point,
    labels are integers in ``[0, num_classes)`` (a regression's targets: finite floating point).

    Usage::

        >>> ds = load_dataset("digits")
        >>> model = torch.nn.Linear(ds.flat().input_shape[0], ds.num_classes)
        >>> model(ds.flat().x_test).shape
        torch.Size([450, 10])

    :param torch.Tensor x_train: inputs, float32, ``(N_train, *input_shape)``; images are ``(N, C, H, W)``,
        normalised (mean about 0, standard deviation about 1 per channel on the train split) unless loaded with
        ``standardize=False``.
    :param torch.Tensor y_train: class labels, int64, ``(N_train,)``, in ``0 .. num_classes - 1``; for a
        regression (``task="regression"``) real-valued targets, float32, ``(N_train,)``.
    :param torch.Tensor x_test: inputs, float32, ``(N_test, *input_shape)``, normalised with the train constants.
    :param torch.Tensor y_test: class labels, int64, ``(N_test,)``, in ``0 .. num_classes - 1``.
    :param str name: the canonical dataset name (``"digits"``, ``"fashion-mnist"``, ``"npz:PATH"``, ...).
    :param int num_classes: number of classes, at least 1 (for a regression the network's outputs per example, 1).
    :param tuple input_shape: shape of one input, e.g. ``(1, 28, 28)``; ``(F,)`` for flat data.
    :param str source: where the data came from, in words (e.g. CIFAR-10's original pickles or its JPEG copy).
    :param tuple mean: the per-channel (one value for feature vectors) constants the inputs were standardised with,
        ``x = (raw - mean) / std``; None for inputs as the loader reads them (``standardize=False``). Set with ``std``.
    :param tuple std: the matching standard deviations, each > 0; None with ``mean``.
    :param tuple classes: the class names, ``num_classes`` of them, where the source names them; None otherwise.
    :param str task: one of :data:`TASKS`, ``"classification"`` (default) or ``"regression"``.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    name: str
    num_classes: int
    input_shape: tuple[int, ...]
    source: str = ""
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    classes: tuple[str, ...] | None = None
    task: str = "classification"

    def __post_init__(self):
        check_int(self.num_classes, "num_classes", low=1)
        _check_constants(self.mean, self.std)
        if self.classes is not None and (len(self.classes) != self.num_classes
                                         or not all(isinstance(c, str) for c in self.classes)):
            raise ValueError(f"classes: expected {self.num_classes} class names (num_classes), got {self.classes!r}")
        if self.task not in TASKS:
            raise ValueError(f"task: expected one of {list(TASKS)}, got {self.task!r}")
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if tuple(x.shape[1:]) != tuple(self.input_shape):
                raise ValueError(
                    f"x_{split}: expected shape (N, *input_shape) with input_shape={tuple(self.input_shape)}, "
                    f"got {tuple(x.shape)}"
                )
            if not x.is_floating_point():
                raise ValueError(f"x_{split}: expected a floating-point tensor, got dtype {x.dtype}")
            finite = torch.isfinite(x)
            if not bool(finite.all()):
                raise ValueError(
                    f"x_{split}: expected finite values, got {int((~finite).sum())} NaN or infinite value(s)"
                )
            if y.ndim != 1 or y.shape[0] != x.shape[0]:
                raise ValueError(
                    f"y_{split}: expected shape ({x.shape[0]},), one label per row of x_{split}, got {tuple(y.shape)}"
                )
            if self.task == "regression":
                if not y.is_floating_point() or not bool(torch.isfinite(y).all()):
                    raise ValueError(f"y_{split}: expected finite real-valued regression targets, got dtype "
                                     f"{y.dtype} with {int((~torch.isfinite(y)).sum()) if y.is_floating_point() else 0}"
                                     " NaN or infinite value(s)")
                continue
            if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
                raise ValueError(f"y_{split}: expected an integer tensor of class labels, got dtype {y.dtype}")
            if y.numel() and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
                raise ValueError(
                    f"y_{split}: expected class labels in [0, {self.num_classes}) (num_classes={self.num_classes}), "
                    f"got labels from {int(y.min())} to {int(y.max())}"
                )

    def flat(self) -> Dataset:
        """The same data with every input flattened to a vector: ``x`` is ``(N, prod(input_shape))``, for MLPs."""
        features = math.prod(self.input_shape)
        return dataclasses.replace(
            self,
            x_train=self.x_train.reshape(len(self.x_train), features),
            x_test=self.x_test.reshape(len(self.x_test), features),
            input_shape=(features,),
        )

    def preprocessing(self) -> Preprocessing:
        """How these inputs were prepared (:class:`Preprocessing`): what a model trained on them records."""
        return Preprocessing(dataset=self.name, input_shape=tuple(self.input_shape), num_classes=self.num_classes,
                             mean=self.mean, std=self.std, classes=self.classes)


def _check_constants(mean, std) -> None:
    """``mean`` and ``std`` both None, or tuples of as many finite numbers (``std`` > 0)."""
    if (mean is None) != (std is None):
        raise ValueError(f"mean, std: expected both (the standardisation constants) or neither, got mean={mean!r}, "
                         f"std={std!r}")
    if mean is None:
        return
    ok = (isinstance(mean, tuple) and isinstance(std, tuple) and len(mean) == len(std) >= 1
          and all(isinstance(v, float) and math.isfinite(v) for v in mean)
          and all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in std))
    if not ok:
        raise ValueError(f"mean, std: expected two tuples of as many finite floats (one per channel; std > 0), got "
                         f"mean={mean!r}, std={std!r}")


@dataclass(frozen=True)
class Preprocessing:
    """How a model's inputs were prepared: the dataset they came from, the constants they were standardised with
    (or none: inputs as :func:`load_dataset` reads them with ``standardize=False``, pixels in [0, 1]), their shape
    and the classes. A saved global model records it (:func:`bnpfed.saved.save_global`), and ``bnpfed evaluate``
    prepares its test inputs by it, so that a model trained on raw pixels is not scored on standardised ones.

    Usage::

        >>> raw = load_dataset("digits", standardize=False)
        >>> ds = load_dataset("digits")
        >>> inputs = ds.preprocessing()
        >>> inputs.standardized, inputs.input_shape, inputs.num_classes
        (True, (1, 8, 8), 10)
        >>> bool(torch.equal(inputs.apply(raw.x_test), ds.x_test))      # raw inputs prepared as the model saw them
        True
        >>> raw.preprocessing().describe()
        'not standardised (as read: pixels in [0, 1])'
        >>> Preprocessing.from_dict(inputs.as_dict()) == inputs
        True

    :param str dataset: the dataset's name (:attr:`Dataset.name`: ``"digits"``, ``"mnist"``, ``"npz:PATH"``, ...).
    :param tuple input_shape: the shape of one input, e.g. ``(1, 28, 28)``.
    :param int num_classes: the number of classes.
    :param tuple mean: per-channel means subtracted (one value for feature vectors), or None (not standardised).
    :param tuple std: the per-channel standard deviations divided by, or None.
    :param tuple classes: the class names, or None where the source names none.
    """

    dataset: str
    input_shape: tuple[int, ...]
    num_classes: int
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    classes: tuple[str, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.dataset, str) or not self.dataset:
            raise ValueError(f"dataset: expected the dataset's name, got {self.dataset!r}")
        shape = self.input_shape
        if not (isinstance(shape, tuple) and shape and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1
                                                           for s in shape)):
            raise ValueError(f"input_shape: expected a tuple of ints >= 1, got {shape!r}")
        check_int(self.num_classes, "num_classes", low=1)
        _check_constants(self.mean, self.std)
        if self.mean is not None and len(self.mean) > 1 and (math.prod(shape) % len(self.mean)
                                                             or (len(shape) == 3 and shape[0] != len(self.mean))):
            raise ValueError(f"mean: expected one constant, or one per channel of input_shape {shape}, got "
                             f"{len(self.mean)}")
        if self.classes is not None and (len(self.classes) != self.num_classes
                                         or not all(isinstance(c, str) for c in self.classes)):
            raise ValueError(f"classes: expected {self.num_classes} class names (num_classes), got {self.classes!r}")

    @property
    def standardized(self) -> bool:
        """Whether the inputs were standardised."""
        return self.mean is not None

    def describe(self) -> str:
        """In words, e.g. ``"standardised with mean (0.1307,) and std (0.3081,)"``."""
        if not self.standardized:
            return "not standardised (as read: pixels in [0, 1])"
        return (f"standardised with mean ({', '.join(f'{m:.4g}' for m in self.mean)}) and std "
                f"({', '.join(f'{v:.4g}' for v in self.std)})")

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Inputs as :func:`load_dataset` reads them with ``standardize=False`` (``x: (N, *input_shape)``) prepared
        as the model saw them: standardised with these constants, or as they are."""
        x = torch.as_tensor(x)
        if tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(f"x: expected inputs of shape (N, {', '.join(map(str, self.input_shape))}) (the model's "
                             f"input shape), got {tuple(x.shape)}")
        if not self.standardized:
            return x
        channels = len(self.mean)   # one pair for every value (digits, feature vectors), or one per channel
        shape = (1, channels, 1)
        mean = torch.tensor(self.mean, dtype=x.dtype).reshape(shape)
        std = torch.tensor(self.std, dtype=x.dtype).reshape(shape)
        return ((x.reshape(len(x), channels, -1) - mean) / std).reshape(x.shape).contiguous()

    def load(self, name: str | None = None, *, data_dir: str | os.PathLike | None = None, download: bool = False,
             num_classes: int | None = None) -> Dataset:
        """The dataset ``name`` (default: :attr:`dataset`, the one the model was trained on; see
        :func:`load_dataset`) with its inputs prepared by these constants: what the model expects. A dataset of
        another input shape or class count is refused (``ValueError`` naming ``name``)."""
        ds = load_dataset(self.dataset if name is None else name, data_dir=data_dir, download=download,
                          standardize=False, num_classes=num_classes)
        problems = self.mismatches(ds, prepared=False)
        if problems:
            raise ValueError(f"name: expected a dataset the model takes, got {ds.name!r}: {'; '.join(problems)}")
        return dataclasses.replace(ds, x_train=self.apply(ds.x_train), x_test=self.apply(ds.x_test), mean=self.mean,
                                   std=self.std)

    def mismatches(self, dataset: Dataset, *, prepared: bool = True) -> list[str]:
        """What keeps ``dataset`` from being the model's input, in words (empty when nothing does): another input
        shape or class count, and (``prepared``: when ``dataset``'s inputs are already prepared) other
        standardisation constants. Another dataset name or other class names are no mismatch: see
        :meth:`differences`."""
        out = []
        if tuple(dataset.input_shape) != self.input_shape:
            out.append(f"inputs of shape {tuple(dataset.input_shape)}, the model takes {self.input_shape}")
        if dataset.num_classes != self.num_classes:
            out.append(f"{dataset.num_classes} classes, the model has {self.num_classes}")
        if prepared and not _same_constants(dataset, self):
            out.append(f"inputs {dataset.preprocessing().describe()}, the model's were {self.describe()}")
        return out

    def differences(self, dataset: Dataset) -> list[str]:
        """What a model trained on :attr:`dataset` may not expect of ``dataset`` although it can run on it: another
        dataset, other class names (a note, not an error: evaluating under a shift of domain is a use)."""
        out = []
        if dataset.name != self.dataset:
            out.append(f"the model was trained on {self.dataset}, not {dataset.name}")
        if self.classes is not None and dataset.classes is not None and tuple(dataset.classes) != self.classes:
            out.append(f"its classes are {list(self.classes)}, {dataset.name}'s {list(dataset.classes)}")
        return out

    def as_dict(self) -> dict:
        """JSON-ready: lists for the tuples."""
        return {"dataset": self.dataset, "input_shape": list(self.input_shape), "num_classes": self.num_classes,
                "mean": None if self.mean is None else list(self.mean),
                "std": None if self.std is None else list(self.std),
                "classes": None if self.classes is None else list(self.classes)}

    @classmethod
    def from_dict(cls, record) -> Preprocessing:
        """What :meth:`as_dict` wrote; a ``ValueError`` naming the field otherwise."""
        keys = {"dataset", "input_shape", "num_classes", "mean", "std", "classes"}
        if not isinstance(record, dict) or set(record) != keys:
            raise ValueError(f"inputs: expected a dict of {sorted(keys)}, got {record!r}")

        def floats(value):
            return None if value is None else tuple(float(v) for v in value)

        return cls(dataset=record["dataset"], input_shape=tuple(record["input_shape"]),
                   num_classes=record["num_classes"], mean=floats(record["mean"]), std=floats(record["std"]),
                   classes=None if record["classes"] is None else tuple(record["classes"]))


def _same_constants(dataset: Dataset, inputs: Preprocessing) -> bool:
    """Whether ``dataset`` was prepared with ``inputs``' constants (to float32's precision: the loaders' floats)."""
    if (dataset.mean is None) != (inputs.mean is None):
        return False
    if dataset.mean is None:
        return True
    return (len(dataset.mean) == len(inputs.mean)
            and np.allclose(dataset.mean, inputs.mean, rtol=1e-6, atol=1e-7)
            and np.allclose(dataset.std, inputs.std, rtol=1e-6, atol=1e-7))


def load_dataset(name: str = "digits", *, data_dir: str | os.PathLike | None = None, download: bool = False,
                 standardize: bool = True, num_classes: int | None = None) -> Dataset:
    """Load a dataset by name into memory.

    An ``"npz:PATH"`` file must be an .npz file (numpy.savez) holding four arrays: x_train (N_train, *input_shape) and
    x_test (N_test, *input_shape) with the same input_shape, either images stored channels-first (N, C, H, W), or
    (N, H, W) for one channel, or feature vectors (N, F); of an unsigned integer dtype (pixels: uint8 values are
    divided by 255, uint16 by 65535, ..., the dtype's maximum) or a float dtype (used as stored), all finite;
    y_train (N_train,) and y_test (N_test,) of an integer dtype, class labels 0 .. C-1 (C is the largest label + 1,
    and every class has an example, unless num_classes says there are more); neither split empty.

    (This paragraph is :data:`NPZ_FORMAT`.) Signed integer inputs are refused rather than guessed at: their maximum
    (2**63 - 1 for int64) is no pixel scale; save ``x.astype(np.uint8)`` or ``x.astype(np.float32)``. Without
    ``num_classes``, a class that only y_test holds is refused too (a model trained on y_train would have an output
    no example taught).

    Parameters
    ----------
    name : str
        One of :data:`DATASET_NAMES` (``"fashion_mnist"`` is accepted for ``"fashion-mnist"``), or
        ``"npz:PATH"`` for an ``.npz`` file as above.
    data_dir : path, optional
        torchvision's ``root`` for ``"mnist"``, ``"fashion-mnist"`` and ``"cifar10"`` (required for those);
        ignored otherwise.
    download : bool
        Let torchvision download missing files into ``data_dir``. Off by default: nothing is fetched unasked.
    standardize : bool
        Standardise inputs with the train split's constants (default). ``False`` keeps pixel values in [0, 1],
        as the PFNM reference code feeds them (its hyper-parameters sigma2 = sigma0_2 = 1 are set for that scale),
        and float ``.npz`` inputs as stored.
    num_classes : int, optional
        ``"npz:PATH"`` only: the number of classes C when some have no example in the file (labels must lie in
        ``0 .. C-1``). Default: the largest label + 1, every class with an example (so that one mistyped label, 999
        among digits, is an error, not a 1000-class model).

    Returns
    -------
    Dataset
        ``"digits"``: 8x8 images ``(N, 1, 8, 8)`` scaled to [0, 1] (divided by 16), then standardised with the
        train split's scalar mean and standard deviation; split 75/25, stratified by class, with a fixed seed
        (:data:`DIGITS_TEST_FRACTION`, :data:`DIGITS_SPLIT_SEED`): 1347 train and 450 test images.
        ``"diabetes"``: 442 patients' 10 features ``(N, 10)`` and a measure of disease progression a year later
        (a regression, ``task="regression"``, ``num_classes=1``), split 75/25 with a fixed seed
        (:data:`DIABETES_TEST_FRACTION`, :data:`DIABETES_SPLIT_SEED`): 331 train and 111 test examples; every feature
        and the target standardised with the train split's mean and standard deviation (``standardize=False``: as
        scikit-learn stores them, features and target in their own units).
        torchvision datasets: images ``(N, C, H, W)`` in [0, 1], normalised per channel with the standard
        constants. ``"npz:PATH"``: float32 inputs, pixels scaled to [0, 1]; ``(N, H, W)`` images become
        ``(N, 1, H, W)``; standardised with the train split's mean and (population) standard deviation, per
        channel for images and one scalar pair for feature vectors (so features keep their stored relative
        scales, as flattened pixels should; standardise differently-scaled features yourself before saving);
        a constant channel is only centred. ``num_classes`` is the largest label over both splits + 1
        (or as given).

    Raises
    ------
    ValueError
        Unknown name, ``data_dir`` missing for a torchvision dataset, or an ``.npz`` that breaks
        :data:`NPZ_FORMAT` (not an ``.npz`` archive, missing arrays, mismatched shapes, an empty split, NaN or
        infinite values, labels that are not non-negative integers); the message names the file.
    ImportError
        torchvision is not installed (``pip install bnpfed[vision]``).
    FileNotFoundError
        The dataset's files are not under ``data_dir`` (or the ``.npz`` file does not exist) and
        ``download`` is False.

    Examples
    --------
    >>> ds = load_dataset("digits")
    >>> tuple(ds.x_train.shape), ds.num_classes
    ((1347, 1, 8, 8), 10)

    An ``.npz`` of uint8 greyscale images ``(N, H, W)``:

    >>> import tempfile
    >>> rng = np.random.default_rng(0)
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     path = os.path.join(folder, "toy.npz")
    ...     np.savez(path, x_train=rng.integers(0, 256, (20, 6, 6), dtype=np.uint8), y_train=np.arange(20) % 3,
    ...              x_test=rng.integers(0, 256, (5, 6, 6), dtype=np.uint8), y_test=np.arange(5) % 3)
    ...     raw = load_dataset(f"npz:{path}", standardize=False)
    ...     ds = load_dataset(f"npz:{path}")
    >>> raw.input_shape, raw.num_classes, 0 <= float(raw.x_train.min()) <= float(raw.x_train.max()) <= 1
    ((1, 6, 6), 3, True)
    >>> round(float(ds.x_train.mean()), 4) + 0.0, round(float(ds.x_train.std(unbiased=False)), 4)
    (0.0, 1.0)
    """
    if not isinstance(name, str):
        raise ValueError(f"name: expected one of {_known_names()}, got {name!r}")
    check_bool(download, "download")
    check_bool(standardize, "standardize")
    if name.startswith(NPZ_PREFIX):
        return _load_npz(name[len(NPZ_PREFIX):], standardize,
                         None if num_classes is None else check_int(num_classes, "num_classes", low=1))
    if num_classes is not None:
        raise ValueError(f"num_classes: expected only with an '{NPZ_PREFIX}PATH' dataset (the others know their "
                         f"classes), got {num_classes!r} with {name!r}")
    canonical = _ALIASES.get(name.lower(), name.lower())
    if canonical == "digits":
        return _load_digits(standardize)
    if canonical == "diabetes":
        return _load_diabetes(standardize)
    if canonical in _VISION:
        return _load_vision(canonical, data_dir=data_dir, download=download, standardize=standardize)
    raise ValueError(f"name: expected one of {_known_names()}, got {name!r}")


def dataset_task(name: str) -> str:
    """The task (:data:`TASKS`) of the dataset ``name`` without loading it: ``"regression"`` for ``"diabetes"``,
    ``"classification"`` for the others (an ``"npz:PATH"`` file holds class labels).

    >>> dataset_task("diabetes"), dataset_task("mnist")
    ('regression', 'classification')
    """
    return "regression" if isinstance(name, str) and name.lower() == "diabetes" else "classification"


def _known_names() -> str:
    return ", ".join([*map(repr, DATASET_NAMES), f"'{NPZ_PREFIX}PATH'"])


def _load_digits(standardize: bool = True) -> Dataset:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = digits.images.astype(np.float32)[:, None] / 16.0  # pixel counts are 0..16
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=DIGITS_TEST_FRACTION, stratify=y, random_state=DIGITS_SPLIT_SEED
    )
    mean, std = (float(x_train.mean()), float(x_train.std())) if standardize else (0.0, 1.0)
    return Dataset(
        x_train=_standardise(torch.from_numpy(x_train), (mean,), (std,)),
        y_train=torch.from_numpy(y_train),
        x_test=_standardise(torch.from_numpy(x_test), (mean,), (std,)),
        y_test=torch.from_numpy(y_test),
        name="digits",
        num_classes=10,
        input_shape=(1, 8, 8),
        mean=(mean,) if standardize else None,
        std=(std,) if standardize else None,
        classes=tuple(str(c) for c in digits.target_names),
    )


def _load_diabetes(standardize: bool = True) -> Dataset:
    from sklearn.datasets import load_diabetes
    from sklearn.model_selection import train_test_split

    data = load_diabetes(scaled=False)
    x, y = data.data.astype(np.float32), data.target.astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=DIABETES_TEST_FRACTION,
                                                        random_state=DIABETES_SPLIT_SEED)
    if standardize:
        mean, std = x_train.mean(0), x_train.std(0)
        x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
        y_mean, y_std = y_train.mean(), y_train.std()
        y_train, y_test = (y_train - y_mean) / y_std, (y_test - y_mean) / y_std
    return Dataset(x_train=torch.from_numpy(x_train), y_train=torch.from_numpy(y_train),
                   x_test=torch.from_numpy(x_test), y_test=torch.from_numpy(y_test), name="diabetes", num_classes=1,
                   input_shape=(10,), source="scikit-learn's bundled diabetes data", task="regression")


@dataclass(frozen=True)
class _VisionSpec:
    class_name: str  # in torchvision.datasets
    folder: str  # where torchvision looks for the files, relative to root
    mean: tuple[float, ...]
    std: tuple[float, ...]


# Normalisation constants: the per-channel mean and std of each train split, the values used across the
# literature (MNIST from the PyTorch examples; CIFAR-10 std is the per-image-pixel std over the train set).
_VISION = {
    "mnist": _VisionSpec("MNIST", os.path.join("MNIST", "raw"), (0.1307,), (0.3081,)),
    "fashion-mnist": _VisionSpec("FashionMNIST", os.path.join("FashionMNIST", "raw"), (0.2860,), (0.3530,)),
    "cifar10": _VisionSpec("CIFAR10", "cifar-10-batches-py", (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}


def _load_vision(name: str, *, data_dir, download: bool, standardize: bool = True) -> Dataset:
    spec = _VISION[name]
    if data_dir is None:
        raise ValueError(
            f"data_dir: expected the folder holding (or to receive, with download=True) torchvision's "
            f"{spec.class_name} files for dataset {name!r} (--data-dir on the command line), got None"
        )
    try:
        datasets = importlib.import_module("torchvision.datasets")
    except ImportError as err:
        raise ImportError(
            f"dataset {name!r} needs torchvision; install it with `pip install bnpfed[vision]`"
        ) from err
    dataset_class = getattr(datasets, spec.class_name)
    root = os.fspath(data_dir)
    if name == "cifar10" and not os.path.isdir(os.path.join(root, spec.folder)) and not download:
        container = Path(root) / CIFAR10_JPEG
        if container.is_file():
            return _load_cifar10_jpeg(container, spec, standardize)
    splits = []
    for train in (True, False):
        try:
            ds = dataset_class(root=root, train=train, download=download)
        except RuntimeError as err:
            if download:
                raise
            where = os.path.join(os.path.abspath(root), spec.folder)
            raise FileNotFoundError(
                f"{name} files not found (or failing torchvision's integrity check) in {where}; "
                f"pass --download (download=True) to fetch them into data_dir={root!r}"
            ) from err
        splits.append(_images_to_tensors(ds.data, ds.targets, spec, standardize))
    (x_train, y_train), (x_test, y_test) = splits
    return Dataset(
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        name=name,
        num_classes=len(ds.classes),
        input_shape=tuple(x_train.shape[1:]),
        source=f"torchvision's {spec.class_name} files in {os.path.join(root, spec.folder)}",
        mean=spec.mean if standardize else None,
        std=spec.std if standardize else None,
        classes=tuple(str(c) for c in ds.classes),
    )


@functools.lru_cache(maxsize=2)
def _decoded_cifar10_jpeg(path: str, mtime: float, size: int) -> tuple[np.ndarray, ...]:
    """The container's images decoded once (PIL), ``(N, 32, 32, 3)`` uint8 per split, in the fixed order of
    :data:`CIFAR10_JPEG_ORDER_SEED`, and their labels. ``mtime`` and ``size`` key the cache to the file's version."""
    from PIL import Image

    with np.load(path, allow_pickle=False) as f:
        missing = [k for k in ("train_jpeg", "test_jpeg", "train_offsets", "test_offsets", "y_train", "y_test")
                   if k not in f.files]
        if missing:
            raise ValueError(f"data_dir: expected {CIFAR10_JPEG} to hold train_jpeg, test_jpeg, train_offsets, "
                             f"test_offsets, y_train, y_test, got {sorted(f.files)} (missing {missing}) in {path}")
        out = []
        for split in ("train", "test"):
            jpeg, offsets, y = f[f"{split}_jpeg"], f[f"{split}_offsets"], f[f"y_{split}"]
            if offsets.ndim != 1 or len(offsets) != len(y) + 1 or (np.diff(offsets) <= 0).any():
                raise ValueError(f"data_dir: expected {split}_offsets of {len(y) + 1} increasing entries (one more "
                                 f"than y_{split}) in {path}, got shape {offsets.shape}")
            images = np.stack([np.asarray(Image.open(io.BytesIO(jpeg[a:b].tobytes())).convert("RGB"))
                               for a, b in zip(offsets[:-1], offsets[1:])])
            order = np.random.default_rng(CIFAR10_JPEG_ORDER_SEED).permutation(len(y))
            out += [images[order], np.asarray(y, dtype=np.int64)[order]]
    return tuple(out)


def _load_cifar10_jpeg(path: Path, spec: _VisionSpec, standardize: bool) -> Dataset:
    """CIFAR-10 from :data:`CIFAR10_JPEG` (decoded once, cached), normalised with the original's constants."""
    stat = path.stat()
    x_train, y_train, x_test, y_test = _decoded_cifar10_jpeg(str(path.resolve()), stat.st_mtime, stat.st_size)
    (x_train, y_train), (x_test, y_test) = (_images_to_tensors(x, y, spec, standardize)
                                            for x, y in ((x_train, y_train), (x_test, y_test)))
    return Dataset(x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test, name="cifar10", num_classes=10,
                   input_shape=tuple(x_train.shape[1:]),
                   source=f"the JPEG copy of CIFAR-10 (quality 75; not the original pickles) in {path}",
                   mean=spec.mean if standardize else None, std=spec.std if standardize else None,
                   classes=CIFAR10_CLASSES)


def _images_to_tensors(data, targets, spec: _VisionSpec, standardize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """torchvision's raw arrays -> normalised float32 ``(N, C, H, W)`` and int64 labels.

    MNIST-style datasets hold a uint8 tensor ``(N, H, W)``; CIFAR-10 a uint8 numpy array ``(N, H, W, C)``.
    """
    x = torch.as_tensor(np.asarray(data))
    x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)
    x = x.to(torch.float32).div_(255.0)
    y = torch.as_tensor(np.asarray(targets), dtype=torch.int64)
    return (_standardise(x, spec.mean, spec.std) if standardize else x.contiguous()), y


def _standardise(x: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """``(x - mean) / std`` per channel of ``x: (N, C, H, W)``."""
    shape = (1, len(mean)) + (1,) * (x.ndim - 2)
    mean_t = torch.tensor(mean, dtype=x.dtype).reshape(shape)
    std_t = torch.tensor(std, dtype=x.dtype).reshape(shape)
    return ((x - mean_t) / std_t).contiguous()


def _load_npz(path: str, standardize: bool = True, num_classes: int | None = None) -> Dataset:
    """An ``"npz:PATH"`` dataset: read, check against :data:`NPZ_FORMAT`, scale pixels, standardise on request."""
    if not path:
        raise ValueError(f"name: expected '{NPZ_PREFIX}PATH' naming an .npz file, got {NPZ_PREFIX!r}, which has no "
                         "path")
    file = Path(path).expanduser()
    if not file.exists():
        raise FileNotFoundError(
            f"npz dataset file {str(file.absolute())!r} does not exist; expected an .npz file holding "
            f"{', '.join(_NPZ_KEYS)}"
        )
    if not file.is_file():
        raise ValueError(f"npz file {str(file)!r}: expected an .npz file, got a directory")
    arrays = _read_npz(file)
    _check_npz(file, arrays)
    x_train, x_test = (_npz_inputs(arrays[key]) for key in ("x_train", "x_test"))
    for key, x in (("x_train", x_train), ("x_test", x_test)):
        finite = np.isfinite(x)
        if not finite.all():  # after the cast: float64 values beyond float32's range are infinite too
            raise ValueError(
                f"npz file {str(file)!r}: {key}: expected finite values (in float32's range), "
                f"got {int(x.size - finite.sum())} NaN or infinite value(s)"
            )
    x_train_t, x_test_t = torch.from_numpy(x_train), torch.from_numpy(x_test)
    mean = std = None
    if standardize:
        mean, std = _train_constants(x_train_t)
        x_train_t, x_test_t = _standardise(x_train_t, mean, std), _standardise(x_test_t, mean, std)
    y_train, y_test = (torch.from_numpy(arrays[key].astype(np.int64)) for key in ("y_train", "y_test"))
    largest = int(max(y_train.max(), y_test.max()))
    if num_classes is None:
        seen = torch.zeros(largest + 1, dtype=torch.bool)
        seen[y_train] = True
        seen[y_test] = True
        empty = torch.nonzero(~seen).flatten().tolist()
        if empty:
            shown = ", ".join(map(str, empty[:5])) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
            raise ValueError(f"npz file {str(file)!r}: y_train, y_test: expected every class 0 .. {largest} (the "
                             f"largest label) to have an example, got none of class(es) {shown}: relabel the "
                             f"classes 0 .. C-1, or give num_classes (--num-classes) if they are meant to be empty")
        num_classes = largest + 1
        only_test = sorted(set(y_test.unique().tolist()) - set(y_train.unique().tolist()))
        if only_test:   # a model trained on y_train has an output for them that no example taught
            shown = ", ".join(map(str, only_test[:5])) + (f" and {len(only_test) - 5} more" if len(only_test) > 5
                                                          else "")
            raise ValueError(f"npz file {str(file)!r}: y_test: expected labels of the classes y_train holds, got "
                             f"class(es) {shown} in y_test only (a model trained on y_train would carry an output "
                             f"no example taught): relabel, drop those examples, or give num_classes (--num-classes) "
                             f"if classes without training examples are meant")
    elif largest >= num_classes:
        raise ValueError(f"num_classes: expected more than the largest label of {str(file)!r} ({largest}), got "
                         f"{num_classes}")
    return Dataset(
        x_train=x_train_t,
        y_train=y_train,
        x_test=x_test_t,
        y_test=y_test,
        name=f"{NPZ_PREFIX}{path}",
        num_classes=num_classes,
        input_shape=tuple(x_train_t.shape[1:]),
        mean=mean,
        std=std,
    )


def _read_npz(file: Path) -> dict[str, np.ndarray]:
    """The four arrays of :data:`NPZ_FORMAT` from ``file``, or a ``ValueError`` naming the file."""
    try:
        npz = np.load(file, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(
            f"npz file {str(file)!r}: expected an .npz archive written by numpy.savez, got a file numpy cannot read "
            f"as one ({type(err).__name__}: {err})"
        ) from err
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise ValueError(
            f"npz file {str(file)!r}: expected an .npz archive written by numpy.savez holding "
            f"{list(_NPZ_KEYS)}, got a single .npy array of shape {npz.shape}"
        )
    with npz:
        missing = [key for key in _NPZ_KEYS if key not in npz.files]
        if missing:
            raise ValueError(
                f"npz file {str(file)!r}: expected arrays {list(_NPZ_KEYS)}, got {sorted(npz.files)}, which lack "
                f"{missing}"
            )
        arrays = {}
        for key in _NPZ_KEYS:
            try:
                arrays[key] = npz[key]
            except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:
                raise ValueError(
                    f"npz file {str(file)!r}: {key}: expected a numeric array, got one numpy cannot read without "
                    f"pickle ({type(err).__name__}: {err})"
                ) from err
    return arrays


def _check_npz(file: Path, arrays: dict[str, np.ndarray]) -> None:
    """Dtypes, shapes, empty splits and label values against :data:`NPZ_FORMAT` (finiteness is checked later)."""

    def bad(key: str, expected: str, got: str) -> ValueError:
        return ValueError(f"npz file {str(file)!r}: {key}: expected {expected}, got {got}")

    for key in ("x_train", "x_test"):
        x = arrays[key]
        if x.dtype.kind == "i":
            raise bad(key, "unsigned integer pixels (uint8, uint16, ...) or floats",
                      f"dtype {x.dtype}; save x.astype(np.uint8) for 0..255 pixels, or x.astype(np.float32) for "
                      f"values to use as stored")
        if x.dtype.kind not in "uf":
            raise bad(key, "unsigned integer pixels (uint8, uint16, ...) or floats", f"dtype {x.dtype}")
        if x.ndim not in (2, 3, 4):
            raise bad(key, "(N, F) feature vectors, (N, H, W) or (N, C, H, W) images", f"shape {x.shape}")
        if x.shape[0] == 0:
            raise bad(key, "at least one example (neither split may be empty)", f"shape {x.shape}")
        if 0 in x.shape[1:]:
            raise bad(key, "inputs of at least one value each", f"shape {x.shape}")
    x_train, x_test = arrays["x_train"], arrays["x_test"]
    if x_test.shape[1:] != x_train.shape[1:]:
        raise bad("x_test", f"shape (N_test, {', '.join(map(str, x_train.shape[1:]))}), the input shape of x_train "
                  f"{x_train.shape}", f"shape {x_test.shape}")
    for key, x_key in (("y_train", "x_train"), ("y_test", "x_test")):
        y, n = arrays[key], arrays[x_key].shape[0]
        if y.dtype.kind not in "iu":
            hint = ""
            if y.dtype.kind == "f" and y.ndim == 1 and np.all(np.isfinite(y)) and np.all(y == np.round(y)):
                hint = "; save y.astype(np.int64)"
            raise bad(key, "integer class labels 0 .. C-1", f"dtype {y.dtype}{hint}")
        if y.shape != (n,):
            raise bad(key, f"shape ({n},), one label per row of {x_key} {arrays[x_key].shape}", f"shape {y.shape}")
        if y.min() < 0:
            raise bad(key, "class labels 0 .. C-1", f"{int((y < 0).sum())} negative label(s), the smallest {y.min()}")


def _npz_inputs(x: np.ndarray) -> np.ndarray:
    """Stored inputs as float32: unsigned integers are pixels, divided by the dtype's maximum; ``(N, H, W)`` gets a
    channel axis."""
    if x.dtype.kind == "u":
        x = x.astype(np.float32) / np.float32(np.iinfo(x.dtype).max)
    with np.errstate(over="ignore"):  # values beyond float32's range become inf, which the caller reports
        x = np.ascontiguousarray(x, dtype=np.float32)
    return x[:, None] if x.ndim == 3 else x


def _train_constants(x: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Mean and population standard deviation of the train inputs: per channel of ``(N, C, H, W)`` images, one
    scalar pair for ``(N, F)`` vectors. A standard deviation of 0 (a constant channel) is replaced by 1."""
    dims = (0, 2, 3) if x.ndim == 4 else tuple(range(x.ndim))
    std, mean = torch.std_mean(x, dim=dims, correction=0)
    std = torch.where(std > 0, std, torch.ones_like(std))
    return tuple(mean.reshape(-1).tolist()), tuple(std.reshape(-1).tolist())


def standardize_together(dataset: Dataset, *others: torch.Tensor) -> tuple[Dataset, list[torch.Tensor]]:
    """``dataset`` (loaded with ``standardize=False``) standardised per channel with its train split's mean and
    (population) standard deviation, and ``others`` (inputs of the same shape, e.g. another dataset's test images
    for out-of-distribution detection) standardised with the *same* constants: what a model trained on ``dataset``
    sees of them.

    >>> ds = load_dataset("digits", standardize=False)
    >>> std, [other] = standardize_together(ds, ds.x_test[:5])
    >>> torch.allclose(std.x_test[:5], other), round(float(std.x_train.mean()), 6) + 0.0
    (True, 0.0)
    """
    if dataset.mean is not None:
        raise ValueError(f"dataset: expected inputs as read (standardize=False), got {dataset.name} "
                         f"{dataset.preprocessing().describe()} already")
    for k, x in enumerate(others):
        if tuple(x.shape[1:]) != tuple(dataset.input_shape):
            raise ValueError(f"others[{k}]: expected inputs of shape (N, {', '.join(map(str, dataset.input_shape))}) "
                             f"like the dataset's, got {tuple(x.shape)}")
    if len(dataset.input_shape) == 3:
        mean, std = _train_constants(dataset.x_train)
    else:  # flat features: one scalar pair, as the digits are standardised
        mean, std = (float(dataset.x_train.mean()),), (float(dataset.x_train.std(unbiased=False)) or 1.0,)

    def standardise(x):
        if len(dataset.input_shape) == 3:
            return _standardise(x, mean, std)
        return (x - mean[0]) / std[0]

    out = dataclasses.replace(dataset, x_train=standardise(dataset.x_train), x_test=standardise(dataset.x_test),
                              mean=tuple(mean), std=tuple(std))
    return out, [standardise(torch.as_tensor(x, dtype=dataset.x_train.dtype)) for x in others]
