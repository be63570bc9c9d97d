"""Random crops and flips of local training: each image a crop of its reflection-padded self, the offsets and flips
uniform, the draws seeded apart from the mini-batch order, and settings that do not apply refused."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from bnpfed.clients import DeterministicClient
from bnpfed.clients.augment import PADDING, augmenter, check_augment, random_crop_flip
from bnpfed.seeding import Stream, torch_generator


def _which_crop(image: np.ndarray, padded: np.ndarray) -> list[tuple[int, int, bool]]:
    """Every (row offset, column offset, mirrored) whose window of ``padded`` is ``image``: by brute force."""
    h, w = image.shape[-2:]
    found = []
    for i in range(padded.shape[-2] - h + 1):
        for j in range(padded.shape[-1] - w + 1):
            window = padded[:, i:i + h, j:j + w]
            for mirrored in (False, True):
                if np.array_equal(window[..., ::-1] if mirrored else window, image):
                    found.append((i, j, mirrored))
    return found


def test_every_image_is_one_window_of_its_reflection_padded_self():
    x = torch.randn(64, 3, 10, 12)
    out = random_crop_flip(x, torch.Generator().manual_seed(0))
    assert out.shape == x.shape and out.dtype == x.dtype
    padded = np.pad(x.numpy(), ((0, 0), (0, 0), (PADDING, PADDING), (PADDING, PADDING)), mode="reflect")  # numpy's
    for b in range(len(x)):
        assert len(_which_crop(out[b].numpy(), padded[b])) == 1    # random images: exactly one window matches


def test_each_image_is_the_window_of_its_documented_draws_and_the_draws_cover_every_window():
    """The draws in their documented order (rows' offsets, columns' offsets, flips, one per image) name each image's
    window of the numpy-padded batch; over 20,000 images every one of the 9 x 9 offsets appears, each within 5
    binomial standard deviations of 1/81 of the draws, and the flips within 5 of one half. (Reflection makes some
    windows equal, offset 0 and offset 1 mirrored, so the images alone cannot name their draws.)"""
    n, size = 20_000, 2 * PADDING + 1
    x = torch.randn(n, 2, 8, 9)
    out = random_crop_flip(x, torch.Generator().manual_seed(1))
    replay = torch.Generator().manual_seed(1)
    rows, cols = torch.randint(size, (n,), generator=replay), torch.randint(size, (n,), generator=replay)
    flips = torch.rand(n, generator=replay) < 0.5
    padded = np.pad(x.numpy(), ((0, 0), (0, 0), (PADDING, PADDING), (PADDING, PADDING)), mode="reflect")
    for b in range(0, n, 97):
        window = padded[b, :, rows[b]:rows[b] + 8, cols[b]:cols[b] + 9]
        assert np.array_equal(out[b].numpy(), window[..., ::-1] if flips[b] else window)
    offsets = np.bincount((rows * size + cols).numpy(), minlength=size * size)
    p = 1 / size**2
    assert np.all(np.abs(offsets - n * p) < 5 * math.sqrt(n * p * (1 - p)))
    assert abs(int(flips.sum()) - n / 2) < 5 * math.sqrt(n / 4)


def test_crop_never_flips_and_no_padding_without_flips_is_the_identity():
    x = torch.randn(200, 1, 10, 12)   # wider than twice the padding: one window per image (see above)
    padded = np.pad(x.numpy(), ((0, 0), (0, 0), (PADDING, PADDING), (PADDING, PADDING)), mode="reflect")
    out = augmenter("crop")(x, torch.Generator().manual_seed(2))
    assert all([w[2] for w in _which_crop(out[b].numpy(), padded[b])] == [False] for b in range(len(x)))
    flipped = augmenter("crop-flip")(x, torch.Generator().manual_seed(2))
    assert any(_which_crop(flipped[b].numpy(), padded[b])[0][2] for b in range(len(x)))
    assert torch.equal(random_crop_flip(x, torch.Generator().manual_seed(3), padding=0, flip=False), x)
    assert augmenter("none") is None


def test_the_same_generator_seed_gives_the_same_images():
    x = torch.randn(16, 3, 32, 32)
    first = random_crop_flip(x, torch.Generator().manual_seed(4))
    assert torch.equal(first, random_crop_flip(x, torch.Generator().manual_seed(4)))
    assert not torch.equal(first, random_crop_flip(x, torch.Generator().manual_seed(5)))


def test_settings_that_do_not_apply_are_refused():
    with pytest.raises(ValueError, match="augment: expected one of"):
        check_augment("flip")
    with pytest.raises(ValueError, match=r"augment: 'crop' crops images; expected inputs of shape \(C, H, W\)"):
        check_augment("crop", (784,))
    with pytest.raises(ValueError, match=r"H and W > 4, got \(1, 4, 4\)"):
        check_augment("crop-flip", (1, 4, 4))
    assert check_augment("none", (784,)) == "none"
    with pytest.raises(ValueError, match="x: expected a batch of images"):
        random_crop_flip(torch.randn(3, 8, 8), torch.Generator())
    with pytest.raises(ValueError, match="padding: expected an int in"):
        random_crop_flip(torch.randn(2, 1, 4, 4), torch.Generator())


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 6 * 6, 3))


def test_a_fit_with_crops_is_plain_sgd_on_the_seeded_mini_batches_drawn_through_the_crops():
    """The fit written out by hand: the mini-batch order from the fit's seed (as without crops), each batch through
    the crops drawn from the stream (seed, AUGMENT), one SGD step each."""
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(40, 1, 8, 8, generator=g), torch.randint(3, (40,), generator=g)
    seed, lr, batch = 11, 0.1, 16
    client = DeterministicClient(_net()).fit(x, y, epochs=2, batch_size=batch, lr=lr, seed=seed, optimizer="sgd",
                                             augment="crop-flip")
    by_hand = _net()
    shuffle, draws = torch.Generator().manual_seed(seed), torch_generator(seed, Stream.AUGMENT)
    for _ in range(2):
        order = torch.randperm(len(x), generator=shuffle)
        for start in range(0, len(x), batch):
            idx = order[start:start + batch]
            loss = nn.functional.cross_entropy(by_hand(random_crop_flip(x[idx], draws)), y[idx])
            by_hand.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in by_hand.parameters():
                    p -= lr * p.grad
    for name, value in by_hand.state_dict().items():
        torch.testing.assert_close(client.net.state_dict()[name], value, rtol=1e-6, atol=1e-6)
    plain = DeterministicClient(_net()).fit(x, y, epochs=2, batch_size=batch, lr=lr, seed=seed, optimizer="sgd")
    assert not torch.equal(plain.net[0].weight, client.net[0].weight)
    again = DeterministicClient(_net()).fit(x, y, epochs=2, batch_size=batch, lr=lr, seed=seed, optimizer="sgd",
                                            augment="crop-flip")
    assert torch.equal(again.net[0].weight, client.net[0].weight)


def test_a_fit_refuses_crops_of_flat_inputs_before_any_step():
    net = nn.Sequential(nn.Linear(64, 3))
    before = net[0].weight.detach().clone()
    with pytest.raises(ValueError, match="augment: 'crop' crops images"):
        DeterministicClient(net).fit(torch.randn(10, 64), torch.randint(3, (10,)), augment="crop")
    assert torch.equal(net[0].weight, before)


# ---------------------------------------------------------------- in the federations


@pytest.fixture(scope="module")
def digits():
    from bnpfed.data import load_dataset

    return load_dataset("digits")


def test_training_config_names_a_transform_and_every_federation_refuses_crops_of_flat_data(digits):
    from bnpfed.federated import run_experiment
    from bnpfed.federated.config import (BayesianConfig, FusionConfig, NetworkConfig, PartitionConfig, PFNMConfig,
                                         TrainingConfig)
    from bnpfed.federated.fusion import FedAvgFederation, FusionFederation
    from bnpfed.federated.matched_fusion import MatchedFusionFederation
    from bnpfed.federated.pfnm import PFNMFederation

    with pytest.raises(ValueError, match="augment: expected one of"):
        TrainingConfig(augment="mixup")
    training, net, flat, parts = TrainingConfig(augment="crop"), NetworkConfig(hidden=(8,)), digits.flat(), [
        np.arange(30), np.arange(30, 60)]
    refused = "augment: 'crop' crops images; expected inputs of shape"
    with pytest.raises(ValueError, match=refused):
        FedAvgFederation(flat, parts, network=net, training=training, seed=0)
    with pytest.raises(ValueError, match=refused):
        PFNMFederation(flat, parts, network=net, training=training, pfnm=PFNMConfig(), seed=0)
    with pytest.raises(ValueError, match=refused):
        FusionFederation(flat, parts, network=net, training=training, bayesian=BayesianConfig(),
                         fusion=FusionConfig(rule="eaa"), seed=0)
    with pytest.raises(ValueError, match=refused):
        MatchedFusionFederation(flat, parts, network=net, training=training, bayesian=BayesianConfig(),
                                fusion=FusionConfig(align="match"), seed=0)
    with pytest.raises(ValueError, match=refused):
        run_experiment(flat, partition=PartitionConfig(clients=2), network=net, training=training)
    TrainingConfig(augment="crop-flip").check_inputs(digits.input_shape)    # 8 x 8 digits: images


@pytest.mark.parametrize("kind", ["deterministic", "variational", "laplace"])
def test_every_kind_of_client_trains_through_the_crops_reproducibly(digits, kind):
    from bnpfed.federated.clients import fit_bayesian, initial_network, posterior_client, train_network
    from bnpfed.federated.config import BayesianConfig, NetworkConfig, TrainingConfig

    x, y = digits.x_train[:120], digits.y_train[:120]
    network = NetworkConfig(hidden=(8,))

    def weights(augment):
        training = TrainingConfig(epochs=2, augment=augment)
        net = initial_network(network, digits.input_shape, 10, seed=0, client=0)
        if kind == "deterministic":
            return train_network(net, x, y, training, seed=0, round=1, client=0).state_dict()["1.weight"]
        client = posterior_client(net, BayesianConfig(client=kind))
        fit_bayesian(client, x, y, training, seed=0, round=1, index=0)
        return client.posterior()["1.weight"].loc if kind == "laplace" else client.posterior()["1.weight"][0]

    crops = weights("crop")
    assert torch.equal(crops, weights("crop"))
    assert not torch.equal(crops, weights("none"))
