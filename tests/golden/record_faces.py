"""Record what the commands and the pure cores give on fixed seeds, before the folder move of issue "One face per
extension point" (``tests/golden/before_faces.pt``). ``tests/test_golden_faces.py`` runs the same calls on today's
code and compares.

Run from the repository root: ``python tests/golden/record_faces.py`` (about a minute on two cores). Recorded at
commit 7d58df7, before any file moved; the pfnm line asked for ``pfnm-pooled`` then, ``pfnm:heads=pooled`` now (the
option schema of issue 50: the same row), and ``--heads fused`` since issue 53 made the pooled heads the default
under label skew (its Dirichlet split): the recorded output layer, asked for by name; the variational clients' runs
``--scale-lr-factor 1`` since issue 51 made 10 the default (one learning rate for all was the recorded behaviour);
likewise the LeNet line's ``--lr 0.01``, the rate it trained at before the CNNs' default became 1e-3; and the
fuse_match line PVI's damping 0.1, the default when it was recorded (issue 53 made the harmonic schedule the default).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "before_faces.pt"

#: Command lines whose ``--json`` results are recorded: every kind of method the commands run, small and seeded.
COMMANDS = {
    "demo": ["demo", "--clients", "4", "--dim", "12", "--seed", "3"],
    "pfnm": ["pfnm", "--clients", "3", "--hidden", "16", "--epochs", "1", "--rounds", "2", "--threads", "1",
             "--methods", "local,ensemble,fedavg,kmeans,pfnm,pfnm-rounds,fedma,pfnm:heads=pooled,weight-matching,"
             "ot-fusion", "--partition", "dirichlet", "--heads", "fused", "--seed", "1"],
    "pfnm_cnn": ["pfnm", "--clients", "2", "--arch", "lenet", "--epochs", "1", "--rounds", "1", "--threads", "1",
                 "--methods", "pfnm,fedavg", "--lr", "0.01", "--seed", "2"],
    "fuse": ["fuse", "--clients", "3", "--epochs", "1", "--rounds", "2", "--threads", "1", "--rule", "all",
             "--scale-lr-factor", "1", "--seed", "0"],
    "fuse_match": ["fuse", "--clients", "3", "--epochs", "1", "--rounds", "2", "--threads", "1", "--align", "match",
                   "--rule", "conflation,pooling,pvi", "--heads", "both", "--baselines", "kl-fusion",
                   "--scale-lr-factor", "1", "--experimental", "pvi-damping=0.1", "--seed", "4"],
    "fuse_laplace": ["fuse", "--clients", "3", "--epochs", "1", "--rounds", "1", "--threads", "1", "--align",
                     "match", "--client", "laplace", "--rule", "conflation", "--no-fedavg", "--seed", "5"],
}

#: Fields of a result row that measure time, not behaviour.
TIMES = ("server_seconds", "seconds", "elapsed")


def strip_times(value):
    if isinstance(value, dict):
        return {k: strip_times(v) for k, v in value.items() if k not in TIMES}
    if isinstance(value, list):
        return [strip_times(v) for v in value]
    return value


def run_command(argv: list[str]) -> dict:
    from bnpfed.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.json"
        rc = main([*argv, "--json", str(path), "--no-progress"] if argv[0] != "demo" else [*argv, "--json", str(path)])
        assert rc == 0, (argv, rc)
        record = json.loads(path.read_text())
    return strip_times(record["results"])


def match_files() -> dict:
    """``bnpfed match`` on three saved MLPs of the bundled digits: the global network's state."""
    from bnpfed.cli import main
    from bnpfed.data import load_dataset
    from bnpfed.federated.clients import initial_network, train_network
    from bnpfed.federated.config import NetworkConfig, TrainingConfig

    data = load_dataset("digits", standardize=False)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for j in range(3):
            net = initial_network(NetworkConfig(hidden=(20,)), data.input_shape, data.num_classes, seed=10 + j)
            idx = torch.arange(j, len(data.y_train), 3)
            net = train_network(net, data.x_train[idx], data.y_train[idx], TrainingConfig(epochs=1), seed=j, round=1,
                                client=j)
            path = Path(tmp) / f"m{j}.pt"
            torch.save(net.state_dict(), path)
            paths.append(str(path))
        for name, extra in (("match", []), ("match_pooled_max", ["--heads", "pooled", "--max-width", "25"])):
            target = Path(tmp) / f"{name}.pt"
            assert main(["match", *paths, "--out", str(target), "--arch", "mlp", "--seed", "0",
                         *extra]) == 0
            saved = torch.load(target, weights_only=False)
            out[name] = {k: v.detach().clone() for k, v in saved["state_dict"].items()}
    return out


def combine_rules() -> dict:
    """Every weight-wise rule and its sums form on one seeded input."""
    from bnpfed import combine
    from bnpfed.combine.secure import SECURE_RULES, fuse_sums, sum_statistics

    g = torch.Generator().manual_seed(0)
    locs = torch.randn(4, 7, generator=g)
    variances = torch.rand(4, 7, generator=g) + 0.05
    weights = torch.tensor([0.1, 0.2, 0.3, 0.4])
    out = {}
    for rule in ("eaa", "gaa", "log_variance", "conflation", "pooling"):
        fused = combine.fuse(locs, variances, rule, weights, num_samples=200,
                             generator=torch.Generator().manual_seed(1))
        out[rule] = (fused.loc.clone(), fused.variance.clone())
    ref_loc, ref_var = locs[0], variances[0]
    for rule in SECURE_RULES:
        sums = None
        for k in range(4):
            s = sum_statistics(rule, locs[k], variances[k], ref_loc, ref_var, weight=float(weights[k]), max_weight=float(weights.max()))
            sums = s if sums is None else {n: sums[n] + s[n] for n in s}
        fused = fuse_sums(rule, sums, ref_loc, ref_var, weight_total=1.0)
        out[f"secure_{rule}"] = (fused.loc.clone(), fused.variance.clone())
    return out


def record() -> dict:
    torch.set_num_threads(1)
    out = {name: run_command(argv) for name, argv in COMMANDS.items()}
    out["match"] = match_files()
    out["combine"] = combine_rules()
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent.parent))
    torch.save(record(), OUT)
    print(f"wrote {OUT}")
