"""The probes, one frozen dataclass, and how a config reads its own of them.

Usage::

    >>> options = ExperimentalOptions.from_text("starts=both,later-rounds=rematch")
    >>> options.spec(), options.set_fields()
    ('starts=both,later-rounds=rematch', ('starts', 'later_rounds'))
    >>> options.only(("starts", "stop")).spec()
    'starts=both'
    >>> ExperimentalOptions.from_text("starts=all")
    Traceback (most recent call last):
    ...
    ValueError: experimental: starts: expected one of ['even-split', 'both', 'small-noise'], got 'all'
    >>> keyed("experimental: later_rounds: expected 'auto' with align='none'")
    "experimental: later-rounds: expected 'auto' with align='none'"
"""

from __future__ import annotations

import functools
import typing
import warnings
from dataclasses import dataclass, fields, replace
from typing import Optional, Sequence

from bnpfed.matching import SCHEDULES, STARTS, STOPS
from bnpfed.schema import coerce, documented, key_of, option, parse_assignments
from bnpfed.validation import check_choice, check_fraction

__all__ = ["ExperimentalOptions", "INACTIVE", "LATER_ROUNDS", "PVI_DAMPING", "ROUND_PRIORS", "keyed",
           "reads_experimental"]

#: What PFNM does with the units a client reports inactive: left out when inactive on every example it holds (its
#: training split and, where it holds one out, its held-out split), left out when inactive on its training split
#: alone (bnpfed before issue 53), or matched like any other.
INACTIVE = ("drop", "drop-train", "keep")
#: Matched fusion's rounds after the first: each client from its slice and the units matched again, or every client
#: from the whole global posterior with the assignment fixed.
LATER_ROUNDS = ("rematch", "fixed")
#: What a variational client's prior is in the rounds after the first: the configured prior, or the global posterior
#: (its slice under matched fusion) as its prior too.
ROUND_PRIORS = ("prior", "posterior")
#: PVI's damping when ``pvi_damping`` is None: None, the harmonic schedule (a client's k-th factor update moves 1/k
#: of the way, so a round-1 error is 1/R of itself after R rounds; 0.1 before issue 53 left 0.9^(R-1)).
PVI_DAMPING = None


@documented
@dataclass(frozen=True)
class ExperimentalOptions:
    """Probes measured worse than the defaults, passed to a config explicitly:
    ``PFNMConfig(experimental=ExperimentalOptions(...))`` reads ``starts``, ``stop``, ``schedule``, ``inactive``;
    ``FusionConfig`` reads ``starts``, ``stop``, ``later_rounds``, ``pvi_damping``; ``BayesianConfig`` reads
    ``round_prior``. A config refuses a probe it does not read. On a command line they are one flag,
    ``--experimental KEY=VALUE,...`` (``bnpfed pfnm --help-all``), on Flower one key, ``experimental``; the keys are
    the fields' names with ``-`` for ``_``.
    """

    starts: str = option("even-split", choices=STARTS, help=(
        'under empirical Bayes, where each layer\'s estimation starts: ``"even-split"``, ``"both"`` (the small-noise '
        'start as well, the assignment of higher marginal likelihood kept per layer, at about twice the time) or '
        '``"small-noise"`` (that start only: bnpfed before 2026-12). PFNM and matched fusion.'))
    stop: str = option("result", choices=STOPS, help=(
        'under empirical Bayes, when a layer\'s sweeps stop: ``"result"`` (once a sweep moved at most 2 % of the '
        'units and no estimate by more than 1 %) or ``"fixed-point"`` (when nothing changes: the exact rule, more '
        'sweeps for the same matching). PFNM and matched fusion.'))
    schedule: str = option("gauss-seidel", choices=SCHEDULES, help=(
        'how a sweep re-matches the clients: ``"gauss-seidel"`` (one after the other, each given the moves of those '
        'before it) or ``"jacobi"`` (all against the assignment at the sweep\'s start, moved at once; on trained '
        'layers it does not settle). PFNM.'))
    inactive: str = option("drop", choices=INACTIVE, help=(
        'the units a client reports inactive (exactly 0 wherever they enter the next layer): ``"drop"`` (left out '
        'before matching when inactive on every example the client holds: its training split and, where it holds '
        'one out -- ``select="federated"`` or ``"operating-point"`` -- its held-out split too; the client\'s '
        'network computes the same without them on all of it), ``"drop-train"`` (left out when inactive on the '
        'training split alone: bnpfed before issue 53) or ``"keep"`` (matched like any other: bnpfed before '
        '2026-12). PFNM.'))
    later_rounds: str = option("auto", choices=("auto",) + LATER_ROUNDS, help=(
        'matched fusion\'s rounds after the first: ``"fixed"`` (every client starts from the whole global '
        'posterior, fused global unit by global unit with the assignment it was sent), ``"rematch"`` (each client '
        'from its slice, the units matched again, warm-started: PFNM\'s rounds) or ``"auto"`` (``"rematch"`` for '
        'rule ``"pvi"``, whose factors live in each client\'s own units; ``"fixed"`` otherwise).'))
    pvi_damping: Optional[float] = option(None, metavar="RHO", default_text="None (the harmonic schedule)", help=(
        'rule ``"pvi"``: rho in (0, 1]; each client\'s factor moves rho of the way to its new value from the second '
        'round on (a round-1 error is (1 - rho)^(R-1) of itself after R rounds; 1: undamped); None: its k-th update '
        'moves 1/k of the way (1/R left after R rounds, the steps shrinking; bnpfed before issue 53: 0.1).'))
    round_prior: Optional[str] = option(None, choices=ROUND_PRIORS, default_text='None (``"prior"``)', help=(
        'a variational client\'s prior in the rounds after the first, where it starts from the global posterior or '
        'its slice: ``"prior"`` (the configured prior; each round fuses posteriors that hold each client\'s data '
        'once) or ``"posterior"`` (the global posterior, or its slice, as its prior too, which counts the client\'s '
        'data once more every round). Not with rule ``"pvi"``, whose clients train against their cavities.'))

    def __post_init__(self):
        check_choice(self.starts, STARTS, "starts")
        check_choice(self.stop, STOPS, "stop")
        check_choice(self.schedule, SCHEDULES, "schedule")
        check_choice(self.inactive, INACTIVE, "inactive")
        check_choice(self.later_rounds, ("auto",) + LATER_ROUNDS, "later_rounds")
        if self.pvi_damping is not None:
            check_fraction(self.pvi_damping, "pvi_damping")
        if self.round_prior is not None:
            check_choice(self.round_prior, ROUND_PRIORS, "round_prior")

    def set_fields(self) -> tuple[str, ...]:
        """The probes set to something other than their default, in field order."""
        default = ExperimentalOptions()
        return tuple(f.name for f in fields(self) if getattr(self, f.name) != getattr(default, f.name))

    def only(self, names: Sequence[str]) -> "ExperimentalOptions":
        """These options with every probe not in ``names`` back at its default (what one config of a command reads)."""
        default = ExperimentalOptions()
        return replace(self, **{f.name: getattr(default, f.name) for f in fields(self) if f.name not in names})

    def spec(self) -> str:
        """The text form, ``"key=value,..."`` of the probes set (keys with ``-``), ``""`` when none is."""
        return ",".join(f"{key_of(name)}={getattr(self, name)}" for name in self.set_fields())

    @classmethod
    def from_text(cls, text: str) -> "ExperimentalOptions":
        """The options of ``"key=value,..."`` (:meth:`spec`'s form; ``""``: none). Raises
        ``ValueError("experimental: ...")``, naming the key and what it expected."""
        try:
            values = parse_assignments(text, "experimental")
            hints = typing.get_type_hints(cls)
            names = [f.name for f in fields(cls)]
            for name in values:
                if name not in names:
                    raise ValueError(f"{key_of(name)}: expected one of the experimental options "
                                     f"{[key_of(n) for n in names]}")
            return cls(**{name: coerce(value, hints[name], name) for name, value in values.items()})
        except ValueError as error:
            message = str(error)
            raise ValueError(message if message.startswith("experimental:") else f"experimental: {message}") from None

    def check_read_by(self, reads: Sequence[str], owner: str) -> None:
        """Raise unless every probe set is one of ``reads``, those ``owner`` reads (nothing is ignored silently)."""
        stray = [name for name in self.set_fields() if name not in reads]
        if stray:
            raise ValueError(f"experimental: {owner} reads {', '.join(reads) or 'no probe'}; expected no other, got "
                             f"{', '.join(f'{n}={getattr(self, n)!r}' for n in stray)}")


def keyed(message: str) -> str:
    """A config's error about a probe, ``"experimental: later_rounds: ..."``, with the probe named as a command line
    and a run config write it (``later-rounds``, the key of ``--experimental`` and of the Flower key)."""
    head, sep, rest = message.partition(": ")
    if head not in ("experimental", "--experimental") or not sep:
        return message
    name, sep, tail = rest.partition(":")
    if sep and name in {f.name for f in fields(ExperimentalOptions)}:
        return f"{head}: {key_of(name)}:{tail}"
    return message


def reads_experimental(*names: str):
    """Class decorator of a frozen config dataclass with a field ``experimental`` (an :class:`ExperimentalOptions`):
    the probes ``names`` become read-only attributes of the config (``config.starts`` is
    ``config.experimental.starts``), ``cls.EXPERIMENTAL`` lists them, and the keywords of the bnpfed 0.1 fields of
    those names keep working for one release, moved into ``experimental`` with a ``DeprecationWarning`` naming the
    new form. The config's ``__post_init__`` calls ``self.experimental.check_read_by(cls.EXPERIMENTAL, ...)``."""
    known = {f.name for f in fields(ExperimentalOptions)}
    for name in names:
        if name not in known:
            raise ValueError(f"names: expected fields of ExperimentalOptions ({sorted(known)}), got {name!r}")

    def decorate(cls):
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            moved = {name: kwargs.pop(name) for name in names if name in kwargs}
            if moved:
                given = ", ".join(f"{n}={v!r}" for n, v in moved.items())
                warnings.warn(f"{cls.__name__}({given}): moved to bnpfed.experimental in bnpfed 0.2, write "
                              f"{cls.__name__}(experimental=ExperimentalOptions({given})); the old keywords go in 0.3",
                              DeprecationWarning, stacklevel=2)
                base = kwargs.get("experimental", ExperimentalOptions())
                kwargs["experimental"] = replace(base, **moved) if isinstance(base, ExperimentalOptions) else base
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        for name in names:
            setattr(cls, name, property(lambda self, n=name: getattr(self.experimental, n),
                                        doc=f"``experimental.{name}`` (:class:`~bnpfed.experimental."
                                            f"ExperimentalOptions`)."))
        cls.EXPERIMENTAL = tuple(names)
        return cls

    return decorate
