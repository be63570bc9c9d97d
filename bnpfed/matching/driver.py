"""The driver of the one layer matcher (:mod:`bnpfed.matching.matcher`): the greedy pass or a given start, sweeps
of Hungarian re-matches, and the hyper-parameters re-estimated between them through an *estimator*
(:mod:`bnpfed.matching.empirical_bayes`, or :class:`FixedValues` when nothing is estimated); under empirical Bayes
from the even split, or from two starts with the likelier assignment kept (:func:`run_matching`).
:func:`match_one_layer` is what :func:`~bnpfed.matching.match_layer` and :func:`~bnpfed.matching.match_bayesian_layer`
share."""

from __future__ import annotations

import sys
import time
from typing import Mapping

import numpy as np
import torch

from bnpfed.matching.layer_inputs import result_dtype, validate_labels, validate_mu0
from bnpfed.matching.matcher import (EB_EXPECTED_SWEEPS, STOP_MOVED, STOP_RTOL, LayerMatcher, MatchResult,
                                      make_matcher)
from bnpfed.validation import check_choice, check_int, check_positive

__all__ = ["SCHEDULES", "STARTS", "STOPS", "FixedValues", "PassProgress", "assignment_objective_of", "match_one_layer",
           "run_matching"]

#: Where empirical Bayes starts (``starts=``): the even split (the default), both starts with the likelier kept, or
#: the small-noise start alone.
STARTS = ("even-split", "both", "small-noise")

#: The choices of ``stop=`` (empirical Bayes: when the sweeps stop), the default first.
STOPS = ("result", "fixed-point")

#: The choices of ``schedule=`` (how a sweep re-matches the clients), the default first: one after the other in a
#: random order, each given the moves of those before it (Gauss-Seidel: :meth:`LayerMatcher.sweep`), or all against
#: the assignment at the sweep's start, moved at once (Jacobi: :meth:`LayerMatcher.jacobi_sweep`).
SCHEDULES = ("gauss-seidel", "jacobi")



class FixedValues:
    """The estimator of a matching whose hyper-parameters are all given (nothing is estimated).

    :param dict values: the given values in the order the result reports them: ``"mu0"`` a (D,) array, the noise
        (named ``noise``), ``"sigma0_2"`` and ``"gamma0"`` floats, and the IBP's ``"concentration"`` where it is not
        1.
    :param str noise: the noise variance's name (``"sigma2"``, ``"tau2"``).
    """

    estimated: tuple = ()
    fixed = True

    def __init__(self, values: Mapping[str, object], noise: str):
        self.values, self.noise, self.notes = dict(values), noise, []

    def start(self) -> dict:
        return dict(self.values)

    def restart(self, matcher: LayerMatcher) -> None:
        return None

    def alternative_start(self) -> None:
        return None

    def update(self, labels, L: int, current: dict) -> dict:
        return current

    def close(self, new: dict, old: dict, rtol: float = 0.0, *, mu0: str = "max") -> bool:
        return True

    def coordinates(self, values: dict) -> dict:
        D = values["mu0"].shape[0]
        return dict(noise=np.full(D, values[self.noise]), prior=np.full(D, values["sigma0_2"]),
                    gamma0=values["gamma0"], mu0=values["mu0"], concentration=values.get("concentration", 1.0))

    def public(self, values: dict, dtype) -> dict:
        return {k: torch.as_tensor(v, dtype=dtype) if k == "mu0" else v for k, v in values.items()}


def match_one_layer(means, variances, *, noise: str, given: Mapping[str, object], mu0, precisions,
                    hyperparameters: str, sweeps, seed, objective, init_assignments, estimator, name: str,
                    stop_at_fixed_point: bool = True, cross_products: str = "auto", stop: str = "result",
                    starts: str = "even-split", schedule: str = "gauss-seidel", progress: bool = False,
                    **options) -> MatchResult:
    """What :func:`~bnpfed.matching.match_layer` and :func:`~bnpfed.matching.match_bayesian_layer` share: the
    options checked, the matcher made, the given variances (``given``, named ``noise``, ``"sigma0_2"``,
    ``"gamma0"``, and the IBP's ``"concentration"``: None estimated) checked, and the matching run with
    ``estimator(matcher, given)`` under empirical Bayes, or with every value given (:class:`FixedValues`, mu0 0 by
    default; the concentration reported where it is not 1)."""
    t0 = time.perf_counter()
    eb = check_choice(hyperparameters, ("empirical-bayes", "fixed"), "hyperparameters") == "empirical-bayes"
    check_choice(cross_products, ("auto", "direct", "gram"), "cross_products")
    check_choice(stop, STOPS, "stop")
    check_choice(schedule, SCHEDULES, "schedule")
    objective = ("marginal" if eb else "map") if objective is None else objective
    if eb and objective == "map":
        raise ValueError("objective: expected 'marginal' with hyperparameters='empirical-bayes', got 'map': the MAP "
                         "objective drops the atoms' normalising constants L D log(2 pi sigma0_2), so it is no "
                         "likelihood of the variances to estimate them by (and its over-splitting at the true "
                         "noise would feed back into the estimates); use hyperparameters='fixed' for it")
    sweeps = (50 if eb else 5) if sweeps is None else check_int(sweeps, "sweeps", low=0)
    matcher = make_matcher(means, variances, precisions=precisions, name=name, objective=objective, **options)
    given = {n: check_positive(v, n) for n, v in given.items() if v is not None}
    init = None if init_assignments is None else validate_labels(init_assignments, matcher.L, "init_assignments")
    if eb:
        estimator = estimator(matcher, given)
    else:
        for n in (noise, "sigma0_2", "gamma0", "concentration"):
            if n not in given:
                raise ValueError(f"{n}: expected a positive finite number with hyperparameters='fixed' (nothing is "
                                 f"estimated), got None; pass {n}=... or use hyperparameters='empirical-bayes'")
        values = {"mu0": validate_mu0(0.0 if mu0 is None else mu0, matcher.D), **given}
        if values["concentration"] == 1.0:   # the one-parameter IBP: not reported
            del values["concentration"]
        estimator = FixedValues(values, noise)
    return run_matching(matcher, estimator, init=init, sweeps=sweeps, seed=seed,
                        stop_at_fixed_point=stop_at_fixed_point, cross_products=cross_products, stop=stop,
                        starts=starts, schedule=schedule, dtype=result_dtype(means), t0=t0, progress=progress)


def assignment_objective_of(means, variances, assignments, *, noise: str, values: Mapping[str, object], mu0,
                            precisions, name: str, **options) -> float:
    """The objective at a given assignment and given hyper-parameters (``values``: the noise, named ``noise``,
    ``sigma0_2``, ``gamma0``, and optionally ``concentration``)."""
    matcher = make_matcher(means, variances, precisions=precisions, name=name, **options)
    given = {n: check_positive(values[n], n) for n in (noise, "sigma0_2", "gamma0")}
    given["concentration"] = check_positive(values.get("concentration", 1.0), "concentration")
    estimator = FixedValues({"mu0": validate_mu0(mu0, matcher.D), **given}, noise)
    matcher.set_hyperparameters(**estimator.coordinates(estimator.values))
    matcher.start_from(validate_labels(assignments, matcher.L, "assignments"))
    return matcher.objective()


def run_matching(matcher: LayerMatcher, estimator, *, init, sweeps: int, seed, stop_at_fixed_point: bool = True,
                 cross_products: str = "auto", stop: str = "result", starts: str = "even-split",
                 schedule: str = "gauss-seidel", dtype, t0: float, progress: bool = False) -> MatchResult:
    """The first assignment (greedy pass at the estimator's start, or ``init``), then up to ``sweeps`` sweeps, the
    hyper-parameters re-estimated after the first assignment and after every sweep, until a sweep changes neither.
    ``starts`` (empirical Bayes, the noise from the data): ``"even-split"`` runs from the estimator's alternative
    start, ``"small-noise"`` from its first, ``"both"`` from each and keeps the run of higher ``log p(Z, V)``.

    With fixed values (:class:`FixedValues`) exactly ``sweeps`` sweeps are run (less any skipped at a fixed point
    with ``stop_at_fixed_point``, the objective then repeating its last value) and the Gram matrix is taken after the
    greedy pass when ``sweeps * L > N``; under empirical Bayes, where ``sweeps`` is only a limit, once the sweeps run
    so far have cost as much (``k * L > N`` after sweep k); the second start reuses a Gram matrix the first took (it
    holds the neurons' products at the precision it was taken with, the ratio applied). ``cross_products``:
    ``"auto"``, ``"direct"`` or ``"gram"`` (from the first sweep on). ``stop`` (empirical Bayes): ``"fixed-point"``
    stops when a sweep changed no assignment and no estimate moved by more than ``EB_RTOL``; ``"result"`` also when at
    most :data:`STOP_MOVED` of the neurons moved in a sweep and no estimate moved by more than :data:`STOP_RTOL` (mu0 by
    the root mean square of its changes over the coordinates; the assignment is then as good as settled: the docs'
    benchmark page on scale compares the two rules on trained layers). ``schedule``: :data:`SCHEDULES`. ``progress``:
    a progress bar of the clients re-matched in each pass (tqdm on stderr, its total the J clients)."""
    check_choice(cross_products, ("auto", "direct", "gram"), "cross_products")
    check_choice(starts, STARTS, "starts")
    check_choice(schedule, SCHEDULES, "schedule")
    if not isinstance(progress, bool):
        raise ValueError(f"progress: expected True or False, got {progress!r}")
    with PassProgress(matcher, progress, sweeps) as bar:
        return _run_matching(matcher, estimator, init=init, sweeps=sweeps, seed=seed,
                             stop_at_fixed_point=stop_at_fixed_point, cross_products=cross_products, stop=stop,
                             starts=starts, schedule=schedule, dtype=dtype, t0=t0, bar=bar)


class PassProgress:
    """A progress bar of one matching (tqdm on stderr, or nothing when off): per pass (the greedy pass, each
    sweep) the J clients re-matched, so a wide or many-client layer shows its rate and time left. Used as a context
    around the matching; it hooks the matcher's per-client tick."""

    def __init__(self, matcher: LayerMatcher, on: bool, sweeps: int):
        self.matcher, self.on, self.sweeps, self.bar = matcher, on, sweeps, None

    def __enter__(self) -> "PassProgress":
        if self.on:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.matcher.J, desc="matching: greedy pass", unit="client", leave=False,
                            file=sys.stderr)
            self.matcher.tick = self.bar.update
        return self

    def phase(self, what: str) -> None:
        """A new pass: the bar back to 0 of J, described ``what``."""
        if self.bar is not None:
            self.bar.reset(total=self.matcher.J)
            self.bar.set_description_str(f"matching: {what}")

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
            self.matcher.tick = None


def _run_matching(matcher: LayerMatcher, estimator, *, init, sweeps: int, seed, stop_at_fixed_point: bool,
                  cross_products: str, stop: str, starts: str, schedule: str, dtype, t0: float,
                  bar: PassProgress) -> MatchResult:
    fixed = getattr(estimator, "fixed", False)
    options = dict(sweeps=sweeps, seed=seed, stop_at_fixed_point=stop_at_fixed_point, cross_products=cross_products,
                   stop=stop, schedule=schedule, dtype=dtype, t0=t0, bar=bar)
    alternative = None if fixed else estimator.alternative_start()
    if init is None and starts == "even-split" and alternative is not None:
        return _alternate(matcher, estimator, alternative, init=None, restart=False, **options)
    if init is not None or starts != "both" or alternative is None:
        return _alternate(matcher, estimator, estimator.start(), init=init, restart=True, **options)
    first = _alternate(matcher, estimator, estimator.start(), init=None, restart=True, **options)
    if first.restarted:   # the small-noise start was already redone from the even split
        return first
    matcher.unassign()   # the Gram matrix, if the first run took it, is kept: it holds the neurons alone
    second = _alternate(matcher, estimator, alternative, init=None, restart=False, **options)
    runs = [("small-noise", first), ("even-split", second)]
    name, best = max(runs, key=lambda r: r[1].log_likelihood)
    best.starts = [dict(start=n, log_likelihood=r.log_likelihood, atoms=int(r.counts.numel()), sweeps=r.sweeps_run,
                        converged=r.converged) for n, r in runs]
    best.notes = list(dict.fromkeys(first.notes + second.notes)) + [
        "both starts run, the " + name + " one kept (higher log p(Z, V): " + ", ".join(
            f"{n} {r.log_likelihood:.1f} at {int(r.counts.numel())} atoms" for n, r in runs) + ")"]
    best.seconds = time.perf_counter() - t0
    best.lsa_seconds = matcher.lsa_seconds   # both runs' (as ``rematches`` lists both runs')
    return best


def _alternate(matcher: LayerMatcher, estimator, current: dict, *, init, restart: bool, sweeps: int, seed,
               stop_at_fixed_point: bool, cross_products: str, stop: str, schedule: str, dtype,
               t0: float, bar: PassProgress) -> MatchResult:
    """One run of :func:`run_matching` from the estimator's values ``current`` (``restart``: redo it from the
    estimator's fallback start when the first pass left every neuron alone)."""
    fixed = getattr(estimator, "fixed", False)
    notes_before = len(estimator.notes)
    restarted = False
    matcher.set_hyperparameters(**estimator.coordinates(current))
    if init is None:
        bar.phase("greedy pass")
        matcher.greedy()
        fallback = estimator.restart(matcher) if restart else None
        if fallback is not None:  # the estimator's fallback start (every neuron alone at its first start)
            current, restarted = fallback, True
            matcher.unassign()
            matcher.set_hyperparameters(**estimator.coordinates(current))
            bar.phase("greedy pass, again from the fallback start")
            matcher.greedy()
    else:
        matcher.start_from(init)
    objective = [matcher.objective()]
    current = estimator.update(*matcher.labels(), current)
    history = [estimator.public(current, dtype)]
    N = int(matcher.offsets[-1])
    # the Gram matrix costs about what N / L sweeps of direct products do: taken when the sweeps expected cost more
    expected = sweeps if fixed else min(sweeps, EB_EXPECTED_SWEEPS)
    if cross_products == "gram" or (cross_products == "auto" and matcher.gram_fits() and expected > 0
                                    and expected * matcher.labels()[1] > N):
        matcher.use_gram()
    rng = np.random.default_rng(seed)
    converged, run, moved = False, 0, []
    for k in range(1, sweeps + 1):
        matcher.set_hyperparameters(**estimator.coordinates(current))
        bar.phase(f"sweep {k} (of at most {sweeps})")
        changed = matcher.sweep(rng) if schedule == "gauss-seidel" else matcher.jacobi_sweep()
        run = k
        moved.append(matcher.moved)
        objective.append(matcher.objective())
        new = estimator.update(*matcher.labels(), current)
        history.append(estimator.public(new, dtype))
        converged = not changed and estimator.close(new, current)
        if not fixed and stop == "result" and not converged and matcher.moved <= STOP_MOVED * N and \
                estimator.close(new, current, rtol=STOP_RTOL, mu0="rms"):
            converged = True
            estimator.note(f"stopped on the result at sweep {k}: {matcher.moved} of {N} neurons moved in the last "
                           f"sweep (at most {STOP_MOVED:g}), no estimate by more than {STOP_RTOL:g} (relative; mu0 by "
                           "the root mean square of its changes)")
        current = new
        if converged and stop_at_fixed_point:
            break
        if cross_products == "auto" and not fixed and matcher.gram is None and matcher.gram_fits() and \
                k * matcher.labels()[1] > N:
            matcher.use_gram()
    if fixed:
        # a fixed point of every re-match: any further sweep, in any order, does the same
        objective.extend([objective[-1]] * (sweeps + 1 - len(objective)))
        history = [dict(history[-1]) for _ in objective]
        converged = converged or schedule == "gauss-seidel"   # Jacobi moves can undo each other: no fixed point
    elif not sweeps:
        estimator.note("not converged: no sweep was run (sweeps=0); the estimates are those of the first assignment")
    elif not converged:
        estimator.note(f"not converged: the assignment or the estimates still changed at sweep {sweeps}, the limit "
                       "(raise sweeps)")
    matcher.set_hyperparameters(**estimator.coordinates(current))  # the atoms' posterior at the final values
    notes = list(estimator.notes)
    del estimator.notes[notes_before:]   # a second run notes its own
    return matcher.result(objective, time.perf_counter() - t0, dtype, hyperparameters=history[-1],
                          hyperparameter_history=history, converged=converged, estimated=tuple(estimator.estimated),
                          notes=notes, sweeps_run=run, moved=moved, log_likelihood=matcher.log_likelihood(),
                          restarted=restarted)
