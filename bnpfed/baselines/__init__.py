"""Baselines: the methods PFNM and posterior fusion are measured against.

This is the folder's one public face: import from ``bnpfed.baselines``; the files behind it are private to it.

* PFNM's own comparisons (Yurochkin et al. 2019, section 4): the uniform ensemble of the local models
  (:func:`ensemble_proba`), FedAvg's weight average (:func:`fedavg_network`), k-means over pooled neurons
  (:func:`kmeans_layer`, :func:`kmeans_networks`);
* fusion by alignment to one reference network, then averaging (:func:`aligned_average`): weight matching (Git
  Re-Basin, Ainsworth et al. 2023: :func:`weight_matching`) and OT fusion (Singh & Jaggi 2020:
  :func:`ot_alignment`);
* KL-fusion (Claici et al. 2020), the published method closest to matched posterior fusion (:func:`kl_fusion`).
"""

from bnpfed.baselines.alignment import OT_REG, apply_maps, ot_alignment, weight_matching, weight_matching_permutations
from bnpfed.baselines.averaging import (aligned_average, ensemble_proba, fedavg_network, kmeans_layer,
                                        kmeans_networks, reference_client)
from bnpfed.baselines.kl_fusion import KL_REG, kl_costs, kl_fusion, kl_fusion_layer

__all__ = [
    "ensemble_proba", "fedavg_network", "kmeans_layer", "kmeans_networks", "aligned_average", "reference_client",
    "OT_REG", "apply_maps", "ot_alignment", "weight_matching", "weight_matching_permutations",
    "KL_REG", "kl_costs", "kl_fusion", "kl_fusion_layer",
]
