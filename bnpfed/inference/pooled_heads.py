"""The clients' own output layers on PFNM's global body, pooled log-linearly with class-share weights.

PFNM's global output layer averages the clients' output weights class by class with weights ``omega_jk = n_jk /
sum_j' n_j'k`` (the class shares, :func:`~bnpfed.inference.averaging_weights`): when no unit merges, the global
network computes ``z_k(x) = sum_j omega_jk z_jk(x)``, the clients' *logits* averaged class by class. A client's
logits are defined only up to a term ``c_j(x)`` common to its classes (its softmax does not see it), and under label
skew that term stops cancelling: class k's logit comes from the clients that hold k, so a client whose logits run
large (a few classes learnt confidently, nothing learnt about the others) makes its classes win on every input. On
Fashion-MNIST under Dirichlet(0.5) (LeNet, J = 10, seed 2; benchmarks/README.md) that average of the clients' own
networks is 0.651 accurate where the average of their probabilities is 0.871, and PFNM's global network, 0.652, is
that average again: the matching costs nothing there, the output rule everything.

The pooled output takes each client's output layer as it trained it, reading the global units its own units were
matched to (``h_S_j(x)``, the members' averages), and pools the clients' *log-probabilities* class by class:

    log p(k | x) = sum_j omega_jk log softmax_k(W_j h(x) + b_j) + const(x),

a logarithmic opinion pool (Genest & Zidek 1986) with the class shares as weights. Each client's term is at most 0,
so a client can only lower a class it knows about, never raise one by the scale of its logits. When every class's
shares are equal (``omega_jk = 1/J``) the pool is the averaged logits up to a term common to the classes, so it
predicts exactly what PFNM's global network predicts when that network's weights are the members' average (the
empirical-Bayes default; tested); only under unequal shares do they differ. A class no client holds gets equal
weights ``1/J`` (the clients' log-probabilities of a class none of them saw), not 0, which would put it above every
held class. The cost: J output layers over the last hidden group instead of one (``J * C * (L + 1)`` parameters;
LeNet's 552 global fc2 units, J = 10: 55,300, 49,770 more than one layer, beside 2.6 M), one forward pass through
the shared body.

:func:`client_heads` is the pure function (the J output layers in the global units' columns),
:class:`PooledHeads` the layer, :func:`pooled_network` the global network with it in place of the output layer.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor, nn

__all__ = ["PooledHeads", "client_heads", "pool_log_probabilities", "pooled_network", "pooling_weights"]


def pooling_weights(class_shares) -> Tensor:
    """(J, C) the pool's weights ``omega_jk``: the class shares ``n_jk / sum_j' n_j'k`` (columns summing to 1), a
    class no client holds (a column of zeros) weighted ``1/J`` for every client.

        >>> pooling_weights(torch.tensor([[3.0, 0.0], [1.0, 0.0]]) / torch.tensor([4.0, 1.0]))
        tensor([[0.7500, 0.5000],
                [0.2500, 0.5000]], dtype=torch.float64)
    """
    s = torch.as_tensor(class_shares, dtype=torch.float64)
    if s.ndim != 2 or not torch.isfinite(s).all() or (s < 0).any():
        raise ValueError(f"class_shares: expected a (J, C) array of finite shares >= 0, got shape "
                         f"{tuple(s.shape)}")
    total = s.sum(0)
    if (total > 0).any() and not torch.allclose(total[total > 0], torch.ones_like(total[total > 0]), atol=1e-6):
        raise ValueError("class_shares: expected every held class's shares to sum to 1 over the clients "
                         f"(n_jk / sum_j' n_j'k), got sums {total.tolist()}")
    return torch.where(total > 0, s, torch.full_like(s, 1.0 / s.shape[0]))


def pool_log_probabilities(logits: Tensor, weights: Tensor) -> Tensor:
    """(N, C) ``sum_j omega_jk log softmax_k(logits_j)``: the clients' log-probabilities pooled class by class.

    :param Tensor logits: (J, N, C) each client's logits.
    :param Tensor weights: (J, C) ``omega_jk`` (:func:`pooling_weights`).
    """
    if logits.ndim != 3 or weights.shape != (logits.shape[0], logits.shape[2]):
        raise ValueError(f"weights: expected (J, C) = {(logits.shape[0], logits.shape[-1])} for logits of shape "
                         f"(J, N, C) {tuple(logits.shape)}, got {tuple(weights.shape)}")
    return (weights.to(logits.dtype)[:, None, :] * logits.log_softmax(-1)).sum(0)


class PooledHeads(nn.Module):
    """J linear output layers on one input, their log-probabilities pooled class by class
    (:func:`pool_log_probabilities`); its output is the pool's log-probabilities up to a term common to the classes
    (the logits of the pooled distribution: ``softmax`` of it is that distribution).

    :param Tensor weight: (J, C, L) each head's weights (parameters).
    :param Tensor bias: (J, C) each head's bias (parameters).
    :param Tensor pool_weights: (J, C) ``omega_jk`` (a buffer).
    """

    def __init__(self, weight: Tensor, bias: Tensor, pool_weights: Tensor):
        super().__init__()
        if weight.ndim != 3 or bias.shape != weight.shape[:2] or pool_weights.shape != weight.shape[:2]:
            raise ValueError(f"weight, bias, pool_weights: expected shapes (J, C, L), (J, C), (J, C), got "
                             f"{tuple(weight.shape)}, {tuple(bias.shape)}, {tuple(pool_weights.shape)}")
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = nn.Parameter(bias.detach().clone())
        self.register_buffer("pool_weights", pool_weights.detach().clone())

    @property
    def heads(self) -> int:
        return self.weight.shape[0]

    def forward(self, h: Tensor) -> Tensor:
        logits = torch.einsum("nl,jcl->jnc", h, self.weight) + self.bias[:, None, :]
        return pool_log_probabilities(logits, self.pool_weights)

    def extra_repr(self) -> str:
        J, C, L = self.weight.shape
        return f"heads={J}, in_features={L}, classes={C}"


def _output_layer(match) -> tuple[str, str, str | None, str]:
    """The output layer's module name, weight and bias keys, and the group owning its weights, checked."""
    spec = match.spec
    weights = spec.params_of_kind("output_weight")
    if len(weights) != 1:
        raise ValueError(f"match: expected a spec with one output layer, got output weights {weights}")
    weight = weights[0]
    biases = spec.params_of_kind("output_bias")
    group = spec.owner(weight)
    if group is None:
        raise ValueError(f"match: the output weight {weight!r} belongs to no group of the spec (nothing was matched "
                         "below the output layer)")
    return weight.rpartition(".")[0], weight, biases[0] if biases else None, group


def client_heads(match, client_states: Sequence[Mapping[str, Tensor]]) -> tuple[Tensor, Tensor]:
    """(J, C, L) weights and (J, C) biases: each client's output layer with its columns moved to the global units
    its own units were matched to (``match.assignments`` of the group below the output layer, the units it reported
    inactive left out as the match left them out: ``match.kept_units``), 0 on the global units it does not hold.

    :param match: the :class:`~bnpfed.inference.SpecMatch` of these clients, in the same order.
    :param client_states: the J clients' ``state_dict`` s (or networks) that were matched.
    """
    _, weight, bias, group = _output_layer(match)
    labels = match.assignments[group]
    states = [s.state_dict() if isinstance(s, nn.Module) else s for s in client_states]
    if len(states) != len(labels):
        raise ValueError(f"client_states: expected the {len(labels)} clients that were matched, got {len(states)}")
    L = match.widths[group]
    heads, biases = [], []
    for j, (state, label) in enumerate(zip(states, labels)):
        if weight not in state:
            raise ValueError(f"client_states[{j}]: expected the output weight {weight!r}, got keys {list(state)[:6]}...")
        w = state[weight].detach().to(torch.float64)
        if w.ndim != 2:
            raise ValueError(f"client_states[{j}][{weight!r}]: expected a Linear output layer's (C, L_j) weight, got "
                             f"shape {tuple(w.shape)} (pooled heads need the output layer to read the group's units "
                             "directly)")
        kept = (torch.arange(w.shape[1]) if match.kept_units is None
                else torch.as_tensor(match.kept_units[j][group], dtype=torch.long))
        if kept.numel() != label.numel():
            raise ValueError(f"client_states[{j}]: its output layer reads {w.shape[1]} units of which {kept.numel()} "
                             f"were kept, but the match has {label.numel()} of its units in group {group!r} (an output "
                             "layer after a Flatten reads several columns per unit: not supported)")
        head = torch.zeros(w.shape[0], L, dtype=torch.float64)
        head[:, label] = w[:, kept]
        heads.append(head)
        biases.append(torch.zeros(w.shape[0], dtype=torch.float64) if bias is None
                      else state[bias].detach().to(torch.float64))
    return torch.stack(heads), torch.stack(biases)


def pooled_network(match, client_states: Sequence[Mapping[str, Tensor]]) -> nn.Module:
    """The global network of ``match`` (:meth:`SpecMatch.network`) with its output layer replaced by the clients'
    own output layers, pooled (:class:`PooledHeads`, weights :func:`pooling_weights` of ``match.class_shares``).

    :param match: a :class:`~bnpfed.inference.SpecMatch` with a template network and class shares (a
        :class:`~bnpfed.inference.posterior_matching.PosteriorMatch` too: its posterior-mean body, the clients'
        posterior-mean networks as ``client_states``; measured as a prototype only, benchmarks/README.md).
    :param client_states: the clients' networks or ``state_dict`` s that were matched, in the match's order.
    """
    name, _, _, _ = _output_layer(match)
    if match.class_shares is None:
        raise ValueError("match: expected the class shares the matching used (SpecMatch.class_shares), got None")
    weight, bias = client_heads(match, client_states)
    net = match.network()
    parent_name, _, child = name.rpartition(".")
    parent = net.get_submodule(parent_name) if parent_name else net
    old = getattr(parent, child)
    if not isinstance(old, nn.Linear):
        raise ValueError(f"match: expected a Linear output layer {name!r}, got {type(old).__name__}")
    dtype = old.weight.dtype
    setattr(parent, child, PooledHeads(weight.to(dtype), bias.to(dtype),
                                       pooling_weights(match.class_shares).to(dtype)))
    return net.eval()
