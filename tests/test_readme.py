"""The README's Python snippets run as written, each on its own (a reader may copy any one of them)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_python_snippets():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_each_readme_python_snippet_runs_alone(index):
    exec(compile(BLOCKS[index], f"{README} (python snippet {index + 1})", "exec"), {})


def test_the_comment_after_available_methods_names_every_method_it_prints():
    from bnpfed.combine import available_rules
    from bnpfed.federated.methods import available_methods

    line = re.search(r"print\(available_methods\(\)\)\s*#(.*?)\n(\s*#.*?\n)?(\s*#.*?\n)?", README.read_text())
    assert line, "the README prints available_methods() with a comment"
    comment = " ".join(g for g in line.groups() if g)
    named = set()
    for word in re.findall(r"[\w-]+(?:\([\w-]+\))?", comment):  # "pfnm(-rounds)" names pfnm and pfnm-rounds
        base, _, suffix = word.partition("(")
        named |= {base} | ({base + suffix.rstrip(")")} if suffix else set())
    if "match-<rule>" in comment:
        named |= {"match-" + rule for rule in available_rules()}
    if "match-<rule>(-pooled)" in comment:   # the matched rows with the clients' output layers pooled too
        named |= {"match-" + rule + "-pooled" for rule in available_rules()}
    # a method with options is named by its spec (match:rule=...) or by the rows of bnpfed 0.1's names: matched
    # fusion's match-<rule>, weight-wise fusion's rules by name
    named |= {word.split(":")[0] for word in re.findall(r"[\w-]+:[\w=:<>-]+", comment)}
    if "match-<rule>" in comment:
        named.add("match")
    if set(available_rules()) <= named:
        named.add("fusion")
    missing = [m for m in available_methods() if m not in named]
    assert not missing, f"the comment leaves out {missing}"
