"""bnpfed: probabilistic federated learning in Pyro."""

__version__ = "0.2.0"

#: names of :mod:`bnpfed.saved` reachable from the top (``bnpfed.load_global(path)``), imported on first use
_SAVED = ("load_global", "read_global", "save_global")


def __getattr__(name: str):
    if name in _SAVED:
        from bnpfed import saved

        return getattr(saved, name)
    raise AttributeError(f"module 'bnpfed' has no attribute {name!r}")
