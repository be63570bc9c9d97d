"""Benchmark of ``match_layer``: the vectorised matcher against a per-neuron loop, and against the floor.

For J clients of L_j = 100 neurons in D dimensions (D = 795 or 3083: 784 or 3072 inputs + bias + 10 outputs), five
sweeps. Per configuration, in one process:

* ``bnpfed``: ``match_layer`` running all five sweeps (seconds, and the share of them inside
  ``linear_sum_assignment``); ``early_stop``: the default, which stops once a sweep changes nothing (same result);
* ``loop``: a plain per-neuron implementation of the same scores (dense (L, D) natural parameters and precisions,
  one row of scores per neuron, as the published code does), same greedy pass, same sweep order, same LSA;
* ``floor``: for every re-match of the ``bnpfed`` run, one product of the client's neurons (L_j, D) with the current
  atoms (D, L), timed on arrays of those shapes, plus that re-match's own ``linear_sum_assignment`` time.

The data: a pool of 4 L_j atoms ~ N(0, 1); each client holds a random 100 of them plus N(0, 0.1) noise; matching
uses sigma2 = 0.2, sigma0_2 = 1, gamma0 = 10.
"""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
from scipy.optimize import linear_sum_assignment

from bnpfed.matching import match_layer


def make_layer(J: int, L_j: int, D: int, *, seed: int = 0, noise: float = 0.1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    pool = rng.normal(size=(4 * L_j, D))
    return [pool[rng.choice(4 * L_j, L_j, replace=False)] + np.sqrt(noise) * rng.normal(size=(L_j, D))
            for _ in range(J)]


HYPER = dict(sigma2=0.2, sigma0_2=1.0, gamma0=10.0)
#: match_layer with these hyper-parameters held fixed (its default estimates them: empirical Bayes).
FIXED = dict(HYPER, hyperparameters="fixed")


def loop_match(neurons, *, sigma2, sigma0_2, gamma0, sweeps=5, seed=0):
    """The baseline: the published algorithm's structure, one neuron at a time, dense per-coordinate statistics."""
    J, D = len(neurons), neurons[0].shape[1]
    tau, P0 = 1.0 / sigma2, 1.0 / sigma0_2
    g = np.zeros((0, D))  # natural parameters mu0/sigma0_2 + sum v/sigma2 (mu0 = 0)
    P = np.zeros((0, D))  # precisions
    m = np.zeros(0, dtype=np.int64)
    assign = [None] * J

    def rematch(j):
        nonlocal g, P, m
        V = neurons[j]
        L = g.shape[0]
        rows = []
        for l in range(V.shape[0]):  # one neuron at a time
            x = tau * V[l]
            exist = ((g + x) ** 2 / (P + tau)).sum(axis=1) - (g ** 2 / P).sum(axis=1)
            exist += 2 * (np.log(m) - np.log(J - m))
            new = (x ** 2 / (P0 + tau)).sum() + 2 * np.log(gamma0 / J)
            rows.append(np.concatenate([exist, np.full(V.shape[0], new)]))
        S = np.array(rows).reshape(V.shape[0], L + V.shape[0])
        r, c = linear_sum_assignment(S, maximize=True)
        target = np.empty(V.shape[0], dtype=np.int64)
        old = c < L
        target[r[old]] = c[old]
        n_new = int((~old).sum())
        target[r[~old]] = np.arange(L, L + n_new)
        g = np.vstack([g, np.zeros((n_new, D))])
        P = np.vstack([P, np.full((n_new, D), P0)])
        m = np.concatenate([m, np.zeros(n_new, dtype=np.int64)])
        g[target] += tau * V
        P[target] += tau
        m[target] += 1
        assign[j] = target

    def remove(j):
        nonlocal g, P, m
        t = assign[j]
        g[t] -= tau * neurons[j]
        P[t] -= tau
        m[t] -= 1
        keep = m > 0
        relabel = np.cumsum(keep) - 1
        g, P, m = g[keep], P[keep], m[keep]
        for k in range(J):
            if k != j and assign[k] is not None:
                assign[k] = relabel[assign[k]]
        assign[j] = None

    for j in np.argsort(-np.array([v.shape[0] for v in neurons]), kind="stable"):
        rematch(int(j))
    rng = np.random.default_rng(seed)
    for _ in range(sweeps):
        for j in rng.permutation(J):
            remove(int(j))
            rematch(int(j))
    return g.shape[0]


def floor_seconds(rematches, D: int, lsa_seconds: float, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    total = 0.0
    cache = {}
    for _, L_j, L in rematches:
        if L == 0:
            continue
        key = (L_j, L)
        if key not in cache:
            cache[key] = (rng.normal(size=(L_j, D)), rng.normal(size=(L, D)))
        a, b = cache[key]
        t0 = time.perf_counter()
        a @ b.T
        total += time.perf_counter() - t0
    return total + lsa_seconds


def run(configs=None, *, repeats: int = 3):
    """One row per (J, D): seconds of bnpfed (all 5 sweeps, and stopping at a fixed point) / loop / floor, ratios,
    the LSA share, peak traced memory, atoms found by each."""
    configs = configs or [(J, D) for D in (795, 3083) for J in (10, 30, 100)]
    rows = []
    for J, D in configs:
        neurons = make_layer(J, 100, D)
        full = min((match_layer(neurons, sweeps=5, seed=0, stop_at_fixed_point=False, **FIXED) for _ in range(repeats)),
                   key=lambda r: r.seconds)
        early = min((match_layer(neurons, sweeps=5, seed=0, **FIXED) for _ in range(repeats)), key=lambda r: r.seconds)
        tracemalloc.start()
        match_layer(neurons, sweeps=5, seed=0, stop_at_fixed_point=False, **FIXED)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        floor = floor_seconds(full.rematches, D, full.lsa_seconds)
        t0 = time.perf_counter()
        loop_atoms = loop_match(neurons, sweeps=5, seed=0, **HYPER)
        loop_s = time.perf_counter() - t0
        rows.append(dict(J=J, D=D, atoms=full.num_atoms, loop_atoms=loop_atoms, loop_s=loop_s, bnpfed_s=full.seconds,
                         floor_s=floor, loop_over_bnpfed=loop_s / full.seconds, bnpfed_over_floor=full.seconds / floor,
                         lsa_share=full.lsa_seconds / full.seconds, peak_MiB=peak / 2 ** 20,
                         early_stop_s=early.seconds, sweeps_run=len(early.rematches) // J - 1))
    return rows
