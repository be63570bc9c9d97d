"""The ServerApp: reads the run config, runs PFNM or posterior fusion (see ``bnpfed.flower.server``)."""

from bnpfed.flower.server import app

__all__ = ["app"]
