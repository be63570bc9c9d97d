import io
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bnpfed.data import DATASET_NAMES, NPZ_FORMAT, Dataset, Preprocessing, load_dataset

# The shared data folder sits next to the repository (<repo root>/../shared/data) unless BNPFED_SHARED_DATA says
# otherwise (docs/guide/development.md); every test that needs it reads it from here, and skips when it is absent.
SHARED_DATA = Path(
    os.environ.get("BNPFED_SHARED_DATA") or Path(__file__).resolve().parents[1].parent / "shared" / "data"
)


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
    with pytest.raises(ValueError, match=r"^name: expected one of .*, got 'svhn'$") as info:
        load_dataset("svhn")
    for known in (*DATASET_NAMES, "npz:PATH"):
        assert known in str(info.value)


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist", "fashion_mnist", "cifar10"])
def test_torchvision_datasets_need_data_dir(name):
    with pytest.raises(ValueError, match=r"^data_dir: expected the folder .*--data-dir.*got None$"):
        load_dataset(name)


@pytest.mark.parametrize("argument", ["standardize", "download"])
def test_flags_must_be_bools(argument):
    with pytest.raises(ValueError, match=f"{argument}: expected a bool, got 'false'"):
        load_dataset("digits", **{argument: "false"})


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


def toy_arrays(input_shape=(5,), dtype=np.float64, n_train=12, n_test=4, seed=0):
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        high = np.iinfo(dtype).max
        x_train = rng.integers(0, high, size=(n_train, *input_shape), dtype=dtype, endpoint=True)
        x_test = rng.integers(0, high, size=(n_test, *input_shape), dtype=dtype, endpoint=True)
    else:
        x_train = rng.normal(3.0, 2.0, size=(n_train, *input_shape)).astype(dtype)
        x_test = rng.normal(3.0, 2.0, size=(n_test, *input_shape)).astype(dtype)
    return dict(x_train=x_train, y_train=np.arange(n_train) % 3, x_test=x_test, y_test=np.arange(n_test) % 3)


@pytest.mark.parametrize("input_shape", [(5,), (2, 3, 3)])
def test_npz_round_trip_keeps_stored_shape_and_float_values_without_standardize(tmp_path, input_shape):
    rng = np.random.default_rng(0)
    arrays = dict(
        x_train=rng.normal(size=(12, *input_shape)),
        y_train=np.array([0, 1, 2] * 4),
        x_test=rng.normal(size=(4, *input_shape)),
        y_test=np.array([0, 1, 6, 2], dtype=np.int32),
    )
    name = write_npz(tmp_path / "toy.npz", **arrays)
    ds = load_dataset(name, standardize=False, num_classes=7)  # classes 3-5 have no example: said so
    assert ds.name == name and ds.input_shape == input_shape
    assert ds.num_classes == 7
    assert ds.x_train.dtype == torch.float32 and ds.y_test.dtype == torch.int64
    np.testing.assert_allclose(ds.x_train.numpy(), arrays["x_train"].astype(np.float32))
    np.testing.assert_array_equal(ds.y_test.numpy(), arrays["y_test"])


def test_npz_classes_are_the_largest_label_plus_one_and_a_class_without_examples_is_an_error(tmp_path):
    arrays = toy_arrays()
    assert load_dataset(write_npz(tmp_path / "ok.npz", **arrays)).num_classes == 3  # over both splits
    arrays["y_test"] = np.array([0, 1, 2, 999])  # one mistyped label: not a 1000-class model
    name = write_npz(tmp_path / "typo.npz", **arrays)
    with pytest.raises(ValueError, match=r"every class 0 \.\. 999 .* none of class\(es\) 3, 4, 5, 6, 7 and 991 more"):
        load_dataset(name)
    assert load_dataset(name, num_classes=1000).num_classes == 1000  # unless the classes are meant to be empty
    with pytest.raises(ValueError, match=r"num_classes: expected more than the largest label .* \(999\), got 10"):
        load_dataset(name, num_classes=10)
    with pytest.raises(ValueError, match="num_classes: expected only with an 'npz:PATH' dataset"):
        load_dataset("digits", num_classes=10)


@pytest.mark.parametrize("dtype, maximum", [(np.uint8, 255), (np.uint16, 65535)])
def test_npz_integer_pixels_are_divided_by_the_dtype_maximum(tmp_path, dtype, maximum):
    arrays = toy_arrays((1, 4, 4), dtype=dtype)
    arrays["x_train"][0, 0, 0, :2] = (0, maximum)
    ds = load_dataset(write_npz(tmp_path / "pixels.npz", **arrays), standardize=False)
    assert float(ds.x_train.min()) == 0.0 and float(ds.x_train.max()) == 1.0
    torch.testing.assert_close(ds.x_test, torch.from_numpy(arrays["x_test"].astype(np.float32) / maximum))


def test_npz_greyscale_images_stored_n_h_w_get_a_channel_axis(tmp_path):
    arrays = toy_arrays((6, 6), dtype=np.uint8)
    ds = load_dataset(write_npz(tmp_path / "grey.npz", **arrays), standardize=False)
    assert ds.input_shape == (1, 6, 6) and tuple(ds.x_train.shape) == (12, 1, 6, 6)
    torch.testing.assert_close(ds.x_train[:, 0], torch.from_numpy(arrays["x_train"] / np.float32(255)))


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_npz_images_are_standardised_per_channel_with_the_train_constants(tmp_path, dtype):
    arrays = toy_arrays((3, 4, 4), dtype=dtype, n_train=50, n_test=10)
    ds = load_dataset(write_npz(tmp_path / "rgb.npz", **arrays))
    raw = load_dataset(write_npz(tmp_path / "rgb.npz", **arrays), standardize=False)
    torch.testing.assert_close(ds.x_train.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(ds.x_train.std(dim=(0, 2, 3), unbiased=False), torch.ones(3), atol=1e-5, rtol=0)
    mean = raw.x_train.mean(dim=(0, 2, 3), keepdim=True)
    std = raw.x_train.std(dim=(0, 2, 3), unbiased=False, keepdim=True)
    torch.testing.assert_close(ds.x_test, (raw.x_test - mean) / std, atol=1e-5, rtol=1e-5)


def test_npz_feature_vectors_are_standardised_with_one_scalar_pair(tmp_path):
    arrays = toy_arrays((4,))
    arrays["x_train"][:, 0] *= 100  # a feature with its own scale keeps it relative to the others
    ds = load_dataset(write_npz(tmp_path / "flat.npz", **arrays))
    x = arrays["x_train"].astype(np.float32)
    mean, std = x.mean(), x.std()
    np.testing.assert_allclose(ds.x_train.numpy(), (x - mean) / std, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ds.x_test.numpy(), (arrays["x_test"].astype(np.float32) - mean) / std,
                               rtol=1e-5, atol=1e-5)


def test_npz_constant_channel_is_centred_not_divided_by_zero(tmp_path):
    arrays = toy_arrays((2, 3, 3), dtype=np.uint8)
    arrays["x_train"][:, 1] = 7
    ds = load_dataset(write_npz(tmp_path / "const.npz", **arrays))
    assert torch.isfinite(ds.x_test).all()
    assert torch.equal(ds.x_train[:, 1], torch.zeros(12, 3, 3))


def test_npz_format_is_what_load_dataset_documents():
    assert " ".join(NPZ_FORMAT.split()) in " ".join(load_dataset.__doc__.split())
    for words in ("x_train", "y_train", "x_test", "y_test", "(N, C, H, W)", "(N, H, W)", "(N, F)", "uint8",
                  "255", "65535", "0 .. C-1", "finite", "empty"):
        assert words in NPZ_FORMAT


def test_npz_missing_keys_list_what_was_found(tmp_path):
    name = write_npz(tmp_path / "bad.npz", x_train=np.zeros((2, 3)), y_train=np.zeros(2, dtype=int), X=np.zeros(1))
    with pytest.raises(ValueError, match=r"bad.npz': expected arrays \[.*\], got \['X', 'x_train', 'y_train'\], "
                                         r"which lack \['x_test', 'y_test'\]"):
        load_dataset(name)


def test_npz_missing_file_says_where_it_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.npz' does not exist"):
        load_dataset(f"npz:{tmp_path / 'nowhere.npz'}")


def bad_npz_cases():
    def edit(**changes):
        def make(path):
            arrays = toy_arrays()
            arrays.update(changes)
            np.savez(path, **arrays)
        return make

    def text(path):
        path.write_text("x_train,y_train\n1,2\n")

    def npy(path):
        with open(path, "wb") as f:
            np.save(f, np.zeros((3, 2)))

    nan = toy_arrays()["x_train"].copy()
    nan[2, 1] = np.nan
    inf = toy_arrays()["x_test"].copy()
    inf[0, 0] = -np.inf
    return {
        "text file": (text, r"expected an .npz archive written by numpy.savez, got a file numpy cannot read"),
        "npy file": (npy, r"expected an .npz archive .*got a single .npy array of shape \(3, 2\)"),
        "x_train/y_train lengths": (edit(y_train=np.zeros(11, dtype=int)),
                                    r"y_train: expected shape \(12,\), one label per row of x_train"),
        "x_test/y_test lengths": (edit(y_test=np.zeros((4, 1), dtype=int)),
                                  r"y_test: expected shape \(4,\), one label per row of x_test .*got shape \(4, 1\)"),
        "feature shapes": (edit(x_test=np.zeros((4, 6))),
                           r"x_test: expected shape \(N_test, 5\), the input shape of x_train \(12, 5\), "
                           r"got shape \(4, 6\)"),
        "NaN": (edit(x_train=nan), r"x_train: expected finite values .*got 1 NaN or infinite value"),
        "inf": (edit(x_test=inf), r"x_test: expected finite values .*got 1 NaN or infinite value"),
        "beyond float32": (edit(x_test=np.full((4, 5), 1e300)), r"x_test: expected finite values \(in float32's"),
        "negative labels": (edit(y_test=np.array([0, -1, 2, -3])),
                            r"y_test: expected class labels 0 .. C-1, got 2 negative label\(s\), the smallest -3"),
        "float labels": (edit(y_train=np.zeros(12)),
                         r"y_train: expected integer class labels 0 .. C-1, got dtype float64; save y.astype"),
        "fractional labels": (edit(y_train=np.full(12, 0.5)),
                              r"y_train: expected integer class labels 0 .. C-1, got dtype float64$"),
        "bool labels": (edit(y_test=np.ones(4, dtype=bool)), r"y_test: expected integer class labels .*got dtype bool"),
        "empty train split": (edit(x_train=np.zeros((0, 5)), y_train=np.zeros(0, dtype=int)),
                              r"x_train: expected at least one example \(neither split may be empty\), "
                              r"got shape \(0, 5\)"),
        "empty test split": (edit(x_test=np.zeros((0, 5)), y_test=np.zeros(0, dtype=int)),
                             r"x_test: expected at least one example"),
        "signed integer pixels": (edit(x_train=np.ones((12, 5), dtype=np.int64)),
                                  r"x_train: expected unsigned integer pixels \(uint8, uint16, ...\) or floats, "
                                  r"got dtype int64; save x.astype\(np.uint8\)"),
        "string inputs": (edit(x_train=np.full((12, 5), "a")), r"x_train: expected .* or floats, got dtype <U1"),
        "one-dimensional x": (edit(x_train=np.zeros(12), x_test=np.zeros(4)),
                              r"x_train: expected \(N, F\) feature vectors, \(N, H, W\) or \(N, C, H, W\) images, "
                              r"got shape \(12,\)"),
        "five-dimensional x": (edit(x_train=np.zeros((12, 1, 1, 2, 2))), r"x_train: expected \(N, F\)"),
        "no features": (edit(x_train=np.zeros((12, 0)), x_test=np.zeros((4, 0))),
                        r"x_train: expected inputs of at least one value each, got shape \(12, 0\)"),
    }


@pytest.mark.parametrize("case", list(bad_npz_cases()))
def test_bad_npz_is_rejected_at_load_time_naming_the_file(tmp_path, case):
    make, message = bad_npz_cases()[case]
    path = tmp_path / "user data.npz"
    make(path)
    with pytest.raises(ValueError, match=message) as info:
        load_dataset(f"npz:{path}")
    assert str(info.value).startswith(f"npz file {str(path)!r}: ")


def test_npz_of_object_arrays_is_refused_without_unpickling(tmp_path):
    arrays = toy_arrays()
    arrays["y_train"] = np.array([0, "a"] * 6, dtype=object)
    path = tmp_path / "pickled.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=r"pickled.npz': y_train: expected a numeric array, got one numpy cannot "
                                         r"read without pickle"):
        load_dataset(f"npz:{path}")


def test_npz_path_that_is_a_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"expected an .npz file, got a directory"):
        load_dataset(f"npz:{tmp_path}")


# ---------------------------------------------------------------- Dataset's own checks


def tiny_dataset(**changes):
    fields = dict(x_train=torch.zeros(4, 3), y_train=torch.tensor([0, 1, 2, 1]), x_test=torch.zeros(2, 3),
                  y_test=torch.tensor([2, 0]), name="tiny", num_classes=3, input_shape=(3,))
    fields.update(changes)
    return Dataset(**fields)


def test_dataset_accepts_a_consistent_split():
    assert tiny_dataset().num_classes == 3


@pytest.mark.parametrize("changes, message", [
    (dict(x_train=torch.tensor([[0.0, float("nan"), 1.0]] * 4)),
     r"x_train: expected finite values, got 4 NaN or infinite value\(s\)"),
    (dict(x_test=torch.tensor([[float("inf"), 0.0, 0.0], [0.0, 0.0, 0.0]])), r"x_test: expected finite values"),
    (dict(y_train=torch.tensor([0, 1, 3, 1])),
     r"y_train: expected class labels in \[0, 3\) \(num_classes=3\), got labels from 0 to 3"),
    (dict(y_test=torch.tensor([-1, 0])), r"y_test: expected class labels in \[0, 3\).*got labels from -1 to 0"),
    (dict(y_test=torch.tensor([0.0, 1.0])), r"y_test: expected an integer tensor of class labels, got dtype"),
    (dict(x_train=torch.zeros(4, 3, dtype=torch.int64)), r"x_train: expected a floating-point tensor"),
    (dict(x_test=torch.zeros(2, 4)), r"x_test: expected shape \(N, \*input_shape\) with input_shape=\(3,\), "
                                     r"got \(2, 4\)"),
    (dict(y_train=torch.tensor([0, 1])), r"y_train: expected shape \(4,\), one label per row of x_train, got \(2,\)"),
    (dict(num_classes=0), r"num_classes: expected an int >= 1, got 0"),
])
def test_dataset_rejects_inconsistent_splits_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        tiny_dataset(**changes)


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
    assert ds.mean == ((0.1307,) if name == "mnist" else (0.2860,)) and len(ds.classes) == 10   # what a model records
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


def write_cifar10_jpeg(folder, n_train=12, n_test=5):
    """A small CIFAR-10 JPEG container in the layout of the shared data: every image one flat colour (lossless
    enough for a check to 2/255 after JPEG), labels grouped by class as in the shared file."""
    from PIL import Image

    colours = [(10 * k, 255 - 20 * k, 128) for k in range(10)]
    out = {}
    for split, n in (("train", n_train), ("test", n_test)):
        labels = np.sort(np.arange(n) % 10)
        blobs = []
        for label in labels:
            buffer = io.BytesIO()
            Image.new("RGB", (32, 32), colours[label]).save(buffer, format="JPEG", quality=95)
            blobs.append(np.frombuffer(buffer.getvalue(), dtype=np.uint8))
        out[f"{split}_jpeg"] = np.concatenate(blobs)
        out[f"{split}_offsets"] = np.concatenate([[0], np.cumsum([len(b) for b in blobs])]).astype(np.int64)
        out[f"y_{split}"] = labels.astype(np.int64)
    np.savez(folder / "cifar10_jpeg.npz", classes=np.array([f"c{k}" for k in range(10)]), **out)
    return colours


def test_cifar10_is_read_from_its_jpeg_container_when_the_pickles_are_not_there(tmp_path):
    colours = write_cifar10_jpeg(tmp_path)
    raw = load_dataset("cifar10", data_dir=tmp_path, standardize=False)
    assert raw.input_shape == (3, 32, 32) and raw.num_classes == 10 and "JPEG copy" in raw.source
    assert tuple(raw.x_train.shape) == (12, 3, 32, 32) and tuple(raw.x_test.shape) == (5, 3, 32, 32)
    for x, y in ((raw.x_train, raw.y_train), (raw.x_test, raw.y_test)):
        for image, label in zip(x, y.tolist()):   # every image the colour of its label: images and labels stay paired
            expected = torch.tensor(colours[label], dtype=torch.float32)[:, None, None] / 255
            torch.testing.assert_close(image, expected.expand(3, 32, 32), atol=2 / 255, rtol=0)
    assert raw.y_train.tolist() != sorted(raw.y_train.tolist())   # a fixed shuffle, not grouped by class
    again = load_dataset("cifar10", data_dir=tmp_path, standardize=False)
    assert torch.equal(again.y_train, raw.y_train) and torch.equal(again.x_test, raw.x_test)
    ds = load_dataset("cifar10", data_dir=tmp_path)
    for c in range(3):   # normalised with the original's constants, as the pickles are
        torch.testing.assert_close(ds.x_train[:, c], (raw.x_train[:, c] - CIFAR_MEAN[c]) / CIFAR_STD[c])


def test_a_jpeg_container_without_its_arrays_is_refused_naming_the_file(tmp_path):
    np.savez(tmp_path / "cifar10_jpeg.npz", train_jpeg=np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match=r"data_dir: expected cifar10_jpeg.npz to hold .* \(missing"):
        load_dataset("cifar10", data_dir=tmp_path)


SHARED_CIFAR = SHARED_DATA / "cifar10"


@pytest.mark.skipif(not (SHARED_CIFAR / "cifar10_jpeg.npz").is_file(), reason="the shared CIFAR-10 copy is absent")
def test_the_shared_cifar10_copy_loads_with_the_published_split_and_statistics():
    raw = load_dataset("cifar10", data_dir=SHARED_CIFAR, standardize=False)
    assert tuple(raw.x_train.shape) == (50000, 3, 32, 32) and tuple(raw.x_test.shape) == (10000, 3, 32, 32)
    assert torch.bincount(raw.y_train).tolist() == [5000] * 10 and torch.bincount(raw.y_test).tolist() == [1000] * 10
    torch.testing.assert_close(raw.x_train.mean((0, 2, 3)), torch.tensor([0.4913, 0.4821, 0.4465]), atol=2e-4, rtol=0)


def test_a_datasets_preprocessing_prepares_raw_inputs_bit_for_bit_as_the_loader_does(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "rgb.npz"
    np.savez(path, x_train=rng.integers(0, 256, (40, 3, 5, 5), dtype=np.uint8), y_train=np.arange(40) % 4,
             x_test=rng.integers(0, 256, (12, 3, 5, 5), dtype=np.uint8), y_test=np.arange(12) % 4)
    for name in ("digits", f"npz:{path}"):
        raw, ready = load_dataset(name, standardize=False), load_dataset(name)
        inputs = ready.preprocessing()
        assert raw.preprocessing().standardized is False and inputs.standardized
        assert torch.equal(inputs.apply(raw.x_test), ready.x_test) and torch.equal(inputs.apply(raw.x_train),
                                                                                    ready.x_train)
        flat = ready.flat()   # a flattened copy keeps its constants, applied channel by channel
        assert torch.equal(Preprocessing(name, flat.input_shape, flat.num_classes, inputs.mean, inputs.std).apply(
            raw.flat().x_test), flat.x_test)
    assert len(load_dataset(f"npz:{path}").mean) == 3   # per channel of images


def test_preprocessing_refuses_inconsistent_constants_and_inputs_of_another_shape():
    with pytest.raises(ValueError, match="mean, std: expected both"):
        Preprocessing("digits", (1, 8, 8), 10, mean=(0.1,))
    with pytest.raises(ValueError, match="mean, std: expected two tuples"):
        Preprocessing("digits", (1, 8, 8), 10, mean=(0.1,), std=(0.0,))
    with pytest.raises(ValueError, match="mean: expected one constant, or one per channel"):
        Preprocessing("x", (3, 4, 4), 10, mean=(0.1, 0.2), std=(1.0, 1.0))
    with pytest.raises(ValueError, match="classes: expected 10 class names"):
        Preprocessing("digits", (1, 8, 8), 10, classes=("a",))
    with pytest.raises(ValueError, match=r"x: expected inputs of shape \(N, 1, 8, 8\)"):
        Preprocessing("digits", (1, 8, 8), 10).apply(torch.zeros(2, 64))
    with pytest.raises(ValueError, match="inputs: expected a dict"):
        Preprocessing.from_dict({"dataset": "digits"})



def test_an_npz_label_only_the_test_split_holds_is_refused_unless_num_classes_says_so(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "extra.npz"
    np.savez(path, x_train=rng.random((30, 4), dtype=np.float32), y_train=np.arange(30) % 3,
             x_test=rng.random((8, 4), dtype=np.float32), y_test=np.array([0, 1, 2, 3, 0, 1, 2, 0]))
    with pytest.raises(ValueError, match=r"y_test: expected labels of the classes y_train holds, got class\(es\) 3 "
                                         r"in y_test only"):
        load_dataset(f"npz:{path}")
    assert load_dataset(f"npz:{path}", num_classes=4).num_classes == 4   # meant: said so
