import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bnpfed.data import DATASET_NAMES, Dataset, load_dataset

SHARED_DATA = Path(os.environ.get("BNPFED_SHARED_DATA", "/work/shared/data"))


# ---------------------------------------------------------------- digits


def test_digits_is_the_default_with_image_shapes_and_dtypes():
    ds = load_dataset()
    assert isinstance(ds, Dataset) and ds.name == "digits"
    assert tuple(ds.x_train.shape) == (1347, 1, 8, 8) and tuple(ds.x_test.shape) == (450, 1, 8, 8)
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert ds.num_classes == 10 and ds.input_shape == (1, 8, 8)
    assert set(ds.y_train.tolist()) == set(range(10)) == set(ds.y_test.tolist())


def test_digits_train_split_is_standardised():
    ds = load_dataset("digits")
    assert abs(ds.x_train.mean().item()) < 1e-5
    assert abs(ds.x_train.std(unbiased=False).item() - 1) < 1e-5
    assert abs(ds.x_test.mean().item()) < 0.1  # same constants, different images


def test_digits_split_is_deterministic_and_stratified():
    first, again = load_dataset("digits"), load_dataset("digits")
    assert torch.equal(first.x_train, again.x_train) and torch.equal(first.y_test, again.y_test)
    train_share = torch.bincount(first.y_train) / len(first.y_train)
    test_share = torch.bincount(first.y_test) / len(first.y_test)
    torch.testing.assert_close(train_share, test_share, atol=0.01, rtol=0)


def test_flat_gives_vectors_for_mlps():
    ds = load_dataset("digits")
    flat = ds.flat()
    assert tuple(flat.x_train.shape) == (1347, 64) and tuple(flat.x_test.shape) == (450, 64)
    assert flat.input_shape == (64,) and flat.num_classes == 10
    assert torch.equal(flat.x_train[5], ds.x_train[5].reshape(-1))
    assert flat.y_train is ds.y_train


# ---------------------------------------------------------------- name errors


def test_unknown_name_lists_the_known_names():
    with pytest.raises(ValueError, match="name='svhn'") as info:
        load_dataset("svhn")
    for known in (*DATASET_NAMES, "npz:PATH"):
        assert known in str(info.value)


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist", "fashion_mnist", "cifar10"])
def test_torchvision_datasets_need_data_dir(name):
    with pytest.raises(ValueError, match="data_dir=None"):
        load_dataset(name)


def test_missing_torchvision_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torchvision", None)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", None)
    with pytest.raises(ImportError, match=r"pip install bnpfed\[vision\]"):
        load_dataset("mnist", data_dir=tmp_path)


@pytest.mark.parametrize("name, folder", [("mnist", "MNIST/raw"), ("cifar10", "cifar-10-batches-py")])
def test_missing_files_say_where_and_to_pass_download(name, folder, tmp_path):
    pytest.importorskip("torchvision")
    with pytest.raises(FileNotFoundError, match="--download") as info:
        load_dataset(name, data_dir=tmp_path)
    assert str(tmp_path / folder) in str(info.value)


# ---------------------------------------------------------------- npz


def write_npz(path, **arrays):
    np.savez(path, **arrays)
    return f"npz:{path}"


@pytest.mark.parametrize("input_shape", [(5,), (2, 3, 3)])
def test_npz_round_trip_keeps_stored_shape(tmp_path, input_shape):
    rng = np.random.default_rng(0)
    arrays = dict(
        x_train=rng.normal(size=(12, *input_shape)),
        y_train=np.array([0, 1, 2] * 4),
        x_test=rng.normal(size=(4, *input_shape)),
        y_test=np.array([0, 1, 6, 2], dtype=np.int32),
    )
    name = write_npz(tmp_path / "toy.npz", **arrays)
    ds = load_dataset(name)
    assert ds.name == name and ds.input_shape == input_shape
    assert ds.num_classes == 7  # max label over both splits + 1
    assert ds.x_train.dtype == torch.float32 and ds.y_test.dtype == torch.int64
    np.testing.assert_allclose(ds.x_train.numpy(), arrays["x_train"].astype(np.float32))
    np.testing.assert_array_equal(ds.y_test.numpy(), arrays["y_test"])


def test_npz_missing_keys_list_what_was_found(tmp_path):
    name = write_npz(tmp_path / "bad.npz", x_train=np.zeros((2, 3)), y_train=np.zeros(2, dtype=int), X=np.zeros(1))
    with pytest.raises(ValueError, match=r"lacks arrays \['x_test', 'y_test'\].*found \['X', 'x_train', 'y_train'\]"):
        load_dataset(name)


def test_npz_with_float_labels_is_rejected(tmp_path):
    name = write_npz(
        tmp_path / "bad.npz",
        x_train=np.zeros((2, 3)), y_train=np.zeros(2), x_test=np.zeros((1, 3)), y_test=np.zeros(1, dtype=int),
    )
    with pytest.raises(ValueError, match="y_train .*float64.*integer labels"):
        load_dataset(name)


def test_npz_missing_file_says_where_it_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.npz"):
        load_dataset(f"npz:{tmp_path / 'nowhere.npz'}")


# ---------------------------------------------------------------- MNIST / Fashion-MNIST (local files, if present)


@pytest.mark.parametrize(
    "name, folder", [("mnist", "mnist"), ("fashion-mnist", "fashion_mnist"), ("fashion_mnist", "fashion_mnist")]
)
def test_real_mnist_style_data_loads_normalised(name, folder):
    pytest.importorskip("torchvision")
    root = SHARED_DATA / folder
    if not root.is_dir():
        pytest.skip(f"{root} not present")
    ds = load_dataset(name, data_dir=root)
    assert ds.name == name.replace("_", "-")
    assert tuple(ds.x_train.shape) == (60000, 1, 28, 28) and tuple(ds.x_test.shape) == (10000, 1, 28, 28)
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert ds.num_classes == 10 and ds.input_shape == (1, 28, 28)
    # The standard constants are the train split's own mean and std, to the 4 digits quoted.
    assert abs(ds.x_train.mean().item()) < 1e-3
    assert abs(ds.x_train.std().item() - 1) < 1e-3


# ---------------------------------------------------------------- CIFAR-10 (fake files in torchvision's layout)

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
CHANNEL_VALUES = (255, 128, 0)  # constant R, G, B pixel values in the fake images


def write_fake_cifar10(root, per_batch=4):
    """torchvision's CIFAR-10 layout: pickled dicts, ``data`` uint8 (n, 3072) as 1024 R, then G, then B values."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    row = np.repeat(np.array(CHANNEL_VALUES, dtype=np.uint8), 32 * 32)
    for file_name, first_label in [*((f"data_batch_{i}", i) for i in range(1, 6)), ("test_batch", 0)]:
        batch = {"data": np.tile(row, (per_batch, 1)), "labels": [(first_label + j) % 10 for j in range(per_batch)]}
        with open(folder / file_name, "wb") as f:
            pickle.dump(batch, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{k}" for k in range(10)]}, f)


@pytest.fixture
def skip_cifar_checksums(monkeypatch):
    """Fake files cannot match the official MD5s that torchvision checks; here existence stands in for them.

    Only the test relaxes the check: the loader itself always goes through torchvision's integrity check.
    """
    cifar = pytest.importorskip("torchvision.datasets.cifar")
    monkeypatch.setattr(cifar, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))


def test_cifar10_loads_channels_first_and_normalised_per_channel(tmp_path, skip_cifar_checksums):
    write_fake_cifar10(tmp_path)
    ds = load_dataset("cifar10", data_dir=tmp_path)
    assert ds.name == "cifar10" and ds.num_classes == 10 and ds.input_shape == (3, 32, 32)
    assert tuple(ds.x_train.shape) == (20, 3, 32, 32) and tuple(ds.x_test.shape) == (4, 3, 32, 32)
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert ds.y_train[:4].tolist() == [1, 2, 3, 4] and ds.y_test.tolist() == [0, 1, 2, 3]
    for c, value in enumerate(CHANNEL_VALUES):
        expected = (value / 255 - CIFAR_MEAN[c]) / CIFAR_STD[c]
        torch.testing.assert_close(ds.x_train[:, c], torch.full((20, 32, 32), expected), atol=1e-5, rtol=0)


def test_cifar10_files_failing_the_checksum_are_reported_not_loaded(tmp_path):
    pytest.importorskip("torchvision")
    write_fake_cifar10(tmp_path)
    with pytest.raises(FileNotFoundError, match="integrity check.*--download"):
        load_dataset("cifar10", data_dir=tmp_path)


def test_unstandardized_images_stay_in_the_unit_interval():
    raw = load_dataset("digits", standardize=False)
    std = load_dataset("digits")
    assert float(raw.x_train.min()) == 0.0 and float(raw.x_train.max()) == 1.0
    # the standardised data is the same images, shifted and scaled by the train constants
    mean, sd = float(raw.x_train.mean()), float(raw.x_train.std(unbiased=False))
    torch.testing.assert_close(std.x_test, (raw.x_test - mean) / sd, rtol=1e-5, atol=1e-5)
