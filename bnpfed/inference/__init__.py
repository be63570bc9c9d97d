"""Moved in bnpfed 0.2: ``bnpfed.inference`` held six rooms in one folder; each now has a folder and a face of its
own. Matching of neurons and networks is :mod:`bnpfed.matching`; the clients (variational, Laplace, guides, the ELBO,
image crops) are :mod:`bnpfed.clients`; the fusion baselines (weight matching, OT fusion, KL-fusion) are
:mod:`bnpfed.baselines`. Every old name and module here still works, with a ``DeprecationWarning`` naming its new
path, until 0.3."""

from __future__ import annotations

import importlib

from bnpfed._moved import warn_moved

#: Old names of this package's face, and the face that holds each now.
_FACES = {
    **dict.fromkeys(
        ("REFERENCE_CONSTANTS", "MatchResult", "assignment_objective", "average_atoms", "averaging_weights",
         "CompactRows", "match_layer", "match_bayesian_layer", "bayesian_assignment_objective", "BatchNormMoments",
         "GroupMatch", "PermutationSpec", "SpecMatch", "align_to_group", "batch_norm_moments", "client_slice",
         "derive_spec", "match_by_spec", "match_group", "network_from_state", "reestimate_batch_norm",
         "set_batch_norm_statistics", "unit_vectors", "verify_spec", "drop_units", "inactive_units", "kept_units",
         "unit_activity", "SizeSearch", "parameter_count", "PooledHeads", "PooledPosterior", "client_heads",
         "pool_log_probabilities", "pooled_network"), "bnpfed.matching"),
    **dict.fromkeys(
        ("AUGMENTATIONS", "random_crop_flip", "MeanFieldGuide", "MeanFieldELBO", "BayesianClient",
         "DeterministicClient", "TrainingDiverged", "LaplaceClient", "laplace_posterior"), "bnpfed.clients"),
}

#: Old module names under this package (each a file of two lines that aliases its new module).
_MODULES = ("activity", "alignment", "assembly", "atom_sums", "augment", "batch_norm", "bayesian_matching",
            "class_shares", "derive", "driver", "elbo", "empirical_bayes", "fedma", "guides", "kl_fusion", "laplace",
            "layer_inputs", "layout", "match_result", "matcher", "matching", "network_matching", "permutation",
            "pooled_heads", "posterior_matching", "recovery", "scoring", "size", "spec", "svi")

__all__ = sorted(_FACES)


def __getattr__(name: str):
    if name in _FACES:
        warn_moved(f"bnpfed.inference.{name}", f"{_FACES[name]}.{name}")
        return getattr(importlib.import_module(_FACES[name]), name)
    if name in _MODULES:
        return importlib.import_module(f"bnpfed.inference.{name}")
    raise AttributeError(f"module 'bnpfed.inference' has no attribute {name!r}")
