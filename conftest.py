"""Fixtures for everything pytest collects: the tests under tests/ and the examples in bnpfed's docstrings."""

import pytest
import torch

#: The old import paths of bnpfed 0.1 (each aliases its new module with a DeprecationWarning): their docstring
#: examples are the new modules', collected there.
collect_ignore = ["bnpfed/inference", "bnpfed/secure_fusion.py", "bnpfed/federated/baselines.py"]


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """The suite's networks are tiny: one torch thread runs them fastest (several only wait on each other on a
    shared machine), and sums then come in the same order as in Flower's client processes (OMP_NUM_THREADS=1)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def same_global_random_state():
    """Every test and docstring example starts from one global random state (Python's, numpy's, torch's, through
    Pyro's ``set_rng_seed``), so that what it draws without a seed of its own -- a network's initialisation, say --
    does not depend on which tests ran before it."""
    import pyro

    pyro.set_rng_seed(0)
    yield
