"""Measurements live in the docs' benchmark pages, not in the library: the library's docstrings and comments may
point at the dated benchmark record only a few times, and the pages they name in words exist."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "bnpfed"
CITATION = "benchmarks/README.md"
MOST_CITATIONS = 5
PAGES = {"one-shot matching": "one-shot.md", "communication and size": "communication.md",
         "calibration": "calibration.md", "scale": "scale.md", "posterior fusion": "fusion.md"}


def citations() -> dict[str, int]:
    counts = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        n = path.read_text().count(CITATION)
        if n:
            counts[str(path.relative_to(ROOT))] = n
    return counts


def test_the_library_cites_the_benchmark_record_at_most_five_times():
    counts = citations()
    assert sum(counts.values()) <= MOST_CITATIONS, (
        f"{sum(counts.values())} citations of {CITATION} in bnpfed/ (at most {MOST_CITATIONS}): {counts}; "
        "a docstring carries the math and the usage, and names the docs' benchmark page in words")


def test_the_count_sees_a_citation_where_one_is_written(tmp_path, monkeypatch):
    package = tmp_path / "bnpfed"
    (package / "sub").mkdir(parents=True)
    (package / "sub" / "a.py").write_text(f'"""Measured: {CITATION}, and again {CITATION}."""\n')
    (package / "b.py").write_text("# nothing cited here\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert citations() == {"bnpfed/sub/a.py": 2}


def test_every_benchmark_page_a_docstring_names_exists():
    named = []
    for path in PACKAGE.rglob("*.py"):
        text = " ".join(path.read_text().split())
        named += [(str(path.relative_to(ROOT)), rest) for rest in re.findall(r"benchmark page on (.{40})", text)]
    assert named, "no docstring names a benchmark page: the pattern above no longer finds them"
    unknown = [(path, rest) for path, rest in named if not any(rest.startswith(name) for name in PAGES)]
    assert not unknown, f"docstrings name benchmark pages that do not exist: {unknown}; known: {sorted(PAGES)}"
    for page in PAGES.values():
        assert (ROOT / "docs" / "benchmarks" / page).is_file(), page
