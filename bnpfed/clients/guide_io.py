"""Reading and writing a guide's posterior as ``{site: GaussianPosterior(loc, variance)}``, for any guide whose latent
sites are mean-field Normals in the unconstrained space.

A Pyro autoguide draws each latent site ``s`` of support ``S`` as ``z_s = T_S(u_s)``, ``u_s ~ N(loc_s, scale_s^2)``
elementwise, with ``T_S = biject_to(S)`` (the identity on the real line, ``exp`` onto the positive numbers); the
client's posterior of the site is ``(loc_s, scale_s^2)``, the Normal of ``u_s``, in that unconstrained space (a
per-layer scale ``tau`` is reported, and fused, as ``log tau``). Three forms of it are read:

* a site drawn from a ``Normal`` (real support), or from ``TransformedDistribution(Normal, biject_to(S))``
  (:class:`~bnpfed.clients.MeanFieldGuide`);
* a site drawn as a ``Delta`` at ``T_S(u_s)`` with ``u_s`` drawn at the auxiliary site ``s + "_unconstrained"``
  (Pyro's ``AutoNormal``);
* every site unpacked from one auxiliary vector drawn from an ``Independent(Normal)`` (Pyro's
  ``AutoDiagonalNormal``: the sites in the order the guide samples them, each its unconstrained size).

A guide with ``posterior()`` and ``load_posterior(...)`` methods (:class:`~bnpfed.clients.MeanFieldGuide`) is asked
directly. Any other is read from its trace, and written through the parameters whose values its Normals' ``loc`` and
``scale`` are (``pyro.param`` statements or a ``PyroModule``'s parameters, constrained or not: the inverse of the
constraint's transform is written into the unconstrained parameter, in place, so an optimiser holding it keeps
working). A guide that cannot be read so (a full-covariance Normal, a flow, a point mass) is refused by name, before
any training: its posterior is not mean-field Gaussian, and no fusion rule of :mod:`bnpfed.combine` reads it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
from pyro import poutine
from pyro.distributions import Delta
from pyro.infer.autoguide import AutoContinuous, AutoDiagonalNormal, AutoGuide, AutoNormal
from torch import Tensor, nn
from torch.distributions import Independent, Normal, TransformedDistribution, biject_to, constraints, transform_to
from torch.distributions.transforms import ComposeTransform

from bnpfed.clients.guides import _real
from bnpfed.posterior import GaussianPosterior
from bnpfed.seeding import seeded
from bnpfed.validation import check_names

__all__ = ["GuideIO", "check_guide_kind", "guide_io"]

#: The autoguides whose posterior is mean-field Gaussian in the unconstrained space (and their subclasses).
MEAN_FIELD_AUTOGUIDES = (AutoNormal, AutoDiagonalNormal)


def check_guide_kind(guide: Any, argument: str = "guide") -> None:
    """Refuse, by name, a Pyro autoguide whose posterior is not mean-field Gaussian (``AutoMultivariateNormal``,
    ``AutoLowRankMultivariateNormal``, a normalising flow such as ``AutoIAFNormal``, ``AutoDelta``, ...): only
    ``AutoNormal`` and ``AutoDiagonalNormal`` (or subclasses) are. Other guides are read when they first run."""
    if isinstance(guide, AutoGuide) and not isinstance(guide, MEAN_FIELD_AUTOGUIDES):
        raise ValueError(f"{argument}: expected a guide whose latent sites are mean-field Normals in the "
                         f"unconstrained space (MeanFieldGuide, AutoNormal, AutoDiagonalNormal), got "
                         f"{type(guide).__name__}, whose posterior is not: a client's posterior is read, fused and "
                         "written back as (loc, variance) per weight")


class GuideIO:
    """How a client reads and writes its guide's posterior.

    Attributes: ``sites`` (the latent sites, in the guide's order).
    """

    sites: tuple[str, ...] = ()

    def posterior(self) -> dict[str, GaussianPosterior]:
        """``{site: GaussianPosterior(loc, variance)}`` in the unconstrained space, copies."""
        raise NotImplementedError

    def load_posterior(self, posterior: Mapping[str, Any]) -> None:
        """Make the guide ``N(loc, variance)`` at every site (exactly the guide's sites), in place."""
        raise NotImplementedError

    def scale_parameters(self) -> list[Tensor]:
        """The parameters that hold the guide's scales (learning at their own rate under ``scale_lr``)."""
        raise NotImplementedError


class _Protocol(GuideIO):
    """A guide with ``posterior()`` and ``load_posterior(...)``: asked directly."""

    def __init__(self, guide):
        self.guide = guide
        self.sites = tuple(guide.posterior())

    def posterior(self):
        return self.guide.posterior()

    def load_posterior(self, posterior):
        self.guide.load_posterior(posterior)

    def scale_parameters(self):
        rhos = getattr(self.guide, "rhos", None)
        return list(rhos) if isinstance(rhos, nn.ParameterList) else []


class _Target:
    """Where a tensor of the guide's Normals comes from: the unconstrained parameter ``raw`` whose value under the
    constraint's transform it is, possibly a slice ``[start, start + size)`` of it (a flat vector of sites)."""

    def __init__(self, raw: Tensor, constraint):
        self.raw, self.constraint = raw, constraint

    def value(self) -> Tensor:
        return transform_to(self.constraint)(self.raw)

    def write(self, value: Tensor) -> None:
        self.raw.copy_(transform_to(self.constraint).inv(value.to(self.raw)))


class _Traced(GuideIO):
    """A guide read from its trace: see the module docstring.

    :param guide: the guide (module or function).
    :param callable run: runs the guide once with the model's arguments (``run()``), under the model's context.
    :param dict supports: ``{site: support}`` of the model's latent sites.
    """

    def __init__(self, guide, run: Callable[[], Any], supports: Mapping[str, Any]):
        self.guide, self._run, self.supports = guide, run, dict(supports)
        self._name = type(guide).__name__ if isinstance(guide, nn.Module) else getattr(guide, "__name__", "guide")
        trace = self._trace()
        self.sites = tuple(s for s in (n for n, node in trace.nodes.items() if node["type"] == "sample")
                           if s in self.supports)
        missing = [s for s in self.supports if s not in self.sites]
        if missing:
            raise ValueError(f"guide: expected a guide of every latent site of the model, got {self._name}, which "
                             f"draws no {missing}")
        self._locate(trace)

    def _trace(self):
        with torch.no_grad(), seeded(0):
            return poutine.trace(self._run).get_trace()

    # ---------------------------------------------------------------- reading

    def _normals(self, trace) -> dict[str, tuple[Tensor, Tensor, Optional[tuple[str, int, int]]]]:
        """``{site: (loc, scale, flat)}``: the tensors of the site's unconstrained Normal; ``flat`` is ``(aux site,
        start, size)`` when they are a slice of one auxiliary vector (then ``loc``, ``scale`` are the vector's)."""
        if isinstance(self.guide, AutoContinuous):
            return self._flat_normals(trace)
        normals = {}
        for site in self.sites:
            node, support = trace.nodes[site], self.supports[site]
            fn, aux = node["fn"], trace.nodes.get(site + "_unconstrained")
            if isinstance(_base(fn), Delta) and aux is not None and _normal(aux["fn"]) is not None:
                normal = _normal(aux["fn"])                         # AutoNormal
            elif _normal(fn) is not None:
                if not _real(support):
                    raise ValueError(f"guide: {self._name} draws site {site!r} from a Normal, but the site's support "
                                     f"is {support}: expected a Normal in the unconstrained space, mapped onto the "
                                     f"support by biject_to (TransformedDistribution, or AutoNormal)")
                normal = _normal(fn)
            elif isinstance(_base(fn), TransformedDistribution) and _normal(_base(fn).base_dist) is not None:
                transform = ComposeTransform(_base(fn).transforms) if len(_base(fn).transforms) != 1 \
                    else _base(fn).transforms[0]
                if transform != biject_to(support):
                    raise ValueError(f"guide: {self._name} maps site {site!r}'s Normal through {transform}, expected "
                                     f"biject_to of its support {support} (the unconstrained space)")
                normal = _normal(_base(fn).base_dist)
            else:
                raise ValueError(f"guide: expected a guide whose latent sites are mean-field Normals in the "
                                 f"unconstrained space (MeanFieldGuide, AutoNormal, AutoDiagonalNormal), got "
                                 f"{self._name}, which draws site {site!r} from {_describe(fn)}")
            normals[site] = (*normal, None)
        return normals

    def _flat_normals(self, trace):
        aux = [name for name, node in trace.nodes.items()
               if node["type"] == "sample" and node["infer"].get("is_auxiliary") and name not in self.sites]
        fn = trace.nodes[aux[0]]["fn"] if len(aux) == 1 else None
        normal = None if fn is None or _base(fn) is fn else _normal(fn)
        if normal is None:
            raise ValueError(f"guide: expected a guide whose latent sites are mean-field Normals in the unconstrained "
                             f"space (MeanFieldGuide, AutoNormal, AutoDiagonalNormal), got {self._name}, whose "
                             f"latent vector is drawn from {_describe(fn)}")
        normals, start = {}, 0
        for site in self.sites:
            size = biject_to(self.supports[site]).inv(trace.nodes[site]["value"]).numel()
            normals[site] = (*normal, (aux[0], start, size))
            start += size
        if start != normal[0].shape[-1]:
            raise ValueError(f"guide: {self._name}'s latent vector has {normal[0].shape[-1]} entries, expected the "
                             f"{start} of the model's latent sites")
        return normals

    def _locate(self, trace) -> None:
        """Find the parameters behind every site's loc and scale (:class:`_Target`); sites whose tensors are no
        parameter's value make the guide read-only (said by :meth:`load_posterior`)."""
        candidates = []
        for node in trace.nodes.values():
            if node["type"] == "param":
                value = node["value"]
                raw = getattr(value, "unconstrained", None)
                raw = raw() if callable(raw) else (value if isinstance(value, nn.Parameter) else None)
                if raw is not None:
                    candidates.append((value, _Target(raw, node["kwargs"].get("constraint", constraints.real))))
        if isinstance(self.guide, nn.Module):
            candidates += [(p, _Target(p, constraints.real)) for p in self.guide.parameters()]
        normals = self._normals(trace)
        self._shapes, self._targets, self._unwritable = {}, {}, None
        for site, (loc, scale, flat) in normals.items():
            found = [_find(candidates, loc), _find(candidates, scale)]
            if flat is None:
                self._shapes[site] = loc.shape
            else:
                shape = biject_to(self.supports[site]).inv(trace.nodes[site]["value"]).shape
                self._shapes[site] = shape
            if None in found and self._unwritable is None:
                which = "loc" if found[0] is None else "scale"
                self._unwritable = (f"guide: {self._name}'s {which} of site {site!r} is no parameter of the guide "
                                    f"(one entry per weight), so a client cannot write a posterior into it")
            self._targets[site] = (*found, None if flat is None else flat[1:])

    def posterior(self):
        normals = self._normals(self._trace())
        posterior = {}
        for site, (loc, scale, flat) in normals.items():
            if flat is not None:
                start, size = flat[1], flat[2]
                loc, scale = loc[..., start:start + size], scale[..., start:start + size]
            shape = self._shapes[site]
            loc, scale = loc.detach().reshape(shape).clone(), scale.detach().reshape(shape)
            posterior[site] = GaussianPosterior(loc, scale * scale)
        return posterior

    @torch.no_grad()
    def load_posterior(self, posterior):
        if self._unwritable is not None:
            raise ValueError(self._unwritable)
        check_names(posterior, self._shapes, "posterior", "site")
        checked = {s: GaussianPosterior.of(posterior[s], f"posterior[{s!r}]", shape)
                   for s, shape in self._shapes.items()}
        new = {}
        for site, (loc_target, scale_target, flat) in self._targets.items():
            loc, variance = checked[site]
            for target, value in ((loc_target, loc), (scale_target, variance.sqrt())):
                if flat is None:
                    new[id(target.raw)] = (target, value.reshape(target.raw.shape))
                else:
                    whole = new.get(id(target.raw), (target, target.value().detach().clone()))[1]
                    whole[..., flat[0]:flat[0] + flat[1]] = value.reshape(-1)
                    new[id(target.raw)] = (target, whole)
        for target, value in new.values():
            target.write(value)

    def scale_parameters(self):
        return list({id(t[1].raw): t[1].raw for t in self._targets.values() if t[1] is not None}.values())


def guide_io(guide, run: Callable[[], Any], supports: Mapping[str, Any]) -> GuideIO:
    """The reader and writer of ``guide``'s posterior: the guide's own ``posterior`` / ``load_posterior`` when it has
    them, else its trace (``run()`` runs it once with the model's arguments; ``supports`` are the model's latent
    sites and their supports).

    :raises ValueError: ``"guide: ..."`` naming the guide and the site, for a guide that cannot be read as mean-field
        Gaussian in the unconstrained space, or that misses a latent site of the model.
    """
    check_guide_kind(guide)
    if callable(getattr(guide, "posterior", None)) and callable(getattr(guide, "load_posterior", None)) \
            and not isinstance(guide, AutoGuide):
        return _Protocol(guide)
    return _Traced(guide, run, supports)


def _base(fn):
    while isinstance(fn, Independent):
        fn = fn.base_dist
    return fn


def _normal(fn) -> Optional[tuple[Tensor, Tensor]]:
    fn = _base(fn)
    return (fn.loc, fn.scale) if isinstance(fn, Normal) else None


def _find(candidates, tensor: Tensor) -> Optional[_Target]:
    """The target whose value ``tensor`` is (the same memory and shape: a distribution's broadcast view of it)."""
    for value, target in candidates:
        if value.data_ptr() == tensor.data_ptr() and value.shape == tensor.shape and value.stride() == tensor.stride():
            return target
    return None


def _describe(fn) -> str:
    if fn is None:
        return "nothing"
    base = _base(fn)
    return type(base).__name__ if base is fn else f"{type(fn).__name__}({type(base).__name__})"
