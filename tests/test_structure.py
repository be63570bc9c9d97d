"""The house keeps its shape: one folder per extension point, each with one public face (its ``__init__``); no folder
reads behind another's face or imports a private name across folders; the rooms' imports run one way (no circle);
and every path of bnpfed 0.1 still works for one release, warning with its new home."""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

try:
    import flwr  # noqa: F401
    FLOWER = True
except ImportError:   # bnpfed.flower's face needs Flower
    FLOWER = False

PACKAGE = Path(__file__).resolve().parent.parent / "bnpfed"
#: The deprecated paths of 0.1 (aliases of their new modules): not rooms of the house.
DEPRECATED = {"inference", "secure_fusion.py", "_moved.py"}
#: Modules that Flower itself loads by path (``bnpfed.flower.client:app``, ``bnpfed.flower.server:app``): public.
APPS = {"bnpfed.flower.client", "bnpfed.flower.server"}
FOLDERS = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()
                 and p.name not in DEPRECATED)


def modules():
    """(room, module name, file) of every module of the house: a room is a folder or a top-level file."""
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in DEPRECATED or rel == Path("federated/baselines.py"):
            continue
        room = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        name = "bnpfed." + ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        yield room, name, path


def imports(path: Path, top_level_only: bool = False):
    """(module, names, line) of every ``from bnpfed... import`` and ``import bnpfed...`` in a file."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bnpfed") and not node.level:
            yield node.module, [a.name for a in node.names], node.lineno
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("bnpfed"):
                    yield a.name, [], node.lineno


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_folder_is_read_through_its_face_from_other_folders():
    behind = []
    for room, name, path in modules():
        for module, _, line in imports(path):
            target = room_of(module)
            if target in FOLDERS and target != room and module != f"bnpfed.{target}" and module not in APPS:
                behind.append(f"{path.relative_to(PACKAGE)}:{line} imports {module} (use bnpfed.{target})")
    assert not behind, "\n".join(behind)


def test_no_folder_takes_another_folders_module_through_its_face():
    """``from bnpfed.matching import recovery`` reads behind the face as much as ``from bnpfed.matching.recovery``
    does (a name the face exports that shares a file's name, such as ``kl_fusion``, is the face's, and allowed)."""
    behind = []
    for room, name, path in modules():
        for module, names, line in imports(path):
            target = room_of(module)
            if target in FOLDERS and target != room and module == f"bnpfed.{target}":
                face = importlib.import_module(module) if target != "flower" or FLOWER else None
                exported = set(getattr(face, "__all__", ())) if face else set()
                behind += [f"{path.relative_to(PACKAGE)}:{line} imports the module {module}.{n}" for n in names
                           if (PACKAGE / target / f"{n}.py").exists() and n not in exported
                           and f"{module}.{n}" not in APPS]
    assert not behind, "\n".join(behind)


def test_no_private_name_is_imported_across_rooms():
    private = []
    for room, name, path in modules():
        for module, names, line in imports(path):
            if room_of(module) != room:
                private += [f"{path.relative_to(PACKAGE)}:{line} imports {n} from {module}" for n in names
                            if n.startswith("_") and n != "__version__"]
    assert not private, "\n".join(private)


def test_the_rooms_import_one_way():
    """Module-level imports between rooms form no circle (a name imported inside a function, to keep an import light,
    is not a circle Python can trip on, and is allowed)."""
    edges = {}
    for room, name, path in modules():
        for module, _, _ in imports(path, top_level_only=True):
            target = room_of(module)
            if target != room and target != "__init__":
                edges.setdefault(room, set()).add(target)

    def reach(start):
        seen, stack = set(), [start]
        while stack:
            for nxt in edges.get(stack.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return seen

    circles = sorted(room for room in edges if room in reach(room))
    assert not circles, f"rooms in an import circle: {circles} ({ {r: sorted(edges[r]) for r in circles} })"


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_face_lists_names_it_defines(folder):
    if folder == "flower":
        pytest.importorskip("flwr")
    face = importlib.import_module(f"bnpfed.{folder}")
    names = getattr(face, "__all__", None)
    assert names, f"bnpfed.{folder} has no __all__"
    assert len(names) == len(set(names)), f"bnpfed.{folder}.__all__ repeats a name"
    missing = [n for n in names if not hasattr(face, n)]
    assert not missing, f"bnpfed.{folder}.__all__ lists names it does not have: {missing}"


OLD_PATHS = [
    ("bnpfed.inference.svi", "BayesianClient", "bnpfed.clients.variational"),
    ("bnpfed.inference.matching", "match_layer", "bnpfed.matching.layer"),
    ("bnpfed.inference.posterior_matching", "match_posteriors", "bnpfed.matching.posteriors"),
    ("bnpfed.inference.alignment", "weight_matching", "bnpfed.baselines.alignment"),
    ("bnpfed.federated.baselines", "fedavg_network", "bnpfed.baselines.averaging"),
    ("bnpfed.secure_fusion", "fuse_sums", "bnpfed.combine.secure"),
]


@pytest.mark.parametrize("old, name, new", OLD_PATHS)
def test_an_old_module_path_still_works_and_names_its_new_home(old, name, new):
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any(old in m and new in m for m in messages), messages


@pytest.mark.parametrize("name, face", [("match_by_spec", "bnpfed.matching"), ("BayesianClient", "bnpfed.clients"),
                                        ("LaplaceClient", "bnpfed.clients"), ("pooled_network", "bnpfed.matching")])
def test_an_old_name_of_bnpfed_inference_still_works_and_names_its_face(name, face):
    import bnpfed.inference

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(bnpfed.inference, name)
    assert value is getattr(importlib.import_module(face), name)
    assert any(f"{face}.{name}" in str(w.message) for w in caught if issubclass(w.category, DeprecationWarning))
