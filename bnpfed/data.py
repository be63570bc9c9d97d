"""Datasets for every experiment command, loaded into memory as normalised tensors.

One entry point, :func:`load_dataset`, returns a :class:`Dataset` whatever the source:

- ``"digits"`` (the default everywhere): scikit-learn's bundled 8x8 handwritten digits, no files needed.
- ``"mnist"``, ``"fashion-mnist"`` (also ``"fashion_mnist"``), ``"cifar10"``: torchvision's datasets, read from
  ``data_dir`` in torchvision's on-disk layout (the optional extra ``bnpfed[vision]``).
- ``"npz:PATH"``: any ``.npz`` file holding ``x_train, y_train, x_test, y_test``.

Usage::

    ds = load_dataset("digits")
    ds.x_train.shape            # torch.Size([1347, 1, 8, 8])
    ds.flat().x_train.shape     # torch.Size([1347, 64]), for MLPs
    mnist = load_dataset("mnist", data_dir="data/mnist", download=True)
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["DATASET_NAMES", "NPZ_PREFIX", "Dataset", "load_dataset"]

#: Names accepted by :func:`load_dataset` (besides the ``"npz:PATH"`` form); the CLI offers these as choices.
DATASET_NAMES = ("digits", "mnist", "fashion-mnist", "cifar10")

#: Prefix of the ``"npz:PATH"`` dataset name.
NPZ_PREFIX = "npz:"

_ALIASES = {"fashion_mnist": "fashion-mnist"}

#: The seeded stratified split of the digits data (it ships as one set of 1797 images).
DIGITS_TEST_FRACTION = 0.25
DIGITS_SPLIT_SEED = 0

_NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


@dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test split held in memory as tensors.

    Usage::

        ds = load_dataset("digits")
        model = torch.nn.Linear(ds.flat().input_shape[0], ds.num_classes)

    :param torch.Tensor x_train: inputs, float32, ``(N_train, *input_shape)``; images are ``(N, C, H, W)``,
        normalised (mean about 0, standard deviation about 1 per channel on the train split).
    :param torch.Tensor y_train: class labels, int64, ``(N_train,)``, in ``0 .. num_classes - 1``.
    :param torch.Tensor x_test: inputs, float32, ``(N_test, *input_shape)``, normalised with the train constants.
    :param torch.Tensor y_test: class labels, int64, ``(N_test,)``.
    :param str name: the canonical dataset name (``"digits"``, ``"fashion-mnist"``, ``"npz:PATH"``, ...).
    :param int num_classes: number of classes.
    :param tuple input_shape: shape of one input, e.g. ``(1, 28, 28)``; ``(F,)`` for flat data.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    name: str
    num_classes: int
    input_shape: tuple[int, ...]

    def __post_init__(self):
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if tuple(x.shape[1:]) != tuple(self.input_shape):
                raise ValueError(
                    f"x_{split} has shape {tuple(x.shape)}; expected (N, *input_shape) with "
                    f"input_shape={tuple(self.input_shape)}"
                )
            if y.ndim != 1 or y.shape[0] != x.shape[0]:
                raise ValueError(
                    f"y_{split} has shape {tuple(y.shape)}; expected ({x.shape[0]},), one label per row of x_{split}"
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


def load_dataset(name: str = "digits", *, data_dir: str | os.PathLike | None = None, download: bool = False,
                 standardize: bool = True) -> Dataset:
    """Load a dataset by name into memory.

    Parameters
    ----------
    name : str
        One of :data:`DATASET_NAMES` (``"fashion_mnist"`` is accepted for ``"fashion-mnist"``), or
        ``"npz:PATH"`` for a ``.npz`` file with arrays ``x_train, y_train, x_test, y_test``.
    data_dir : path, optional
        torchvision's ``root`` for ``"mnist"``, ``"fashion-mnist"`` and ``"cifar10"`` (required for those);
        ignored otherwise.
    download : bool
        Let torchvision download missing files into ``data_dir``. Off by default: nothing is fetched unasked.
    standardize : bool
        Standardise images with the train split's constants (default). ``False`` keeps pixel values in [0, 1],
        as the PFNM reference code feeds them (its hyper-parameters sigma2 = sigma0_2 = 1 are set for that scale).
        Ignored for ``"npz:PATH"`` (stored values are used as they are).

    Returns
    -------
    Dataset
        ``"digits"``: 8x8 images ``(N, 1, 8, 8)`` scaled to [0, 1] (divided by 16), then standardised with the
        train split's scalar mean and standard deviation; split 75/25, stratified by class, with a fixed seed
        (:data:`DIGITS_TEST_FRACTION`, :data:`DIGITS_SPLIT_SEED`): 1347 train and 450 test images.
        torchvision datasets: images ``(N, C, H, W)`` in [0, 1], normalised per channel with the standard
        constants. ``"npz:PATH"``: ``x`` as stored (cast to float32, no normalisation),
        ``num_classes = max label + 1`` over both splits.

    Raises
    ------
    ValueError
        Unknown name, ``data_dir`` missing for a torchvision dataset, or an ``.npz`` with missing keys or bad shapes.
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
    """
    if not isinstance(name, str):
        raise ValueError(f"name={name!r} is not a string; expected one of {_known_names()}")
    if name.startswith(NPZ_PREFIX):
        return _load_npz(name[len(NPZ_PREFIX):])
    canonical = _ALIASES.get(name.lower(), name.lower())
    if canonical == "digits":
        return _load_digits(standardize)
    if canonical in _VISION:
        return _load_vision(canonical, data_dir=data_dir, download=download, standardize=standardize)
    raise ValueError(f"name={name!r} is not a known dataset; expected one of {_known_names()}")


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
    )


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
            f"data_dir=None for dataset {name!r}; expected the folder holding (or to receive, with download=True) "
            f"torchvision's {spec.class_name} files"
        )
    try:
        datasets = importlib.import_module("torchvision.datasets")
    except ImportError as err:
        raise ImportError(
            f"dataset {name!r} needs torchvision; install it with `pip install bnpfed[vision]`"
        ) from err
    dataset_class = getattr(datasets, spec.class_name)
    root = os.fspath(data_dir)
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
    )


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


def _load_npz(path: str) -> Dataset:
    if not path:
        raise ValueError(f"name={NPZ_PREFIX!r} has no path; expected '{NPZ_PREFIX}PATH' naming an .npz file")
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"npz dataset file {str(file.absolute())!r} does not exist")
    with np.load(file, allow_pickle=False) as npz:
        missing = [key for key in _NPZ_KEYS if key not in npz.files]
        if missing:
            raise ValueError(
                f"npz file {str(file)!r} lacks arrays {missing}; expected {list(_NPZ_KEYS)}, "
                f"found {sorted(npz.files)}"
            )
        arrays = {key: npz[key] for key in _NPZ_KEYS}
    for key in ("y_train", "y_test"):
        y = arrays[key]
        if y.ndim != 1 or y.dtype.kind not in "iu" or (y.size and y.min() < 0):
            raise ValueError(
                f"{key} in {str(file)!r} has shape {y.shape} and dtype {y.dtype}; "
                f"expected a 1-D array of non-negative integer labels"
            )
    x_train, x_test = arrays["x_train"], arrays["x_test"]
    if x_train.ndim < 2 or x_train.shape[1:] != x_test.shape[1:]:
        raise ValueError(
            f"x_train {x_train.shape} and x_test {x_test.shape} in {str(file)!r}; "
            f"expected (N, *input_shape) arrays with the same input_shape"
        )
    labels = np.concatenate([arrays["y_train"], arrays["y_test"]])
    num_classes = int(labels.max()) + 1 if labels.size else 0
    return Dataset(
        x_train=torch.from_numpy(np.ascontiguousarray(x_train, dtype=np.float32)),
        y_train=torch.from_numpy(arrays["y_train"].astype(np.int64)),
        x_test=torch.from_numpy(np.ascontiguousarray(x_test, dtype=np.float32)),
        y_test=torch.from_numpy(arrays["y_test"].astype(np.int64)),
        name=f"{NPZ_PREFIX}{path}",
        num_classes=num_classes,
        input_shape=tuple(x_train.shape[1:]),
    )
