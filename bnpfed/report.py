"""Plain-text tables and JSON output for the command line (no math here)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence


def _cell(value: Any, digits: int) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 10 ** -digits):
            return f"{value:.{digits}g}"
        return f"{value:.{digits}f}"
    if isinstance(value, (list, tuple)):
        return "-".join(str(v) for v in value)
    return str(value)


def format_table(rows: Sequence[dict], columns: Sequence[str] | None = None, *, digits: int = 4) -> str:
    """Format dict rows as an aligned text table (columns default to the keys of the first row)."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    cells = [[_cell(r.get(c, ""), digits) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    rule = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.rjust(w) if _is_number(v) else v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join([line, rule, *body])


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def json_safe(value):
    """NaN / inf become null (JSON has no NaN); containers are walked."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json(path: str | Path, payload: dict) -> None:
    """Write ``payload`` as indented, standard JSON (tensors and numpy values must already be plain Python;
    NaN and inf are written as null)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(payload), indent=2, allow_nan=False) + "\n")
