import pytest
import torch


@pytest.fixture
def float64():
    """Run a test with torch's default dtype float64 (Pyro's densities then carry enough digits to compare)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)
