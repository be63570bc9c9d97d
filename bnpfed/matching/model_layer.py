"""Matching one layer under any atom prior and noise law of the model (:func:`~bnpfed.models.beta_bernoulli_layer`'s
``atom_prior=`` and ``noise=``): which path a model takes, the general path's empirical Bayes, and its entry point
(:func:`match_model_layer`, what :func:`~bnpfed.matching.match_layer` calls when the model is not Gaussian).

**Which path.** A Gaussian atom prior (``atom_prior`` None, or a ``Normal`` of one scale on every coordinate) with
Gaussian noise (``noise`` None or :func:`~bnpfed.models.gaussian_noise`) is the fast path: the closed forms of
:mod:`bnpfed.matching.matcher`, unchanged. Any other model takes the general path
(:mod:`bnpfed.matching.model_matcher`), which scores the same objectives from the model's log densities.

**Empirical Bayes on the general path** (:class:`ModelEstimator`). What the model does not fix is estimated from the
neurons alone, alternating with the assignment sweeps as on the fast path: the noise variance ``sigma2`` (None), the
free shape parameters of a :class:`~bnpfed.models.NoiseLaw` (``StudentTNoise(df=None)``), and with the default
Gaussian atom prior its variance ``sigma0_2`` and mean ``mu0``; gamma0 and the concentration by
:func:`~bnpfed.matching.ibp.ibp_estimates`. At an assignment the continuous ones maximise the model's log likelihood
with the atoms integrated out, ``sum_i log int p_0(theta) prod_{S_i} p(v | theta) dtheta`` (Laplace; exact on
Gaussian layers; Nelder-Mead over their logarithms within :data:`SCALE_RANGE` of the neurons' spread and the laws'
bounds); mu0 is then the mean of the atoms' MAP values. (The joint at the atoms' MAP values would be no likelihood
of the noise: an atom of one member fits it exactly, so it would shrink the noise towards 0.) The iteration starts
from the even split of the neurons' robust pooled variance ``T`` (``(1.4826 MAD)^2`` per coordinate, averaged: heavy
tails leave it finite): ``sigma2 = sigma0_2 = T / 2``, mu0 the neurons' median, gamma0 the neurons per client, c 1,
a free shape parameter at its law's start. As on the fast path, what the assignment cannot tell keeps its previous
value (noted): the noise when no atom has two members, sigma0_2 with fewer than two atoms; and sigma0_2 stays above
``SIGMA0_2_FLOOR`` times the noise (:mod:`~bnpfed.matching.empirical_bayes`).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pyro.distributions as dist
import torch
from scipy.optimize import minimize

from bnpfed.matching.driver import STARTS, run_matching
from bnpfed.matching.empirical_bayes import SIGMA0_2_FLOOR
from bnpfed.matching.ibp import CONCENTRATION_RANGE, ibp_estimates
from bnpfed.matching.layer_inputs import CompactRows, result_dtype, validate_clients, validate_labels, \
    validate_mu0, validate_precisions
from bnpfed.matching.model_matcher import ModelMatcher, atom_law
from bnpfed.models import NoiseLaw, gaussian_noise
from bnpfed.validation import check_choice, check_device, check_float, check_int, check_positive

__all__ = ["SCALE_RANGE", "ModelEstimator", "gaussian_model", "match_model_layer"]

#: An estimated variance (sigma2, sigma0_2) stays within this range relative to the neurons' robust pooled variance.
SCALE_RANGE = (1e-8, 1e4)

#: The Nelder-Mead search of the continuous estimates (over their logarithms): its first simplex's size, and it stops
#: once the simplex is below ``EB_XATOL`` (a relative change of 1e-4) and its values within ``EB_FATOL`` nats of each
#: other, or after ``EB_MAXFEV`` evaluations per parameter.
EB_SIMPLEX = 0.1
EB_XATOL = 1e-4
EB_FATOL = 1e-3
EB_MAXFEV = 60

#: Empirical Bayes has converged when a sweep changed no assignment and no estimate moved by more than this
#: (relative), as on the fast path.
EB_RTOL = 1e-6


def gaussian_model(atom_prior, noise, D: int) -> tuple | None:
    """``(mu0, sigma0_2)`` (mu0 a (D,) array, None without an atom prior) when the model is the fast path's (a
    Gaussian atom prior of one scale, or none, and Gaussian noise); None when it needs the general path."""
    if noise is not None and noise is not gaussian_noise:
        return None
    if atom_prior is None:
        return None, None
    law = atom_law(atom_prior, D)
    if type(law) is not dist.Normal:
        return None
    scale = law.scale.detach().double().cpu().numpy()
    if np.ptp(scale) > 0:
        return None
    return law.loc.detach().double().cpu().numpy(), float(scale[0]) ** 2


def _robust_spread(V: np.ndarray, weight: np.ndarray | None) -> tuple[float, np.ndarray]:
    """The neurons' robust pooled variance ``T`` (mean over coordinates of (1.4826 MAD)^2) and their per-coordinate
    medians (where some neuron says something)."""
    D = V.shape[1]
    med, spread = np.zeros(D), np.zeros(D)
    for d in range(D):
        x = V[:, d] if weight is None else V[weight[:, d] > 0, d]
        if x.size:
            med[d] = np.median(x)
            spread[d] = (1.4826 * np.median(np.abs(x - med[d]))) ** 2
    T = float(spread.mean())
    if not T > 0:
        T = float(V.var()) if V.var() > 0 else 1.0
    return T, med


class ModelEstimator:
    """The hyper-parameters of the general path, given or estimated (module docstring), behind the interface
    :func:`~bnpfed.matching.driver.run_matching` drives (``start``, ``update``, ``close``, ``coordinates``,
    ``public``; ``fixed`` when nothing is estimated).

    :param ModelMatcher matcher: the matcher of the neurons.
    :param atom_prior: the given atom prior (batch shape (D,)), or None: Gaussian, ``N(mu0, sigma0_2)``.
    :param mu0: (D,) the default prior's mean, NaN where estimated (None with ``atom_prior``).
    :param float sigma0_2: the default prior's variance (None: estimated).
    :param noise: the noise law (a callable, or a :class:`~bnpfed.models.NoiseLaw` whose free parameters are estimated).
    :param float sigma2: the noise variance (None: estimated).
    :param float gamma0: the IBP's mass (None: estimated).
    :param float concentration: the IBP's concentration (None: estimated).
    """

    def __init__(self, matcher: ModelMatcher, *, atom_prior, mu0, sigma0_2, noise, sigma2, gamma0, concentration):
        self.mt, self.notes = matcher, []
        self.atom_prior, self.noise = atom_prior, noise
        weight = None if matcher.weight is None else matcher.weight.cpu().numpy()
        self.T, median = _robust_spread(matcher.v.cpu().numpy(), weight)
        self.free_shape = list(noise.free) if isinstance(noise, NoiseLaw) else []
        #: the continuous parameters estimated, with their (low, high) bounds
        self.continuous = {}
        if sigma2 is None:
            self.continuous["sigma2"] = (SCALE_RANGE[0] * self.T, SCALE_RANGE[1] * self.T)
        if atom_prior is None and sigma0_2 is None:
            self.continuous["sigma0_2"] = (SCALE_RANGE[0] * self.T, SCALE_RANGE[1] * self.T)
        for name in self.free_shape:
            low, high, _ = noise.bounds[name]
            self.continuous[name] = (low, high)
        self.mu0_free = None if atom_prior is not None else np.isnan(mu0)
        start = dict(gamma0=matcher_neurons(matcher) / matcher.J if gamma0 is None else gamma0,
                     concentration=1.0 if concentration is None else concentration,
                     sigma2=self.T / 2 if sigma2 is None else sigma2)
        if atom_prior is None:
            start["sigma0_2"] = self.T / 2 if sigma0_2 is None else sigma0_2
            start["mu0"] = np.where(self.mu0_free, median, mu0)
        for name in self.free_shape:
            start[name] = noise.bounds[name][2]
        for name, value in (getattr(noise, "parameters", {}) or {}).items():
            if value is not None:
                start[name] = value
        self._first = start
        self.shape_names = list(getattr(noise, "parameters", {}) or {})
        self.names = (["sigma0_2"] if atom_prior is None else []) + ["sigma2"] + self.shape_names + ["gamma0"] + (
            ["concentration"] if concentration is None or concentration != 1.0 else [])
        self.estimated = (("mu0",) if self.mu0_free is not None and self.mu0_free.any() else ()) + tuple(
            n for n in self.names if n in self.continuous) + (("gamma0",) if gamma0 is None else ()) + (
            ("concentration",) if concentration is None else ())
        self.fixed = not self.estimated
        self.given_gamma0, self.given_concentration = gamma0, concentration
        empty = [j for j in range(matcher.J) if matcher.L[j] == 0]
        if empty:
            self.note(f"client(s) {empty} hold no neurons: counted in J, nowhere else")

    def note(self, message: str) -> None:
        if message not in self.notes:
            self.notes.append(message)

    # --- the interface of run_matching ------------------------------------------------------------------------------
    def start(self) -> dict:
        return dict(self._first)

    def restart(self, matcher) -> None:
        return None

    def alternative_start(self) -> None:
        return None

    def _law(self, values: dict):
        if self.atom_prior is not None:
            prior = self.atom_prior
        else:
            loc = torch.as_tensor(values["mu0"], dtype=torch.float64, device=self.mt.device)
            prior = dist.Normal(loc, math.sqrt(values["sigma0_2"]))
        noise = self.noise.with_values(**{n: values[n] for n in self.free_shape}) if self.free_shape else self.noise
        return prior, noise

    def coordinates(self, values: dict) -> dict:
        prior, noise = self._law(values)
        key = tuple((n, values[n]) for n in self.names) + (
            (("mu0", values["mu0"].tobytes()),) if self.atom_prior is None else ())
        return dict(prior=prior, noise=noise, sigma2=values["sigma2"], gamma0=values["gamma0"],
                    concentration=values["concentration"], key=key)

    def public(self, values: dict, dtype) -> dict:
        out = {"mu0": torch.as_tensor(values["mu0"], dtype=dtype)} if self.atom_prior is None else {}
        out.update({n: float(values[n]) for n in self.names})
        return out

    def close(self, new: dict, old: dict, rtol: float = EB_RTOL, *, mu0: str = "max") -> bool:
        """Whether no estimate moved by more than ``rtol`` (relative; mu0 relative to sqrt(sigma0_2), its largest
        change or, with ``mu0="rms"``, the root mean square of its changes)."""
        if mu0 not in ("max", "rms"):
            raise ValueError(f"mu0: expected 'max' or 'rms', got {mu0!r}")
        for name in self.names:
            if abs(new[name] - old[name]) > rtol * abs(old[name]):
                return False
        if self.atom_prior is not None:
            return True
        change = np.abs(new["mu0"] - old["mu0"])
        size = change.max(initial=0.0) if mu0 == "max" else math.sqrt(float(np.mean(change ** 2)))
        return bool(size <= rtol * math.sqrt(new["sigma0_2"]))

    def update(self, labels: list, L: int, current: dict) -> dict:
        """The estimates at the assignment ``labels`` (compact, L atoms): the continuous ones maximise the Laplace
        evidence, then mu0 the mean of the atoms' MAP values, then gamma0 and c by maximum likelihood."""
        if self.fixed:
            return current
        out = dict(current)
        flat = np.concatenate(labels)
        members = np.arange(flat.size)
        counts = np.bincount(flat, minlength=L)
        names = [n for n in self.names if n in self.continuous]
        if counts.max(initial=0) < 2:   # every neuron alone: nothing says how far a neuron strays from its atom
            kept = [n for n in names if n != "sigma0_2"]
            if kept:
                self.note(f"{', '.join(kept)} not estimable (no atom has two members): the previous values were kept")
            names = [n for n in names if n == "sigma0_2"]
        if L < 2 and "sigma0_2" in names:
            self.note("sigma0_2 not estimable (fewer than two atoms): the previous value was kept")
            names.remove("sigma0_2")
        if names:
            logs = np.log([current[n] for n in names])
            bounds = {**self.continuous}
            if "sigma0_2" in bounds:   # the prior stays proper: no narrower than SIGMA0_2_FLOOR times the noise
                sigma2 = current["sigma2"]
                bounds["sigma0_2"] = (max(bounds["sigma0_2"][0], SIGMA0_2_FLOOR * sigma2), bounds["sigma0_2"][1])
            bounds = np.log([bounds[n] for n in names])
            logs = np.clip(logs, bounds[:, 0], bounds[:, 1])
            cache = {}

            def negative(x):
                x = np.clip(x, bounds[:, 0], bounds[:, 1])
                values = {**current, **dict(zip(names, np.exp(x)))}
                prior, noise = self._law(values)
                law = self.mt.law_at(prior, noise, values["sigma2"])
                ev, th = law.evidence(members, flat, L, start=cache.get("theta"))
                cache["theta"] = th
                return -ev

            simplex = logs + np.vstack([np.zeros(len(names)), EB_SIMPLEX * np.eye(len(names))])
            best = minimize(negative, logs, method="Nelder-Mead", options=dict(
                xatol=EB_XATOL, fatol=EB_FATOL, initial_simplex=simplex, maxfev=EB_MAXFEV * len(names)))
            x = np.clip(best.x, bounds[:, 0], bounds[:, 1])
            for n, b, v in zip(names, bounds, x):
                if min(v - b[0], b[1] - v) < 1e-6:
                    self.note(f"{n} stopped at the end of its range ({math.exp(b[0]):.3g}, {math.exp(b[1]):.3g})")
                out[n] = float(math.exp(v))
        if self.mu0_free is not None and self.mu0_free.any():
            prior, noise = self._law(out)
            theta = self.mt.law_at(prior, noise, out["sigma2"]).fit(members, flat, L, marginal=False)[0].cpu().numpy()
            out["mu0"] = np.where(self.mu0_free, theta.mean(axis=0), out["mu0"])
        if "gamma0" in self.estimated or "concentration" in self.estimated:
            out["gamma0"], out["concentration"], at_bound = ibp_estimates(
                np.bincount(flat, minlength=L), self.mt.J, gamma0=self.given_gamma0, c=self.given_concentration)
            if at_bound:
                self.note(f"the concentration stopped at the end of its range {CONCENTRATION_RANGE}")
        return out


def matcher_neurons(matcher: ModelMatcher) -> int:
    return int(matcher.offsets[-1])


def match_model_layer(neurons, *, atom_prior, noise, sigma2, sigma0_2, gamma0, mu0, precisions, concentration,
                      hyperparameters: str, start, sweeps, seed, objective, popularity_factor, popularity_cap,
                      max_atoms, new_atom_penalty, stop_at_fixed_point, cross_products, init_assignments, stop, starts,
                      schedule, device):
    """:func:`~bnpfed.matching.match_layer` on the general path (its parameters; the module docstring says what is
    estimated). Refuses what the general path does not do: ``start``, a second start (``starts``), the Gram matrix
    (``cross_products``), Jacobi sweeps."""
    t0 = time.perf_counter()
    eb = check_choice(hyperparameters, ("empirical-bayes", "fixed"), "hyperparameters") == "empirical-bayes"
    for name, value, default in (("start", start, None), ("cross_products", cross_products, "auto"),
                                 ("schedule", schedule, "gauss-seidel")):
        if value != default:
            raise ValueError(f"{name}: expected {default!r} with a non-Gaussian atom_prior or noise (the general "
                             f"path has no such choice), got {value!r}")
    check_choice(starts, STARTS, "starts")
    if starts != "even-split":
        raise ValueError(f"starts: expected 'even-split' with a non-Gaussian atom_prior or noise (the general path "
                         f"starts from the even split alone), got {starts!r}")
    check_choice(stop, ("result", "fixed-point"), "stop")
    objective = ("marginal" if eb else "map") if objective is None else check_choice(objective, ("map", "marginal"),
                                                                                      "objective")
    if eb and objective == "map":
        raise ValueError("objective: expected 'marginal' with hyperparameters='empirical-bayes', got 'map' (the "
                         "MAP objective is no likelihood of the variances); use hyperparameters='fixed' for it")
    sweeps = (50 if eb else 5) if sweeps is None else check_int(sweeps, "sweeps", low=0)
    if not callable(noise):
        raise ValueError(f"noise: expected a callable noise(loc, variance) -> Distribution, got "
                         f"{type(noise).__name__}")
    V, _ = validate_clients(neurons, None, name="neurons")
    V = [v.dense() if isinstance(v, CompactRows) else v for v in V]
    D = V[0].shape[1]
    s = validate_precisions(precisions, [v.shape[0] for v in V], D)
    popularity_factor = check_float(popularity_factor, "popularity_factor", low=0.0)
    if popularity_cap is not None and (int(popularity_cap) != popularity_cap or popularity_cap < 1):
        raise ValueError(f"popularity_cap: expected None or an integer >= 1, got {popularity_cap!r}")
    if max_atoms is not None and (int(max_atoms) != max_atoms or max_atoms < 1):
        raise ValueError(f"max_atoms: expected None or an integer >= 1, got {max_atoms!r}")
    check_choice(new_atom_penalty, ("none", "log_k"), "new_atom_penalty")
    if device is not None:
        device = torch.device(check_device(str(device) if isinstance(device, torch.device) else device, "device"))
    if atom_prior is not None:
        for name, value in (("mu0", mu0), ("sigma0_2", sigma0_2)):
            if value is not None:
                raise ValueError(f"{name}: expected None with atom_prior (the prior is given whole), got {value!r}")
        atom_prior = atom_law(atom_prior, D)
        mu = None
    else:
        mu = np.full(D, np.nan) if mu0 is None else validate_mu0(mu0, D, estimable=eb)
    given = {n: check_positive(v, n) for n, v in (("sigma2", sigma2), ("sigma0_2", sigma0_2), ("gamma0", gamma0),
                                                   ("concentration", concentration)) if v is not None}
    free_shape = noise.free if isinstance(noise, NoiseLaw) else ()
    if not eb:
        required = ["sigma2", "gamma0", "concentration"] + (["sigma0_2"] if atom_prior is None else [])
        for n in required:
            if n not in given:
                raise ValueError(f"{n}: expected a positive finite number with hyperparameters='fixed' (nothing is "
                                 f"estimated), got None; pass {n}=... or use hyperparameters='empirical-bayes'")
        if free_shape:
            raise ValueError(f"noise: expected every parameter given with hyperparameters='fixed', got "
                             f"{free_shape[0]}=None ({noise!r})")
        if mu is not None:
            mu = np.where(np.isnan(mu), 0.0, mu)
    matcher = ModelMatcher(V, s, marginal=objective == "marginal", popularity_factor=popularity_factor,
                           popularity_cap=popularity_cap, max_atoms=max_atoms, new_atom_penalty=new_atom_penalty,
                           device=device)
    estimator = ModelEstimator(matcher, atom_prior=atom_prior, mu0=mu, sigma0_2=given.get("sigma0_2"), noise=noise,
                               sigma2=given.get("sigma2"), gamma0=given.get("gamma0"),
                               concentration=given.get("concentration"))
    init = None if init_assignments is None else validate_labels(init_assignments, matcher.L, "init_assignments")
    return run_matching(matcher, estimator, init=init, sweeps=sweeps, seed=seed,
                        stop_at_fixed_point=stop_at_fixed_point, cross_products="auto", stop=stop,
                        starts="even-split", schedule="gauss-seidel", dtype=result_dtype(neurons), t0=t0)
