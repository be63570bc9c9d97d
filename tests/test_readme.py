"""The README is a front page: its Python snippets run as written, each on its own (a reader may copy any one of
them), it names the test command CI runs, and it stays one screen of links rather than a second manual."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
TEXT = README.read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, re.S)


def test_the_readme_has_a_python_snippet_for_each_half():
    assert len(BLOCKS) >= 2, "one snippet for PFNM matching, one for posterior fusion"
    assert any("PFNMConfig" in block or "match_" in block for block in BLOCKS), "no PFNM snippet"
    assert any("fuse" in block or "FusionConfig" in block for block in BLOCKS), "no posterior-fusion snippet"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_each_readme_python_snippet_runs_alone(index):
    exec(compile(BLOCKS[index], f"{README} (python snippet {index + 1})", "exec"), {})


def test_the_readme_names_the_test_command_that_ci_runs():
    assert "make test" in (ROOT / ".ci" / "run").read_text(), "CI's entry point no longer runs make test"
    assert "make test" in TEXT, "CI runs make test: the README must name it"


def test_the_readme_is_a_front_page_and_its_history_lives_in_the_changelog():
    lines = TEXT.count("\n")
    assert lines <= 250, f"README.md has {lines} lines; the guides and the docs site hold the rest"
    assert "What changed" not in TEXT, "release notes belong in CHANGELOG.md"
    assert "## 0.1.0" in (ROOT / "CHANGELOG.md").read_text()


def test_the_readme_links_resolve_inside_the_repository_or_to_the_docs_pages():
    docs_pages = {"docs/index.md", "docs/guide/pfnm.md", "docs/guide/fusion.md", "docs/guide/own-models.md",
                  "docs/guide/flower.md", "docs/extending/index.md"}   # written by the docs site's own branch
    missing = []
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", TEXT):
        if re.match(r"https?://", target) or target in docs_pages:
            continue
        if not (ROOT / target).exists():
            missing.append(target)
    assert not missing, f"README.md links to files that do not exist: {missing}"
