import pytest
import torch


@pytest.fixture
def float64():
    """Run a test with torch's default dtype float64 (Pyro's densities then carry enough digits to compare)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """The suite's networks are tiny: one torch thread runs them fastest (several only wait on each other on a
    shared machine), and sums then come in the same order as in Flower's client processes (OMP_NUM_THREADS=1)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
