"""The Flower ClientApp (``bnpfed.flower.client:app``): a PFNM or Bayesian client on this SuperNode's partition.

On a SuperNode every message runs in a fresh ``flwr-clientapp`` process that imports this module first, so the
module imports Flower alone; the handlers import the client's steps (:mod:`bnpfed.flower.client_steps`: torch,
Pyro, the data: seconds of CPU) when a message needs them. Three of the four stages of SecAgg+
(``secaggplus_mod``: setup, key sharing, unmasking) need none of it; the masked-vector stage calls
:func:`~bnpfed.flower.secure.secure_fit`.

Plugins: before anything else each handler imports the plugins the server names in the message (``plugins``,
:mod:`bnpfed.plugins`) and the entry points of the group ``bnpfed.plugins``; a node that cannot import one answers
with an error reply naming it (the server logs it and goes on without that node), it does not crash.

Usage (the example app under ``examples/flower_app`` does exactly this)::

    from bnpfed.flower.client import app          # [tool.flwr.app.components] clientapp = "...:app"
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

from flwr.app import Context, Error, Message
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from bnpfed.plugins import PluginError, load_plugins

__all__ = ["app", "make_client_app", "plugins_error"]

#: Names of :mod:`bnpfed.flower.client_steps` reachable from here too, as before the steps moved there (imported on
#: first use, and not in ``__all__``: a star import would load torch).
_STEPS = ("evaluation_shard", "initial_global_model", "node_partition")


def __getattr__(name: str):
    if name in _STEPS:
        from bnpfed.flower import client_steps

        return getattr(client_steps, name)
    raise AttributeError(f"module 'bnpfed.flower.client' has no attribute {name!r}")


def _secure_fit(msg: Message, context: Context) -> Message:
    from bnpfed.flower.secure import secure_fit

    return secure_fit(msg, context)


#: The key of a message's ``ConfigRecord`` (``"config"``) that names the plugins to import
#: (:meth:`~bnpfed.flower.config.FlowerSettings.client_record`).
_CONFIG, _PLUGINS = "config", "plugins"


def plugins_error(msg: Message) -> Optional[Message]:
    """Import the plugins ``msg`` names (and the entry points); None when they load, else the error reply that
    names the plugin and why it cannot be imported on this node."""
    config = msg.content.config_records.get(_CONFIG)
    modules = [] if config is None else config.get(_PLUGINS, [])
    try:
        load_plugins(modules)
    except PluginError as error:
        reason = f"this node cannot load the run's plugins: {' '.join(str(error).split())}"
        return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=msg)
    return None


def _with_plugins(handler: Callable[[Message, Context], Message]) -> Callable[[Message, Context], Message]:
    @functools.wraps(handler)
    def run(msg: Message, context: Context) -> Message:
        return plugins_error(msg) or handler(msg, context)

    return run


def make_client_app() -> ClientApp:
    """A ``ClientApp`` with ``query`` (this node's partition and data shape, or batch-norm moments), ``train``
    (PFNM, posterior fusion, matched posterior fusion, FedAvg by the message's ``task``; the stages of SecAgg+) and
    ``evaluate`` (:mod:`bnpfed.flower.client_steps`)."""
    client_app = ClientApp()

    @client_app.query()
    @_with_plugins
    def query(msg: Message, context: Context) -> Message:
        from bnpfed.flower import client_steps

        return client_steps.query(msg, context)

    @client_app.train()
    @_with_plugins
    def train(msg: Message, context: Context) -> Message:
        if RECORD_KEY_CONFIGS in msg.content.config_records:  # a stage of SecAgg+ (SecureFusionStrategy)
            return secaggplus_mod(msg, context, _secure_fit)
        from bnpfed.flower import client_steps

        return client_steps.train(msg, context)

    @client_app.evaluate()
    @_with_plugins
    def evaluate(msg: Message, context: Context) -> Message:
        from bnpfed.flower import client_steps

        return client_steps.evaluate(msg, context)

    return client_app


#: The ClientApp a SuperNode runs (``bnpfed.flower.client:app``).
app = make_client_app()
