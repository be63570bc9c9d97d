"""PFNM's server step at scale: J = 10 .. 500 clients, empirical Bayes against fixed hyper-parameters (issue 18).

Per (network, J, hyper-parameters), in a fresh process (so that its peak resident memory is its own): one
``pfnm_step`` on round-1 local models (best of 3 when under 10 s), its seconds, sweeps, global widths, the peak of
the matcher's numpy memory (``tracemalloc``, the matching alone) and the process's peak resident memory (data and
local models included).

Local models (``--source``):

* ``trained`` (default when MNIST is in ``--data-dir``, with the global network's test accuracy): MNIST split IID
  into J shards (60000 / J images each),
  each client trained from its own initialisation with PFNM's reference schedule (Adam/AMSGrad, batch 32,
  10 epochs, lr 0.01): ``mlp`` is 784-100-10 (one matched layer, 784 + 1 + 10 coordinates per neuron),
  ``mlp-50`` and ``mlp-200`` its 50- and 200-unit variants (the growth in L_j), ``lenet`` LeNet-5 (four groups).
  The local models are cached in ``--cache`` (trained once per network and J);
* ``model`` (the fallback without MNIST): layers drawn from the generative model with a finite pool, the
  published benchmark's way: 4 L_j atoms ~ N(0, 1) in 795 coordinates, each client 100 of them + N(0, 0.01)
  noise, matched as one layer (``match_layer``).

Fixed hyper-parameters are the reference's sigma2 = sigma0_2 = gamma0 = 1 with 5 sweeps; empirical Bayes is
bnpfed's default (every hyper-parameter estimated per group, stopped on the result). The growth exponent of a
column is the least-squares slope of log(seconds) on log(J) over J >= 25.

Usage: python benchmarks/bench_scaling.py [--nets mlp,lenet] [--clients 10,25,...] [--threads N]; ``--stops``
compares the stopping rule on the result with the exact fixed point, ``--schedules`` Gauss-Seidel sweeps with Jacobi
sweeps, ``--starts`` the two starts of empirical Bayes,
``--interleaved J`` times EB against fixed matching alternately in one process, ``--plane J`` the accuracy-width plane.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tracemalloc
from bnpfed.experimental import ExperimentalOptions
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).parent
DEFAULT_DATA = HERE.parent.parent / "shared" / "data" / "mnist"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bnpfed-bench"
CLIENTS = (10, 25, 50, 100, 200, 500)
#: the networks: (arch, hidden widths)
NETS = {"mlp": ("mlp", (100,)), "mlp-50": ("mlp", (50,)), "mlp-200": ("mlp", (200,)), "lenet": ("lenet", None)}
MODES = ("empirical-bayes", "fixed")
#: a measurement under REPEAT_BELOW seconds is repeated, the best of REPEATS kept (``pfnm_step``'s own seconds)
REPEATS, REPEAT_BELOW = 3, 10.0


def _pfnm_config(mode: str, device: str | None = None):
    from bnpfed.federated.config import PFNMConfig
    return PFNMConfig(matcher_device=device) if mode == "empirical-bayes" else PFNMConfig(
        hyperparameters="fixed", sigma2=1.0, sigma0_2=1.0, gamma0=1.0, matcher_device=device)


def _experiment(data_dir: str, net: str, J: int, progress: bool = False):
    """The federation the local models of (net, J) come from: MNIST split IID into J shards, seed 0."""
    from bnpfed.data import load_dataset
    from bnpfed.federated.config import PFNM_NETWORK, PFNM_TRAINING, PartitionConfig
    from bnpfed.federated.methods import Experiment, ExperimentConfig
    arch, hidden = NETS[net]
    network = replace(PFNM_NETWORK, arch=arch, **({"hidden": hidden} if hidden else {}))
    ds = load_dataset("mnist", data_dir=data_dir, standardize=False)
    return Experiment(ds, partition=PartitionConfig(clients=J, partition="iid"), network=network,
                      training=PFNM_TRAINING, config=ExperimentConfig(seed=0), progress=progress)


def _activity(data_dir: str, net: str, J: int, saved: dict, template) -> list:
    """Every client's report on its units on its own shard (what PFNM's clients send: ``inactive="drop"``)."""
    from bnpfed.federated.clients import unit_activity_step
    from bnpfed.matching.permutation import network_from_state
    experiment = _experiment(data_dir, net, J)
    return [unit_activity_step(network_from_state(template, state), experiment.client_data[j][0],
                               saved["input_shape"]) for j, state in enumerate(saved["states"])]


def _local_models(data_dir: str, cache: Path, net: str, J: int, progress: bool = True):
    """The J clients' round-1 state dicts and class counts (trained on first use, then read from ``cache``)."""
    import torch
    path = cache / f"{net}_J{J}.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    experiment = _experiment(data_dir, net, J, progress)
    local = experiment.local_models()
    saved = dict(states=[m.state_dict() for m in local], counts=experiment.class_counts,
                 network=experiment.network, input_shape=experiment.input_shape,
                 num_classes=experiment.dataset.num_classes)
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(saved, path)
    return saved


def _federation(data_dir: str, cache: Path, net: str, J: int, *, inactive: str = "drop", progress: bool = False):
    """The J clients' saved models, the template network and (``inactive="drop"``) their activity reports."""
    from bnpfed.federated.clients import initial_network
    saved = _local_models(data_dir, Path(cache), net, J, progress=progress)
    template = initial_network(saved["network"], saved["input_shape"], saved["num_classes"], seed=0)
    activity = _activity(data_dir, net, J, saved, template) if inactive == "drop" else None
    return saved, template, activity


def _test_accuracy(match, ds, batch: int = 500) -> float:
    """The global network's accuracy on the test split, ``batch`` images at a time (LeNet's global network at J = 500
    has a 1,026-channel conv2: all 10,000 images at once would hold gigabytes of activations)."""
    import torch
    net = match.network().eval()
    with torch.no_grad():
        right = sum(int((net(x).argmax(-1) == y).sum()) for x, y in zip(ds.x_test.split(batch), ds.y_test.split(batch)))
    return right / len(ds.y_test)


def _model_layer(J: int, L_j: int = 100, D: int = 795, seed: int = 0):
    import numpy as np
    rng = np.random.default_rng(seed)
    pool = rng.normal(size=(4 * L_j, D))
    return [pool[rng.choice(4 * L_j, L_j, replace=False)] + 0.1 * rng.normal(size=(L_j, D)) for _ in range(J)]


def _dgemm_rate(rows: int = 100, inner: int = 785, cols: int = 20_000, repeats: int = 20) -> float:
    """This process's float64 matrix-product rate (GFLOP/s) at the shape of a client's cross products against a wide
    layer, (rows x inner) times (inner x cols), numpy, at the process's thread count."""
    import numpy as np
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(rows, inner)), rng.normal(size=(cols, inner))
    a @ b.T
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b.T
    return repeats * 2 * rows * inner * cols / (time.perf_counter() - t0) / 1e9


def one(args) -> dict:
    """One (network, J, mode) measurement, in this process."""
    import resource
    import torch
    torch.set_num_threads(args.threads)
    if args.source == "model":
        from bnpfed.matching import match_layer
        layer = _model_layer(args.J)
        match_layer(layer[:2], seed=0)  # warm-up
        kwargs = {} if args.mode == "empirical-bayes" else dict(sigma2=1.0, sigma0_2=1.0, gamma0=1.0,
                                                                  hyperparameters="fixed", sweeps=5)
        kwargs["device"] = args.device
        tracemalloc.start()
        t0 = time.perf_counter()
        result = match_layer(layer, seed=0, **kwargs)
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        groups = {"layer": dict(seconds=seconds, sweeps=getattr(result, "sweeps_run", 5), width=result.num_atoms,
                                converged=bool(getattr(result, "converged", True)))}
        neurons = 100
    else:
        from bnpfed.federated.clients import initial_network
        from bnpfed.federated.server import pfnm_step
        saved = _local_models(args.data_dir, Path(args.cache), args.net, args.J, progress=not args.no_progress)
        if args.train:
            return {}
        template = initial_network(saved["network"], saved["input_shape"], saved["num_classes"], seed=0)
        activity = _activity(args.data_dir, args.net, args.J, saved, template) if args.inactive == "drop" else None
        # warm-up (imports, first touches) on two clients, outside the measurement
        pfnm_step(saved["states"][:2], saved["counts"][:2], _pfnm_config(args.mode, args.device), seed=0, round=1,
                  template=template, input_shape=saved["input_shape"], activity=activity and activity[:2])
        tracemalloc.start()
        t0 = time.perf_counter()
        match = pfnm_step(saved["states"], saved["counts"], _pfnm_config(args.mode, args.device), seed=0, round=1,
                          template=template, input_shape=saved["input_shape"], activity=activity)
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        for _ in range(REPEATS - 1 if seconds < REPEAT_BELOW else 0):  # best of REPEATS for the short ones
            again = pfnm_step(saved["states"], saved["counts"], _pfnm_config(args.mode, args.device), seed=0, round=1,
                              template=template, input_shape=saved["input_shape"], activity=activity)
            if again.seconds < seconds:   # the groups' seconds below are the best run's
                seconds, match = again.seconds, again
        groups = {g: dict(seconds=r.seconds, sweeps=getattr(r, "sweeps_run", None), width=r.num_atoms,
                          converged=bool(getattr(r, "converged", True)),
                          starts=list(getattr(r, "starts", None) or []),   # each start's sweeps and atoms, under EB
                          pairs=sum(L_j * L for _, L_j, L in r.rematches),   # (neuron, atom) pairs scored
                          lsa_seconds=r.lsa_seconds)
                  for g, r in match.layer_results.items()}
        neurons = NETS[args.net][1][0] if NETS[args.net][1] else None
    process_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    accuracy = None
    if args.source == "trained":  # the one-shot global network on MNIST's test split (after the measurements)
        match.layer_results = {}   # only the state is evaluated: the groups' (L, D) posterior means go first
        from bnpfed.data import load_dataset
        accuracy = _test_accuracy(match, load_dataset("mnist", data_dir=args.data_dir, standardize=False))
    return dict(net=args.net, J=args.J, mode=args.mode, source=args.source, L_j=neurons, seconds=seconds,
                dgemm_gflops=_dgemm_rate(),
                groups=groups, accuracy=accuracy, matcher_peak_mib=peak / 2 ** 20, process_peak_mib=process_peak,
                threads=args.threads, inactive=args.inactive if args.source == "trained" else "keep",
                device=args.device or "numpy")


def interleaved(J: int, repeats: int, *, net: str = "mlp", data_dir=str(DEFAULT_DATA), cache=str(DEFAULT_CACHE),
                inactive: str = "drop") -> dict:
    """EB (the default even split, and both starts) and fixed matching of the same local models alternated
    ``repeats`` times in this process (one thread), the best of each and their ratios: the issue's measure of what
    empirical Bayes costs; and each group's best seconds under empirical Bayes."""
    import torch
    from bnpfed.federated.config import PFNMConfig
    from bnpfed.federated.server import pfnm_step
    torch.set_num_threads(1)
    saved, template, activity = _federation(data_dir, cache, net, J, inactive=inactive, progress=True)
    both = PFNMConfig(experimental=ExperimentalOptions(starts="both"))
    configs = {mode: _pfnm_config(mode) for mode in MODES} | {"both": both}
    best = dict.fromkeys(configs, float("inf"))
    groups: dict[str, float] = {}   # each group's best seconds under empirical Bayes (the default)
    for _ in range(repeats):
        for mode, config in configs.items():
            match = pfnm_step(saved["states"], saved["counts"], config, seed=0, round=1,
                              template=template, input_shape=saved["input_shape"], activity=activity)
            best[mode] = min(best[mode], match.seconds)
            if mode == "empirical-bayes":
                for g, r in match.layer_results.items():
                    groups[g] = min(groups.get(g, float("inf")), r.seconds)
    return {"net": net, "J": J, "inactive": inactive, "repeats": repeats, "eb s": best["empirical-bayes"],
            "eb both starts s": best["both"], "fixed s": best["fixed"],
            "eb/fixed": best["empirical-bayes"] / best["fixed"], "both/fixed": best["both"] / best["fixed"],
            **{f"eb {g} s": round(v, 3) for g, v in groups.items()}}


def _pfnm_records(nets_and_clients, configs, group_record, *, data_dir, cache, out) -> list[dict]:
    """Per (network, J), dead units left out, one thread: one ``pfnm_step`` per ``(name, PFNMConfig)`` in
    ``configs`` on the same local models, in this process; each record ``{net, J, name: {seconds, accuracy (MNIST
    test), groups: {group: group_record(layer result)}}}``. ``out``: JSON lines, one per (network, J), resumed."""
    import torch
    from bnpfed.data import load_dataset
    from bnpfed.federated.server import pfnm_step
    torch.set_num_threads(1)
    ds = load_dataset("mnist", data_dir=data_dir, standardize=False)
    path = Path(out) if out else None
    done = {}
    if path is not None and path.exists():
        done = {(r["net"], r["J"]): r for r in map(json.loads, path.read_text().splitlines()) if r}
    records = []
    for net, J in nets_and_clients:
        record = done.get((net, J))
        if record is None:
            saved, template, activity = _federation(data_dir, cache, net, J)
            record = dict(net=net, J=J)
            for name, config in configs:
                match = pfnm_step(saved["states"], saved["counts"], config, seed=0, round=1, template=template,
                                  input_shape=saved["input_shape"], activity=activity)
                record[name] = dict(seconds=match.seconds, accuracy=_test_accuracy(match, ds), groups={
                    g: group_record(r) for g, r in match.layer_results.items()})
            if path is not None:
                with path.open("a") as f:
                    f.write(json.dumps(record, default=float) + "\n")
        records.append(record)
    return records


def starts(nets_and_clients, *, data_dir=str(DEFAULT_DATA), cache=str(DEFAULT_CACHE), out=None) -> list[dict]:
    """Per (network, J), dead units left out, one thread: ``pfnm_step`` with both starts of empirical Bayes
    (``ExperimentalOptions(starts="both")``) and with the even split alone (the default), in this process: every group's
    two log likelihoods and widths, which start was kept, the seconds and the global network's MNIST test accuracy.
    One line per (network, J, group) in the returned rows; ``out``: JSON lines, one per (network, J), resumed."""
    from bnpfed.federated.config import PFNMConfig
    rows = []
    both = PFNMConfig(experimental=ExperimentalOptions(starts="both"))
    for record in _pfnm_records(nets_and_clients, (("both", both), ("even-split", PFNMConfig())),
                                lambda r: dict(atoms=r.num_atoms, seconds=r.seconds, starts=r.starts),
                                data_dir=data_dir, cache=cache, out=out):
        net, J = record["net"], record["J"]
        network = {"seconds (both / even)": f"{record['both']['seconds']:.2f} / {record['even-split']['seconds']:.2f}",
                   "accuracy (both / even)": f"{record['both']['accuracy']:.4f} / "
                                             f"{record['even-split']['accuracy']:.4f}"}
        for g, both in record["both"]["groups"].items():
            runs = {s["start"]: s for s in both["starts"]}
            row = {"net": net, "J": J, "group": g, **network}
            if runs:
                gap = runs["small-noise"]["log_likelihood"] - runs["even-split"]["log_likelihood"]
                row.update({"kept": "small-noise" if gap > 0 else "even-split", "small - even (nats)": round(gap, 1),
                            "atoms (small / even)": f"{runs['small-noise']['atoms']} / {runs['even-split']['atoms']}"})
            else:
                row.update({"kept": "one start (small-noise redone from the even split)", "small - even (nats)": "",
                            "atoms (small / even)": f"- / {both['atoms']}"})
            rows.append(row)
    return rows


def stops(nets_and_clients, *, data_dir=str(DEFAULT_DATA), cache=str(DEFAULT_CACHE), out=None) -> list[dict]:
    """Per (network, J), dead units left out, one thread: ``pfnm_step`` under the exact fixed point (the probe
    ``ExperimentalOptions(stop="fixed-point")``) and under the stopping rule on the result (the default), in this
    process: per group the sweeps, widths and seconds, and the global network's MNIST test accuracy. One row per (network, J);
    ``out``: JSON lines, one per (network, J), resumed."""
    from bnpfed.federated.config import PFNMConfig
    rows = []
    exact = PFNMConfig(experimental=ExperimentalOptions(stop="fixed-point"))
    for record in _pfnm_records(nets_and_clients, (("fixed-point", exact),
                                                   ("result", PFNMConfig())),
                                lambda r: dict(atoms=r.num_atoms, sweeps=r.sweeps_run, converged=bool(r.converged),
                                               log_likelihood=r.log_likelihood),
                                data_dir=data_dir, cache=cache, out=out):
        net, J = record["net"], record["J"]
        exact, quick = record["fixed-point"], record["result"]
        rows.append({"net": net, "J": J,
                     "sweeps (exact / result)": " / ".join("/".join(str(g["sweeps"]) for g in r["groups"].values())
                                                          for r in (exact, quick)),
                     "widths (exact / result)": " / ".join("/".join(str(g["atoms"]) for g in r["groups"].values())
                                                          for r in (exact, quick)),
                     "accuracy (exact / result)": f"{exact['accuracy']:.4f} / {quick['accuracy']:.4f}",
                     "seconds (exact / result)": f"{exact['seconds']:.2f} / {quick['seconds']:.2f}",
                     "exact converged": all(g["converged"] for g in exact["groups"].values())})
    return rows


def schedules(nets_and_clients, *, data_dir=str(DEFAULT_DATA), cache=str(DEFAULT_CACHE), out=None) -> list[dict]:
    """Per (network, J), dead units left out, one thread: ``pfnm_step`` with Gauss-Seidel sweeps (the default: each
    client re-matched given the moves of those before it) and with Jacobi sweeps (the probe
    ``ExperimentalOptions(schedule="jacobi")``: every client against the assignment at the sweep's start, moved at once), under empirical Bayes and under the
    reference's fixed values, in this process: per group the sweeps, whether it settled, the widths, ``log p(Z, V)``,
    the neurons moved in the last sweep, the seconds and the global network's MNIST test accuracy. One row per
    (network, J, hyper-parameters); ``out``: JSON lines, one per (network, J), resumed."""
    def with_(config, schedule):
        return replace(config, experimental=replace(config.experimental, schedule=schedule))

    configs = [(f"{mode}/{schedule}", with_(_pfnm_config(mode), schedule)) for mode in MODES
               for schedule in ("gauss-seidel", "jacobi")]
    rows = []
    for record in _pfnm_records(nets_and_clients, configs,
                                lambda r: dict(atoms=r.num_atoms, sweeps=r.sweeps_run, converged=bool(r.converged),
                                               log_likelihood=r.log_likelihood, moved=list(r.moved),
                                               seconds=r.seconds),
                                data_dir=data_dir, cache=cache, out=out):
        for mode in MODES:
            gs, jac = record[f"{mode}/gauss-seidel"], record[f"{mode}/jacobi"]

            def per_group(key, run):
                return "/".join(str(g[key]) for g in run["groups"].values())

            rows.append({"net": record["net"], "J": record["J"], "hyper-parameters": mode,
                         "sweeps (GS / Jacobi)": f"{per_group('sweeps', gs)} / {per_group('sweeps', jac)}",
                         "settled (GS / Jacobi)": f"{per_group('converged', gs)} / {per_group('converged', jac)}",
                         "widths (GS / Jacobi)": f"{per_group('atoms', gs)} / {per_group('atoms', jac)}",
                         "log p(Z,V) Jacobi - GS": "/".join(
                             f"{jac['groups'][g]['log_likelihood'] - v['log_likelihood']:.0f}"
                             for g, v in gs["groups"].items()),
                         "moved in last sweep (GS / Jacobi)": " / ".join(
                             "/".join(str(g["moved"][-1] if g["moved"] else 0) for g in r["groups"].values())
                             for r in (gs, jac)),
                         "accuracy (GS / Jacobi)": f"{gs['accuracy']:.4f} / {jac['accuracy']:.4f}",
                         "seconds (GS / Jacobi)": f"{gs['seconds']:.2f} / {jac['seconds']:.2f}"})
    return rows


def plane(J: int, noises, *, net: str = "mlp", data_dir=str(DEFAULT_DATA), cache=str(DEFAULT_CACHE)) -> list[dict]:
    """The accuracy-width plane of empirical Bayes on the J clients' models (dead units left out, one thread): the
    default, then the noise variance ``sigma2`` given at each of ``noises`` (both coordinate blocks; every other
    hyper-parameter still estimated), one ``pfnm_step`` each: the hidden width and the MNIST test accuracy."""
    import torch
    from bnpfed.data import load_dataset
    from bnpfed.federated.config import PFNMConfig
    from bnpfed.federated.server import pfnm_step
    torch.set_num_threads(1)
    ds = load_dataset("mnist", data_dir=data_dir, standardize=False)
    saved, template, activity = _federation(data_dir, cache, net, J)
    rows = []
    for sigma2 in (None, *noises):
        match = pfnm_step(saved["states"], saved["counts"], PFNMConfig(sigma2=sigma2), seed=0, round=1,
                          template=template, input_shape=saved["input_shape"], activity=activity)
        accuracy = _test_accuracy(match, ds)
        estimates = next(iter(match.layer_results.values())).hyperparameters
        rows.append({"net": net, "J": J, "sigma2": "estimated" if sigma2 is None else sigma2,
                     "estimated sigma2": round(float(estimates["sigma2"]), 4) if sigma2 is None else "",
                     "width": sum(match.hidden_sizes), "accuracy": round(accuracy, 4)})
    return rows


def _done(out: Path) -> set:
    if not out.exists():
        return set()
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return {(r["net"], r["J"], r["mode"], r["source"], r["threads"], r.get("inactive", "keep"),
             r.get("device", "numpy")) for r in rows}


def exponent(Js, seconds) -> float | None:
    """Least-squares slope of log(seconds) on log(J) over J >= 25 (None with fewer than two such points)."""
    import numpy as np
    pairs = [(j, s) for j, s in zip(Js, seconds) if j >= 25 and s]
    if len(pairs) < 2:
        return None
    x, y = np.log([p[0] for p in pairs]), np.log([p[1] for p in pairs])
    return float(np.polyfit(x, y, 1)[0])


def table(rows: list[dict]) -> list[dict]:
    """One line per (network, J): seconds, sweeps, widths and memory under both modes, and the ratio EB / fixed;
    then one line per network with the growth exponents."""
    by = {(r["net"], r["J"], r["mode"]): r for r in rows}
    lines = []
    nets = list(dict.fromkeys(r["net"] for r in rows))
    for net in nets:
        Js = sorted({r["J"] for r in rows if r["net"] == net})
        for J in Js:
            eb, fx = by.get((net, J, "empirical-bayes")), by.get((net, J, "fixed"))
            line = {"net": net, "J": J}
            for tag, r in (("eb", eb), ("fixed", fx)):
                if r is None:
                    continue
                line[f"{tag} s"] = round(r["seconds"], 2)
                line[f"{tag} sweeps"] = "/".join(str(g["sweeps"]) for g in r["groups"].values())
                line[f"{tag} width"] = "/".join(str(g["width"]) for g in r["groups"].values())
                if r.get("accuracy") is not None:
                    line[f"{tag} acc"] = round(r["accuracy"], 4)
                if tag == "eb":
                    line["eb converged"] = all(g["converged"] for g in r["groups"].values())
                line[f"{tag} matcher MiB"] = round(r["matcher_peak_mib"])
                line[f"{tag} process MiB"] = round(r["process_peak_mib"])
            if eb and fx:
                line["eb/fixed"] = round(eb["seconds"] / fx["seconds"], 2)
            lines.append(line)
        for tag, mode in (("eb", "empirical-bayes"), ("fixed", "fixed")):
            k = exponent(Js, [by[(net, J, mode)]["seconds"] if (net, J, mode) in by else None for J in Js])
            if k is not None:
                lines.append({"net": net, "J": f"exponent in J ({tag})", f"{tag} s": round(k, 2)})
    return lines


def lj_exponents(rows: list[dict]) -> list[dict]:
    """The growth in L_j at fixed J: the slope of log(seconds) on log(L_j) over the MLP variants."""
    import numpy as np
    out = []
    for J in sorted({r["J"] for r in rows if r["net"].startswith("mlp")}):
        for mode in MODES:
            pts = sorted((r["L_j"], r["seconds"]) for r in rows
                         if r["net"].startswith("mlp") and r["J"] == J and r["mode"] == mode)
            if len(pts) >= 2:
                k = float(np.polyfit(np.log([p[0] for p in pts]), np.log([p[1] for p in pts]), 1)[0])
                out.append({"J": J, "mode": mode, "L_j": "/".join(str(p[0]) for p in pts),
                            "seconds": "/".join(f"{p[1]:.2f}" for p in pts), "exponent in L_j": round(k, 2)})
    return out


def run(nets=("mlp",), clients=CLIENTS, *, threads: int = 2, data_dir=str(DEFAULT_DATA), cache=str(DEFAULT_CACHE),
        out: Path | None = None, source: str | None = None, progress: bool = True, inactive: str = "drop",
        device: str | None = None) -> list[dict]:
    """Every (network, J, mode) in a fresh process, results appended to ``out`` (JSON lines; finished ones are
    skipped); returns the rows of this configuration."""
    if source is None:
        source = "trained" if (Path(data_dir) / "MNIST" / "raw").is_dir() else "model"
    if source == "model":
        nets = ("model",)
    out = Path(out) if out is not None else HERE / "results" / f"scaling_{source}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    done = _done(out)
    from tqdm import tqdm
    inactive = inactive if source == "trained" else "keep"   # layers drawn from the model have no dead units
    todo = [(net, J, mode) for net in nets for J in clients for mode in MODES
            if (net, J, mode, source, threads, inactive, device or "numpy") not in done]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    for net, J, mode in tqdm(todo, desc="scaling", unit="run", disable=not progress):
        cmd = [sys.executable, __file__, "--one", "--net", net, "--J", str(J), "--mode", mode, "--source", source,
               "--threads", str(threads), "--data-dir", str(data_dir), "--cache", str(cache), "--inactive", inactive]
        cmd += ["--device", device] if device else []
        if source == "trained" and not (Path(cache) / f"{net}_J{J}.pt").exists():   # the local models, in a
            quiet = [] if progress else ["--no-progress"]                                  # process of their own
            subprocess.run(cmd + ["--train"] + quiet, check=True, env=env)
        line = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout.strip().splitlines()[-1]
        with out.open("a") as f:
            f.write(line + "\n")
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["net"] in nets and r["J"] in clients and r["source"] == source
            and r["threads"] == threads and r.get("inactive", "keep") == inactive
            and r.get("device", "numpy") == (device or "numpy")]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nets", default="mlp,lenet", help=f"comma-separated, of {', '.join(NETS)}")
    p.add_argument("--clients", default=",".join(map(str, CLIENTS)))
    p.add_argument("--threads", type=int, default=2, help="BLAS and torch threads of each measurement")
    p.add_argument("--data-dir", default=str(DEFAULT_DATA), help="MNIST in torchvision's layout")
    p.add_argument("--cache", default=str(DEFAULT_CACHE), help="where trained local models are kept")
    p.add_argument("--source", choices=("trained", "model"), default=None,
                   help="local models trained on MNIST shards or layers drawn from the model (default: trained "
                        "when MNIST is in --data-dir)")
    p.add_argument("--out", default=None, help="JSON lines (default benchmarks/results/scaling_<source>.jsonl)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--inactive", choices=("drop", "keep"), default="drop",
                   help="trained clients: report their units' activity and the server leaves the dead ones out "
                   "(drop, PFNMConfig's default) or matches them too (keep, the rows recorded before 2026-12-03)")
    p.add_argument("--device", default=None,
                   help="the matcher's products in torch on this device (cpu, cuda[:N]; PFNMConfig's matcher_device); "
                        "default: its numpy path. Local training stays on the CPU")
    p.add_argument("--interleaved", type=int, metavar="J", default=None,
                   help="instead: EB and fixed alternated in one process on J clients' models (one thread)")
    p.add_argument("--repeats", type=int, default=7, help="alternations of --interleaved (the best kept)")
    p.add_argument("--plane", type=int, metavar="J", default=None,
                   help="instead: the accuracy-width plane on J clients' models, sigma2 given at --noises")
    p.add_argument("--noises", default="0.045,0.04,0.035,0.03,0.025,0.02",
                   help="the sigma2 values of --plane, comma-separated")
    p.add_argument("--stops", action="store_true",
                   help="per --nets and --clients: the exact fixed point against the stopping rule on the result "
                        "(sweeps, widths, accuracy, seconds; one thread)")
    p.add_argument("--schedules", action="store_true",
                   help="per --nets and --clients: Gauss-Seidel sweeps against Jacobi sweeps, under empirical Bayes "
                        "and fixed values (sweeps, widths, log p(Z, V), accuracy, seconds; one thread)")
    p.add_argument("--starts", action="store_true",
                   help="instead: both starts of empirical Bayes against the even split alone, every (net, J) of "
                   "--nets x --clients, dead units left out (JSON lines in --out, resumed)")
    # one measurement in this process (what run() calls)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--net", default="mlp", help=argparse.SUPPRESS)
    p.add_argument("--J", type=int, default=10, help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, default="empirical-bayes", help=argparse.SUPPRESS)
    p.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        row = one(args)
        if row:
            print(json.dumps(row))
        return
    nets = tuple(args.nets.split(","))
    unknown = [n for n in nets if n not in NETS]
    if unknown:
        p.error(f"--nets: unknown network(s) {unknown}; expected names from {list(NETS)}")
    if args.threads < 1:
        p.error(f"--threads: expected a positive integer, got {args.threads}")
    from bnpfed.report import format_table
    if args.interleaved is not None:
        if args.interleaved < 1 or args.repeats < 1:
            p.error(f"--interleaved, --repeats: expected positive integers, got {args.interleaved}, {args.repeats}")
        print(format_table([interleaved(args.interleaved, args.repeats, net=nets[0], data_dir=args.data_dir,
                                        cache=args.cache, inactive=args.inactive)]))
        return
    if args.plane is not None:
        print(format_table(plane(args.plane, [float(v) for v in args.noises.split(",")], net=nets[0],
                                 data_dir=args.data_dir, cache=args.cache)))
        return
    if args.stops:
        print(format_table(stops([(n, int(j)) for n in nets for j in args.clients.split(",")],
                                 data_dir=args.data_dir, cache=args.cache, out=args.out)))
        return
    if args.schedules:
        print(format_table(schedules([(n, int(j)) for n in nets for j in args.clients.split(",")],
                                     data_dir=args.data_dir, cache=args.cache, out=args.out)))
        return
    if args.starts:
        print(format_table(starts([(n, int(j)) for n in nets for j in args.clients.split(",")],
                                  data_dir=args.data_dir, cache=args.cache, out=args.out)))
        return
    rows = run(nets, tuple(int(j) for j in args.clients.split(",")), threads=args.threads, data_dir=args.data_dir,
               cache=args.cache, out=args.out, source=args.source, progress=not args.no_progress,
               inactive=args.inactive, device=args.device)
    print(format_table(table(rows)))
    lj = lj_exponents(rows)
    if lj:
        print(format_table(lj))


if __name__ == "__main__":
    main()
