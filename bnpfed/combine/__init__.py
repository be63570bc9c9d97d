"""Combine: the fusion rules of mean-field Gaussian posteriors, their registry, and the same rules from sums over
clients (what secure aggregation computes).

This is the folder's one public face: import from ``bnpfed.combine``; the files behind it are private to it.

* the rules of Ozer et al. (2022), weight by weight: :func:`eaa`, :func:`gaa`, :func:`log_variance`,
  :func:`pooling`, :func:`conflation`; :func:`fuse` and :func:`fuse_sites` apply a rule by name;
  :func:`register_rule` adds one (it then reaches every federation, command and the Flower app; from a
  plugin, :mod:`bnpfed.plugins`, with no file of bnpfed changed), :func:`unregister_rule` removes it;
  :func:`available_rules` lists them;
* :func:`average_deterministic`: FedAvg's weighted average of the parameters no rule applies to;
* sums over clients (:func:`sum_statistics`, :func:`fuse_sums`, :data:`SECURE_RULES`), and the fixed-point limbs
  SecAgg+ adds them in (:func:`split_limbs`, :func:`join_limbs`).
"""

from bnpfed.combine.rules import (FusionRule, GaussianPosterior, available_rules, average_deterministic, conflation,
                                  eaa, fuse, fuse_sites, gaa, log_variance, pooling, register_rule, unregister_rule)
from bnpfed.combine.secure import (SECURE_RULES, deterministic_from_sum, deterministic_statistic, fuse_sums,
                                   join_limbs, quantisation_bound, quantization_range, split_limbs, statistic_names,
                                   sum_statistics)

__all__ = [
    "GaussianPosterior", "FusionRule", "available_rules", "register_rule", "unregister_rule", "fuse", "fuse_sites",
    "eaa", "gaa", "log_variance", "pooling", "conflation", "average_deterministic",
    "SECURE_RULES", "statistic_names", "sum_statistics", "fuse_sums", "deterministic_statistic",
    "deterministic_from_sum", "quantization_range", "split_limbs", "join_limbs", "quantisation_bound",
]
