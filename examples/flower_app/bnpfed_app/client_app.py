"""The ClientApp: a PFNM or Bayesian client on this SuperNode's partition (see ``bnpfed.flower.client``)."""

from bnpfed.flower.client import app

__all__ = ["app"]
