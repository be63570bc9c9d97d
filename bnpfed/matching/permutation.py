"""Permutation specs: a feed-forward network's hidden-unit symmetries as data, and PFNM matching of any network that
has one. This module is the public face of that floor; each job lives in a file of its own:
:mod:`~bnpfed.matching.spec` (the spec types), :mod:`~bnpfed.matching.derive` (deriving and checking a spec),
:mod:`~bnpfed.matching.layout` (a unit's vector), :mod:`~bnpfed.matching.assembly` (atoms back to a network, a
client's slice), :mod:`~bnpfed.matching.network` (the one network driver, :func:`match_by_spec`),
:mod:`~bnpfed.matching.fedma` (one group at a time) and :mod:`~bnpfed.matching.batch_norm` (running statistics
from data).

The hidden units of a network can be reordered without changing what it computes, provided every parameter axis that
indexes them is reordered the same way (Git Re-Basin, Ainsworth et al., ICLR 2023, ``weight_matching.py``). A
:class:`PermutationSpec` lists those symmetries: one :class:`Group` per hidden permutation (the units of a Linear, the
output channels of a Conv2d), each with every (parameter, axis) it acts on, and a kind for every parameter. For LeNet::

    conv1: conv1.weight[0], conv1.bias[0], conv2.weight[1]
    conv2: conv2.weight[0], conv2.bias[0], fc1.weight[1] in blocks of 25
    fc1: fc1.weight[0], fc1.bias[0], fc2.weight[1]
    fc2: fc2.weight[0], fc2.bias[0], fc3.weight[1]

``fc1.weight[1] in blocks of 25``: the Flatten before fc1 lays conv2's 16 channels of 5x5 pixels out channel-major,
so channel c owns fc1's input columns ``25c .. 25c + 24``. Parameters are named by their ``state_dict`` keys; a
batch norm after a layer adds its ``weight``, ``bias``, ``running_mean`` and ``running_var`` (axis 0) to the layer's
group (``num_batches_tracked`` is left alone). :func:`derive_spec` finds all this from the module tree and a forward
pass; :func:`verify_spec` checks any spec numerically.

**Writing a spec by hand.** For a network :func:`derive_spec` does not understand (a concatenation, a layer whose
input and output channels one skip ties), list the groups yourself, in the order they are to be matched, and a kind
for every parameter::

    >>> from torch import nn
    >>> class Residual(nn.Module):                       # stem, then x + conv2(relu(conv1(x))), pool, classifier
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.stem = nn.Conv2d(1, 4, 3, padding=1)
    ...         self.conv1, self.conv2 = nn.Conv2d(4, 5, 3, padding=1), nn.Conv2d(5, 4, 3, padding=1)
    ...         self.fc = nn.Linear(4, 3)
    ...     def forward(self, x):
    ...         x = torch.relu(self.stem(x))
    ...         x = torch.relu(x + self.conv2(torch.relu(self.conv1(x))))
    ...         return self.fc(x.mean((2, 3)))
    >>> spec = PermutationSpec(
    ...     groups=[Group("stem", [Axis("stem.weight", 0), Axis("stem.bias", 0),      # the skip adds stem's channels
    ...                            Axis("conv2.weight", 0), Axis("conv2.bias", 0),    # to conv2's: one permutation
    ...                            Axis("conv1.weight", 1), Axis("fc.weight", 1)]),
    ...             Group("conv1", [Axis("conv1.weight", 0), Axis("conv1.bias", 0), Axis("conv2.weight", 1)])],
    ...     kinds={"stem.weight": "weight", "stem.bias": "bias", "conv1.weight": "weight", "conv1.bias": "bias",
    ...            "conv2.weight": "weight", "conv2.bias": "bias", "fc.weight": "output_weight",
    ...            "fc.bias": "output_bias"})
    >>> verify_spec(Residual(), spec, (1, 6, 6))         # permuting by the spec leaves the outputs unchanged
    >>> print(spec)
    PermutationSpec: 2 hidden permutations, matched in this order
      stem: stem.weight[0], stem.bias[0], conv2.weight[0], conv2.bias[0], conv1.weight[1], fc.weight[1]
      conv1: conv1.weight[0], conv1.bias[0], conv2.weight[1]
      output layer (axis 0 = classes): fc.weight, fc.bias

A residual block like this one needs no hand-written spec any more: :func:`derive_spec` ties the permutations a
residual addition joins (identity and projection skips, batch norms on either branch). **A spec in a file**, for what
the derivation cannot read, is the JSON of :meth:`PermutationSpec.to_dict` (``bnpfed match --spec FILE`` reads it
with :meth:`PermutationSpec.from_dict` and checks it on the networks)::

    {"groups": [{"name": "stem", "axes": [["stem.weight", 0], ["stem.bias", 0], ["conv2.weight", 0],
                                          ["conv2.bias", 0], ["conv1.weight", 1], ["fc.weight", 1]]},
                {"name": "conv1", "axes": [["conv1.weight", 0], ["conv1.bias", 0], ["conv2.weight", 1]]}],
     "kinds": {"stem.weight": "weight", "stem.bias": "bias", "conv1.weight": "weight", "conv1.bias": "bias",
               "conv2.weight": "weight", "conv2.bias": "bias", "fc.weight": "output_weight", "fc.bias": "output_bias"}}

(an axis is ``[param, dim]``, or ``[param, dim, block]`` with a block other than 1).

Kinds: ``"weight"`` and ``"bias"`` (of a Linear or Conv2d), ``"bn_weight"``, ``"bn_bias"``, ``"running_mean"``,
``"running_var"`` (of a batch norm), ``"output_weight"`` and ``"output_bias"`` (of the output layer, whose axis 0
indexes the classes and is not permuted). A ``state_dict`` key without a kind (``num_batches_tracked``) is copied
from the template network. The order of ``kinds`` is the order of the parameters inside a unit's vector.

**A unit's vector** (:func:`unit_vectors`). Groups are matched one at a time in the spec's order (bottom-up for a
derived spec). A parameter belongs to the *last* group (in that order) among those acting on it: once that group is
matched, every other axis of the parameter indexes already matched global units. The vector of a unit u of group g
concatenates, over the parameters belonging to g in ``kinds`` order (running statistics excepted), the parameter's
slice at u along g's axis (``block`` consecutive entries), with every other permuted axis re-indexed to the global
units of its group (a global unit the client lacks contributes 0), flattened in row-major order. For a derived spec
that is PFNM's bottom-up neuron (Yurochkin et al. 2019, appendix B): a Linear unit's incoming
weights and bias; a conv channel's ``C_in x k x k`` kernel (input channels re-indexed), bias and batch-norm scale and
shift; the last hidden group also carries the output layer's weights ``W_out[:, u]`` (``C x block`` of them after a
Flatten), which are seen at precision ``share_jk / sigma2`` (``share_jk = n_jk / sum_j' n_j'k``, client j's share of
class k's examples), so that a client that never saw class k does not pull that class's weights.

**Batch norm.** A unit's vector holds its batch norm's affine parameters (scale and shift; under fixed
hyper-parameters with prior means 1 and 0, torch's initial values), not the running statistics: those are summaries
of data on scales of their own, which one shared sigma2 would weigh badly. :func:`match_by_spec` gives a global unit
the mean of its members' running mean and variance (its members: the clients' units matched to it). That needs no
data and is exact when the clients hold permuted copies of one network, but a merged unit's weights are averages, and
the statistics of its pre-normalisation activations are not the averages of its members'. **Re-estimate them from
the clients' data after matching** (REPAIR, Jordan et al., ICLR 2023, which for a batch-normalised network is a reset
of the running statistics): each client sends :func:`batch_norm_moments` of its data under the global network (one
pass, batch norms in training mode), the server sums them and calls :func:`set_batch_norm_statistics`
(:func:`reestimate_batch_norm` does both in one process).

Why re-estimate: a merged channel's statistics are not its members' mean statistics, and with the members' means
alone a matched batch-normalised CNN can sit near chance where re-estimated statistics put it above the clients' own
networks (the docs' benchmark page on one-shot matching, "Batch norm after matching"; tutorial 04 shows it on the
digits). Folding each batch norm into its convolution before matching (the global network's batch norms then the
identity) does no better than the members' means, and the global network would lose its batch norms for the rounds
that follow, so it is not offered. Where nothing merges (the clients' networks side by side) the three agree.

From matched atoms back to a network: :func:`state_from_atoms` lays each group's atoms out into the parameters it
owns, :func:`network_from_state` rebuilds the template with the matched widths (Linear features, Conv2d channels,
BatchNorm features; any module type other than those three that holds a resized parameter is an error), and
:func:`client_slice` cuts a client's slice out of a global state (the global units each of its own units was matched
to, in its own order). :func:`match_by_spec` is the whole-network matcher built on these.

**One group at a time** (FedMA's layer-wise scheme, Wang et al., ICLR 2020): :func:`match_group` is
:func:`match_by_spec`'s step for one group (``match_by_spec`` is that step for every group in turn, the groups
matched before re-indexing the next), returning a :class:`GroupMatch`; :func:`align_to_group` gives a client the
matched group (every global unit, the next layer's input columns re-indexed to them, zeros for units it lacks), so
that after it every client holds the same units below the next group, which :func:`match_group` then takes as the
identity. Between two groups FedMA's clients retrain the layers above with the matched ones frozen
(:mod:`bnpfed.federated.pfnm`).
"""

from __future__ import annotations

import torch  # noqa: F401 (the examples above use it)

from bnpfed.matching.assembly import client_slice, network_from_atoms, network_from_state, state_from_atoms
from bnpfed.matching.batch_norm import (BatchNormMoments, batch_norm_moments, batch_norm_statistics,
                                         reestimate_batch_norm, set_batch_norm_statistics)
from bnpfed.matching.derive import derive_spec, verify_spec
from bnpfed.matching.fedma import align_to_group, match_group
from bnpfed.matching.layout import UnitVectors, VectorLayout, unit_vectors
from bnpfed.matching.network import GroupMatch, SpecMatch, match_by_spec, resolve_spec
from bnpfed.matching.spec import BN_FIXED_PRIOR_MEANS, KINDS, Axis, Group, PermutationSpec

__all__ = [
    "Axis",
    "Group",
    "PermutationSpec",
    "KINDS",
    "BN_FIXED_PRIOR_MEANS",
    "derive_spec",
    "resolve_spec",
    "verify_spec",
    "VectorLayout",
    "UnitVectors",
    "unit_vectors",
    "state_from_atoms",
    "network_from_state",
    "network_from_atoms",
    "client_slice",
    "SpecMatch",
    "match_by_spec",
    "GroupMatch",
    "match_group",
    "align_to_group",
    "BatchNormMoments",
    "batch_norm_moments",
    "batch_norm_statistics",
    "set_batch_norm_statistics",
    "reestimate_batch_norm",
]
