"""Batch-norm statistics from data after a match or an average (REPAIR's reset, Jordan et al., ICLR 2023,
federated): the clients send the moments of every batch norm's inputs under the global network, the server pools
them and sets the running statistics."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import Tensor, nn

__all__ = ["BatchNormMoments", "batch_norm_moments", "batch_norm_order", "batch_norm_statistics",
           "reestimate_batch_norm", "set_batch_norm_statistics"]



@dataclass(frozen=True)
class BatchNormMoments:
    """Sufficient statistics of one batch norm's inputs over some examples: ``count`` values per feature (examples
    times spatial positions), their ``sum`` and ``sum_sq`` per feature, (C,) float64. Moments add over clients."""

    count: float
    sum: Tensor
    sum_sq: Tensor

    def __add__(self, other: BatchNormMoments) -> BatchNormMoments:
        return BatchNormMoments(self.count + other.count, self.sum + other.sum, self.sum_sq + other.sum_sq)


def _norms(net: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in net.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def batch_norm_order(net: nn.Module, input_shape: Sequence[int]) -> list[str]:
    """The batch norms of ``net`` in the order a forward pass reaches them (one pass of zeros of shape ``(2,
    *input_shape)`` in eval mode; ``net`` is not modified): the order :func:`reestimate_batch_norm` sets them in.

    >>> from bnpfed.models import simple_cnn_bn
    >>> batch_norm_order(simple_cnn_bn(1, 8), (1, 8, 8))
    ['bn1', 'bn2']
    """
    net = copy.deepcopy(net).eval()
    order: list[str] = []
    for name, m in _norms(net).items():
        m.register_forward_pre_hook(lambda module, args, name=name: order.append(name) if name not in order else None)
    param = next(iter(net.parameters()), None)
    with torch.no_grad():
        net(torch.zeros(2, *input_shape, dtype=param.dtype if param is not None else None))
    return order


def batch_norm_moments(net: nn.Module, batches, layers: Sequence[str] | None = None) -> dict[str, BatchNormMoments]:
    """A client's step of re-estimating the running statistics: the moments of the inputs of batch norms ``layers``
    (default: every one) over the given batches, the whole network in eval mode -- every batch norm normalising by the
    running statistics it holds, so that a layer's inputs are what they will be once the layers below it are set
    (:func:`reestimate_batch_norm` sets them one at a time, front to back). ``net`` is not modified.

    :param net: the (global) network.
    :param batches: an iterable of input tensors ``(N, *input_shape)`` (e.g. the client's training inputs in batches).
    :param layers: names of batch norms of ``net``; None: all of them.
    :returns: batch norm's qualified name -> :class:`BatchNormMoments`.
    """
    net = copy.deepcopy(net).eval()
    norms = _norms(net)
    if layers is not None:
        unknown = [n for n in layers if n not in norms]
        if unknown:
            raise ValueError(f"layers: expected batch norms of net among {list(norms)}, got {unknown}")
        norms = {n: norms[n] for n in layers}
    moments: dict[str, BatchNormMoments] = {}

    def hook(name):
        def record(module, args):
            x = args[0].detach().to(torch.float64)
            x = x.transpose(0, 1).reshape(x.shape[1], -1)  # (C, N * spatial)
            m = BatchNormMoments(float(x.shape[1]), x.sum(1), (x * x).sum(1))
            moments[name] = moments[name] + m if name in moments else m
        return record

    for name, m in norms.items():
        m.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        for x in batches:
            net(x)
    return moments


def set_batch_norm_statistics(net: nn.Module, moments: Mapping[str, BatchNormMoments]) -> nn.Module:
    """The server's step: set the running mean and (unbiased) variance of every batch norm in ``moments`` from its
    pooled moments (the sum of the clients' :func:`batch_norm_moments`), in place. Returns ``net``."""
    norms = _norms(net)
    statistics = batch_norm_statistics(moments)
    with torch.no_grad():
        for name, (mean, var) in statistics.items():
            if name not in norms:
                raise ValueError(f"moments: expected batch norms of net among {list(norms)}, got {name!r}")
            norms[name].running_mean.copy_(mean)
            norms[name].running_var.copy_(var)
    return net


def batch_norm_statistics(moments: Mapping[str, BatchNormMoments]) -> dict[str, tuple[Tensor, Tensor]]:
    """The running mean and (unbiased) variance, float64, of every batch norm from pooled moments: batch norm's
    name -> ``(mean, var)`` (what :func:`set_batch_norm_statistics` writes)."""
    out = {}
    for name, mo in moments.items():
        if mo.count <= 0:
            raise ValueError(f"moments[{name!r}]: expected a positive count, got {mo.count}")
        mean = mo.sum / mo.count
        out[name] = (mean, (mo.sum_sq / mo.count - mean * mean).clamp(min=0) * (mo.count / max(mo.count - 1.0, 1.0)))
    return out


def reestimate_batch_norm(net: nn.Module, client_batches: Sequence) -> nn.Module:
    """Re-estimate a (global) network's batch-norm running statistics from the clients' data in one process, one batch
    norm at a time, front to back (:func:`batch_norm_order`): each layer's moments pooled (summed) over every client's
    :func:`batch_norm_moments` with the layers below already set, then set (:func:`set_batch_norm_statistics`). This
    is REPAIR's reset (Jordan et al., ICLR 2023) with the statistics pooled over the clients' examples; layer by layer,
    a batch norm's eval-mode outputs have mean 0 and variance 1 over all the clients' examples even when their inputs
    differ in distribution (estimated in one pass, every layer's inputs normalised by each batch's own statistics,
    the second batch norm of a conv-BN-conv-BN net came out at variances 0.47-1.61 under such covariate shift). After
    a match it lifts a batch-normalised global network above what the members' mean statistics give (from near
    chance with posterior-mean weights; :mod:`bnpfed.matching.permutation`, *Batch norm*). The first batch norm's
    running mean is then the mean of its inputs over all the clients' examples::

        >>> from bnpfed.models import simple_cnn_bn
        >>> x = torch.randn(32, 1, 8, 8)
        >>> net = reestimate_batch_norm(simple_cnn_bn(1, 8), [[x[:16]], [x[16:24], x[24:]]])   # two clients
        >>> torch.allclose(net.bn1.running_mean, net.conv1(x).mean((0, 2, 3)), atol=1e-6)
        True

    :param net: the network, modified in place and returned.
    :param client_batches: one sequence of input batches per client.
    """
    client_batches = [list(batches) for batches in client_batches]
    first = next((b[0] for b in client_batches if b), None)
    if first is None:
        raise ValueError("client_batches: expected at least one batch of inputs, got none")
    for layer in batch_norm_order(net, tuple(first.shape[1:])):
        pooled = None
        for batches in client_batches:
            for m in batch_norm_moments(net, batches, [layer]).values():
                pooled = m if pooled is None else pooled + m
        if pooled is not None:
            set_batch_norm_statistics(net, {layer: pooled})
    return net
