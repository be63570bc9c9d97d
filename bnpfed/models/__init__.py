"""Pyro generative programs: the Beta-Bernoulli neuron model of PFNM (with its noise laws, :class:`NoiseLaw`), a
Gaussian mixture (the local model of the federated mixture), and Bayesian neural networks; priors and
likelihoods by name (:func:`register_prior`, :func:`register_likelihood`: what a config's ``prior`` and
``likelihood`` take, and what a plugin can add to)."""

from bnpfed.models.beta_bernoulli import (
    FederatedLayer,
    UniformPermutation,
    beta_bernoulli_layer,
    canonical_conditioning,
    gaussian_noise,
    log_joint,
    sample_federated_layer,
)
from bnpfed.models.noise import NoiseLaw, StudentTNoise
from bnpfed.models.mixture import GaussianMixture, fit_gaussian_mixture, gaussian_mixture
from bnpfed.models.bayesian import BayesianNetwork
from bnpfed.models.likelihoods import (NOISE_SITE, Categorical, Gaussian, GaussianPredictive, Likelihood, StudentT,
                                      predictive_of)
from bnpfed.models.local_reparameterization import (
    LocalReparameterizationMessenger,
    LocalReparameterizedLinear,
    local_reparameterization,
    sample_linear,
)
from bnpfed.models.named import (
    LIKELIHOODS,
    PRIOR_VARIANCES,
    PRIORS,
    available_likelihoods,
    available_priors,
    build_likelihood,
    build_prior,
    register_likelihood,
    register_prior,
    unregister_likelihood,
    unregister_prior,
)
from bnpfed.models.program import PyroProgram, localize_, module_local_params
from bnpfed.models.networks import LeNet, mlp, reference_init_, simple_cnn, simple_cnn_bn
from bnpfed.models.priors import (
    EmpiricalBayesPrior,
    HierarchicalPrior,
    IIDPrior,
    LayerwisePrior,
    Prior,
    Selector,
    SitePrior,
    linear_weights,
    only_linear_weights,
)

__all__ = [
    "FederatedLayer",
    "UniformPermutation",
    "beta_bernoulli_layer",
    "canonical_conditioning",
    "gaussian_noise",
    "log_joint",
    "sample_federated_layer",
    "NoiseLaw",
    "StudentTNoise",
    "GaussianMixture",
    "fit_gaussian_mixture",
    "gaussian_mixture",
    "BayesianNetwork",
    "Categorical",
    "Gaussian",
    "GaussianPredictive",
    "Likelihood",
    "NOISE_SITE",
    "StudentT",
    "predictive_of",
    "PyroProgram",
    "localize_",
    "module_local_params",
    "LocalReparameterizationMessenger",
    "LocalReparameterizedLinear",
    "local_reparameterization",
    "sample_linear",
    "LIKELIHOODS",
    "PRIORS",
    "PRIOR_VARIANCES",
    "available_likelihoods",
    "available_priors",
    "build_likelihood",
    "build_prior",
    "register_likelihood",
    "register_prior",
    "unregister_likelihood",
    "unregister_prior",
    "LeNet",
    "mlp",
    "reference_init_",
    "simple_cnn",
    "simple_cnn_bn",
    "EmpiricalBayesPrior",
    "HierarchicalPrior",
    "IIDPrior",
    "LayerwisePrior",
    "Prior",
    "Selector",
    "SitePrior",
    "linear_weights",
    "only_linear_weights",
]
