"""An option written once: the schema of bnpfed's config dataclasses.

Every field of a config dataclass (:mod:`bnpfed.federated.config`, the experiment harness, the Flower run,
:mod:`bnpfed.experimental`) is declared with :func:`option`: its default, its help text and, where they differ from
what the field's name gives, its command-line flag and metavar, and whether the default ``--help`` of a command
shows it (the rest is behind ``--help-all``). From that one declaration come

* the ``:param`` lines of the class's docstring (:func:`documented`);
* the commands' flags and their help (:mod:`bnpfed.commands`, argparse groups built from the fields);
* the Flower run-config keys (:mod:`bnpfed.flower.config`: a field's name with ``-`` for ``_``), their defaults,
  ``bnpfed flower keys`` and the example app's ``pyproject.toml``.

A value from a command line or a run config is turned into the field's type by :func:`coerce` and then checked once,
by the dataclass's ``__post_init__``; its error ``"<field>: expected ..., got ..."`` is re-worded by each surface
with its own name for the field (the flag, the key). Help texts may name other options as ````name```` or
````name="value"````; :func:`render` writes them as the surface spells them (``--name value`` on a command line).

Usage::

    >>> from dataclasses import dataclass
    >>> @documented
    ... @dataclass(frozen=True)
    ... class Knob:
    ...     '''A knob.'''
    ...     turns: int = option(3, help="how far it turns, >= 0; see ``speed``.")
    ...     speed: float = option(1.0, help="turns a second.", flag="--rate", shown=False)
    >>> print(Knob.__doc__.splitlines()[-2].strip())
    :param int turns: how far it turns, >= 0; see ``speed``. Default ``3``.
    >>> [flag_of(f) for f, _ in options(Knob)], render(option_of(Knob, "turns").help, {"speed": "--rate"})
    (['--turns', '--rate'], 'how far it turns, >= 0; see --rate.')
    >>> coerce("0.3,none", Optional[tuple[Optional[float], ...]], "sigma2")
    (0.3, None)
    >>> parse_assignments("starts=both, stop=fixed-point", "experimental")
    {'starts': 'both', 'stop': 'fixed-point'}
"""

from __future__ import annotations

import dataclasses
import math
import re
import textwrap
import types
import typing
from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable, Mapping, Optional, Sequence, Union

__all__ = [
    "METADATA",
    "Option",
    "coerce",
    "default_of",
    "documented",
    "flag_of",
    "key_of",
    "literal",
    "option",
    "option_of",
    "options",
    "parse_assignments",
    "render",
    "summary",
]

#: The metadata key under which a field keeps its :class:`Option`.
METADATA = "bnpfed.option"


@dataclass(frozen=True)
class Option:
    """What a config field says about itself, beyond its name, type and default.

    :param str help: what the option is, in one or a few sentences (no measurements: those live in the benchmark
        pages): the docstring's ``:param`` line, the flag's help, the Flower key's comment.
    :param str flag: the command-line flag, when ``--`` + the name with ``-`` for ``_`` is not it.
    :param str metavar: the flag's placeholder (default: the choices, or the name in capitals).
    :param choices: the values a string option takes, for the help only (the dataclass checks them): a sequence, or a
        callable that asks a registry (so that a value a plugin registered shows).
    :param bool shown: in a command's default ``--help`` (False: behind ``--help-all``).
    :param bool cli: a command may offer it as a flag (False: set by the command itself, or not from a command line).
    :param key: a Flower run-config key (True), or why not (a sentence; the run config names it when given).
    :param tuple null: the words a command line or run config writes for None.
    :param str default_text: how the help says the default, when its value does not say it (e.g. ``"estimated"``
        for a None that means an estimate).
    """

    help: str
    flag: Optional[str] = None
    metavar: Optional[str] = None
    choices: Union[None, Sequence[str], Callable[[], Sequence[str]]] = None
    shown: bool = True
    cli: bool = True
    key: Union[bool, str] = True
    null: tuple[str, ...] = ("none",)
    default_text: Optional[str] = None

    def choice_list(self) -> Optional[list[str]]:
        """The choices as a list (asking the registry now, when they are a callable), or None."""
        if self.choices is None:
            return None
        return list(self.choices() if callable(self.choices) else self.choices)


def option(default: Any = MISSING, *, help: str, default_factory: Any = MISSING, **kwargs) -> Any:
    """A dataclass field with its :class:`Option` (``help`` and the keywords of :class:`Option`)."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={METADATA: Option(help=help, **kwargs)})


def options(cls) -> list[tuple[dataclasses.Field, Option]]:
    """Every field of the dataclass ``cls`` that has an :class:`Option`, in the class's order."""
    return [(f, f.metadata[METADATA]) for f in fields(cls) if METADATA in f.metadata]


def option_of(cls, name: str) -> Option:
    """The :class:`Option` of field ``name`` of ``cls``."""
    for f, opt in options(cls):
        if f.name == name:
            return opt
    raise ValueError(f"name: expected an option of {cls.__name__} ({[f.name for f, _ in options(cls)]}), got "
                     f"{name!r}")


def default_of(f: dataclasses.Field) -> Any:
    """A field's default (its factory's value when it has one)."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise ValueError(f"{f.name}: expected a field with a default")


def flag_of(f: dataclasses.Field) -> str:
    """The command-line flag of a field: its option's ``flag``, or ``--`` + its name with ``-`` for ``_``."""
    opt = f.metadata.get(METADATA)
    return opt.flag if opt is not None and opt.flag else "--" + f.name.replace("_", "-")


def key_of(name: str) -> str:
    """The Flower run-config key of a field: ``sigma0_2`` -> ``sigma0-2``."""
    return name.replace("_", "-")


# ------------------------------------------------------------------------------------------------ words


def literal(value: Any) -> str:
    """A default as a user writes it in Python: ``"iid"``, ``(100,)``, ``0.01``, ``None``."""
    if isinstance(value, str):
        return f'"{value}"'
    if dataclasses.is_dataclass(value):
        return f"{type(value).__name__}()"
    return repr(value)


_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")
_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.+)$")


def render(text: str, names: Mapping[str, str], assign: str = "{name} {value}") -> str:
    """``text`` for a surface other than Python: reST roles become their target's last name
    (``:class:`~a.b.C``` -> ``C``), ````x```` becomes ``names[x]`` where ``x`` is an option (``--x``, or the key
    ``x``), ````x="v"```` becomes ``assign`` of them (``--x v``), ````"v"```` becomes ``v``, and any other
    literal loses its backticks. Whitespace is folded."""
    def role(match):
        target = match.group(2)
        return target.rsplit(".", 1)[-1] if match.group(1) else target

    def word(match):
        inner = match.group(1)
        if inner in names:
            return names[inner]
        assignment = _ASSIGNMENT.match(inner)
        if assignment and assignment.group(1) in names:
            return assign.format(name=names[assignment.group(1)], value=assignment.group(2).strip('"'))
        if len(inner) >= 2 and inner[0] == inner[-1] == '"':
            return inner[1:-1]
        return inner

    return " ".join(_LITERAL.sub(word, _ROLE.sub(role, text)).split())


_SENTENCE_END = re.compile(r"\.\s+(?=[A-Z`])")


def summary(text: str) -> str:
    """The first sentence of a help text (up to the first full stop outside brackets and literals that a capital
    or a literal follows): what a command's default ``--help`` and an app's run-config comment show; the rest is
    for ``--help-all`` and the docstring."""
    depth, literal = 0, False
    for i, char in enumerate(text):
        if text.startswith("``", i):
            literal = not literal
        elif char in "([" and not literal:
            depth += 1
        elif char in ")]" and not literal:
            depth = max(0, depth - 1)
        elif (char == "." and depth == 0 and not literal and _SENTENCE_END.match(text, i)
              and text[max(0, i - 3):i] not in ("e.g", "i.e")):
            return text[:i + 1]
    return text


def _type_word(annotation) -> str:
    """The ``:param type name:`` type of a field's annotation, where it is one word."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    text = re.sub(r"^Optional\[(.*)\]$", r"\1", text.replace(" ", ""))
    if text in ("int", "float", "str", "bool"):
        return text
    return "tuple" if text.startswith("tuple[") else ""


def documented(cls):
    """Class decorator: append a ``:param type name: help Default ...`` line per option field to ``cls``'s
    docstring, from the fields' :class:`Option` (the help is written once, on the field)."""
    lines = []
    for f, opt in options(cls):
        kind = _type_word(f.type)
        default = opt.default_text if opt.default_text is not None else f"``{literal(default_of(f))}``"
        head = f":param {kind + ' ' if kind else ''}{f.name}: "
        text = " ".join(f"{head}{opt.help} Default {default}.".split())
        lines.append(textwrap.fill(text, 116, initial_indent="    ", subsequent_indent="        ",
                                   break_on_hyphens=False, break_long_words=False))
    doc = (cls.__doc__ or "").rstrip()
    cls.__doc__ = doc + "\n\n" + "\n".join(lines) + "\n"
    return cls


# ------------------------------------------------------------------------------------------------ values


def _describe(hint) -> str:
    return {bool: "true or false", int: "an int", float: "a number", str: "a string"}.get(hint, "a value")


def _scalar(value: Any, hint, name: str) -> Any:
    """``value`` as the scalar type ``hint`` (bool, int, float, str)."""
    ok = True
    if hint is bool:
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        ok = isinstance(value, bool)
    elif hint is int:
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                ok = False
        elif isinstance(value, float) and value.is_integer():
            return int(value)
        ok = ok and isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        if isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError:
                ok = False
        ok = ok and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if ok:
            return float(value)
    elif hint is str:
        ok = isinstance(value, str)
    if not ok:
        raise ValueError(f"{name}: expected {_describe(hint)}, got {value!r}")
    return value


def _items(value: Any) -> list:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _is_null(value: Any, null: Sequence[str]) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in tuple(null) + ("",))


def coerce(value: Any, hint, name: str, null: Sequence[str] = ("none",)) -> Any:
    """``value`` -- a string from a command line, or a run config's scalar, list or string -- as the field type
    ``hint``: a tuple from a list or comma-separated items, a bool from ``"true"`` / ``"false"``, None from one of the
    ``null`` words where the type allows it, a number where a union reads one, else a name; a dataclass with
    ``from_text`` from its text. Raises ``ValueError("<name>: expected ..., got ...")``; the ranges and choices are
    the dataclass's to check."""
    if isinstance(hint, str):
        raise ValueError(f"{name}: expected a resolved type hint, got the string {hint!r}")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and hasattr(hint, "from_text"):
        return value if isinstance(value, hint) else hint.from_text(_scalar(value, str, name))
    if origin is tuple:  # tuple[X, ...]
        items = _items(value)
        if not items:
            raise ValueError(f"{name}: expected one or more comma-separated values, got {value!r}")
        return tuple(coerce(v, args[0], name, null) for v in items)
    if origin in (Union, types.UnionType):
        options_ = [a for a in args if a is not type(None)]
        if len(options_) < len(args) and _is_null(value, null):
            return None
        if any(isinstance(a, type) and a is not str and not typing.get_origin(a) and a not in (int, float, bool)
               for a in options_):  # Union[str, Prior]: a name, from a command line or a run config
            return _scalar(value, str, name)
        tuples = [a for a in options_ if typing.get_origin(a) is tuple]
        scalars = [a for a in options_ if typing.get_origin(a) is not tuple]
        if tuples and (isinstance(value, (list, tuple)) or (isinstance(value, str) and "," in value)):
            return coerce(value, tuples[0], name, null)
        if len(scalars) == 2 and str in scalars:   # Union[int, str]: a number where it reads as one, else a name
            other = next(a for a in scalars if a is not str)
            try:
                return coerce(value, other, name, null)
            except ValueError:
                return _scalar(value, str, name)
        if len(scalars) == 1:
            try:
                return coerce(value, scalars[0], name, null)
            except ValueError:
                if tuples:
                    raise ValueError(f"{name}: expected {_describe(scalars[0])} or comma-separated ones, got "
                                     f"{value!r}") from None
                raise
    return _scalar(value, hint, name)


def parse_assignments(text: str, name: str) -> dict[str, str]:
    """``"key=value,key=value"`` as ``{field: value}`` (a key's ``-`` read as ``_``), the values as written;
    ``""`` is ``{}``. Raises ``ValueError("<name>: ...")`` for text that is not such pairs or names a key twice."""
    if not isinstance(text, str):
        raise ValueError(f"{name}: expected KEY=VALUE pairs separated by commas, got {text!r}")
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part and not text.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) or not value.strip():
            raise ValueError(f"{name}: expected KEY=VALUE pairs separated by commas (e.g. starts=both,stop=fixed-"
                             f"point), got {text!r}")
        if key in out:
            raise ValueError(f"{name}: expected each key once, got {key_of(key)!r} twice in {text!r}")
        out[key] = value.strip()
    return out
