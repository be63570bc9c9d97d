"""Old import paths that keep working for one release: each names its new home in a ``DeprecationWarning``.

Version 0.2 moved ``bnpfed.inference`` into folders by extension point (:mod:`bnpfed.matching`,
:mod:`bnpfed.clients`, :mod:`bnpfed.baselines`) and ``bnpfed.secure_fusion`` into :mod:`bnpfed.combine`; the old
paths go in 0.3. A moved module's old file is two lines that call :func:`moved`.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType

#: The release that removes the old paths.
REMOVED_IN = "0.3"


def _caller():
    """The first frame outside the import machinery and this file: where the old path was written."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith("<frozen importlib") or "importlib" in name or name == __file__
                or frame.f_globals.get("__name__", "").startswith("bnpfed.inference")
                or frame.f_globals.get("__name__") in ("bnpfed.secure_fusion", "bnpfed.federated.baselines")):
            return frame
        frame = frame.f_back
    return None


def warn_moved(old: str, new: str) -> None:
    """Warn that ``old`` is now ``new``, pointing at the line that used the old path."""
    message = f"{old} moved to {new} in bnpfed 0.2; the old path goes in {REMOVED_IN}"
    frame = _caller()
    if frame is None:
        warnings.warn(message, DeprecationWarning, stacklevel=3)
        return
    warnings.warn_explicit(message, DeprecationWarning, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__", "<unknown>"), registry=frame.f_globals.setdefault(
                               "__warningregistry__", {}))


def moved(old: str, new: str) -> ModuleType:
    """Make the module ``old`` an alias of ``new`` (the same module object, so that patching one patches the other),
    with a ``DeprecationWarning``."""
    warn_moved(old, new)
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module
