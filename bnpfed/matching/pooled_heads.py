"""The clients' own output layers on PFNM's global body, pooled log-linearly with class-share weights.

PFNM's global output layer averages the clients' output weights class by class with weights ``omega_jk = n_jk /
sum_j' n_j'k`` (the class shares, :func:`~bnpfed.matching.averaging_weights`): when no unit merges, the global
network computes ``z_k(x) = sum_j omega_jk z_jk(x)``, the clients' *logits* averaged class by class. A client's
logits are defined only up to a term ``c_j(x)`` common to its classes (its softmax does not see it), and under label
skew that term stops cancelling: class k's logit comes from the clients that hold k, so a client whose logits run
large (a few classes learnt confidently, nothing learnt about the others) makes its classes win on every input.
Under strong label skew that average of the clients' own networks, with no matching at all, can be far less accurate
than the average of their probabilities, and PFNM's global network is that average again: the matching costs
nothing there, the output rule everything (the docs' benchmark page on one-shot matching measures it).

The pooled output takes each client's output layer as it trained it, reading the global units its own units were
matched to (``h_S_j(x)``, the members' averages), and pools the clients' *log-probabilities* class by class:

    log p(k | x) = sum_j omega_jk log softmax_k(W_j h(x) + b_j) + const(x),

a log-linear pool whose weights depend on the class (the class shares); a logarithmic opinion pool (Genest & Zidek
1986) has one weight per client for every class, so this is one only when the shares are equal. Each client's term is
at most 0,
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

Matched posterior fusion has the same output rule (its global output layer fuses the clients' output weights with
the class shares), so :class:`PooledPosterior` gives its Bayesian global network the same pool: the fused posterior
of the body, each client's own posterior of its output layer at the global units its units were matched to, and the
posterior predictive

    p(k | x) = (1/S) sum_s softmax_k( sum_j omega_jk log softmax(W_j^(s) h^(s)(x) + b_j^(s)) ),

one draw ``s`` of the body's weights from the fused posterior and of every client's head from its own posterior,
the pool taken inside each draw (each draw is one pooled network, the predictive their average).
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from bnpfed.matching.permutation import network_from_state
from bnpfed.validation import check_positive

__all__ = ["HEAD_CHOICES", "PooledHeads", "PooledPosterior", "SHARES_DIFFER_LEVEL", "TEMPERATURES", "attach_heads",
           "chosen_heads", "client_heads", "fit_temperature", "homogeneity_p_value", "pool_log_probabilities",
           "pool_nll", "pooled_heads_layer", "pooled_heads_of", "pooled_network", "pooling_weights", "sample_state",
           "set_temperature", "shares_differ"]

#: What a global network's output layer can be: ``"auto"`` (pooled when the clients' class shares differ,
#: :func:`chosen_heads`), ``"fused"`` (the class-share average or fusion of the clients' output layers) or ``"pooled"``
#: (the clients' own output layers pooled log-linearly with the class shares).
HEAD_CHOICES = ("auto", "fused", "pooled")

#: ``heads="auto"``: the level of Pearson's chi-squared test of homogeneity of the clients' class counts below which
#: their class shares differ (:func:`shares_differ`). A random split (IID) has equal shares in expectation, and passes
#: the test (fused heads, unchanged) with probability 1 - 1e-3; a label-skewed one (Dirichlet(0.5), shards) fails it
#: by hundreds of orders of magnitude.
SHARES_DIFFER_LEVEL = 1e-3


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


def homogeneity_p_value(class_counts) -> float:
    """The p-value of Pearson's chi-squared test that the J clients draw their examples from one class distribution
    (Pearson 1900; a test of homogeneity of the ``(J, C)`` contingency table of training examples per class):
    ``X^2 = sum_jk (n_jk - e_jk)^2 / e_jk`` with ``e_jk = n_j. n_.k / n``, referred to chi-squared with ``(J' - 1)
    (C' - 1)`` degrees of freedom, J' and C' the clients and classes with any example. 1 when fewer than two clients or
    classes hold examples (nothing can differ).

    >>> homogeneity_p_value([[10, 10], [10, 10]])
    1.0
    >>> homogeneity_p_value([[100, 0], [0, 100]]) < 1e-40
    True
    """
    from scipy.stats import chi2

    counts = torch.as_tensor(class_counts, dtype=torch.float64)
    if counts.ndim != 2 or not bool(torch.isfinite(counts).all()) or bool((counts < 0).any()):
        raise ValueError(f"class_counts: expected a (J, C) table of examples per class, >= 0, got shape "
                         f"{tuple(counts.shape)}")
    counts = counts[counts.sum(1) > 0][:, counts.sum(0) > 0]
    if counts.shape[0] < 2 or counts.shape[1] < 2:
        return 1.0
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    statistic = float(((counts - expected).square() / expected).sum())
    return float(chi2.sf(statistic, (counts.shape[0] - 1) * (counts.shape[1] - 1)))


def shares_differ(class_counts, level: float = SHARES_DIFFER_LEVEL) -> bool:
    """Whether the clients' class shares differ: :func:`homogeneity_p_value` of their ``(J, C)`` class counts below
    ``level`` (default :data:`SHARES_DIFFER_LEVEL`)."""
    return homogeneity_p_value(class_counts) < level


def chosen_heads(heads: str, class_counts) -> str:
    """The output layer ``heads`` asks for given the clients' ``(J, C)`` class counts: ``"fused"`` or ``"pooled"`` as
    given, and ``"auto"`` as ``"pooled"`` when their class shares differ (:func:`shares_differ`), else ``"fused"``
    (also without counts, ``class_counts`` None).
    With equal shares the pool predicts what the class-share average of the output layers predicts (module
    docstring), so the fused layer, one instead of J, loses nothing there; under label skew the average is what
    fails, and the pool is the default.

    >>> chosen_heads("auto", [[50, 50], [50, 50]]), chosen_heads("auto", [[90, 10], [10, 90]])
    ('fused', 'pooled')
    """
    if heads not in HEAD_CHOICES:
        raise ValueError(f"heads: expected one of {list(HEAD_CHOICES)}, got {heads!r}")
    if heads != "auto":
        return heads
    if class_counts is None:   # no counts (a match that weighs every client alike): nothing says the shares differ
        return "fused"
    return "pooled" if shares_differ(class_counts) else "fused"


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
    (:func:`pool_log_probabilities`) and divided by a temperature; its output is the pool's log-probabilities over
    ``temperature`` up to a term common to the classes (the logits of the pooled distribution: ``softmax`` of it is
    that distribution).

    :param Tensor weight: (J, C, L) each head's weights (parameters).
    :param Tensor bias: (J, C) each head's bias (parameters).
    :param Tensor pool_weights: (J, C) ``omega_jk`` (a buffer).
    :param float temperature: ``T > 0`` (a buffer). Default 1: the pool itself; :func:`fit_temperature` chooses one
        from the clients' data.
    """

    def __init__(self, weight: Tensor, bias: Tensor, pool_weights: Tensor, temperature: float = 1.0):
        super().__init__()
        if weight.ndim != 3 or bias.shape != weight.shape[:2] or pool_weights.shape != weight.shape[:2]:
            raise ValueError(f"weight, bias, pool_weights: expected shapes (J, C, L), (J, C), (J, C), got "
                             f"{tuple(weight.shape)}, {tuple(bias.shape)}, {tuple(pool_weights.shape)}")
        self.weight = nn.Parameter(weight.detach().clone())
        self.bias = nn.Parameter(bias.detach().clone())
        self.register_buffer("pool_weights", pool_weights.detach().clone())
        self.register_buffer("temperature", torch.tensor(check_positive(temperature, "temperature"), dtype=weight.dtype))

    @property
    def heads(self) -> int:
        return self.weight.shape[0]

    def forward(self, h: Tensor) -> Tensor:
        logits = torch.einsum("nl,jcl->jnc", h, self.weight) + self.bias[:, None, :]
        return pool_log_probabilities(logits, self.pool_weights) / self.temperature

    def extra_repr(self) -> str:
        J, C, L = self.weight.shape
        return f"heads={J}, in_features={L}, classes={C}, temperature={float(self.temperature):.4g}"


#: The temperatures the clients score a pool at (:func:`pool_nll`): 61 values, geometric from 0.05 to 5 (each about
#: 8 % above the one before).
TEMPERATURES = torch.logspace(math.log10(0.05), math.log10(5.0), 61, dtype=torch.float64)


def pool_nll(log_pool: Tensor, y: Tensor, temperatures: Tensor = TEMPERATURES) -> Tensor:
    """(K,) the summed negative log-likelihood of labels ``y`` (N,) under the pool at each of ``temperatures`` (K,):
    ``-sum_n log (1/S) sum_s softmax(log_pool[s, n] / T)[y_n]``. What one client computes on its own data and sends;
    the server adds the clients' sums up (:func:`fit_temperature`).

    :param Tensor log_pool: (N, C) a pooled network's outputs at temperature 1, or (S, N, C) those of S posterior
        draws (the predictive averages the draws' probabilities, each at temperature T).
    """
    z = log_pool.to(torch.float64)
    if z.ndim == 2:
        z = z[None]
    if z.ndim != 3 or y.shape != (z.shape[1],):
        raise ValueError(f"log_pool, y: expected (N, C) or (S, N, C) outputs and (N,) labels, got "
                         f"{tuple(log_pool.shape)} and {tuple(y.shape)}")
    t = torch.as_tensor(temperatures, dtype=torch.float64).reshape(-1, 1, 1, 1)
    log_probs = (z[None] / t).log_softmax(-1)                                  # (K, S, N, C)
    picked = log_probs.gather(-1, y.reshape(1, 1, -1, 1).expand(*log_probs.shape[:3], 1))[..., 0]
    predictive = torch.logsumexp(picked, 1) - math.log(z.shape[0])              # (K, N)
    return -predictive.sum(-1)


def fit_temperature(nll_sums: Sequence[Tensor], temperatures: Tensor = TEMPERATURES) -> float:
    """The temperature of ``temperatures`` at which the clients' summed negative log-likelihoods (each client's
    :func:`pool_nll` on its own data) add up to the least: a temperature scaling (Guo et al., ICML 2017) of the pool
    fitted by the federation, no data leaving a client. The clients' *training* data serve when nothing is held out
    (their best temperature was the test split's to a grid step in the docs' benchmark page on calibration); clients
    that fit their data to a loss near 0 would choose one too low."""
    total = torch.stack([torch.as_tensor(s, dtype=torch.float64) for s in nll_sums]).sum(0)
    temperatures = torch.as_tensor(temperatures, dtype=torch.float64)
    if total.shape != temperatures.shape or not torch.isfinite(total).all():
        raise ValueError(f"nll_sums: expected one finite sum per temperature ({tuple(temperatures.shape)}), got "
                         f"{tuple(total.shape)}")
    return float(temperatures[int(total.argmin())])


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

    :param match: the :class:`~bnpfed.matching.SpecMatch` of these clients, in the same order.
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


def pooled_network(match, client_states: Sequence[Mapping[str, Tensor]], temperature: float = 1.0) -> nn.Module:
    """The global network of ``match`` (:meth:`SpecMatch.network`) with its output layer replaced by the clients'
    own output layers, pooled (:class:`PooledHeads`, weights :func:`pooling_weights` of ``match.class_shares``).

    :param match: a :class:`~bnpfed.matching.SpecMatch` with a template network and class shares (a
        :class:`~bnpfed.matching.posteriors.PosteriorMatch` too: its posterior-mean body, the clients'
        posterior-mean networks as ``client_states``; :class:`PooledPosterior` is its Bayesian predictive).
    :param client_states: the clients' networks or ``state_dict`` s that were matched, in the match's order.
    :param float temperature: the pool's temperature (:class:`PooledHeads`). Default 1.
    """
    name, _, _, _ = _output_layer(match)
    heads = pooled_heads_of(match, client_states)
    return attach_heads(match.network(), name, heads["weight"], heads["bias"], heads["pool_weights"], temperature)


def pooled_heads_of(match, client_states: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """What a :class:`PooledHeads` layer of ``match`` and its clients holds, float64: ``"weight"`` (J, C, L) and
    ``"bias"`` (J, C) (:func:`client_heads`), ``"pool_weights"`` (J, C) (:func:`pooling_weights` of
    ``match.class_shares``); what a Flower server sends its clients beside the global body."""
    if match.class_shares is None:
        raise ValueError("match: expected the class shares the matching used (SpecMatch.class_shares), got None")
    weight, bias = client_heads(match, client_states)
    return {"weight": weight, "bias": bias, "pool_weights": pooling_weights(match.class_shares)}


def attach_heads(net: nn.Module, output: str, weight: Tensor, bias: Tensor, pool_weights: Tensor,
                 temperature: float = 1.0) -> nn.Module:
    """``net`` with its ``Linear`` output layer named ``output`` replaced (in place) by
    ``PooledHeads(weight, bias, pool_weights, temperature)`` in the layer's dtype; returned in eval mode."""
    parent_name, _, child = output.rpartition(".")
    parent = net.get_submodule(parent_name) if parent_name else net
    old = getattr(parent, child, None)
    if not isinstance(old, nn.Linear):
        raise ValueError(f"output: expected the name of a Linear output layer, got {output!r} "
                         f"({type(old).__name__})")
    dtype = old.weight.dtype
    setattr(parent, child, PooledHeads(weight.to(dtype), bias.to(dtype), pool_weights.to(dtype), temperature))
    return net.eval()


def pooled_heads_layer(net: nn.Module) -> PooledHeads:
    """``net``'s one :class:`PooledHeads` layer (raises unless there is exactly one)."""
    layers = [m for m in net.modules() if isinstance(m, PooledHeads)]
    if len(layers) != 1:
        raise ValueError(f"net: expected a network with one PooledHeads layer, got {len(layers)}")
    return layers[0]


def set_temperature(net: nn.Module, temperature: float) -> nn.Module:
    """``net``'s :class:`PooledHeads` layer's temperature set to ``temperature`` (in place); returns ``net``."""
    pooled_heads_layer(net).temperature.fill_(check_positive(temperature, "temperature"))
    return net


def sample_state(locs: Mapping[str, Tensor], variances: Mapping[str, Tensor],
                 generator: torch.Generator) -> dict[str, Tensor]:
    """One draw from a mean-field Gaussian posterior: ``locs`` with every key of ``variances`` replaced by
    ``loc + sqrt(variance) * eps``, ``eps ~ N(0, I)`` from ``generator`` (keys in ``variances``' order); the other
    entries (deterministic parameters) as they are."""
    out = dict(locs)
    for k, v in variances.items():
        loc = locs[k]
        eps = torch.randn(loc.shape, generator=generator, dtype=torch.float64)
        out[k] = (loc.to(torch.float64) + v.to(torch.float64).clamp_min(0).sqrt() * eps).to(loc.dtype)
    return out


#: What :meth:`PooledPosterior.heads` gives and :meth:`PooledPosterior.of_heads` takes.
HEAD_TENSORS = ("weight", "weight_variance", "bias", "bias_variance", "pool_weights", "temperature")


class PooledPosterior:
    """Matched posterior fusion's global Bayesian network with the clients' own posterior output layers pooled: the
    fused posterior of the body and each client's posterior of its output layer at the global units its units were
    matched to, log-probabilities pooled with the class shares inside every weight draw (the module docstring's
    predictive). Built from a match by :meth:`of_match`; the constructor takes the tensors themselves (what a
    Flower client receives).

    :param nn.Module template: the network kind the body is built from (:func:`network_from_state`).
    :param dict locs: the body's ``state_dict`` (posterior means and deterministic values; the output layer's
        entries are replaced by the heads).
    :param dict variances: the body's Bayesian sites' posterior variances.
    :param str output: the output layer's module name (a ``Linear`` in the template).
    :param Tensor weight: (J, C, L) the heads' posterior means, 0 on the global units a client does not hold;
        ``weight_variance`` their variances (0 there: those weights are exactly 0).
    :param Tensor bias: (J, C) the heads' biases' means; ``bias_variance`` their variances (0: point masses).
    :param Tensor pool_weights: (J, C) ``omega_jk`` (:func:`pooling_weights`).
    :param float temperature: the pool's temperature in every draw (:class:`PooledHeads`). Default 1; the attribute
        may be set later (e.g. to :func:`fit_temperature` of the clients' :func:`pool_nll` of :meth:`log_pools`).
    """

    def __init__(self, template: nn.Module, locs: Mapping[str, Tensor], variances: Mapping[str, Tensor], output: str,
                 weight: Tensor, weight_variance: Tensor, bias: Tensor, bias_variance: Tensor, pool_weights: Tensor,
                 temperature: float = 1.0):
        if not isinstance(template, nn.Module):
            raise ValueError(f"template: expected the network kind (an nn.Module), got {type(template).__name__}")
        layer = dict(template.named_modules()).get(output)
        if not isinstance(layer, nn.Linear):
            raise ValueError(f"output: expected the name of the template's Linear output layer, got {output!r}")
        if weight.ndim != 3 or weight_variance.shape != weight.shape:
            raise ValueError(f"weight, weight_variance: expected two (J, C, L) tensors of one shape, got "
                             f"{tuple(weight.shape)} and {tuple(weight_variance.shape)}")
        J, C, L = weight.shape
        for name, value in (("bias", bias), ("bias_variance", bias_variance), ("pool_weights", pool_weights)):
            if tuple(value.shape) != (J, C):
                raise ValueError(f"{name}: expected shape (J, C) = {(J, C)}, got {tuple(value.shape)}")
        for name, value in (("weight_variance", weight_variance), ("bias_variance", bias_variance)):
            if not torch.isfinite(value).all() or (value < 0).any():
                raise ValueError(f"{name}: expected finite variances >= 0")
        self.template, self.output = template, output
        self.locs, self.variances = dict(locs), dict(variances)
        self.weight, self.weight_variance = weight.to(torch.float64), weight_variance.to(torch.float64)
        self.bias, self.bias_variance = bias.to(torch.float64), bias_variance.to(torch.float64)
        self.pool_weights = pool_weights.to(torch.float64)
        self.temperature = check_positive(temperature, "temperature")

    @classmethod
    def of_match(cls, match, client_posteriors: Sequence[tuple[Mapping[str, Tensor], Mapping[str, Tensor]]]
                 ) -> "PooledPosterior":
        """The pooled posterior of a :class:`~bnpfed.matching.posteriors.PosteriorMatch` (with its template
        and class shares) and its J clients' posteriors in the match's order, each ``(locs, variances)``
        (:func:`~bnpfed.matching.posteriors.client_posterior`; a head entry not among ``variances`` is a
        point mass), their heads placed by :func:`client_heads`."""
        name, weight, bias, group = _output_layer(match)
        if getattr(match, "template", None) is None or not hasattr(match, "variances"):
            raise ValueError("match: expected a PosteriorMatch with its template network (match_posteriors(..., "
                             f"template=...)), got {type(match).__name__}")
        if match.class_shares is None:
            raise ValueError("match: expected the class shares the matching used (PosteriorMatch.class_shares), got "
                             "None")
        posteriors = list(client_posteriors)
        if len(posteriors) != len(match.assignments[group]):
            raise ValueError(f"client_posteriors: expected the {len(match.assignments[group])} clients that were "
                             f"matched, got {len(posteriors)}")
        means, spreads = [], []
        for j, pair in enumerate(posteriors):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], Mapping)
                    and isinstance(pair[1], Mapping)):
                raise ValueError(f"client_posteriors[{j}]: expected a (locs, variances) pair of dicts, got "
                                 f"{type(pair).__name__}")
            locs, variances = pair
            keys = [k for k in (weight, bias) if k is not None and k in locs]
            means.append({k: locs[k] for k in keys})
            spreads.append({k: variances[k] if k in variances else torch.zeros_like(locs[k]) for k in keys})
        W, b = client_heads(match, means)
        W_var, b_var = client_heads(match, spreads)
        return cls(match.template, match.locs, match.variances, name, W, W_var, b, b_var,
                   pooling_weights(match.class_shares))

    @classmethod
    def of_heads(cls, template: nn.Module, locs: Mapping[str, Tensor], variances: Mapping[str, Tensor], output: str,
                 heads: Mapping[str, Tensor]) -> "PooledPosterior":
        """The pooled posterior of a body ``(locs, variances)`` and ``heads`` as :meth:`heads` gives them (what a
        Flower server sends beside the body, what a global-model file keeps): ``"weight"``, ``"weight_variance"``,
        ``"bias"``, ``"bias_variance"``, ``"pool_weights"``, ``"temperature"``."""
        missing = [k for k in HEAD_TENSORS if k not in heads]
        if missing:
            raise ValueError(f"heads: expected the pooled posterior's heads {list(HEAD_TENSORS)}, missing {missing} "
                             "(a network's pooled heads have no variances)")
        return cls(template, locs, variances, output, heads["weight"], heads["weight_variance"], heads["bias"],
                   heads["bias_variance"], heads["pool_weights"], float(heads["temperature"]))

    @property
    def clients(self) -> int:
        """J, the number of heads."""
        return self.weight.shape[0]

    def _network(self, locs, weight: Tensor, bias: Tensor) -> nn.Module:
        return attach_heads(network_from_state(self.template, locs), self.output, weight, bias, self.pool_weights,
                            check_positive(self.temperature, "temperature"))

    def heads(self) -> dict[str, Tensor]:
        """The heads' posterior as tensors: ``"weight"``, ``"weight_variance"`` (J, C, L), ``"bias"``,
        ``"bias_variance"``, ``"pool_weights"`` (J, C), ``"temperature"`` (0-d) (what a Flower server sends beside
        the global body)."""
        return {"weight": self.weight, "weight_variance": self.weight_variance, "bias": self.bias,
                "bias_variance": self.bias_variance, "pool_weights": self.pool_weights,
                "temperature": torch.tensor(float(self.temperature), dtype=torch.float64)}

    def mean_network(self) -> nn.Module:
        """The pooled posterior-mean network: the body's posterior means, every head's posterior means (for a match,
        :func:`pooled_network` of it and the clients' means)."""
        return self._network(self.locs, self.weight, self.bias)

    def sample_network(self, generator: torch.Generator) -> nn.Module:
        """One pooled network drawn from the posterior: the body (:func:`sample_state`), then every head's weights
        ``(J, C, L)`` and biases ``(J, C)``, in that order from ``generator``."""
        body = sample_state(self.locs, self.variances, generator)
        W = self.weight + self.weight_variance.sqrt() * torch.randn(self.weight.shape, generator=generator,
                                                                    dtype=torch.float64)
        b = self.bias + self.bias_variance.sqrt() * torch.randn(self.bias.shape, generator=generator,
                                                                dtype=torch.float64)
        return self._network(body, W, b)

    @torch.no_grad()
    def log_pools(self, x: Tensor, num_samples: int = 10, seed: Optional[int] = None) -> Tensor:
        """(S, N, C) the pool's log-probabilities (up to a term per row) in ``num_samples`` draws
        (:meth:`sample_network`, from a generator seeded with ``seed``; None: seeded from torch's global generator),
        at temperature 1: what :func:`pool_nll` scores a temperature with."""
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples: expected an int >= 1, got {num_samples!r}")
        if seed is None:
            seed = int(torch.randint(0, 2 ** 62, (1,)))
        generator = torch.Generator().manual_seed(int(seed))
        return torch.stack([self.sample_network(generator).to(x.dtype)(x) for _ in range(num_samples)]) \
            * self.temperature

    @torch.no_grad()
    def predict_proba(self, x: Tensor, num_samples: int = 10, seed: Optional[int] = None) -> Tensor:
        """(N, C) the posterior predictive: the pooled networks' class probabilities (at ``temperature``) averaged
        over ``num_samples`` draws (:meth:`sample_network`) from a generator seeded with ``seed`` (None: seeded from
        torch's global generator)."""
        return (self.log_pools(x, num_samples, seed) / self.temperature).softmax(-1).mean(0)
