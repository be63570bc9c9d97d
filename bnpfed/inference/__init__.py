"""Inference: Hungarian MAP matching of neurons (PFNM), permutation specs (matching any feed-forward network), and
SVI for Bayesian clients.

The matching floor, one job a file: :mod:`~bnpfed.inference.matcher` (the one layer matcher: per-neuron,
per-coordinate noise, the Hungarian re-match, the full log likelihood), :mod:`~bnpfed.inference.driver` (sweeps and
estimates alternated, from one start or two), :mod:`~bnpfed.inference.layer_inputs` (its inputs checked; ``CompactRows``, a client's units on the columns it uses),
:mod:`~bnpfed.inference.atom_sums` (the sums the estimates read, client by client),
:mod:`~bnpfed.inference.empirical_bayes` (its two estimators), :mod:`~bnpfed.inference.matching` and
:mod:`~bnpfed.inference.bayesian_matching` (the homoscedastic and the heteroscedastic model: ``match_layer``,
``match_bayesian_layer``), :mod:`~bnpfed.inference.spec`, :mod:`~bnpfed.inference.derive`,
:mod:`~bnpfed.inference.layout`, :mod:`~bnpfed.inference.assembly` (permutation specs),
:mod:`~bnpfed.inference.network_matching` (the one network driver, ``match_by_spec``),
:mod:`~bnpfed.inference.fedma` (one group at a time), :mod:`~bnpfed.inference.posterior_matching` (the driver with a
fusing step), :mod:`~bnpfed.inference.batch_norm`, :mod:`~bnpfed.inference.activity` (the units a client reports
inactive on its data, left out of matching), :mod:`~bnpfed.inference.size` (a width or parameter count asked for,
met through the IBP mass), :mod:`~bnpfed.inference.pooled_heads` (the clients' own output layers on the global
body, pooled log-linearly); :mod:`~bnpfed.inference.permutation` is the public face of the spec
floor. The clients: :mod:`~bnpfed.inference.svi` (variational, by SVI; deterministic), :mod:`~bnpfed.inference.laplace`
(a trained network's diagonal Laplace posterior), :mod:`~bnpfed.inference.augment` (random crops and flips of their
training images)."""

from bnpfed.inference.matching import REFERENCE_CONSTANTS, MatchResult, assignment_objective, match_layer
from bnpfed.inference.bayesian_matching import bayesian_assignment_objective, match_bayesian_layer
from bnpfed.inference.matching import average_atoms, averaging_weights
from bnpfed.inference.layer_inputs import CompactRows
from bnpfed.inference.permutation import (
    BatchNormMoments,
    GroupMatch,
    PermutationSpec,
    SpecMatch,
    align_to_group,
    batch_norm_moments,
    client_slice,
    derive_spec,
    match_by_spec,
    match_group,
    network_from_state,
    reestimate_batch_norm,
    set_batch_norm_statistics,
    unit_vectors,
    verify_spec,
)

from bnpfed.inference.activity import drop_units, inactive_units, kept_units, unit_activity
from bnpfed.inference.size import SizeSearch, parameter_count
from bnpfed.inference.pooled_heads import (PooledHeads, PooledPosterior, client_heads, pool_log_probabilities,
                                          pooled_network)
from bnpfed.inference.augment import AUGMENTATIONS, random_crop_flip
from bnpfed.inference.guides import MeanFieldGuide
from bnpfed.inference.elbo import MeanFieldELBO
from bnpfed.inference.svi import BayesianClient, DeterministicClient, TrainingDiverged
from bnpfed.inference.laplace import LaplaceClient, laplace_posterior

__all__ = [
    "REFERENCE_CONSTANTS",
    "MatchResult",
    "assignment_objective",
    "average_atoms",
    "averaging_weights",
    "CompactRows",
    "match_layer",
    "match_bayesian_layer",
    "bayesian_assignment_objective",
    "BatchNormMoments",
    "GroupMatch",
    "PermutationSpec",
    "SpecMatch",
    "align_to_group",
    "batch_norm_moments",
    "client_slice",
    "derive_spec",
    "match_by_spec",
    "match_group",
    "network_from_state",
    "reestimate_batch_norm",
    "set_batch_norm_statistics",
    "unit_vectors",
    "verify_spec",
    "drop_units",
    "inactive_units",
    "kept_units",
    "unit_activity",
    "SizeSearch",
    "parameter_count",
    "PooledHeads",
    "PooledPosterior",
    "client_heads",
    "pool_log_probabilities",
    "pooled_network",
    "AUGMENTATIONS",
    "random_crop_flip",
    "MeanFieldGuide",
    "MeanFieldELBO",
    "BayesianClient",
    "DeterministicClient",
    "TrainingDiverged",
    "LaplaceClient",
    "laplace_posterior",
]
