"""Pyro generative programs: the Beta-Bernoulli neuron model of PFNM."""

from bnpfed.models.beta_bernoulli import (
    FederatedLayer,
    UniformPermutation,
    beta_bernoulli_layer,
    canonical_conditioning,
    gaussian_noise,
    log_joint,
    sample_federated_layer,
)

__all__ = [
    "FederatedLayer",
    "UniformPermutation",
    "beta_bernoulli_layer",
    "canonical_conditioning",
    "gaussian_noise",
    "log_joint",
    "sample_federated_layer",
]
