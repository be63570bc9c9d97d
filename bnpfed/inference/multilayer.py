"""PFNM for fully connected networks of any depth: one layer at a time, every layer through :func:`match_layer`.

Yurochkin et al. 2019, appendix B. Client j holds a ReLU MLP with weights ``W_c`` (H_c^j x H_{c-1}^j, torch's
(out, in) convention) and biases ``b_c`` for hidden layers c = 1..K, and an output layer ``(W_out, b_out)`` with C
classes. A hidden neuron of layer c is matched as one vector in R^D made of

* its incoming weights, when the layer below is the input (c = 1) or already matched: the columns are then re-indexed
  to the L_{c-1} global neurons below (a global neuron the client lacks contributes a weight 0, as in the reference);
* its bias (prior mean ``bias_mu0``, 0.1 in the reference);
* its outgoing weights, when the layer above is the output (c = K) or already matched. Output-layer coordinates carry
  precision ``share_jk / sigma2`` with ``share_jk = n_jk / sum_j' n_j'k`` the share of class k's training examples
  held by client j (as in the reference code), so a client that never saw class k does not pull that class's
  weights.

``direction="top-down"`` is the published order: layers K..1, a neuron being (incoming weights if c = 1, bias,
outgoing weights re-indexed to the matched layer above). Above the first layer a neuron is then only its bias and
its outgoing weights -- for the last hidden layer just C + 1 numbers -- too little evidence to tell neurons apart, and
with the published constants the upper layers of a 784-100-100-10 net collapse towards one client's width.
``direction="bottom-up"`` (default) matches layers 1..K, a neuron being (incoming weights re-indexed to the matched
layer below, bias, and outgoing weights if c = K): every layer is matched on its incoming weights, hundreds of
coordinates. For one hidden layer both orders give the same vectors ``[W_in, b, W_out]``.

Global weights (``global_weights``). ``"posterior-mean"`` (the published way, and the default with fixed
hyper-parameters): every weight is its atom's posterior mean; the output bias is the class-share-weighted posterior
mean of the clients' output biases, ``b_out_k = (bias_mu0/sigma0_2 + sum_j share_jk b_out_jk / sigma2) /
(1/sigma0_2 + sum_j share_jk / sigma2)`` (the reference's ``process_softmax_bias``), with the last hidden layer's
final sigma2 and sigma0_2: those of the output weights (``sigma2_scaled``, ``sigma0_2_scaled``) when that layer has
its own for them. ``"average"`` (the default under empirical Bayes): the clients' networks averaged on the matched
neurons. A global hidden neuron's incoming weights and bias are the average of its members' (their incoming weights
re-indexed to the global neurons below), so that its pre-activation is the average of theirs; the logits are the
class-wise average of the clients' logits, ``W_out[k, i] = sum_j omega_jk sum_{l -> i} W_out^j[k, l]`` and
``b_out[k] = sum_j omega_jk b_out^j[k]`` with ``omega_jk = share_jk`` (0 for a class nobody holds), each client's
output weights re-indexed to the global neurons its own were matched to.
The posterior mean shrinks an atom of m clients towards the prior mean by ``sigma2 / (m sigma0_2 + sigma2)``. With
the published values (sigma2 = sigma0_2 = 1 against weights of order 0.1, mu0 = 0) that only rescales a neuron
(ReLU is positively homogeneous) and weighs the output layer by popularity much as the average does. With estimated
values it does harm: mu0 is the average neuron, towards which every rarely shared neuron is blurred, and the output
weights are pulled towards a class-wise mean. On MNIST (784-100-10, J = 10, 10 000 held-out training images, seven
partitions of each kind) the posterior means of the empirical-Bayes matching were 4.7 points less accurate than its
average under Dirichlet(0.5) (from 0.4 better to 7.7 worse), and within 0.1 point of it under homogeneous ones.

Hyper-parameters. By default (``hyperparameters="empirical-bayes"``) every hidden layer's matching estimates its own
mu0 (per coordinate), sigma0_2, sigma2 and gamma0 from the clients' neurons (:func:`~bnpfed.inference.match_layer`);
a scalar fixes that hyper-parameter in every layer, a list gives one value per hidden layer (None entries estimated
there). ``mu0`` fixes the prior mean of the weight coordinates (incoming and output weights) and ``bias_mu0`` that of
the bias coordinate, each on its own; what is not given is estimated per coordinate. The output bias is no coordinate
of any neuron: its prior mean is ``bias_mu0`` when given, and otherwise the mean over the classes of the
class-share-weighted mean of the clients' output biases (the same moment estimate as a layer's mu0, each class being
one atom). ``hyperparameters="fixed"`` is the published way: sigma2, sigma0_2 and gamma0 required, ``mu0 = 0`` and
``bias_mu0 = 0.1`` unless given.

Communication rounds ("PFNM with communication" in the paper's experiments): in round r client j starts from its
slice of round r-1's global network (:meth:`NetworkMatch.client_slice`), whose hidden-layer-c neurons are, in order,
the global neurons ``assignments[c][j]``. ``match_networks(..., warm_start=previous)`` starts each layer's matching
from that assignment instead of the greedy pass, as the published code does, and the sweeps improve on it from there.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from bnpfed.inference.matching import MatchResult, average_atoms, averaging_weights, match_layer
from bnpfed.models.networks import mlp
from bnpfed.validation import check_choice

__all__ = ["NetworkMatch", "match_networks", "linear_layers", "network_from_layers"]


def linear_layers(net: nn.Module) -> list[tuple[Tensor, Tensor]]:
    """The (weight, bias) pairs of every ``nn.Linear`` in ``net``, in order (weight in torch's (out, in) layout)."""
    layers = [(m.weight.detach().clone(), m.bias.detach().clone()) for m in net.modules() if isinstance(m, nn.Linear)]
    if not layers:
        raise ValueError("net has no nn.Linear layers")
    return layers


def network_from_layers(layers: Sequence[tuple[Tensor, Tensor]]) -> nn.Sequential:
    """The ReLU MLP of :func:`bnpfed.models.mlp` (``Flatten, Linear, ReLU, ..., Linear``; parameters ``"1.weight"``,
    ``"1.bias"``, ``"3.weight"``, ...) carrying exactly the given (weight (out, in), bias (out,)) pairs, in the
    default dtype.

    Usage::

        >>> net = network_from_layers([(torch.ones(3, 4), torch.zeros(3)), (torch.ones(2, 3), torch.full((2,), 0.5))])
        >>> net
        Sequential(
          (0): Flatten(start_dim=1, end_dim=-1)
          (1): Linear(in_features=4, out_features=3, bias=True)
          (2): ReLU()
          (3): Linear(in_features=3, out_features=2, bias=True)
        )
        >>> net(torch.ones(1, 2, 2)).tolist()          # each hidden unit sums 4 ones; the output sums 3 of them
        [[12.5, 12.5]]
    """
    pairs = [(torch.as_tensor(w), torch.as_tensor(b)) for w, b in layers]
    if not pairs:
        raise ValueError("layers: expected at least one (weight, bias) pair, got none")
    for i, (w, b) in enumerate(pairs):
        if w.dim() != 2 or b.shape != (w.shape[0],):
            raise ValueError(f"layers[{i}]: expected weight (out, in) and bias (out,), got {tuple(w.shape)} and "
                             f"{tuple(b.shape)}")
        if i and w.shape[1] != pairs[i - 1][0].shape[0]:
            raise ValueError(f"layers[{i}]: expected a weight taking the {pairs[i - 1][0].shape[0]} outputs of "
                             f"layers[{i - 1}], got one taking {w.shape[1]} inputs")
    widths = [int(w.shape[0]) for w, _ in pairs]
    net = mlp(int(pairs[0][0].shape[1]), widths[:-1], widths[-1])
    with torch.no_grad():
        for linear, (w, b) in zip((m for m in net if isinstance(m, nn.Linear)), pairs):
            linear.weight.copy_(w)
            linear.bias.copy_(b)
    return net


@dataclass
class NetworkMatch:
    """Result of :func:`match_networks`.

    :param list layers: global (weight, bias) per layer, hidden layers then the output layer.
    :param list assignments: per hidden layer, J long tensors mapping each client's neurons to global neurons.
    :param list layer_results: the :class:`MatchResult` of every hidden layer, bottom layer first.
    :param str direction: the order the layers were matched in, ``"bottom-up"`` or ``"top-down"``.
    :param float seconds: wall time of all the matching.
    :param Tensor class_shares: (J, C) ``share_jk = n_jk / sum_j' n_j'k`` (0 for a class nobody holds).
    :param list hyperparameters: per hidden layer (bottom layer first), the ``hyperparameters`` of its
        :class:`MatchResult` (mu0, sigma0_2, sigma2, gamma0: estimated or given); ``{}`` for a ``layer_fn`` whose
        result carries none.
    :param float output_bias_mu0: the prior mean the output bias was shrunk towards (given or estimated); None with
        ``global_weights="average"`` (nothing is shrunk).
    :param str global_weights: how the weights were built, ``"average"`` or ``"posterior-mean"``
        (:func:`match_networks`).
    """

    layers: list
    assignments: list
    layer_results: list
    direction: str
    seconds: float = 0.0
    class_shares: Tensor | None = field(default=None, repr=False)
    hyperparameters: list = field(default_factory=list)
    output_bias_mu0: float | None = None
    global_weights: str = "posterior-mean"

    @property
    def hidden_sizes(self) -> list[int]:
        return [int(w.shape[0]) for w, _ in self.layers[:-1]]

    def network(self) -> nn.Sequential:
        """The global network: posterior-mean weights of every layer."""
        return network_from_layers(self.layers)

    def client_slice(self, j: int) -> list[tuple[Tensor, Tensor]]:
        """Client j's slice of the global network: for every hidden layer, the global neurons its own neurons were
        matched to (in its own order), and the weights between them; the whole output layer."""
        out, prev = [], None
        for c, (w, b) in enumerate(self.layers[:-1]):
            rows = self.assignments[c][j]
            w_rows = w[rows]
            out.append((w_rows if prev is None else w_rows[:, prev], b[rows]))
            prev = rows
        w_out, b_out = self.layers[-1]
        out.append((w_out[:, prev], b_out))
        return out


def _per_layer(value, K: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != K:
            raise ValueError(f"{name} must be a scalar or one value per hidden layer ({K}), got {len(value)}")
        return list(value)
    return [value] * K


def _accepts(fn, name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name`` (by name or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _validate(client_layers, class_counts):
    if not isinstance(client_layers, Sequence) or len(client_layers) == 0:
        raise ValueError("client_layers must be a non-empty sequence (one list of (weight, bias) per client)")
    J = len(client_layers)
    layers = []
    for j, net in enumerate(client_layers):
        if isinstance(net, nn.Module):
            net = linear_layers(net)
        pairs = [(torch.as_tensor(w, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)) for w, b in net]
        if len(pairs) < 2:
            raise ValueError(f"client_layers[{j}] has {len(pairs)} layer(s): PFNM needs at least one hidden layer")
        for c, (w, b) in enumerate(pairs):
            if w.dim() != 2 or b.shape != (w.shape[0],):
                raise ValueError(f"client_layers[{j}] layer {c}: weight must be (out, in) and bias (out,), got "
                                 f"{tuple(w.shape)} and {tuple(b.shape)}")
            if c and w.shape[1] != pairs[c - 1][0].shape[0]:
                raise ValueError(f"client_layers[{j}] layer {c} takes {w.shape[1]} inputs but layer {c - 1} has "
                                 f"{pairs[c - 1][0].shape[0]} outputs")
            if not (np.isfinite(w.detach().numpy()).all() and np.isfinite(b.detach().numpy()).all()):
                raise ValueError(f"client_layers[{j}] layer {c} contains NaN or inf")
        if layers:
            ref = layers[0]
            if len(pairs) != len(ref):
                raise ValueError(f"client_layers[{j}] has {len(pairs)} layers but client 0 has {len(ref)}")
            if pairs[0][0].shape[1] != ref[0][0].shape[1] or pairs[-1][0].shape[0] != ref[-1][0].shape[0]:
                raise ValueError(f"client_layers[{j}] maps {pairs[0][0].shape[1]} inputs to {pairs[-1][0].shape[0]} "
                                 f"outputs but client 0 maps {ref[0][0].shape[1]} to {ref[-1][0].shape[0]}")
        layers.append(pairs)
    C = layers[0][-1][0].shape[0]
    if class_counts is None:
        counts = torch.ones(J, C, dtype=torch.float64)
    else:
        counts = torch.as_tensor(np.asarray(class_counts), dtype=torch.float64)
        if counts.shape != (J, C):
            raise ValueError(f"class_counts must have shape ({J}, {C}) (clients x classes), got {tuple(counts.shape)}")
        if not torch.isfinite(counts).all() or (counts < 0).any() or (counts.sum(1) <= 0).any():
            raise ValueError("class_counts must be finite, >= 0, with a positive total per client")
    # share of each class's examples held by each client; a class nobody holds gets share 0 everywhere (dividing by
    # the total only where it is positive, so that any positive multiple of the counts gives the same shares)
    total = counts.sum(0, keepdim=True)
    held = total > 0
    shares = torch.where(held, counts / torch.where(held, total, torch.ones_like(total)), torch.zeros_like(counts))
    return layers, shares


def _warm_start_assignments(warm_start, layers) -> list | None:
    """Per hidden layer, J initial assignments from a previous :class:`NetworkMatch`, checked against the clients'
    widths (labels distinct within a client are checked by the layer matcher)."""
    if warm_start is None:
        return None
    if isinstance(warm_start, NetworkMatch):
        previous = warm_start.assignments
    elif isinstance(warm_start, Sequence) and not isinstance(warm_start, (str, bytes)):
        previous = warm_start
    else:
        raise ValueError(f"warm_start: expected a NetworkMatch (a previous match_networks result), its per-layer "
                         f"assignments, or None, got {type(warm_start).__name__}")
    J, K = len(layers), len(layers[0]) - 1
    if len(previous) != K:
        raise ValueError(f"warm_start: expected a match of {K} hidden layer(s), as deep as the clients' networks, got "
                         f"one of {len(previous)}")
    out = []
    for c in range(K):
        if len(previous[c]) != J:
            raise ValueError(f"warm_start.assignments[{c}]: expected one assignment per client ({J}), got "
                             f"{len(previous[c])}")
        per_client = []
        for j in range(J):
            labels = torch.as_tensor(previous[c][j])
            width = int(layers[j][c][0].shape[0])
            if labels.dim() != 1 or labels.numel() != width:
                raise ValueError(f"warm_start.assignments[{c}][{j}]: expected {width} labels (client {j}'s hidden "
                                 f"layer {c} has {width} neurons), got shape {tuple(labels.shape)}")
            per_client.append(labels)
        out.append(per_client)
    return out


#: How the global network's weights are built from a matching (``match_networks(global_weights=...)``).
GLOBAL_WEIGHTS = ("average", "posterior-mean")


def _reindex(w: Tensor, columns: Tensor, size: int) -> Tensor:
    """Add the columns of ``w`` into the given global positions of a ``size``-wide zero matrix (positions are
    distinct for a matching; a baseline that maps two neurons to one global neuron adds their weights)."""
    return torch.zeros(w.shape[0], size, dtype=w.dtype).index_add_(1, torch.as_tensor(columns), w)


def _average_network(layers, assignments, sizes, shares) -> tuple[list, list]:
    """The global weights of ``global_weights="average"`` (module docstring): layer by layer, the clients' neurons
    [incoming weights re-indexed to the global neurons below, bias (, output weights at the class shares' scales, in
    the last hidden layer)] through :func:`~bnpfed.inference.matching.average_atoms`; the output bias the class-wise
    weighted average of the clients'."""
    J, K = len(layers), len(layers[0]) - 1
    C = shares.shape[1]
    weights, biases = [], []
    for c in range(K):
        n_in = layers[0][0][0].shape[1] if c == 0 else sizes[c - 1]
        vectors = []
        for j in range(J):
            w, b = layers[j][c]
            parts = [w if c == 0 else _reindex(w, assignments[c - 1][j], n_in), b[:, None]]
            if c == K - 1:
                parts.append(layers[j][K][0].T)
            vectors.append(torch.cat(parts, dim=1))
        scales = None
        if c == K - 1:
            scales = torch.ones(J, n_in + 1 + C, dtype=torch.float64)
            scales[:, n_in + 1:] = shares
        atoms = average_atoms(vectors, assignments[c], precisions=scales)
        weights.append(atoms[:, :n_in])
        biases.append(atoms[:, n_in])
    weights.append(atoms[:, n_in + 1:].T)
    omega = averaging_weights(shares)
    biases.append((omega * torch.stack([layers[j][K][1] for j in range(J)])).sum(0))
    return weights, biases


def match_networks(
    client_layers,
    class_counts=None,
    *,
    sigma2=None,
    sigma0_2=None,
    gamma0=None,
    mu0=None,
    bias_mu0=None,
    hyperparameters: Literal["empirical-bayes", "fixed"] = "empirical-bayes",
    direction: Literal["bottom-up", "top-down"] = "bottom-up",
    sweeps: int | None = None,
    seed: int | None = None,
    warm_start: NetworkMatch | None = None,
    layer_fn=match_layer,
    global_weights: Literal["average", "posterior-mean"] | None = None,
    **matcher_kwargs,
) -> NetworkMatch:
    """Match J clients' MLPs into one global MLP (PFNM's server step, one communication round).

    The networks come from the clients' local training (``nn.Module`` s such as :func:`bnpfed.models.mlp`, or their
    (weight, bias) pairs) and ``class_counts`` from their labels. Here two clients hold the same 4-3-2 network with
    its hidden neurons in different orders, and matching puts them back together::

        >>> g = torch.Generator().manual_seed(0)
        >>> net = [(torch.randn(3, 4, generator=g), torch.randn(3, generator=g)),     # hidden layer, 4 -> 3
        ...        (torch.randn(2, 3, generator=g), torch.randn(2, generator=g))]     # output layer, 3 -> 2
        >>> perm = torch.tensor([2, 0, 1])
        >>> shuffled = [(net[0][0][perm], net[0][1][perm]), (net[1][0][:, perm], net[1][1])]
        >>> counts = [[10, 5], [5, 10]]                                               # (J, C) examples per class
        >>> fixed = dict(hyperparameters="fixed", sigma2=0.01, sigma0_2=1.0, gamma0=1.0)
        >>> result = match_networks([net, shuffled], counts, seed=0, **fixed)
        >>> result.hidden_sizes
        [3]
        >>> torch.equal(result.assignments[0][1], result.assignments[0][0][perm])
        True
        >>> result.network()(torch.zeros(5, 4)).shape
        torch.Size([5, 2])

    By default each hidden layer's hyper-parameters are estimated from the clients' weights (the output weights,
    seen at the class shares' precision, get their own variances, ``*_scaled``)::

        >>> estimated = match_networks([net, shuffled], counts, seed=0)
        >>> estimated.hidden_sizes, estimated.layer_results[0].estimated
        ([3], ('mu0', 'sigma0_2', 'sigma2', 'gamma0', 'sigma0_2_scaled', 'sigma2_scaled'))

    The next communication round starts every client from its slice of the global network; warm-started from this
    match, and with no sweeps, the round-2 matching returns the same assignment::

        >>> slices = [result.client_slice(j) for j in range(2)]
        >>> again = match_networks(slices, counts, seed=0, warm_start=result, sweeps=0, **fixed)
        >>> all(torch.equal(a, b) for a, b in zip(again.assignments[0], result.assignments[0]))
        True

    :param client_layers: J networks, each an ``nn.Module`` (its ``nn.Linear`` layers in order) or a list of
        (weight (out, in), bias (out,)) pairs. Depths, input and output sizes must agree; widths may differ.
    :param class_counts: (J, C) number of training examples of each class at each client (any positive multiple
        works: only ``n_jk / sum_j' n_j'k`` is used); default: all ones.
    :param sigma2: noise variance, ``sigma0_2`` prior variance, ``gamma0`` IBP mass: None (estimated per layer under
        empirical Bayes; required with ``"fixed"``), a scalar (that value in every hidden layer), or one value per
        hidden layer (None entries estimated in that layer).
    :param mu0: prior mean of the weight coordinates (reference 0), ``bias_mu0`` of the bias coordinate and of the
        output bias (reference 0.1): None (estimated per coordinate under empirical Bayes; 0 and 0.1 with
        ``"fixed"``), a scalar, or one per hidden layer.
    :param str hyperparameters: ``"empirical-bayes"`` (default) or ``"fixed"`` (see the module docstring and
        :func:`~bnpfed.inference.match_layer`).
    :param direction: ``"bottom-up"`` (default) or ``"top-down"`` (the published order); see the module docstring.
    :param int sweeps: remove-and-rematch passes per layer (see :func:`match_layer`; None: its default, 5 with
        ``"fixed"``, at most 50 under empirical Bayes).
    :param int seed: seed of the sweeps' client order; layer c uses ``seed + c``.
    :param warm_start: optional :class:`NetworkMatch` of the same J clients with the same number of hidden layers,
        typically the previous communication round's, when every client's network is its
        :meth:`~NetworkMatch.client_slice` (trained further): for each hidden layer c, ``warm_start.assignments[c][j]``
        (one label per neuron of client j's layer c, distinct within a client) is client j's initial assignment,
        replacing the greedy pass (``init_assignments`` of :func:`match_layer`). Or the same labels without a match,
        per hidden layer J label arrays (e.g. the global ids of what each client was sent: its slice, or the whole
        network for a client that was not matched). Default None: match from scratch.
    :param layer_fn: the one-layer matcher, :func:`match_layer` by default; any function with its signature
        returning an object with ``global_atoms``, ``assignments`` and ``num_atoms`` (a baseline such as k-means
        plugs in here and gets the same neuron vectors, re-indexing and output bias), or one such function per
        hidden layer (a sequence, in layer order). It is passed ``neurons``, ``sigma2``, ``sigma0_2``, ``gamma0``,
        ``mu0`` (None, or a (D,) tensor with NaN on the coordinates to estimate), ``precisions``, ``sweeps``,
        ``seed`` and ``matcher_kwargs``; ``hyperparameters`` only if it takes it (by name or ``**kwargs``), and
        ``init_assignments`` only when ``warm_start`` is given. If its result has no ``hyperparameters`` (or they
        lack sigma2 / sigma0_2), a ``"posterior-mean"`` output bias uses the given ones, 1 where None.
    :param str global_weights: how the global network's weights are built from the matching (module docstring):
        ``"average"`` (the clients' networks averaged on the matched neurons) or ``"posterior-mean"`` (the atoms'
        posterior means, as published). None (default): ``"average"`` under empirical Bayes, ``"posterior-mean"``
        with fixed hyper-parameters.
    :param matcher_kwargs: passed to ``layer_fn`` (``objective``, ``popularity_factor``, ``start``, ...).
    """
    t0 = time.perf_counter()
    mode = check_choice(hyperparameters, ("empirical-bayes", "fixed"), "hyperparameters")
    eb = mode == "empirical-bayes"
    if global_weights is None:
        combine = "average" if eb else "posterior-mean"
    else:
        combine = check_choice(global_weights, GLOBAL_WEIGHTS, "global_weights")
    layers, shares = _validate(client_layers, class_counts)
    init = _warm_start_assignments(warm_start, layers)
    if direction not in ("bottom-up", "top-down"):
        raise ValueError(f"direction must be 'bottom-up' or 'top-down', got {direction!r}")
    J, K = len(layers), len(layers[0]) - 1
    if callable(layer_fn):
        layer_fns = [layer_fn] * K
    elif isinstance(layer_fn, Sequence) and len(layer_fn) == K and all(callable(f) for f in layer_fn):
        layer_fns = list(layer_fn)
    else:
        raise ValueError(f"layer_fn: expected a one-layer matcher or one per hidden layer ({K}), got {layer_fn!r}")
    sig, sig0, gam, mus, bias_mus = (_per_layer(v, K, n) for v, n in (
        (sigma2, "sigma2"), (sigma0_2, "sigma0_2"), (gamma0, "gamma0"), (mu0, "mu0"), (bias_mu0, "bias_mu0")))
    if not eb:  # the published prior means
        mus = [0.0 if m is None else m for m in mus]
        bias_mus = [0.1 if m is None else m for m in bias_mus]
    D_in = layers[0][0][0].shape[1]
    C = layers[0][-1][0].shape[0]
    weights: list = [None] * (K + 1)
    biases: list = [None] * (K + 1)
    assignments: list = [None] * K
    results: list = [None] * K

    def match(c: int, parts: list[list[Tensor]], kinds: list[str], output_part: int | None) -> MatchResult:
        """Match layer c (0-based) from per-client blocks of coordinates, each block of weights (``"w"``) or the
        bias (``"b"``); ``output_part`` indexes the block holding output-layer weights (class-share precision)."""
        neurons = [torch.cat(p, dim=1) for p in parts]
        widths = [p.shape[1] for p in parts[0]]
        means = [mus[c] if kind == "w" else bias_mus[c] for kind in kinds]
        mu = None
        if any(m is not None for m in means):
            mu = torch.cat([torch.full((w,), float("nan") if m is None else float(m), dtype=torch.float64)
                            for w, m in zip(widths, means)])
        precisions = None
        if output_part is not None:
            start = sum(widths[:output_part])
            precisions = torch.ones(J, sum(widths), dtype=torch.float64)
            precisions[:, start:start + C] = shares
        fn = layer_fns[c]
        extra = {} if init is None else {"init_assignments": init[c]}
        if _accepts(fn, "hyperparameters"):
            extra["hyperparameters"] = mode
        r = fn(neurons, sigma2=sig[c], sigma0_2=sig0[c], gamma0=gam[c], mu0=mu, precisions=precisions, sweeps=sweeps,
               seed=None if seed is None else seed + c, **extra, **matcher_kwargs)
        results[c] = r
        assignments[c] = r.assignments
        return r

    if direction == "bottom-up":
        for c in range(K):
            parts = []
            for j in range(J):
                w, b = layers[j][c]
                incoming = w if c == 0 else _reindex(w, assignments[c - 1][j], weights[c - 1].shape[0])
                block = [incoming, b[:, None]]
                if c == K - 1:
                    block.append(layers[j][K][0].T)
                parts.append(block)
            kinds = ["w", "b"] + (["w"] if c == K - 1 else [])
            r = match(c, parts, kinds, 2 if c == K - 1 else None)
            atoms = r.global_atoms.to(torch.float64)
            n_in = parts[0][0].shape[1]
            weights[c], biases[c] = atoms[:, :n_in], atoms[:, n_in]
            if c == K - 1:
                weights[K] = atoms[:, n_in + 1:].T
    else:
        for c in reversed(range(K)):
            parts = []
            for j in range(J):
                w, b = layers[j][c]
                block = [w] if c == 0 else []
                block.append(b[:, None])
                w_up = layers[j][c + 1][0]
                block.append(w_up.T if c == K - 1 else _reindex(w_up.T, assignments[c + 1][j], biases[c + 1].shape[0]))
                parts.append(block)
            kinds = (["w"] if c == 0 else []) + ["b", "w"]
            r = match(c, parts, kinds, len(parts[0]) - 1 if c == K - 1 else None)
            atoms = r.global_atoms.to(torch.float64)
            n_in = D_in if c == 0 else 0
            if c == 0:
                weights[0] = atoms[:, :D_in]
            biases[c] = atoms[:, n_in]
            weights[c + 1] = atoms[:, n_in + 1:].T  # the layer above's incoming weights
    per_layer = [dict(getattr(r, "hyperparameters", None) or {}) for r in results]
    if combine == "average":
        sizes = [int(r.num_atoms) for r in results]
        weights, biases = _average_network(layers, assignments, sizes, shares)
        b_mu0 = None
    else:
        # output bias: posterior mean under N(bias_mu0, sigma0_2) with client j's bias seen at precision
        # share_jk / sigma2, sigma2 and sigma0_2 those of the last hidden layer
        last = per_layer[-1]
        s2 = last.get("sigma2", sig[-1] if sig[-1] is not None else 1.0)
        s02 = last.get("sigma0_2", sig0[-1] if sig0[-1] is not None else 1.0)
        # the output bias is seen at the class shares' precision, as the output weights: their variances when they
        # have their own (the coordinates with per-client precision scales, see match_layer)
        s2_out = last.get("sigma2_scaled", s2)
        s02 = last.get("sigma0_2_scaled", s02)
        b_out = torch.stack([layers[j][K][1] for j in range(J)])
        weighted, precision = (shares * b_out).sum(0) / s2_out, shares.sum(0) / s2_out
        if bias_mus[-1] is not None:
            b_mu0 = float(bias_mus[-1])
        else:  # the mean over the classes of each class's precision-weighted mean of the clients' biases
            held = precision > 0
            b_mu0 = float((weighted[held] / precision[held]).mean())
        biases[K] = (b_mu0 / s02 + weighted) / (1.0 / s02 + precision)
    dtype = torch.get_default_dtype()
    return NetworkMatch(
        layers=[(w.to(dtype), b.to(dtype)) for w, b in zip(weights, biases)],
        assignments=assignments,
        layer_results=results,
        direction=direction,
        seconds=time.perf_counter() - t0,
        class_shares=shares,
        hyperparameters=per_layer,
        output_bias_mu0=b_mu0,
        global_weights=combine,
    )
