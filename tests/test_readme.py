"""The README's Python snippets run as written."""

import re
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def test_readme_python_snippets_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks
    namespace: dict = {}
    for block in blocks:  # later snippets use names from earlier ones, as a reader would
        exec(compile(block, str(README), "exec"), namespace)
