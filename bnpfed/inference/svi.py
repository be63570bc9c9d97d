"""Federated clients: a variational Bayesian client trained by SVI, and a deterministic (FedAvg) client.

A Bayesian client k fits a mean-field Gaussian posterior ``q_k(w) = N(mu_k, sigma_k^2)`` to its ``n_k`` examples
by maximising the ELBO divided by ``n_k`` (Ozer et al. 2022):

    L_k(q) = 1/n_k sum_i E_q[log p(y_i | x_i, w)] - 1/n_k KL(q(w) || p(w))

estimated on mini-batches (the model's data plate scales a batch's log-likelihood by ``n_k / B``), with the KL in
closed form (``TraceMeanField_ELBO``) and Adam, for E local epochs. A server fuses the clients'
:meth:`BayesianClient.posterior` s with :mod:`bnpfed.combine` and sends the result back through
:meth:`BayesianClient.load_posterior`.

Isolation: a client's parameters are its own tensors: the guide's are ``nn.Parameter`` s of its
:class:`~bnpfed.inference.guides.MeanFieldGuide`, the deterministic ones belong to its
:class:`~bnpfed.models.BayesianNetwork` 's private copy of the network, which always runs in Pyro's
``module_local_params`` mode (otherwise ``PyroModule`` parameters are registered in Pyro's global parameter store
by name, and two copies of one architecture would share them). A ``torch.optim.Adam`` over exactly those tensors
minimises ``TraceMeanField_ELBO().differentiable_loss`` — the PyTorch form of ``pyro.infer.SVI``, whose
``PyroOptim`` looks parameters up in the global store. The global store's contents are never changed, so any
number of clients of one architecture coexist, with each other and with a user's own Pyro code.

Randomness: ``fit(seed=s)`` shuffles with a ``torch.Generator`` seeded with ``s`` and draws all samples under
``torch.random.fork_rng`` seeded with ``s``: the same seed gives the same numbers, and the global random state is
left untouched. Each ``fit`` starts a fresh Adam state.
"""

from __future__ import annotations

import copy
from typing import Callable, Iterable, Mapping, Optional

import torch
import torch.nn.functional as F
from pyro.infer import TraceMeanField_ELBO
from torch import Tensor, nn

from bnpfed.inference._checks import check_names, check_tensor
from bnpfed.inference.guides import MeanFieldGuide
from bnpfed.models.bayesian import BayesianNetwork, seeded
from bnpfed.models.priors import Prior

__all__ = ["BayesianClient", "DeterministicClient"]


class BayesianClient:
    """A client holding a mean-field Gaussian posterior over the Bayesian parameters of its copy of a network.

    Usage::

        client = BayesianClient(LeNet(image_size=8), only_linear_weights(), local_reparameterization=True)
        client.fit(x, y, epochs=5, batch_size=64, lr=1e-3, seed=0)
        sites = client.posterior()                      # {"fc1.weight": (loc, variance), ...}
        client.load_posterior(fused)                    # a server's fused posterior, written into the guide
        probs = client.predict_proba(x_test, num_samples=10)

    :param nn.Module net: the network (deep-copied; the user's module is not changed). Clients built from the same
        ``net`` start from the same weights, as federated clients should.
    :param Prior prior: which parameters are Bayesian and their priors, e.g. ``only_linear_weights()``.
    :param bool local_reparameterization: train and predict with the local reparameterisation trick. Default False.
    :param float init_scale: initial posterior standard deviation of every Bayesian weight; means start at the
        network's own initial values. Default ``1e-2``.

    Attributes: ``bnn`` (the :class:`BayesianNetwork`), ``guide`` (the :class:`MeanFieldGuide`), ``losses_`` (mean
    negative ELBO per example, one per epoch of the last ``fit``).
    """

    def __init__(
        self, net: nn.Module, prior: Prior, *, local_reparameterization: bool = False, init_scale: float = 1e-2
    ):
        self.bnn = BayesianNetwork(net, prior, local_reparameterization=local_reparameterization)
        self.guide = MeanFieldGuide(self.bnn.init_values, init_scale=init_scale)
        self._elbo = TraceMeanField_ELBO(max_plate_nesting=1)
        self.losses_: list[float] = []

    def fit(
        self, x: Tensor, y: Tensor, *, epochs: int = 1, batch_size: int = 64, lr: float = 1e-3, seed: int = 0,
        amsgrad: bool = False,
    ) -> "BayesianClient":
        """Run SVI on the local data ``x`` ``(n, ...)``, ``y`` ``(n,)`` for ``epochs`` passes of mini-batches of
        ``batch_size`` with Adam at learning rate ``lr``; every random step uses ``seed``. Returns ``self``."""
        n = _check_data(x, y)
        params = [*self.bnn.parameters(), *self.guide.parameters()]

        def loss(xb, yb):
            return self.loss(xb, yb, dataset_size=n)

        self.losses_ = _train(params, loss, x, y, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed,
                              amsgrad=amsgrad)
        return self

    def loss(self, x: Tensor, y: Tensor, dataset_size: Optional[int] = None) -> Tensor:
        """The training objective on a batch: a one-sample estimate of ``-ELBO / n_k``,

            ( KL(q || p) - n_k / B sum_{i in batch} E_q[log p(y_i | x_i, w)] ) / n_k

        with the KL in closed form. Differentiable in the guide's and the deterministic parameters.

        :param int dataset_size: ``n_k``, the size of the local dataset the batch comes from. Default ``len(x)``.
        """
        batch = _check_data(x, y)
        n = batch if dataset_size is None else dataset_size
        with self.bnn.context():
            return self._elbo.differentiable_loss(self.bnn, self.guide, x, y, dataset_size=n) / n

    def posterior(self) -> dict[str, tuple[Tensor, Tensor]]:
        """``{site: (loc, variance)}`` for every Bayesian site, copies of the guide's current values."""
        return self.guide.posterior()

    def load_posterior(self, posterior: Mapping[str, tuple[Tensor, Tensor]]) -> None:
        """Set the guide to ``{site: (loc, variance)}`` (exactly the Bayesian sites), in place; see
        :meth:`MeanFieldGuide.load_posterior`. Raises ``ValueError`` naming the site on a bad entry."""
        self.guide.load_posterior(posterior)

    def deterministic_state(self) -> dict[str, Tensor]:
        """``{name: tensor}`` copies of the parameters the prior keeps deterministic (empty if there are none)."""
        return _state(self.bnn.net)

    def load_deterministic(self, state: Mapping[str, Tensor]) -> None:
        """Overwrite the deterministic parameters in place with ``state`` (exactly their names and shapes)."""
        _load_state(self.bnn.net, state, "state")

    def predict_proba(self, x: Tensor, num_samples: int = 10, seed: Optional[int] = None) -> Tensor:
        """Posterior predictive probabilities ``(B, num_classes)``: the softmax averaged over ``num_samples`` draws
        from the guide (see :meth:`BayesianNetwork.predict`)."""
        return self.bnn.predict(x, num_samples=num_samples, guide=self.guide, seed=seed)


class DeterministicClient:
    """A FedAvg client: the same network trained by maximum likelihood (cross-entropy, Adam), the baseline of the
    federated loop.

    Usage::

        client = DeterministicClient(LeNet(image_size=8))
        client.fit(x, y, epochs=5, batch_size=64, lr=1e-3, seed=0)
        server_state = average_deterministic([c.state() for c in clients], weights)
        client.load_state(server_state)

    :param nn.Module net: the network (deep-copied; the user's module is not changed).

    Attributes: ``net`` (the copy), ``losses_`` (mean cross-entropy per example, one per epoch of the last ``fit``).
    """

    def __init__(self, net: nn.Module):
        if not isinstance(net, nn.Module):
            raise ValueError(f"net: expected a torch.nn.Module, got {type(net).__name__}")
        self.net = copy.deepcopy(net)
        self.losses_: list[float] = []

    def fit(
        self, x: Tensor, y: Tensor, *, epochs: int = 1, batch_size: int = 64, lr: float = 1e-3, seed: int = 0,
        amsgrad: bool = False, weight_decay: float = 0.0,
    ) -> "DeterministicClient":
        """Minimise the mean cross-entropy on ``x`` ``(n, ...)``, ``y`` ``(n,)``; same schedule and seeding as
        :meth:`BayesianClient.fit`; ``weight_decay`` adds ``weight_decay * ||theta||^2 / 2`` to the loss (the L2
        term of the PFNM reference, 1e-6 there). Returns ``self``."""
        _check_data(x, y)

        def loss(xb, yb):
            return F.cross_entropy(self.net(xb), yb)

        self.losses_ = _train(self.net.parameters(), loss, x, y, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed,
                              amsgrad=amsgrad, weight_decay=weight_decay)
        return self

    @torch.no_grad()
    def predict_proba(self, x: Tensor) -> Tensor:
        """Class probabilities ``(B, num_classes)``, the softmax of the network's logits."""
        return self.net(x).softmax(-1)

    def state(self) -> dict[str, Tensor]:
        """``{name: tensor}`` copies of all the network's parameters."""
        return _state(self.net)

    def load_state(self, state: Mapping[str, Tensor]) -> None:
        """Overwrite the network's parameters in place with ``state`` (exactly their names and shapes)."""
        _load_state(self.net, state, "state")


def _train(
    params: Iterable[Tensor],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    amsgrad: bool = False,
    weight_decay: float = 0.0,
) -> list[float]:
    """Adam (optionally AMSGrad, with coupled L2 ``weight_decay``) on ``loss_fn(x_batch, y_batch)`` over shuffled
    mini-batches; returns the mean loss of each epoch."""
    for value, argument in ((epochs, "epochs"), (batch_size, "batch_size")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{argument}: expected a positive int, got {value!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"lr: expected a positive number, got {lr!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed: expected an int, got {seed!r}")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
        raise ValueError(f"weight_decay: expected a number >= 0, got {weight_decay!r}")
    optimizer = torch.optim.Adam(list(params), lr=lr, amsgrad=amsgrad, weight_decay=weight_decay)
    shuffle = torch.Generator().manual_seed(seed)
    n = x.shape[0]
    losses = []
    with seeded(seed, x.device):
        for _ in range(epochs):
            order = torch.randperm(n, generator=shuffle).to(x.device)
            total = 0.0
            for start in range(0, n, batch_size):
                batch = order[start : start + batch_size]
                loss = loss_fn(x[batch], y[batch])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                total += loss.item() * batch.numel()
            losses.append(total / n)
    return losses


def _check_data(x, y) -> int:
    if not torch.is_tensor(x) or x.dim() < 1 or x.shape[0] < 1:
        raise ValueError(f"x: expected a tensor of shape (n, ...) with n >= 1, got {_describe(x)}")
    n = x.shape[0]
    if not torch.is_tensor(y) or y.shape != (n,):
        raise ValueError(f"y: expected a tensor of shape ({n},) matching x, got {_describe(y)}")
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ValueError(f"y: expected integer class labels, got dtype {y.dtype}")
    return n


def _describe(value) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else repr(value)


def _state(net: nn.Module) -> dict[str, Tensor]:
    return {name: param.detach().clone() for name, param in net.named_parameters()}


@torch.no_grad()
def _load_state(net: nn.Module, state, argument: str) -> None:
    params = dict(net.named_parameters())
    check_names(state, {name: p.shape for name, p in params.items()}, argument, "parameter")
    for name, param in params.items():
        check_tensor(state[name], param.shape, f"{argument}[{name!r}]")
    for name, param in params.items():
        param.copy_(state[name])
