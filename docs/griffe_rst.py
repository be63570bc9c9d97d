"""A Griffe extension: bnpfed's reStructuredText docstrings read as the Markdown that mkdocstrings renders.

The docstrings are written for Sphinx (``:param type name:`` fields, which Griffe's ``sphinx`` parser reads, and
roles such as ``:class:`~bnpfed.matching.SpecMatch```, which it leaves alone). Once the whole package is loaded,
every docstring is rewritten, outside code, as follows:

* a role ``:func:`name``` (``func``, ``class``, ``meth``, ``mod``, ``attr``, ``data``, ``obj``, ``exc``) becomes
  an optional cross-reference of mkdocs-autorefs, titled by the name in code (``~a.b.C`` is titled ``C``). The name
  is resolved as Sphinx's Python domain does: absolute, else from the docstring's object outwards (its class, its
  module, the modules above). A name found in bnpfed links to the object's page under its public face; a name that
  no page documents (a private module, a name of torch) is shown as code, without a link and without a warning;
* a literal block (a paragraph ending in ``::`` and the indented block after it) becomes a fenced code block
  (``pycon`` when it holds ``>>>`` lines, else ``python`` when it parses as Python, else ``text``), and a doctest
  block outside one becomes a ``pycon`` block;
* a face that imports its names lazily (``bnpfed.flower``) gets them as members, from its ``__all__`` at run time;
* a docstring with numpydoc's sections (``Parameters`` over a line of dashes) is parsed as numpydoc;
* characters that Markdown would take for markup in plain reST prose are escaped: ``<`` before a letter (which
  Markdown would read as an HTML tag and drop: ``match-<rule>``), a ``>`` opening a line (a block quote),
  ``][`` (a reference link that autorefs would try to resolve: ``x[j][k]``) and ``*`` between two words (a
  product, ``H*W``, not emphasis); code spans keep their text.

Loaded by mkdocstrings-python (``extensions: [docs/griffe_rst.py]`` in ``mkdocs.yml``).
"""

from __future__ import annotations

import ast
import html
import importlib
import re
from typing import Any

import griffe

ROLES = ("func", "class", "meth", "mod", "attr", "data", "obj", "exc", "const")
ROLE = re.compile(r":(?:py:)?(" + "|".join(ROLES) + r"):`([^`]+)`")
CODE_SPAN = re.compile(r"(``.+?``|`[^`]+`)")
LINK = re.compile(r"`([^`<]+?)\s*<(https?://[^>]+)>`__?")
PLACEHOLDER = "\x00{}\x00"
NUMPY_SECTION = re.compile(r"^\s*(?:Parameters|Returns|Raises|Examples)\n\s*-{3,}\s*$", re.M)


class RstToMarkdown(griffe.Extension):
    """Rewrite every docstring of a loaded package from reST to Markdown (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        self.collection = loader.modules_collection
        for face_name in FACES:
            add_lazy_exports(pkg, face_name)
        self.public = public_paths(pkg)
        records = []
        for obj in walk(pkg):
            if obj.is_class and is_record(obj):
                records.append(obj)
            if obj.docstring is not None:
                obj.docstring.value = hoist_trailing_prose(self.convert(obj.docstring.value, obj))
                if NUMPY_SECTION.search(obj.docstring.value):
                    obj.docstring.parser = griffe.Parser.numpy  # a few docstrings have numpydoc's sections
                    # their "name : type" lines show the type as code already: reST's ``...`` inside it would show
                    obj.docstring.value = re.sub(r"^(\w+ : .*)$", lambda m: m.group(1).replace("``", ""),
                                                 obj.docstring.value, flags=re.M)
        for cls in records:
            describe_fields(cls)
            show_option_defaults(cls, self.convert)

    # ------------------------------------------------------------------ blocks

    def convert(self, text: str, obj: griffe.Object) -> str:
        lines = text.split("\n")
        out: list[str] = []
        i = 0
        while i < len(lines):
            line = lines[i]
            stripped = line.rstrip()
            if stripped.endswith("::") and not stripped.lstrip().startswith(":"):
                block, end = indented_block(lines, i + 1, indent_of(line))
                if block:
                    intro = stripped[:-2].rstrip()
                    if intro.strip():
                        out.append(self.prose(intro + (":" if not stripped[:-2].endswith(" ") else ""), obj))
                    out.extend(fence(block, indent_of(line)))
                    i = end
                    continue
            if stripped.lstrip().startswith(">>>"):
                end = i
                while end < len(lines) and lines[end].strip():
                    end += 1
                block = [x[indent_of(line):] for x in lines[i:end]]
                # an example indented under prose (not a list item's continuation) is fenced at the prose's indent:
                # Markdown would read a fence indented four spaces deeper as literal text of an indented code block
                before = next((x for x in reversed(out) if x.strip()), "")
                pad = indent_of(line) if indent_of(before) >= indent_of(line) else indent_of(before)
                out.extend(fence(block, pad, language="pycon"))
                i = end
                continue
            out.append(self.prose(line, obj))
            i += 1
        return "\n".join(out)

    # ------------------------------------------------------------------ inline

    def prose(self, line: str, obj: griffe.Object) -> str:
        """One line of prose: roles resolved, reST links made Markdown ones, Markdown's markup characters escaped."""
        kept: list[str] = []

        def keep(value: str) -> str:
            kept.append(value)
            return PLACEHOLDER.format(len(kept) - 1)

        line = ROLE.sub(lambda m: keep(self.role(m.group(1), m.group(2), obj)), line)
        line = LINK.sub(lambda m: keep(f"[{m.group(1)}]({m.group(2)})"), line)
        line = CODE_SPAN.sub(lambda m: keep(m.group(1)), line)
        line = re.sub(r"<(?=[A-Za-z/!?])", "&lt;", line)
        line = re.sub(r"^(\s*)>", r"\1\\>", line)
        line = line.replace("][", "]\\[")
        line = re.sub(r"(?<=[\w)])\*(?=[\w(])", r"\\*", line)   # a product, 400*120, not emphasis
        return re.sub("\x00(\\d+)\x00", lambda m: kept[int(m.group(1))], line)

    def role(self, kind: str, target: str, obj: griffe.Object) -> str:
        title, explicit = target, re.fullmatch(r"(.+?)\s*<(.+)>", target)
        if explicit:
            title, target = explicit.group(1), explicit.group(2)
        target = target.strip().removesuffix("()")
        if target.startswith("~"):
            target = target[1:]
            title = target.rsplit(".", 1)[-1]
        elif not explicit:
            title = target.lstrip(".")
        if kind in ("func", "meth") and not title.endswith(")"):
            title += "()"
        code = f"<code>{html.escape(title)}</code>"
        found = self.resolve(target.lstrip("."), obj)
        if found is None:
            return code
        return f'<autoref identifier="{found}" optional>{code}</autoref>'

    def resolve(self, name: str, obj: griffe.Object) -> str | None:
        """The identifier under which the object ``name`` (seen from ``obj``'s docstring) is documented, or None."""
        scopes = [] if name.startswith("bnpfed.") else [s for s in lineage(obj)]
        for path in [*(f"{scope.path}.{name}" for scope in scopes), name]:
            try:
                target = self.collection.get_member(path)
                canonical = target.canonical_path
            except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
                continue
            return self.public_path(canonical)
        return None

    def public_path(self, canonical: str) -> str:
        """A canonical path as a public face shows it (``bnpfed.matching.network.SpecMatch.fit`` ->
        ``bnpfed.matching.SpecMatch.fit``), or unchanged if no face exports it or an object above it."""
        head, tail = canonical, ""
        while head:
            if head in self.public:
                return self.public[head] + tail
            head, _, last = head.rpartition(".")
            tail = f".{last}{tail}"
        return canonical


def add_lazy_exports(pkg: griffe.Module, face_name: str) -> None:
    """A face that imports its names on first use (a module ``__getattr__``, as ``bnpfed.flower`` does, so that a
    SuperNode's process loads Flower alone) has no members Griffe can see: its ``__all__`` is read by importing it,
    and each name becomes an alias of the object where it is defined, so that the face's page lists it."""
    face = pkg.get_member(face_name.removeprefix("bnpfed."))
    if face.exports or "__getattr__" not in face.members:
        return
    module = importlib.import_module(face_name)
    for name in module.__all__:
        obj = getattr(module, name)
        face.set_member(name, griffe.Alias(name, f"{obj.__module__}.{obj.__qualname__}", parent=face))
    face.exports = list(module.__all__)


def public_paths(pkg: griffe.Module) -> dict[str, str]:
    """Canonical path -> the path under the first face (in the order of ``FACES``) whose ``__all__`` lists it."""
    found: dict[str, str] = {}
    for face_name in FACES:
        try:
            face = pkg.get_member(face_name.removeprefix("bnpfed."))
        except KeyError:
            continue
        for name in face.exports or ():
            name = name if isinstance(name, str) else getattr(name, "name", str(name))
            try:
                canonical = face.get_member(name).canonical_path
            except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
                continue
            found.setdefault(canonical, f"{face.path}.{name}")
        found.setdefault(face.path, face.path)
    return found


# the faces that have a reference page; a name two faces export is linked to the first (the clients' priors to
# bnpfed.models, where they live)
FACES = ("bnpfed.models", "bnpfed.clients", "bnpfed.matching", "bnpfed.combine", "bnpfed.baselines",
         "bnpfed.federated", "bnpfed.flower", "bnpfed.data", "bnpfed.metrics", "bnpfed.saved")


FIELD_LINE = re.compile(r":(?:param|parameter|arg|argument|key|keyword|type|returns?|rtype|raises?|except|exception"
                        r"|var|ivar|cvar|yields?)\b")


def hoist_trailing_prose(text: str) -> str:
    """Prose that follows the ``:param`` fields (an "Attributes: ..." paragraph) moved above them: Griffe's Sphinx
    parser would append it to the last field's description."""
    lines = text.split("\n")
    first = next((i for i, line in enumerate(lines) if FIELD_LINE.match(line)), None)
    if first is None:
        return text
    fields, prose, i, fence = [], [], first, False
    while i < len(lines):
        line = lines[i]
        starts_prose = line.strip() and not line[0].isspace() and not FIELD_LINE.match(line)
        if starts_prose or (prose and (fence or not FIELD_LINE.match(line))):
            if line.lstrip().startswith("```"):
                fence = not fence
            prose.append(line)
        else:
            fields.append(line)
        i += 1
    if not prose:
        return text
    return "\n".join([*lines[:first], *prose, "", *fields]).rstrip() + "\n"


def is_record(cls: griffe.Class) -> bool:
    """A dataclass or a NamedTuple: a class whose fields are its constructor's parameters."""
    return (any("dataclass" in str(d.value) for d in cls.decorators)
            or any("NamedTuple" in str(base) for base in cls.bases))


def describe_fields(cls: griffe.Class) -> None:
    """A record's ``:param`` lines moved onto its fields: each field undocumented so far gets its parameter's
    description as its docstring, and the line leaves the class docstring. Else every field would be listed twice,
    once described under Parameters and once as a bare attribute (and a NamedTuple's parameters, which Griffe does
    not see in a signature, would be warned about)."""
    if cls.docstring is None:
        return
    lines, kept, i = cls.docstring.value.split("\n"), [], 0
    while i < len(lines):
        field = re.match(r"(\s*):param (?:[^:]*\s)?(\w+):(.*)$", lines[i])
        end = i + 1
        if field:
            while end < len(lines) and lines[end].strip() and indent_of(lines[end]) > len(field.group(1)):
                end += 1
        member = cls.members.get(field.group(2)) if field else None
        if member is not None and not member.is_alias and member.is_attribute and member.docstring is None:
            text = " ".join([field.group(3).strip(), *(x.strip() for x in lines[i + 1:end])])
            member.docstring = griffe.Docstring(text, parent=member, parser=cls.docstring.parser,
                                                parser_options=cls.docstring.parser_options)
        else:
            kept.extend(lines[i:end])
        i = end
    cls.docstring.value = "\n".join(kept)


def show_option_defaults(cls: griffe.Class, convert) -> None:
    """A field declared ``name: T = option(default, help=...)`` (:mod:`bnpfed.schema`) shows ``default`` as its value
    and in the class's signature, not the whole declaration, and its ``help`` as its description (the ``:param``
    lines :func:`bnpfed.schema.documented` writes exist only at run time; ``convert`` turns the help's reST into
    Markdown)."""
    for member in cls.members.values():
        value = getattr(member, "value", None) if not member.is_alias else None
        if (isinstance(value, griffe.ExprCall) and str(value.function) == "option" and value.arguments
                and not isinstance(value.arguments[0], griffe.ExprKeyword)):
            member.value = value.arguments[0]
            helps = [a.value for a in value.arguments if isinstance(a, griffe.ExprKeyword) and a.name == "help"]
            if helps and member.docstring is None:
                try:
                    text = ast.literal_eval(str(helps[0]))
                except (ValueError, SyntaxError):
                    continue
                member.docstring = griffe.Docstring(convert(text[:1].upper() + text[1:], member), parent=member)
    init = cls.members.get("__init__")
    parameters = list(init.parameters) if init is not None and not init.is_alias else list(cls.parameters or ())
    for parameter in parameters:
        default = parameter.default
        if (isinstance(default, griffe.ExprCall) and str(default.function) == "option" and default.arguments
                and not isinstance(default.arguments[0], griffe.ExprKeyword)):
            parameter.default = default.arguments[0]


def walk(obj: griffe.Object):
    """Every object defined in the package (no aliases: an alias shares its target's docstring)."""
    yield obj
    for member in list(obj.members.values()):
        if not member.is_alias:
            yield from walk(member)


def lineage(obj: griffe.Object):
    """The scopes a relative name is looked up in: the object (if it holds members), then its parents outwards."""
    scope = obj if (obj.is_class or obj.is_module) else obj.parent
    while scope is not None:
        yield scope
        scope = scope.parent


def indent_of(line: str) -> int:
    return len(line) - len(line.lstrip())


def indented_block(lines: list[str], start: int, indent: int) -> tuple[list[str], int]:
    """The block indented deeper than ``indent`` from line ``start`` on (blank lines before it skipped), dedented;
    and the index of the first line after it."""
    i = start
    while i < len(lines) and not lines[i].strip():
        i += 1
    if i == len(lines) or indent_of(lines[i]) <= indent:
        return [], start
    end = i
    while end < len(lines) and (not lines[end].strip() or indent_of(lines[end]) > indent):
        end += 1
    while end > i and not lines[end - 1].strip():
        end -= 1
    body = lines[i:end]
    cut = min(indent_of(x) for x in body if x.strip())
    return [x[cut:] for x in body], end


def fence(block: list[str], indent: int, language: str | None = None) -> list[str]:
    if language is None:
        code = "\n".join(block)
        if any(x.lstrip().startswith(">>>") for x in block):
            language = "pycon"
        else:
            try:
                ast.parse(code)
                language = "python"
            except SyntaxError:
                language = "text"
    pad = " " * indent
    return ["", f"{pad}```{language}", *(pad + x if x else "" for x in block), f"{pad}```", ""]
