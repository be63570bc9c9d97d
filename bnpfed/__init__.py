"""bnpfed: probabilistic federated learning in Pyro."""

__version__ = "0.1.0"
