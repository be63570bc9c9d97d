"""The docs site's Python snippets run as written, each on its own (a reader may copy any one of them): every
```python block of docs/**/*.md. The extending pages' examples assert what they claim."""

import re
from pathlib import Path

import pytest

from bnpfed.combine import rules
from bnpfed.federated import generic, registry
from bnpfed.models import named

DOCS = Path(__file__).parent.parent / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
SNIPPETS = [(page, index, code) for page in sorted(DOCS.rglob("*.md"))
            for index, code in enumerate(BLOCK.findall(page.read_text()))]


def test_the_docs_have_python_snippets_on_every_guide_and_extending_page():
    pages = {page.relative_to(DOCS).as_posix() for page, _, _ in SNIPPETS}
    expected = {"index.md", "guide/pfnm.md", "guide/fusion.md", "guide/own-models.md", "extending/rule.md",
                "extending/prior.md", "extending/likelihood.md", "extending/model.md"}
    assert expected <= pages, f"no python snippet on {sorted(expected - pages)}"


@pytest.fixture
def scratch_registries(monkeypatch):
    """Copies of the registries (rules, methods, federated methods, named priors and likelihoods): a snippet that registers its own rule or method (the extending
    pages do) leaves the others' registries as they were."""
    monkeypatch.setattr(rules, "_RULES", dict(rules._RULES))
    monkeypatch.setattr(rules, "_PER_COORDINATE", set(rules._PER_COORDINATE))
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    monkeypatch.setattr(generic, "_FEDERATED", dict(generic._FEDERATED))
    monkeypatch.setattr(named, "_PRIORS", dict(named._PRIORS))
    monkeypatch.setattr(named, "_LIKELIHOODS", dict(named._LIKELIHOODS))


@pytest.mark.parametrize("page, index, code", SNIPPETS,
                         ids=[f"{page.relative_to(DOCS).as_posix()}-{index + 1}" for page, index, _ in SNIPPETS])
def test_each_docs_python_snippet_runs_alone(page, index, code, scratch_registries):
    exec(compile(code, f"{page} (python snippet {index + 1})", "exec"), {"__name__": "docs_snippet"})
