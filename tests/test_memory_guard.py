"""Size guards: the matcher's peak memory estimated from the neuron counts (bnpfed.matching.memory), a layer the
machine cannot hold refused before anything is allocated, by the matcher and by the commands and the Flower server
before anything trains; long matchings show their progress."""

import re
import tracemalloc

import pytest
import torch

import bnpfed.matching.memory as memory
from bnpfed.cli import main
from bnpfed.matching import (MemoryLimitError, check_matching_memory, match_bayesian_layer, match_layer,
                             matching_bytes)
from bnpfed.matching.matcher import LayerMatcher

FIXED = dict(hyperparameters="fixed", sigma2=0.1, sigma0_2=1.0, gamma0=1.0)


def test_the_estimate_is_the_formula_of_the_two_largest_clients_and_the_neurons():
    # 24 N D + max(16 L1^2, 8 L2 (L1 + L2) + 17 L2 L1), in bytes
    assert matching_bytes([300, 500, 100], 7) == 24 * 900 * 7 + max(16 * 500 ** 2, 8 * 300 * 800 + 17 * 300 * 500)
    assert matching_bytes([400], 3) == 24 * 400 * 3 + 16 * 400 ** 2   # one client: its own scores against new atoms
    assert matching_bytes([0, 0], 5) == 0
    with pytest.raises(ValueError, match=r"widths\[1\]: expected an int >= 0"):
        matching_bytes([3, -1], 5)


@pytest.mark.parametrize("widths, dim, options", [
    ([1500, 1500, 800], 30, FIXED),                       # no merges: later clients score against more atoms
    ([2000, 600], 20, {}),                                # empirical Bayes
    ([1200, 1200, 1200], 10, dict(FIXED, sigma2=1.0)),
], ids=["fixed", "empirical-bayes", "equal-clients"])
def test_the_estimate_is_a_lower_bound_of_the_matchers_traced_peak(widths, dim, options):
    """numpy's allocations, traced while random layers are matched: the peak is at least the estimate (a refused
    layer could not have been matched) and within four times it (the estimate is not vacuous)."""
    g = torch.Generator().manual_seed(0)
    neurons = [torch.randn(w, dim, generator=g, dtype=torch.float64) for w in widths]
    tracemalloc.start()
    try:
        match_layer(neurons, seed=0, **options)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    estimate = matching_bytes(widths, dim)
    assert estimate <= peak <= 4 * estimate, (estimate, peak)


def test_a_layer_the_machine_cannot_hold_is_refused_before_the_matcher_allocates(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda: 2 ** 30)   # a machine with 1 GiB free

    def allocated(*args, **kwargs):
        raise AssertionError("the matcher allocated before it checked the memory")

    monkeypatch.setattr(LayerMatcher, "__init__", allocated)
    big = [torch.zeros(20_000, 4), torch.zeros(20_000, 4)]   # 8 bytes x (2 x 20,000 x 40,000 + 17 x 20,000^2)
    need = matching_bytes([20_000, 20_000], 4)
    message = (rf"neurons: matching 2 clients of up to 20,000 neurons \(40,000 in all, 4 coordinates each\) needs at "
               rf"least {need / 2 ** 30:.3g} GiB .* more than the 1 GiB this machine has available; match fewer or "
               r"narrower layers")
    with pytest.raises(MemoryLimitError, match=message):
        match_layer(big, **FIXED)
    with pytest.raises(MemoryLimitError, match=r"^means: matching 2 clients"):
        match_bayesian_layer(big, [torch.ones(20_000, 4)] * 2, tau2=0.1, sigma0_2=1.0, gamma0=1.0,
                             hyperparameters="fixed")
    assert check_matching_memory([2_000, 2_000], 4) == matching_bytes([2_000, 2_000], 4)   # under 256 MiB: quiet


def test_bnpfed_pfnm_and_fuse_refuse_widths_the_matcher_cannot_hold_before_anything_trains(monkeypatch, capsys):
    import bnpfed.federated as federated

    monkeypatch.setattr(memory, "available_memory", lambda: 2 ** 30)
    monkeypatch.setattr(federated, "run_experiment", lambda *a, **k: pytest.fail("the run started"))
    for command in (["pfnm"], ["fuse", "--align", "match"]):
        assert main([*command, "--hidden", "20000", "--clients", "3", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert re.match(rf"bnpfed {command[0]}: error: --hidden: matching 3 clients of up to 20,000 neurons .* "
                        r"needs at least [\d.]+ GiB .* more than the 1 GiB this machine has available; lower "
                        r"--hidden \(the clients' widths\) or --clients", err), err


def test_the_flower_server_refuses_widths_it_cannot_match_once_the_nodes_report_before_any_training(monkeypatch):
    pytest.importorskip("flwr")
    from bnpfed.flower.client import app as client_app
    from bnpfed.flower.local import LocalGrid
    from bnpfed.flower.server import run_federation

    monkeypatch.setattr(memory, "available_memory", lambda: 2 ** 30)
    grid = LocalGrid(client_app, 3)
    with pytest.raises(MemoryLimitError, match=r"^hidden: matching 3 clients of up to 20,000 neurons .* lower hidden"):
        run_federation(grid, {"method": "pfnm", "hidden": "20000"})
    assert {kind for _, kind in grid.calls} == {"query"}


def test_a_matching_shows_a_progress_bar_of_its_passes_only_when_asked(capsys):
    g = torch.Generator().manual_seed(0)
    neurons = [torch.randn(5, 3, generator=g) for _ in range(7)]
    quiet = match_layer(neurons, seed=0, sweeps=2, **{k: v for k, v in FIXED.items() if k != "sweeps"})
    assert capsys.readouterr().err == ""
    shown = match_layer(neurons, seed=0, sweeps=2, progress=True, **FIXED)
    err = capsys.readouterr().err
    assert "matching: greedy pass" in err and "matching: sweep 2 (of at most 2)" in err and "/7 " in err
    assert [a.tolist() for a in shown.assignments] == [a.tolist() for a in quiet.assignments]   # the same matching
    with pytest.raises(ValueError, match="progress: expected True or False"):
        match_layer(neurons, progress="yes", **FIXED)


def test_bnpfed_demo_says_which_matching_runs_and_shows_its_progress_unless_told(capsys):
    assert main(["demo", "--clients", "4", "--dim", "5", "--gamma0", "3"]) == 0
    err = capsys.readouterr().err
    assert "matching 1 of 4: map at sigma2 = 0.01" in err and "matching: greedy pass" in err
    assert main(["demo", "--clients", "4", "--dim", "5", "--gamma0", "3", "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
