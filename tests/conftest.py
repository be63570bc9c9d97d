import pytest
import torch


@pytest.fixture
def float64():
    """Run a test with torch's default dtype float64 (Pyro's densities then carry enough digits to compare)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture(scope="module")
def digits():
    """The bundled digits, standardised (a test module may define its own)."""
    from bnpfed.data import load_dataset

    return load_dataset("digits")


@pytest.fixture(scope="module")
def parts(digits):
    """Three label-skewed clients of digits' training split: Dirichlet(0.5), seed 0 (the saved-model tests')."""
    from bnpfed.federated.config import PartitionConfig

    return PartitionConfig(clients=3, partition="dirichlet", alpha=0.5).split(digits.y_train.numpy(), seed=0)
