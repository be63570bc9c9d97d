"""What the subcommands share: argparse types, the help formatter, and checking everything before any work.

A command builds its configs (which validate themselves, :mod:`bnpfed.federated.config`), loads and checks its data,
and checks its output paths before it trains anything. A bad value comes back as a :class:`UsageError` whose one
line names the flag, e.g. ``--sigma2: expected a positive finite number, got nan``; the command prints it as
``bnpfed pfnm: error: ...`` and exits with status 2. A run that fails while training exits with status 1.

Usage::

    >>> flag_message(ValueError("sigma0_2: expected a positive finite number, got 0.0"))
    '--sigma0-2: expected a positive finite number, got 0.0'
    >>> flag_message(ValueError("hidden[1]: expected an int >= 1, got 0"))
    '--hidden (item 2): expected an int >= 1, got 0'
    >>> flag_message(ValueError("methods: expected one of [...], got 'foo'"), aliases={"methods": "--rule"})
    "--rule: expected one of [...], got 'foo'"
    >>> flag_message(ValueError("x_test: expected finite values"), fields=("data_dir",), default="--dataset")
    '--dataset: x_test: expected finite values'
    >>> names("eaa, gaa")
    ('eaa', 'gaa')
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Collection, Mapping, Optional

import torch
from torch import Tensor

from bnpfed.data import (CIFAR10_JPEG, DATASET_NAMES, NPZ_FORMAT, NPZ_PREFIX, Dataset, load_dataset,
                         standardize_together)
from bnpfed.clients import TrainingDiverged
from bnpfed.experimental import keyed
from bnpfed.matching import MemoryLimitError, SizeLimitError
from bnpfed.report import comparison_rows, format_table, plural
from bnpfed.federated import PartitionConfig

__all__ = [
    "HelpAll",
    "HelpFormatter",
    "TRAINING_ERRORS",
    "UsageError",
    "add_data_arguments",
    "add_help_all",
    "add_output_arguments",
    "briefly",
    "check_output_path",
    "check_partition",
    "available_cpus",
    "check_threads",
    "torch_threads",
    "dataset_name",
    "examples",
    "fail",
    "flag_message",
    "hidden",
    "notices",
    "floats",
    "ints",
    "load_data",
    "names",
    "one_line",
    "paragraphs",
    "plural",
    "round_log",
    "positive_float",
    "positive_int",
    "training_failure",

    "warn",
]

#: What a run that fails while training raises: :class:`~bnpfed.clients.TrainingDiverged` (a NaN or infinite loss
#: or parameter, which says where and why), or another error from deep inside a fit; the commands print it as one
#: line and exit with status 1.
TRAINING_ERRORS = (TrainingDiverged, RuntimeError, ValueError, FloatingPointError)


class UsageError(Exception):
    """A bad argument or input file, said in one line that names the flag; the command exits with status 2."""


# ------------------------------------------------------------------------------------------------ messages


_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\[(\d+|'[^']*')\])?: (.*)$", re.S)


def one_line(text: str, limit: int = 400) -> str:
    """``text`` on one line (newlines folded), cut at ``limit`` characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def flag_message(error: Exception, *, aliases: Optional[Mapping[str, str]] = None,
                 fields: Optional[Collection[str]] = None, default: Optional[str] = None) -> str:
    """The message of a config error ``"<field>: ..."`` with the field named as its flag, ``--<field with - for
    _>`` (or ``aliases[field]``). Only ``fields`` and the aliases are fields when ``fields`` is given; any other
    message gets ``default`` in front, when given."""
    message = keyed(one_line(error))   # a probe as --experimental spells it
    aliases = dict(aliases or {})
    match = _FIELD.match(message)
    if match and (fields is None or match.group(1) in fields or match.group(1) in aliases):
        field, index, rest = match.groups()
        flag = aliases.get(field, "--" + field.replace("_", "-"))
        if index is None:
            return f"{flag}: {rest}"
        where = f"group {index}" if index.startswith("'") else f"item {int(index) + 1}"   # a group by name
        return f"{flag} ({where}): {rest}"
    return f"{default}: {message}" if default else message


def fail(prog: str, message: str, status: int = 2) -> int:
    """Print ``prog: error: message`` (one line) on stderr and return ``status``."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    return status


def training_failure(error: BaseException, start: Optional[str] = None) -> str:
    """One line for an error raised while training: a :class:`~bnpfed.clients.TrainingDiverged` says where and
    why itself (and, when the first loss was already not finite, ``start``: the flags that set the starting point);
    any other error gives its type and the first line of its message."""
    text = str(error).strip()
    if isinstance(error, (SizeLimitError, MemoryLimitError)):   # a size the clients' networks cannot meet, or hold
        return flag_message(error)
    if isinstance(error, TrainingDiverged):
        if start and error.epoch == 1 and error.step == 1:
            text += f" The starting point is set by {start}."
        return one_line(text, 600)
    first = text.splitlines()[0] if text else ""
    return (f"training failed ({type(error).__name__}: {one_line(first, 300)}); a run that diverges needs a lower "
            "--lr (or fewer --epochs)")


def examples(doc: str, *notes: str) -> str:
    """An epilog: ``notes`` as wrapped paragraphs, then the ``Examples::`` block of a command module's docstring as
    it stands."""
    block = doc.split("Examples::\n\n", 1)[1].rstrip() + "\n"
    return (paragraphs(*notes) + "\n\n" if notes else "") + "examples:\n" + block


def round_log(progress: bool):
    """What a run calls with a line after each round: written above the progress bar on stderr, or nothing."""
    if not progress:
        return None
    from tqdm.auto import tqdm

    return lambda line: tqdm.write(line, file=sys.stderr)


def print_comparisons(comparisons, examples: int) -> None:
    """The table of an experiment's paired comparisons (:func:`~bnpfed.report.comparison_rows`), under a line that
    says how to read it; nothing without any."""
    if not comparisons:
        return
    against = comparisons[0]["against"]
    print(f"paired with the {against} on the same {examples} test examples: method - {against}, 95 % bootstrap "
          "interval (an interval without 0 is a difference the test split resolves; --json has every metric):")
    print(format_table(comparison_rows(comparisons)))


def warn(message: str) -> None:
    print(f"warning: {one_line(message, 1000)}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------ help


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in every option's help, written as a user types them: ``100,50`` for a tuple, ``--no-x`` for a
    switch that is off, nothing for a plain flag or a default of None (the help text says what happens then).
    Descriptions and epilogs keep their line breaks (:func:`paragraphs` wraps them); lines never break at a
    hyphen (``--no-warm-start`` stays whole)."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=34, width=help_width())

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if isinstance(action, argparse.BooleanOptionalAction):
            text = text.replace(" (default: %(default)s)", "")
            if isinstance(default, bool):
                flag = action.option_strings[0 if default else 1]
                return f"{text} (default: {flag})"
            return text
        if ("%(default)" in text or default is None or default is argparse.SUPPRESS or isinstance(default, bool)
                or not action.option_strings):
            return text
        return f"{text} (default: {_shown(default)})".replace("%", "%%").replace("%%(", "%(")


def hidden(action: argparse.Action) -> argparse.Action:
    """Leave ``action`` out of the default ``--help``; ``--help-all`` shows it."""
    action.full_help = action.help
    action.help = argparse.SUPPRESS
    return action


def briefly(action: argparse.Action, short: str) -> argparse.Action:
    """Show ``short`` as ``action``'s help in the default ``--help``; ``--help-all`` shows its whole help."""
    action.full_help = action.help
    action.help = short
    return action


class HelpAll(argparse.Action):
    """``--help-all``: the help with every flag (those :func:`hidden` left out of ``--help`` too), then exit."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        for action in parser._actions:
            if getattr(action, "full_help", None) is not None:
                action.help = action.full_help
        for group in parser._action_groups:
            if getattr(group, "full_description", None) is not None:
                group.description = group.full_description
        parser.print_help()
        parser.exit()


def add_help_all(parser) -> None:
    parser.add_argument("--help-all", action=HelpAll,
                        help="show every option, with those this help leaves out, and exit")


def help_width() -> int:
    """The width of ``--help``: the terminal's, between 60 and 110 columns."""
    try:
        columns = os.get_terminal_size().columns - 2
    except OSError:
        columns = 100
    return min(110, max(60, columns))


def paragraphs(*texts: str) -> str:
    """Paragraphs wrapped to :func:`help_width`, blank lines between them (for descriptions and epilogs)."""
    return "\n\n".join(textwrap.fill(" ".join(t.split()), help_width(), break_on_hyphens=False) for t in texts)


def _shown(value) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(_shown(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# ------------------------------------------------------------------------------------------------ types


def dataset_name(value: str) -> str:
    """``--dataset``: a known name or ``npz:PATH`` (which no ``choices`` list can hold)."""
    if value.startswith(NPZ_PREFIX):
        if not value[len(NPZ_PREFIX):]:
            raise argparse.ArgumentTypeError(f"expected {NPZ_PREFIX}PATH naming an .npz file, got {value!r}, which "
                                             "has no path")
        return value
    if value.lower().replace("_", "-") in DATASET_NAMES:
        return value.lower().replace("_", "-")
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(DATASET_NAMES)} or {NPZ_PREFIX}PATH, got "
                                     f"{value!r}")


def _items(value: str, convert, what: str, example: str) -> tuple:
    try:
        items = tuple(convert(v) for v in value.split(","))
    except ValueError:
        items = ()
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, e.g. {example}, got {value!r}")
    return items


def ints(value: str) -> tuple[int, ...]:
    """Comma-separated ints, e.g. ``--hidden 200,100`` or ``--clients 5,10,20`` (their bounds are the configs')."""
    return _items(value, lambda v: int(v.strip()), "ints", "100 or 200,100")


def floats(value: str) -> tuple[float, ...]:
    """Comma-separated numbers, e.g. a grid ``0.1,0.3,1`` (their bounds are the configs')."""
    return _items(value, lambda v: float(v.strip()), "numbers", "0.1,0.3,1")


def positive_int(value: str) -> int:
    """An int >= 1."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value!r}")
    return n


def positive_float(value: str) -> float:
    """A finite number > 0."""
    try:
        x = float(value)
    except ValueError:
        x = float("nan")
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {value!r}")
    return x


def names(value: str) -> tuple[str, ...]:
    """Comma-separated names, e.g. ``--methods local,pfnm`` (checked against their registry later)."""
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {value!r}")
    return items


# ------------------------------------------------------------------------------------------------ argument groups


def add_data_arguments(parser, *, standardize: Optional[bool], standardize_help: str) -> None:
    """``--dataset``, ``--data-dir``, ``--download``, ``--standardize/--no-standardize``."""
    g = parser.add_argument_group("data")
    briefly(g.add_argument(
        "--dataset", type=dataset_name, default="digits", metavar="NAME",
        help=f"{', '.join(DATASET_NAMES)} or {NPZ_PREFIX}PATH. digits (scikit-learn's 8x8 digits) and diabetes "
        f"(scikit-learn's diabetes regression: with --likelihood gaussian or student-t) need no files; "
        f"mnist, fashion-mnist and cifar10 are read with torchvision from --data-dir; cifar10 from {CIFAR10_JPEG} "
        f"(a JPEG copy: decoded once, and said so on stderr) in --data-dir when torchvision's pickles are not there; "
        f"{NPZ_PREFIX}PATH is {NPZ_FORMAT}"),
        f"{', '.join(DATASET_NAMES)} (bundled digits, diabetes; the others read from --data-dir) or "
        f"{NPZ_PREFIX}PATH (an .npz file of the splits)")
    g.add_argument("--data-dir", metavar="DIR", help="torchvision's root folder for mnist / fashion-mnist / cifar10 "
                   f"(required for those; for cifar10 also the folder of {CIFAR10_JPEG})")
    hidden(g.add_argument("--download", action="store_true",
                          help="let torchvision download missing files into --data-dir"))
    g.add_argument("--standardize", action=argparse.BooleanOptionalAction, default=standardize,
                   help=standardize_help)
    hidden(g.add_argument("--num-classes", type=int, metavar="C",
                          help=f"{NPZ_PREFIX}PATH only: the number of classes when some have no example in the file "
                          "(default: the largest label + 1, every class with an example)"))


def add_output_arguments(parser, *, threads: Optional[int], json_help: str, plot_help: str):
    """``--seed``, ``--json``, ``--plot``, ``--no-progress``, ``--threads``; returns the group."""
    g = parser.add_argument_group("run and output")
    g.add_argument("--seed", type=int, metavar="SEED", default=0,
                   help="the one seed every random step derives from (partition, initialisations, mini-batches, "
                   "sampling), >= 0")
    g.add_argument("--json", metavar="PATH", help=json_help)
    g.add_argument("--plot", metavar="PATH", help=plot_help)
    hidden(g.add_argument("--no-progress", action="store_true", help="no progress bar or per-round lines on stderr"))
    hidden(g.add_argument("--threads", type=int, metavar="N", default=threads,
                          help="torch CPU threads, >= 1" + (" (default: torch's choice)" if threads is None else
                                                            "; the clients' small networks train fastest on one")))
    return g


# ------------------------------------------------------------------------------------------------ checks


def check_partition(partition: PartitionConfig, dataset: Dataset, seed: int) -> None:
    """The partition can be drawn on ``dataset`` (J fits the data; a Dirichlet draw gives every client
    ``min_size`` examples within its tries), checked by drawing it: the same draw the run will make."""
    partition.check_fits(len(dataset.y_train))
    try:
        partition.split(dataset.y_train.numpy(), seed)
    except RuntimeError as error:
        raise UsageError(f"--min-size: {one_line(error)} (--min-size, --alpha)") from None


@contextmanager
def notices(prog: str):
    """The ``DeprecationWarning`` s bnpfed raises in the block (an old method name, an old run-config key) as
    one-line notices ``prog: note: ...`` on stderr, where a user of the command sees them (Python hides them from
    a command by default)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        try:
            yield
        finally:   # said before an error the block raises, too
            for message in dict.fromkeys(str(w.message) for w in caught
                                         if issubclass(w.category, DeprecationWarning)):
                print(f"{prog}: note: {one_line(message, 600)}", file=sys.stderr)


@contextmanager
def torch_threads(threads: Optional[int]):
    """torch's CPU threads at ``threads`` (None: as they are) for the block, and back to what they were after it: a
    command run in process (a notebook, the tests) leaves no thread count behind for the code after it."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity where the system says, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # not on Linux
        return os.cpu_count() or 1


def check_threads(threads: Optional[int]) -> None:
    """``--threads``: an int from 1 to the CPUs this process may use (more threads than CPUs wait on each other:
    slower, never faster)."""
    cpus = available_cpus()
    if threads is not None and (isinstance(threads, bool) or not 1 <= threads <= cpus):
        raise ValueError(f"threads: expected an int from 1 to {cpus} (the CPUs this process may use), got {threads}")


def check_output_path(path: Optional[str], flag: str, *, plot: bool = False) -> None:
    """``path`` can be written (its folder exists or can be made; it is not a folder), and a plot's suffix is one
    matplotlib writes. Checked before anything trains, so a run is not lost at the end."""
    if path is None:
        return
    target = Path(path).expanduser()
    if not str(path).strip() or target.is_dir():
        raise UsageError(f"{flag}: expected a file path, got {'a folder' if target.is_dir() else 'nothing'} "
                         f"({str(path)!r})")
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UsageError(f"{flag}: expected a path in a writable folder, got {str(target)!r} ({str(parent)!r} is "
                         "not a writable folder)")
    if plot:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
        if target.suffix[1:].lower() not in formats:
            raise UsageError(f"{flag}: expected a file name ending in one of {', '.join('.' + f for f in formats)} "
                             f"(e.g. .png), got {str(path)!r}")


def check_save_global(folder: Optional[str]) -> None:
    """``--save-global DIR`` names a folder that exists or can be made (not a file), checked before anything trains."""
    if folder is None:
        return
    if Path(folder).exists() and not Path(folder).is_dir():
        raise UsageError(f"--save-global: expected a folder, got {folder!r}, which is a file")
    check_output_path(str(Path(folder) / "probe.pt"), "--save-global")


def save_globals(folder, global_models: Mapping[str, dict]) -> None:
    """Write every kept global model (:meth:`~bnpfed.federated.experiment.Experiment.keep`: method -> its network or
    Bayesian client and what describes it) to ``folder/<method>.pt`` (:func:`bnpfed.saved.save_global`) and say so."""
    from bnpfed.saved import save_global

    for method, kept in global_models.items():
        kept = dict(kept)
        save_global(Path(folder) / f"{method}.pt", kept.pop("network"), method=method, **kept)
    print(f"wrote {plural(len(global_models), 'global model')} to {folder}: "
          f"{', '.join(f'{m}.pt' for m in global_models)}")


def load_data(args, *, standardize: bool) -> Dataset:
    """``args.dataset`` loaded and checked against its format, or a :class:`UsageError` naming the flag."""
    try:
        dataset = load_dataset(args.dataset, data_dir=args.data_dir, download=args.download, standardize=standardize,
                               num_classes=args.num_classes)
        if CIFAR10_JPEG in dataset.source:
            print(f"{dataset.name}: read from {dataset.source}", file=sys.stderr)
        return dataset
    except FileNotFoundError as error:
        flag = "--dataset" if args.dataset.startswith(NPZ_PREFIX) else "--data-dir"
        raise UsageError(f"{flag}: {one_line(error)}") from None
    except (ValueError, ImportError, OSError) as error:
        raise UsageError(flag_message(error, aliases={"name": "--dataset"}, fields=("data_dir", "num_classes"),
                                        default="--dataset")) from None


def check_ood_flags(args) -> None:
    """``--ood`` another dataset than ``--dataset``; ``--ood-data-dir`` only with ``--ood``."""
    if args.ood is not None and args.ood == args.dataset:
        raise UsageError(f"--ood: expected another dataset than --dataset ({args.dataset})")
    if args.ood_data_dir is not None and args.ood is None:
        raise UsageError("--ood-data-dir: expected only with --ood (the folder of its dataset)")


def load_data_and_ood(args, *, standardize: bool) -> tuple[Dataset, Optional[Tensor]]:
    """``--dataset`` (:func:`load_data`) and, with ``--ood``, the other dataset's test inputs as out-of-distribution
    inputs (read from ``--ood-data-dir``, default ``--data-dir``; of ``--dataset``'s input shape), both standardised
    with ``--dataset``'s training constants when ``standardize``; ``(dataset, None)`` without ``--ood``."""
    if args.ood is None:
        return load_data(args, standardize=standardize), None
    dataset = load_data(args, standardize=False)
    folder = args.data_dir if args.ood_data_dir is None else args.ood_data_dir
    try:
        other = load_data(argparse.Namespace(**{**vars(args), "dataset": args.ood, "data_dir": folder,
                                                "num_classes": None}), standardize=False)
    except UsageError as error:
        raise UsageError("--ood: " + str(error).split(": ", 1)[-1]) from None
    if tuple(other.input_shape) != tuple(dataset.input_shape):
        raise UsageError(f"--ood: expected images of the shape of --dataset's {tuple(dataset.input_shape)}, got "
                         f"{tuple(other.input_shape)} ({args.ood})")
    if not standardize:
        return dataset, other.x_test
    dataset, (ood,) = standardize_together(dataset, other.x_test)
    return dataset, ood
