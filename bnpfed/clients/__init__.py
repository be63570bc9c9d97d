"""Clients: what one federated client fits on its own data, and the Pyro pieces it is built from.

This is the folder's one public face: import from ``bnpfed.clients``; the files behind it are private to it.

* :class:`BayesianClient`: a variational Bayesian network, any ``nn.Module`` plus a prior object plus a likelihood
  object (a Pyro program, :class:`BayesianNetwork`), or a Pyro user's own program (a ``PyroModule`` with
  ``PyroSample`` priors, or a model function, with its guide: :class:`PyroProgram`), fitted by SVI under a
  mean-field Gaussian guide (:class:`MeanFieldGuide`, Pyro's ``AutoNormal`` and ``AutoDiagonalNormal``, the ELBO in
  closed form where it has one: :class:`MeanFieldELBO`); :class:`DeterministicClient`, the same
  network trained by maximum likelihood (FedAvg's);
* :class:`LaplaceClient`: an ordinary trained network with a diagonal Laplace posterior after the fact
  (:func:`laplace_posterior`);
* priors (which parameters are random, with which law: :class:`Prior`, :class:`IIDPrior`, :class:`LayerwisePrior`,
  :class:`SitePrior`, :class:`EmpiricalBayesPrior`, :class:`HierarchicalPrior`) and likelihoods
  (:class:`Likelihood`, :class:`Categorical`, :class:`Gaussian`, :class:`StudentT`), from :mod:`bnpfed.models`,
  where the Pyro programs live; swap either in one line;
* the random crops and flips of local training images (:func:`random_crop_flip`).
"""

from bnpfed.clients.augment import AUGMENTATIONS, check_augment, random_crop_flip
from bnpfed.clients.elbo import MeanFieldELBO
from bnpfed.clients.guides import MeanFieldGuide
from bnpfed.clients.laplace import LaplaceClient, LaplaceFit, laplace_posterior
from bnpfed.clients.variational import OPTIMIZERS, SCALE_LR_FACTOR, BayesianClient, DeterministicClient, \
    TrainingDiverged, check_optimizer
from bnpfed.models import (BayesianNetwork, Categorical, EmpiricalBayesPrior, Gaussian, GaussianPredictive,
                           HierarchicalPrior, IIDPrior, LayerwisePrior, Likelihood, Prior, PyroProgram, Selector,
                           SitePrior, StudentT, linear_weights, only_linear_weights)

__all__ = [
    "BayesianClient", "DeterministicClient", "TrainingDiverged", "OPTIMIZERS", "check_optimizer", "SCALE_LR_FACTOR",
    "LaplaceClient", "LaplaceFit", "laplace_posterior",
    "MeanFieldGuide", "MeanFieldELBO",
    "AUGMENTATIONS", "check_augment", "random_crop_flip",
    "BayesianNetwork", "PyroProgram", "Prior", "IIDPrior", "LayerwisePrior", "SitePrior", "EmpiricalBayesPrior",
    "HierarchicalPrior", "Selector",
    "linear_weights", "only_linear_weights", "Likelihood", "Categorical", "Gaussian", "StudentT",
    "GaussianPredictive",
]
