"""PFNM, posterior fusion, matched posterior fusion and FedAvg on Flower (1.42, the Message API): the same servers
and clients as :mod:`bnpfed.federated`, run as real server and client processes. Needs the extra ``bnpfed[flower]``.

* :mod:`bnpfed.flower.strategies`: :class:`PFNMStrategy` (one-shot or multi-round matching of any architecture
  of :class:`~bnpfed.federated.config.NetworkConfig`, MLP or CNN, with the batch-norm moments step; each client gets
  its slice of the global network back) and :class:`PosteriorFusionStrategy` (any rule of
  :mod:`bnpfed.combine`, weight by weight) and :class:`MatchedFusionStrategy` (``align = "match"``: the clients'
  Bayesian hidden units matched, then fused unit by unit; each client gets its slice of the global posterior back)
  and :class:`FedAvgStrategy` (the FedAvg baseline, the in-process ``fedavg`` method's server step).
  They sample partitions, check every reply at the boundary and call the server steps of
  :mod:`bnpfed.federated.server`; no aggregation math is written here.
* :mod:`bnpfed.flower.method_strategy`: :class:`MethodStrategy`, any registered federated method
  (:mod:`bnpfed.federated.protocol`, ``method = "<name>"``, a plugin's too: ``plugins = "<module>"``), one strategy
  for them all.
* :mod:`bnpfed.flower.secure`: :class:`SecureFusionStrategy`, weight-wise posterior fusion under SecAgg+ (the server
  sees sums over clients, :mod:`bnpfed.combine.secure`, and counts, never one client's posterior).
* :mod:`bnpfed.flower.client`: the ClientApp (``bnpfed.flower.client:app``), light to import (Flower only);
  :mod:`bnpfed.flower.client_steps`: what it does with each message, with Torch, Pyro and the data; the steps are
  :mod:`bnpfed.federated.clients`'.
* :mod:`bnpfed.flower.server`: the ServerApp (``bnpfed.flower.server:app``) and :func:`run_federation`.
* :mod:`bnpfed.flower.config`: the run config (the configs of :mod:`bnpfed.federated.config` as Flower keys).
* :mod:`bnpfed.flower.records`: packing arrays into Flower records, checking replies.
* :mod:`bnpfed.flower.local`: :class:`LocalGrid`, an in-process grid for tests.

``examples/flower_app`` is an app ``flwr run`` accepts; ``bnpfed flower --help`` says how to start the pieces.
"""

try:
    import flwr  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("bnpfed.flower needs Flower: pip install 'bnpfed[flower]' (flwr[simulation]>=1.42,<1.43)"
                      ) from error

#: The package's names; each is imported on first use, so that ``import bnpfed.flower.client`` (every message a
#: SuperNode runs) loads Flower alone, not torch and Pyro.
_STRATEGIES = ("FedAvgStrategy", "MatchedFusionStrategy", "PFNMStrategy", "PosteriorFusionStrategy")
_SECURE = ("SecureFusionStrategy", "SecureMatchedFusionStrategy")
_CONFIG = ("FlowerSettings", "app_config_toml", "describe_keys", "parse_run_config", "run_config_defaults")

__all__ = sorted([*_STRATEGIES, *_SECURE, *_CONFIG, "MethodStrategy", "ReplyError", "LocalGrid", "run_federation"])


def __getattr__(name: str):
    if name in _STRATEGIES:
        from bnpfed.flower import strategies as module
    elif name in _SECURE:
        from bnpfed.flower import secure as module
    elif name in _CONFIG:
        from bnpfed.flower import config as module
    elif name == "MethodStrategy":
        from bnpfed.flower import method_strategy as module
    elif name == "ReplyError":
        from bnpfed.flower import records as module
    elif name == "LocalGrid":
        from bnpfed.flower import local as module
    elif name == "run_federation":
        from bnpfed.flower import server as module
    else:
        raise AttributeError(f"module 'bnpfed.flower' has no attribute {name!r}")
    return getattr(module, name)
