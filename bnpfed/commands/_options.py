"""The commands' config flags, generated from the config dataclasses' schema (:mod:`bnpfed.schema`): one argparse
group per config, a flag per field with the field's help, read back into the config, which checks every value once
(its error names the field; :func:`~bnpfed.commands._args.flag_message` names the flag). Also ``--help-all`` (the
flags the default ``--help`` leaves out) and ``--experimental`` (the probes of :mod:`bnpfed.experimental`).

The flags take text as the Flower run config does (:func:`bnpfed.schema.coerce`): ``--hidden 200,100``,
``--sigma2 0.3,auto``, ``--max-params none``; a switch is ``--x`` / ``--no-x``.

Usage::

    >>> from bnpfed.federated import PartitionConfig
    >>> parser = argparse.ArgumentParser(prog="demo")
    >>> group = add_config_options(parser, PartitionConfig, PartitionConfig(), title="clients and partition")
    >>> args = parser.parse_args(["--partition", "dirichlet", "--alpha", "0.1"])
    >>> config_from_args(PartitionConfig, args, PartitionConfig())
    PartitionConfig(clients=10, partition='dirichlet', alpha=0.1, min_size=10)
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import textwrap
import typing
from dataclasses import replace
from typing import Any, Mapping, Optional, Sequence

from bnpfed.commands._args import UsageError, briefly, help_width, hidden, paragraphs
from bnpfed.experimental import ExperimentalOptions
from bnpfed.federated import (BayesianConfig, ExperimentConfig, FusionConfig, NetworkConfig, PartitionConfig,
                              PFNMConfig, TrainingConfig)
from bnpfed.schema import coerce, default_of, flag_of, option_of, options, render, summary

__all__ = ["add_config_options", "add_experimental_option", "config_from_args", "experimental_from_args", "flags",
           "given", "network_config", "shown_default", "training_config"]

#: The configs whose fields are flags somewhere (their names, as ``--name``, in every help text).
CONFIGS = (PartitionConfig, NetworkConfig, TrainingConfig, BayesianConfig, PFNMConfig, FusionConfig, ExperimentConfig)


@functools.lru_cache(maxsize=1)
def flags() -> dict[str, str]:
    """Every config field's flag by field name (what ````name```` in a help text becomes)."""
    out = {}
    for cls in CONFIGS + (ExperimentalOptions,):
        for f, _ in options(cls):
            out.setdefault(f.name, flag_of(f))
    return out


def help_text(text: str) -> str:
    """A schema help text as a flag's help: reST rendered for the command line (without its closing period),
    ``%`` escaped for argparse."""
    text = render(text, flags())
    if text.endswith(".") and not text.endswith("..."):
        text = text[:-1]
    return text.replace("%", "%%")


def shown_default(value: Any) -> str:
    """A default as a user types it: ``100,50`` for a tuple, ``none`` for None."""
    if value is None:
        return "none"
    if isinstance(value, (tuple, list)):
        return ",".join(shown_default(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# ------------------------------------------------------------------------------------------------ config flags


def _is_bool(hint) -> bool:
    return hint is bool


def add_config_options(parser, cls, base, *, title: Optional[str] = None, description: Optional[str] = None,
                       group=None, exclude: Sequence[str] = (), only: Optional[Sequence[str]] = None,
                       show: Sequence[str] = (), hide: Sequence[str] = (),
                       helps: Optional[Mapping[str, str]] = None,
                       defaults: Optional[Mapping[str, Optional[str]]] = None,
                       metavars: Optional[Mapping[str, str]] = None):
    """A flag per option field of ``cls`` (all of them, in the class's order, but ``exclude`` and those the schema
    keeps off the command line; or ``only`` these, in this order), in ``group`` or a new group ``title``.
    ``base``: the command's defaults (an instance of ``cls``), shown in the help; ``show`` / ``hide``: fields shown
    in (left out of) the default ``--help`` against the schema's ``shown``; ``helps``: a command's own help of a
    field; ``defaults``: how the help says a field's default (None: not said); ``metavars``: a command's own
    placeholder of a field. The default ``--help`` shows the first sentence of a help (``--help-all`` all of it).
    Returns the group; :func:`config_from_args` reads the flags back."""
    if group is None:
        group = parser.add_argument_group(title, description)
    hints = typing.get_type_hints(cls)
    helps, said = dict(helps or {}), dict(defaults or {})
    names = []
    found = {f.name: (f, opt) for f, opt in options(cls)}
    for name in only or ():
        if name not in found:
            raise ValueError(f"only: expected options of {cls.__name__}, got {name!r}")
    for f, opt in ([found[name] for name in only] if only is not None else options(cls)):
        if not opt.cli or f.name in exclude:
            continue
        text = helps.get(f.name, opt.help)
        if f.name in said:
            default = said[f.name]
        elif opt.default_text is not None:
            default = opt.default_text
        else:
            default = f"``{shown_default(getattr(base, f.name))}``" if getattr(base, f.name) is not None else None
        if _is_bool(hints[f.name]):
            flag = flag_of(f)
            value = getattr(base, f.name)
            default = f"``{flag if value else '--no-' + flag[2:]}``" if f.name not in said else default
            action = group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
        else:
            choices = opt.choice_list()
            metavar = (dict(metavars or {}).get(f.name) or opt.metavar
                       or ("{" + ",".join(choices) + "}" if choices else f.name.upper()))
            action = group.add_argument(flag_of(f), dest=f.name, default=None, metavar=metavar)
        if default:
            default = re.sub(r"^None \((.*)\)$", r"\1", default)   # what None means, on a command line
        said_default = f" (default: {help_text(default)})" if default else ""
        action.help = help_text(text) + said_default
        if (f.name in hide) or (not opt.shown and f.name not in show):
            hidden(action)
        elif summary(text) != text:
            briefly(action, help_text(summary(text)) + said_default)
        names.append(f.name)
    parser.set_defaults(**{_recorded(cls): tuple(names)})
    return group


def _recorded(cls) -> str:
    return f"_flags_of_{cls.__name__}"


def given(cls, args) -> dict[str, Any]:
    """The flags of ``cls``'s fields that were given, as the fields' values (coerced, not yet checked; ``args`` then
    holds them so, as a command's JSON record of its flags shows them)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for name in getattr(args, _recorded(cls), ()):
        raw = getattr(args, name, None)
        if raw is not None:
            out[name] = coerce(raw, hints[name], name, option_of(cls, name).null)
            setattr(args, name, out[name])
    return out


def config_from_args(cls, args, base, **fixed):
    """``base`` with the flags of ``cls`` that were given and ``fixed`` (values a command sets itself), checked by
    the config (a ``ValueError`` naming the field)."""
    return replace(base, **{**given(cls, args), **fixed})


def network_config(args, defaults: NetworkConfig, **fixed) -> NetworkConfig:
    """The command's :class:`NetworkConfig` from its flags over ``defaults``; ``--hidden`` only with ``--arch mlp``,
    whose widths it is."""
    arch = args.arch if args.arch is not None else fixed.get("arch", defaults.arch)
    if args.hidden is not None and arch != "mlp":
        raise UsageError(f"--hidden: expected only with --arch mlp (the widths of {arch} are fixed), got --arch "
                         f"{arch}")
    return config_from_args(NetworkConfig, args, defaults, **fixed)


def training_config(args, defaults: TrainingConfig) -> TrainingConfig:
    """The command's :class:`TrainingConfig` from its flags over ``defaults``; ``--amsgrad`` not given is
    ``defaults.amsgrad`` with Adam and off with SGD (AMSGrad is a variant of Adam: a default of the command's Adam
    schedule does not refuse ``--optimizer sgd``; ``--amsgrad`` given with it does)."""
    optimizer = args.optimizer if args.optimizer is not None else defaults.optimizer
    amsgrad = args.amsgrad if args.amsgrad is not None else defaults.amsgrad_for(optimizer)
    return config_from_args(TrainingConfig, args, defaults, amsgrad=amsgrad)


# ------------------------------------------------------------------------------------------------ --experimental


def add_experimental_option(parser, reads: Sequence[str], *, old: Sequence[str] = ()) -> None:
    """``--experimental KEY=VALUE,...``: the probes ``reads`` of :class:`~bnpfed.experimental.ExperimentalOptions`
    (listed under ``--help-all`` only), and the bnpfed 0.1 flags ``old`` of some of them, which keep working for one
    release (:func:`experimental_from_args` prints a notice naming the new form)."""
    lines = [paragraphs("probes measured worse than the defaults, kept to re-run those measurements: --experimental "
                        "KEY=VALUE,... with the keys")]
    for name in reads:
        f, opt = next((f, opt) for f, opt in options(ExperimentalOptions) if f.name == name)
        default = (re.sub(r"^None \((.*)\)$", r"\1", render(opt.default_text, {})) if opt.default_text is not None
                   else shown_default(default_of(f)))
        lines.append(textwrap.fill(f"{name.replace('_', '-')}: {render(opt.help, {})} (default: {default})",
                                   help_width(), initial_indent="  ", subsequent_indent="      ",
                                   break_on_hyphens=False))
    group = parser.add_argument_group("experimental (bnpfed.experimental)", "\n".join(lines))
    group.full_description, group.description = group.description, None
    hidden(group.add_argument("--experimental", metavar="KEY=VALUE,...",
                              help="the probes to set (their keys above), e.g. starts=both"))
    for name in old:
        group.add_argument("--" + name.replace("_", "-"), dest=f"_old_{name}", default=None, help=argparse.SUPPRESS)
    parser.set_defaults(_experimental_reads=tuple(reads), _experimental_old=tuple(old))


def experimental_from_args(args, prog: str) -> ExperimentalOptions:
    """``--experimental`` read (a ``ValueError("experimental: ...")`` when it does not), with the bnpfed 0.1 flags
    given moved into it: each prints a one-line notice on stderr naming the new form."""
    options_ = ExperimentalOptions.from_text(args.experimental or "")
    old = {name: getattr(args, f"_old_{name}") for name in args._experimental_old
           if getattr(args, f"_old_{name}", None) is not None}
    if old:
        hints = typing.get_type_hints(ExperimentalOptions)
        values = {name: coerce(value, hints[name], name) for name, value in old.items()}
        options_ = replace(options_, **values)
        typed = " ".join(f"--{n.replace('_', '-')} {v}" for n, v in old.items())
        print(f"{prog}: note: {typed} moved to bnpfed.experimental; write --experimental "
              f"{options_.only(tuple(old)).spec()} (the old flags go in bnpfed 0.3)", file=sys.stderr)
    return options_
