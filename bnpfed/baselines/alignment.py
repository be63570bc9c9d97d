"""Aligning networks to one reference before averaging them: the fusion baselines PFNM is measured against, through
any permutation spec (:mod:`bnpfed.matching.permutation`).

**Weight matching** (Git Re-Basin, Ainsworth, Hayase & Srinivasa, ICLR 2023, ``weight_matching.py``): for model j,
the permutations ``P_g`` of every hidden group g that maximise the inner product of its weights with the
reference's,

    max_P  sum_params < theta_ref , P(theta_j) >,

by coordinate descent: in a random order of the groups, ``P_g`` with the others fixed is a linear assignment problem
(scipy's LSA) on ``A_g = sum_{params on g} W_ref,g W_j,g^T`` (each parameter with g's axis first and the other
groups' permutations applied); sweeps until none improves. Every parameter a group acts on counts (incoming and
outgoing weights, biases, batch-norm scales and shifts; running statistics are permuted, not scored). Widths must be
the reference's.

**OT fusion** (Singh & Jaggi, "Model Fusion via Optimal Transport", NeurIPS 2020): bottom-up, group by group, model
j's units are transported onto the reference's by an optimal-transport plan ``T`` (``n_j x n_ref``) between uniform
marginals ``a = 1/n_j``, ``b = 1/n_ref`` with the ground cost the Euclidean distance between the units' vectors (the
parameters the group owns, as PFNM matches them: incoming weights and bias, batch-norm parameters, and for the last
hidden group its weights to the output layer), the groups below already aligned. The plan is exact
(``ot.emd``, the network simplex) or entropic (``ot.sinkhorn``, regularisation ``reg`` times the largest cost). Model j
aligned: every axis of group g mapped by ``A_g = diag(1 / b) T^T`` (``n_ref x n_j``: reference unit r gets the
``T``-weighted barycentre of model j's units), the next layer's input columns by the same map. Widths may differ; the
fused network has the reference's. With uniform marginals and equal widths the exact plan is ``1/n`` times a
permutation matrix (an extreme point of the Birkhoff polytope), the one LSA finds on the same cost: OT fusion is then
hard alignment by that assignment. Uses POT (``pot``, the field's optimal-transport library; extra ``bnpfed[ot]``).

Both return each model's aligned ``state_dict``; the baselines (:mod:`bnpfed.baselines.averaging`) average them with
the clients' weights.

Usage::

    >>> import torch
    >>> from bnpfed.matching import client_slice, derive_spec
    >>> from bnpfed.models import mlp
    >>> g = torch.manual_seed(0)
    >>> net = mlp(4, [6, 5], 3)
    >>> spec, state = derive_spec(net, (4,)), net.state_dict()
    >>> shuffled = client_slice(spec, state, {"1": torch.randperm(6), "3": torch.randperm(5)})
    >>> aligned = weight_matching([state, shuffled], spec, seed=0)
    >>> all(torch.equal(aligned[1][k], v) for k, v in state.items())      # the permutation undone
    True
"""

from __future__ import annotations

from typing import Literal, Mapping, Sequence

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from bnpfed.matching import client_slice
from bnpfed.matching import width
from bnpfed.matching import STATISTICS, PermutationSpec
from bnpfed.validation import check_choice, check_int, check_positive

__all__ = ["OT_REG", "apply_maps", "ot_alignment", "weight_matching", "weight_matching_permutations"]

#: Sinkhorn's default regularisation, relative to the largest ground cost.
OT_REG = 0.01


def _states(states: Sequence[Mapping[str, Tensor]], spec: PermutationSpec, reference: int) -> list[dict]:
    if not isinstance(states, Sequence) or len(states) < 1:
        raise ValueError("states: expected a sequence of state_dicts, got none")
    if not isinstance(spec, PermutationSpec):
        raise ValueError(f"spec: expected a PermutationSpec, got {type(spec).__name__}")
    reference = check_int(reference, "reference", low=0, high=len(states) - 1)
    out = [{k: torch.as_tensor(v).detach() for k, v in s.items()} for s in states]
    keys = set(out[reference])
    for j, s in enumerate(out):
        if set(s) != keys:
            raise ValueError(f"states[{j}]: expected the keys of states[{reference}] (one architecture), got "
                             f"{sorted(set(s) ^ keys)[:4]} differing")
    return out


def _scored(spec: PermutationSpec, key: str) -> bool:
    return spec.kinds.get(key) not in STATISTICS


def weight_matching_permutations(states: Sequence[Mapping[str, Tensor]], spec: PermutationSpec, *,
                                 reference: int = 0, max_sweeps: int = 100, seed: int | None = 0
                                 ) -> list[dict[str, Tensor]]:
    """Per model, per group, the permutation of Git Re-Basin's weight matching (module docstring): ``perms[j][g][r]``
    is model j's unit that goes to the reference's unit r (the reference's own is the identity).

    :param states: J ``state_dict`` s of one architecture, every group at the reference's width.
    :param spec: their :class:`~bnpfed.matching.permutation.PermutationSpec`.
    :param int reference: the model the others are aligned to.
    :param int max_sweeps: at most this many sweeps over the groups per model (each stops when no group improves).
    :param int seed: seed of the random group order of each sweep.
    """
    states = _states(states, spec, reference)
    max_sweeps = check_int(max_sweeps, "max_sweeps", low=1)
    ref = states[reference]
    sizes = {g.name: width(ref, g, f"states[{reference}]") for g in spec.groups}
    for j, s in enumerate(states):
        for g in spec.groups:
            n = width(s, g, f"states[{j}]")
            if n != sizes[g.name]:
                raise ValueError(f"states[{j}]: expected group {g.name!r} at the reference's width {sizes[g.name]} "
                                 f"(weight matching permutes, it does not merge), got {n}; use OT fusion or PFNM")
    ref64 = {k: v.to(torch.float64) for k, v in ref.items()}
    out = []
    for j, state in enumerate(states):
        perm = {name: torch.arange(n) for name, n in sizes.items()}
        if j == reference:
            out.append(perm)
            continue
        model = {k: v.to(torch.float64) for k, v in state.items()}
        rng = np.random.default_rng(None if seed is None else (int(seed), j))
        for _ in range(max_sweeps):
            progress = False
            for c in rng.permutation(len(spec.groups)):
                group = spec.groups[c]
                n = sizes[group.name]
                A = torch.zeros(n, n, dtype=torch.float64)
                others = {**perm, group.name: torch.arange(n)}   # the other groups' permutations applied
                for axis in group.axes:
                    if not _scored(spec, axis.param):
                        continue
                    w_b = client_slice(spec, {axis.param: model[axis.param]}, others)[axis.param]
                    A += ref64[axis.param].movedim(axis.dim, 0).reshape(n, -1) @ \
                        w_b.movedim(axis.dim, 0).reshape(n, -1).T
                _, cols = linear_sum_assignment(A.numpy(), maximize=True)
                cols = torch.as_tensor(cols, dtype=torch.long)
                old = float(A[torch.arange(n), perm[group.name]].sum())
                new = float(A[torch.arange(n), cols].sum())
                if new > old + 1e-12 * max(1.0, abs(old)):
                    progress = True
                    perm[group.name] = cols
            if not progress:
                break
        out.append(perm)
    return out


def weight_matching(states: Sequence[Mapping[str, Tensor]], spec: PermutationSpec, *, reference: int = 0,
                    max_sweeps: int = 100, seed: int | None = 0) -> list[dict[str, Tensor]]:
    """Every model's ``state_dict`` permuted onto the reference by :func:`weight_matching_permutations` (the same
    dtypes; the reference's unchanged)."""
    perms = weight_matching_permutations(states, spec, reference=reference, max_sweeps=max_sweeps, seed=seed)
    return [client_slice(spec, {k: torch.as_tensor(v).detach() for k, v in s.items()}, p)
            for s, p in zip(states, perms)]


def apply_maps(spec: PermutationSpec, state: Mapping[str, Tensor], maps: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with every axis of every group g in ``maps`` mapped by ``maps[g]`` (``n_ref x n_j``): the new unit r
    along that axis is ``sum_u maps[g][r, u]`` times unit u's block (a permutation matrix permutes; a transport map
    averages); axes of groups not in ``maps``, and keys no group acts on, unchanged."""
    out = {}
    for key, t in state.items():
        t = torch.as_tensor(t).detach()
        for c, a in spec.axes_of(key):
            if spec.groups[c].name not in maps:
                continue
            A = maps[spec.groups[c].name].to(t.dtype)
            moved = t.movedim(a.dim, 0)
            n = moved.shape[0] // a.block
            blocks = moved.reshape(n, a.block, *moved.shape[1:])
            mapped = torch.tensordot(A, blocks, dims=([1], [0]))
            t = mapped.reshape(A.shape[0] * a.block, *moved.shape[1:]).movedim(0, a.dim)
        out[key] = t.contiguous()
    return out


def ot_alignment(states: Sequence[Mapping[str, Tensor]], spec: PermutationSpec, *, reference: int = 0,
                 solver: Literal["exact", "sinkhorn"] = "exact", reg: float = OT_REG
                 ) -> tuple[list[dict[str, Tensor]], list[dict[str, Tensor]]]:
    """OT fusion's alignment (module docstring): ``(aligned, plans)``, per model its ``state_dict`` mapped onto the
    reference's units and per group its transport plan ``T`` (``n_j x n_ref``, float64; the reference's own: the
    identity over n).

    :param str solver: ``"exact"`` (``ot.emd``) or ``"sinkhorn"`` (``ot.sinkhorn``, log-domain).
    :param float reg: Sinkhorn's entropic regularisation, relative to the largest ground cost (> 0).
    """
    states = _states(states, spec, reference)
    solver = check_choice(solver, ("exact", "sinkhorn"), "solver")
    reg = check_positive(reg, "reg")
    try:
        import ot
    except ImportError:
        raise ImportError("OT fusion needs POT, the optimal-transport library: pip install 'bnpfed[ot]' (or pot)") \
            from None
    ref = {k: v.to(torch.float64) for k, v in states[reference].items()}
    sizes = {g.name: width(ref, g, f"states[{reference}]") for g in spec.groups}
    aligned, plans = [], []
    for j, state in enumerate(states):
        model = {k: v.to(torch.float64) for k, v in state.items()}
        maps, plan = {}, {}
        for group in spec.groups:
            n_ref, n_j = sizes[group.name], width(model, group, f"states[{j}]")
            if j == reference:
                plan[group.name] = torch.eye(n_ref, dtype=torch.float64) / n_ref
                maps[group.name] = torch.eye(n_ref, dtype=torch.float64)
                continue
            owned = [k for k in spec.owned(group.name) if _scored(spec, k)]
            mine = apply_maps(spec, {k: model[k] for k in owned}, maps)  # the groups below already aligned
            rows_j = torch.cat([mine[k].movedim(_axis(spec, k, group.name), 0).reshape(n_j, -1) for k in owned], 1)
            rows_ref = torch.cat([ref[k].movedim(_axis(spec, k, group.name), 0).reshape(n_ref, -1) for k in owned],
                                 1)
            M = torch.cdist(rows_j, rows_ref).numpy()
            a, b = np.full(n_j, 1.0 / n_j), np.full(n_ref, 1.0 / n_ref)
            if solver == "exact":
                T = ot.emd(a, b, M)
            else:
                scale = float(M.max()) or 1.0
                T = ot.sinkhorn(a, b, M / scale, reg, method="sinkhorn_log", numItermax=10_000)
            T = torch.as_tensor(np.asarray(T), dtype=torch.float64)
            plan[group.name] = T
            maps[group.name] = (T / torch.as_tensor(b)[None, :]).T   # diag(1 / b) T^T
        aligned.append({k: v.to(state[k].dtype) for k, v in apply_maps(spec, model, maps).items()})
        plans.append(plan)
    return aligned, plans


def _axis(spec: PermutationSpec, key: str, group: str) -> int:
    return next(a.dim for c, a in spec.axes_of(key) if spec.groups[c].name == group)
