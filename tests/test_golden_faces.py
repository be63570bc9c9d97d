"""The folder move of issue "One face per extension point" keeps behaviour: what the commands (``demo``, ``pfnm`` on
an MLP and on LeNet, ``fuse`` weight-wise with every rule, matched with pooled heads, PVI and KL-fusion, with Laplace
clients, ``match`` on saved networks) and the fusion rules (weight-wise and from secure sums) gave on fixed seeds
before any file moved (``tests/golden/before_faces.pt``, written by ``tests/golden/record_faces.py`` at commit
7d58df7) is what today's code gives: every row, width and hyper-parameter, every global network's weights."""

import importlib.util
from pathlib import Path

import pytest
import torch

from test_golden import assert_same

HERE = Path(__file__).with_name("golden")


def recorder():
    spec = importlib.util.spec_from_file_location("record_faces", HERE / "record_faces.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def recorded():
    return torch.load(HERE / "before_faces.pt", weights_only=False)


@pytest.fixture(scope="module")
def record():
    return recorder()


@pytest.mark.parametrize("name", list(recorder().COMMANDS))
def test_every_command_gives_the_recorded_results(recorded, record, name):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        new = record.run_command(record.COMMANDS[name])
    finally:
        torch.set_num_threads(threads)
    assert_same(new, recorded[name], name, rtol=1e-6)


def test_bnpfed_match_writes_the_recorded_global_networks(recorded, record):
    assert_same(record.match_files(), recorded["match"], "match", rtol=1e-6)


def test_every_fusion_rule_and_its_sums_form_give_the_recorded_posteriors(recorded, record):
    assert_same(record.combine_rules(), recorded["combine"], "combine", rtol=1e-6)
