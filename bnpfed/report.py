"""What the commands print and write: plain-text tables, the one JSON layout of every command, and figures
(no math here).

Every command's JSON (``bnpfed pfnm``, ``fuse``, ``demo``, ``flower sim``, the Flower app's summary) is
:func:`command_record`'s layout, :data:`RECORD_SCHEMA` (a JSON Schema) and :func:`read_record` (a typed reader)::

    {"command": "pfnm", "arguments": {...the parsed flags...}, "settings": {...the configs as plain values...},
     "versions": {"bnpfed": ..., "torch": ..., "pyro": ..., "flwr": ... or null, "python": ...},
     "timestamp": "2025-01-31T12:00:00Z",
     "results": {"runs": [{"rows": [{...one table row...}, ...], ...what else the run reports}, ...],
                 "rounds": [{"run": 0, "method": "fedavg", "round": 1, ...that round's metrics}, ...]}}

``results.runs`` holds one entry per experiment the command ran (``pfnm --clients 5,10``: two; everything else:
one), each with its table (``rows``: methods, or the demo's matchings, or the width sweep's points); ``results.rounds``
every method's metrics after every communication round, one flat record each (empty when nothing ran in rounds).

Usage::

    >>> print(format_table([{"method": "pfnm", "accuracy": 0.93125, "hidden": [120, 40]}]))
    method  accuracy  hidden
    ------  --------  ------
    pfnm      0.9313  120-40
    >>> record = command_record("demo", {"clients": 3, "func": print}, {"clients": 3},
    ...                         command_results([{"rows": []}]))
    >>> list(record), record["arguments"], sorted(record["versions"])
    (['command', 'arguments', 'settings', 'versions', 'timestamp', 'results'], {'clients': 3}, \
['bnpfed', 'flwr', 'pyro', 'python', 'torch'])
"""

from __future__ import annotations

import datetime
import json
import math
import platform
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["COMPARED_METRICS", "RECORD_SCHEMA", "CommandRecord", "command_record", "command_results",
           "comparison_rows", "format_table", "interval_text", "json_safe", "line_styles", "plural", "pyplot",
           "read_record", "round_records", "save_figure", "versions", "with_intervals", "write_json"]


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


def interval_text(interval, digits: int = 4) -> str:
    """``[low, high]`` as text, ``"[0.9412, 0.9501]"``; ``"-"`` without one (None or empty).

    >>> interval_text([0.94123, 0.95])
    '[0.9412, 0.9500]'
    """
    if not interval:
        return "-"
    low, high = interval
    return f"[{low:.{digits}f}, {high:.{digits}f}]"


def with_intervals(rows: Sequence[dict], metrics: Sequence[str] = ("accuracy",), digits: int = 4) -> list[dict]:
    """``rows`` (result rows as dicts, with their ``intervals``) with a column ``<metric>_95`` per metric: the row's
    95 % interval as :func:`interval_text` (``-`` where the row has none)."""
    return [{**row, **{f"{m}_95": interval_text((row.get("intervals") or {}).get(m), digits) for m in metrics}}
            for row in rows]


#: The metrics a command's table of paired comparisons shows (its JSON has every one).
COMPARED_METRICS = ("accuracy", "nll", "ece15", "ece_debiased")


def comparison_rows(comparisons: Sequence[dict], metrics: Sequence[str] = COMPARED_METRICS,
                    digits: int = 4) -> list[dict]:
    """A table of paired comparisons (an experiment's ``comparisons``): one row per method, one cell per metric,
    ``"difference [low, high]"``.

    >>> comparison_rows([{"method": "pfnm", "against": "ensemble",
    ...                   "accuracy": {"difference": -0.012, "low": -0.015, "high": -0.009}}], ["accuracy"])
    [{'method': 'pfnm', 'accuracy': '-0.0120 [-0.0150, -0.0090]'}]
    """
    def cell(d: dict) -> str:
        return f"{d['difference']:.{digits}f} {interval_text((d['low'], d['high']), digits)}"

    return [{"method": c["method"], **{m: cell(c[m]) for m in metrics if m in c}} for c in comparisons]


def plural(n: int, word: str) -> str:
    """``"1 round"``, ``"3 rounds"``."""
    return f"{n} {word}{'' if n == 1 else 's'}"


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
    return "\n".join(text.rstrip() for text in [line, rule, *body])


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


def versions() -> dict:
    """The versions of bnpfed, torch, pyro, flwr (None when not installed) and Python."""
    from bnpfed import __version__

    def installed(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {"bnpfed": __version__, "torch": installed("torch"), "pyro": installed("pyro-ppl"),
            "flwr": installed("flwr"), "python": platform.python_version()}


def _plain(value) -> bool:
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


#: The JSON Schema (draft 2020-12) of every command's record (module docstring).
RECORD_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "bnpfed command record",
    "type": "object",
    "required": ["command", "arguments", "settings", "versions", "timestamp", "results"],
    "additionalProperties": False,
    "properties": {
        "command": {"type": "string"},
        "arguments": {"type": "object"},
        "settings": {"type": "object"},
        "versions": {"type": "object", "required": ["bnpfed", "torch", "pyro", "flwr", "python"],
                     "additionalProperties": {"type": ["string", "null"]}},
        "timestamp": {"type": "string", "pattern": "^\\d{4}-\\d\\d-\\d\\dT\\d\\d:\\d\\d:\\d\\dZ$"},
        "results": {
            "type": "object",
            "required": ["runs", "rounds"],
            "additionalProperties": False,
            "properties": {
                "runs": {"type": "array", "minItems": 1,
                         "items": {"type": "object", "required": ["rows"],
                                   "properties": {"rows": {"type": "array", "items": {"type": "object"}}}}},
                "rounds": {"type": "array",
                           "items": {"type": "object", "required": ["run", "method", "round"],
                                     "properties": {"run": {"type": "integer", "minimum": 0},
                                                    "method": {"type": "string"},
                                                    "round": {"type": "integer", "minimum": 1}}}},
            },
        },
    },
}


def round_records(runs: Sequence[Mapping]) -> list[dict]:
    """``results.rounds``: every row's per-round ``history`` (rows of methods that ran in rounds) as flat records
    ``{"run": i, "method": ..., "round": r, ...metrics}``."""
    out = []
    for i, run in enumerate(runs):
        for row in run["rows"]:
            for record in row.get("history") or []:
                out.append({"run": i, "method": row["method"], **record})
    return out


def command_results(runs: Sequence[Mapping], rounds: Sequence[Mapping] | None = None) -> dict:
    """The ``results`` of a command record: its ``runs`` (each a mapping with ``rows``) and ``rounds`` (default:
    :func:`round_records` of the runs)."""
    runs = [dict(run) for run in runs]
    for i, run in enumerate(runs):
        if not isinstance(run.get("rows"), list):
            raise ValueError(f"runs[{i}]: expected a mapping with a list of rows, got keys {sorted(run)}")
    return {"runs": runs, "rounds": round_records(runs) if rounds is None else [dict(r) for r in rounds]}


@dataclass(frozen=True)
class CommandRecord:
    """A command's JSON record, read back (:func:`read_record`): the fields of :data:`RECORD_SCHEMA`, with
    ``runs`` and ``rounds`` lifted out of ``results``."""

    command: str
    arguments: dict
    settings: dict
    versions: dict
    timestamp: str
    runs: list
    rounds: list

    @property
    def rows(self) -> list[dict]:
        """Every run's rows, in order (one run: its table)."""
        return [row for run in self.runs for row in run["rows"]]


def read_record(path: str | Path) -> CommandRecord:
    """Read a command's JSON record and check its layout (:data:`RECORD_SCHEMA`), or raise a ``ValueError`` saying
    which field breaks it."""
    payload = json.loads(Path(path).read_text())

    def need(ok: bool, where: str, what: str):
        if not ok:
            raise ValueError(f"{path}: {where}: expected {what} (the layout of bnpfed.report.RECORD_SCHEMA)")

    need(isinstance(payload, dict), "the record", "a JSON object")
    need(list(payload) == RECORD_SCHEMA["required"], "keys", ", ".join(RECORD_SCHEMA["required"]))
    res = payload["results"]
    need(isinstance(res, dict) and sorted(res) == ["rounds", "runs"], "results", "an object of runs and rounds")
    need(isinstance(res["runs"], list) and res["runs"], "results.runs", "a non-empty list")
    for i, run in enumerate(res["runs"]):
        need(isinstance(run, dict) and isinstance(run.get("rows"), list), f"results.runs[{i}]", "an object with rows")
    for k, record in enumerate(res["rounds"]):
        need(isinstance(record, dict) and {"run", "method", "round"} <= set(record), f"results.rounds[{k}]",
             "an object with run, method and round")
    return CommandRecord(command=payload["command"], arguments=payload["arguments"], settings=payload["settings"],
                         versions=payload["versions"], timestamp=payload["timestamp"], runs=res["runs"],
                         rounds=res["rounds"])


def command_record(command: str, arguments, settings: Mapping, results) -> dict:
    """The JSON layout of every command: ``command``; ``arguments``, the parsed flags (an ``argparse.Namespace`` or
    a dict; values that are not plain data, such as the handler function, are left out, and so is argparse's
    ``command``); ``settings``, the
    configs as plain values; ``versions`` (:func:`versions`); ``timestamp``, ISO 8601 UTC; ``results``, from
    :func:`command_results` (``runs`` and ``rounds``)."""
    if not (isinstance(results, Mapping) and sorted(results) == ["rounds", "runs"]):
        raise ValueError(f"results: expected command_results(runs, rounds) (keys runs, rounds), got {results!r:.80}")
    items = vars(arguments) if not isinstance(arguments, Mapping) else arguments
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    return {"command": command, "arguments": {k: v for k, v in items.items() if k != "command" and _plain(v)},
            "settings": dict(settings), "versions": versions(),
            "timestamp": now.isoformat().replace("+00:00", "Z"), "results": results}


# ------------------------------------------------------------------------------------------------ figures


def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend (the commands only write files)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, *, dpi: int = 120) -> None:
    """Write ``fig`` to ``path`` (its folder made if needed) and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)


def line_styles(names: Sequence[str]) -> dict[str, dict]:
    """Keywords of ``Axes.plot`` per series name: a colour (tab10; the local models' ``local-*`` rows in greys,
    FedAvg in black) and a marker of its own, every other series hollow and dashed, so that two series with the same
    values (k-means sits at PFNM's width by construction; EAA and log-variance often agree) both show."""
    tab10 = iter(pyplot().get_cmap("tab10").colors * 3)
    greys = iter(("0.45", "0.65", "0.8"))
    markers = "osD^vPX*<>"
    styles = {}
    for i, name in enumerate(names):
        color = next(greys, "0.5") if name.startswith("local") else "k" if name == "fedavg" else next(tab10)
        hollow = i % 2 == 1
        styles[name] = dict(color=color, marker=markers[i % len(markers)], ms=7 if hollow else 5,
                            markerfacecolor="none" if hollow else color, linestyle="--" if hollow else "-")
    return styles
