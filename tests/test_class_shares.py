"""Class shares estimated from a client's own output layer (bnpfed.matching.class_shares)."""

import numpy as np
import pytest
import torch

from bnpfed.data import load_dataset
from bnpfed.federated.clients import initial_network, train_network
from bnpfed.federated.config import PFNM_NETWORK, TrainingConfig
from bnpfed.federated.partition import class_counts
from bnpfed.matching import derive_spec
from bnpfed.matching.class_shares import estimate_class_shares, estimate_shares


def test_the_estimate_is_the_softmax_of_the_standardised_output_weight_sums_over_the_temperature():
    rng = np.random.default_rng(0)
    W = rng.normal(size=(10, 7))
    z = (W.sum(1) - W.sum(1).mean()) / W.sum(1).std(ddof=1)
    for T in (0.5, 1.0, 3.0):
        expected = np.exp(z / T - (z / T).max()) / np.exp(z / T - (z / T).max()).sum()
        np.testing.assert_allclose(estimate_shares([torch.tensor(W)], temperature=T)[0].numpy(), expected,
                                   rtol=1e-12)
    with pytest.raises(ValueError, match="temperature"):
        estimate_shares([torch.tensor(W)], temperature=0)


def test_equal_classes_get_equal_shares_and_bad_input_is_named():
    shares = estimate_shares([torch.ones(4, 3)])
    assert torch.equal(shares, torch.full((1, 4), 0.25, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"output_weights\[0\]: expected \(C, H\)"):
        estimate_shares([torch.ones(4)])
    with pytest.raises(ValueError, match=r"output_weights\[0\]: expected finite"):
        estimate_shares([torch.full((4, 3), float("nan"))])
    with pytest.raises(ValueError, match="one per client"):
        estimate_shares([])


def test_on_trained_networks_the_classes_a_client_never_saw_get_the_smallest_shares():
    """Digits split into 7-class shards: each client's 3 unseen classes rank below every class it trained on."""
    ds = load_dataset("digits", standardize=False)
    y = ds.y_train.numpy()
    rng = np.random.default_rng(0)
    parts = [np.flatnonzero(np.isin(y, rng.choice(10, 7, replace=False))) for _ in range(3)]
    nets = [train_network(initial_network(PFNM_NETWORK, ds.input_shape, 10, seed=0, client=j), ds.x_train[p],
                          ds.y_train[p], TrainingConfig(epochs=10, lr=0.01), seed=0, round=1, client=j)
            for j, p in enumerate(parts)]
    shares = estimate_class_shares(nets, derive_spec(nets[0], ds.input_shape))
    seen = class_counts(y, parts, 10) > 0
    assert shares.shape == (3, 10) and torch.allclose(shares.sum(1), torch.ones(3, dtype=torch.float64))
    for j in range(3):
        assert float(shares[j][~torch.as_tensor(seen[j])].max()) < float(shares[j][torch.as_tensor(seen[j])].min())
