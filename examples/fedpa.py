"""Federated Posterior Averaging (FedPA) as a bnpfed federated method: one file, as a user would write it.

Al-Shedivat, Gillenwater, Xing & Rostamizadeh, "Federated Learning via Posterior Averaging: A New Perspective and
Practical Algorithms", ICLR 2021. Federated learning as posterior inference: the global posterior is the product of
the clients' posteriors. With Gaussian (Laplace) approximations ``N(mu_k, Sigma_k)`` of them, its mode is

    mu = (sum_k b_k Sigma_k^{-1})^{-1} sum_k b_k Sigma_k^{-1} mu_k,

the minimiser of ``sum_k b_k (theta - mu_k)^T Sigma_k^{-1} (theta - mu_k) / 2``, whose gradient at the global
``theta`` is ``sum_k b_k Delta_k`` with the client deltas ``Delta_k = Sigma_k^{-1} (theta - mu_k)``. FedPA:

* **client** (:meth:`FedPA.client_step`): local SGD from the global ``theta`` for ``burn_in`` epochs, then one
  approximate posterior sample per epoch, the average of that epoch's SGD iterates (iterate-averaged SGD, IASG:
  ``l = epochs - burn_in`` samples ``x_1 .. x_l``); the local posterior's mean ``x_bar`` and its covariance by
  shrinkage, ``Sigma_hat = rho_l I + (1 - rho_l) S_l`` with ``S_l`` the samples' covariance and
  ``rho_l = 1 / (1 + (l - 1) rho)``; the delta ``Sigma_hat^{-1} (theta - x_bar)`` by the paper's dynamic
  program (:func:`posterior_delta`: O(l d) memory and O(l^2 d) time for d parameters, no d x d matrix);
* **server** (:meth:`FedPA.server_step`): the clients' weighted average delta ``Delta = sum_k b_k Delta_k`` is a
  gradient of the global objective, applied by SGD with momentum: ``m <- beta m + Delta``,
  ``theta <- theta - eta m``.

With ``rho = 0`` the covariance is the identity and ``Delta_k = theta - x_bar``: FedAvg (with ``eta = 1``,
``beta = 0``, the server's new model is the weighted average of the clients' models), whose fixed point is the
average of the client modes rather than the product's mode.

Usage (from the repository root, so that ``examples`` is importable; on Flower every machine needs it importable)::

    bnpfed pfnm --plugin examples.fedpa --methods fedpa,fedavg --optimizer sgd --lr 0.05 --rounds 5
    bnpfed flower sim --plugin examples.fedpa --run-config 'method="fedpa" optimizer="sgd" lr=0.05 rounds=5'

    >>> from bnpfed.data import load_dataset
    >>> from bnpfed.federated import MethodFederation, NetworkConfig, PartitionConfig, TrainingConfig
    >>> ds = load_dataset("digits")
    >>> parts = PartitionConfig(clients=3).split(ds.y_train.numpy(), seed=0)
    >>> federation = MethodFederation(ds, parts, method="fedpa", network=NetworkConfig(hidden=(32,)),
    ...                               training=TrainingConfig(epochs=4, optimizer="sgd", lr=0.05), seed=0)
    >>> federation.run(3)[-1].metrics["accuracy"] > 0.8
    True
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bnpfed.federated import (ClientTask, ClientUpdate, FederatedMethod, ServerTask, ServerUpdate,
                              register_federated_method)

__all__ = ["FedPA", "posterior_delta"]


def posterior_delta(samples: Tensor, theta: Tensor, rho: float) -> Tensor:
    """``Sigma_hat^{-1} (theta - x_bar)`` of ``l`` samples ``(l, d)``: ``x_bar`` their mean, ``Sigma_hat =
    rho_l I + (1 - rho_l) S_l`` their shrinkage covariance (``S_l`` the sample covariance, ``rho_l = 1 / (1 + (l - 1)
    rho)``; one sample: the identity), by dynamic programming over the samples, never forming a d x d matrix.

    Why it works: ``(l - 1) S_l = M_l``, the samples' scatter matrix, so ``Sigma_hat = (I + rho M_l) / (1 + (l - 1)
    rho)``; and ``M_t = M_{t-1} + gamma_t' u_t u_t^T`` with ``u_t = x_t - x_bar_{t-1}``, ``gamma_t' = (t - 1) / t``
    (Welford). So ``A_t = I + rho M_t`` takes one rank-one term per sample, ``gamma_t = rho (t - 1) / t``, and
    Sherman-Morrison gives ``A_t^{-1}`` from ``A_{t-1}^{-1}`` through ``v_t = A_{t-1}^{-1} u_t``, itself
    ``u_t - sum_{k<t} gamma_k (v_k . u_t) / (1 + gamma_k u_k . v_k) v_k``. With ``x_bar_t = x_bar_{t-1} + u_t / t``
    the delta ``d_t = A_t^{-1} (theta - x_bar_t)`` follows from ``d_{t-1}``:
    ``d_t = d_{t-1} - (1 + c_t) v_t / t``, ``c_t = gamma_t (t u_t . d_{t-1} - u_t . v_t) / (1 + gamma_t u_t . v_t)``;
    the answer is ``(1 + (l - 1) rho) d_l``. Memory O(l d) (the ``v_k``), time O(l^2 d).

    :param Tensor samples: ``(l, d)``, l >= 1 approximate posterior samples.
    :param Tensor theta: ``(d,)``, the point the delta is taken at (the global model).
    :param float rho: the shrinkage, >= 0 (0: the identity covariance, ``theta - x_bar``).
    :returns: ``(d,)`` in ``theta``'s dtype (computed in float64).
    """
    if not (torch.is_tensor(samples) and samples.dim() == 2 and samples.shape[0] >= 1):
        raise ValueError(f"samples: expected a tensor (l, d) of l >= 1 samples, got "
                         f"{getattr(samples, 'shape', samples)}")
    if not (torch.is_tensor(theta) and theta.shape == samples.shape[1:]):
        raise ValueError(f"theta: expected a tensor of shape ({samples.shape[1]},), got "
                         f"{getattr(theta, 'shape', theta)}")
    if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not math.isfinite(rho) or rho < 0:
        raise ValueError(f"rho: expected a finite number >= 0, got {rho!r}")
    x = samples.to(torch.float64)
    mean = x[0].clone()
    delta = theta.to(torch.float64) - mean          # A_1 = I: one sample's covariance is the identity
    vs, uvs = [], []                                 # v_k = A_{k-1}^{-1} u_k and u_k . v_k, k = 2 .. t - 1
    for t in range(2, len(x) + 1):
        u = x[t - 1] - mean
        v = u.clone()
        for k, (v_k, uv_k) in enumerate(zip(vs, uvs), start=2):
            gamma_k = rho * (k - 1) / k
            v -= gamma_k * torch.dot(v_k, u) / (1 + gamma_k * uv_k) * v_k
        uv = torch.dot(u, v)
        gamma = rho * (t - 1) / t
        c = gamma * (t * torch.dot(u, delta) - uv) / (1 + gamma * uv)
        delta -= (1 + c) * v / t
        vs.append(v)
        uvs.append(uv)
        mean += u / t
    return ((1 + (len(x) - 1) * rho) * delta).to(theta.dtype)


def _flat(tensors) -> Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


class FedPA(FederatedMethod):
    """Federated Posterior Averaging (Al-Shedivat et al., ICLR 2021): IASG samples and a shrinkage covariance on the
    clients, SGD with momentum on the averaged deltas on the server (module docstring).

    The clients read ``training``: ``optimizer`` (must be ``"sgd"``: IASG is SGD's iterates), the round's epochs and
    learning rate (``training.schedule(round)``; epochs must exceed ``burn_in``), ``batch_size``, ``momentum`` and
    ``weight_decay``, ``device``; ``augment`` must be ``"none"``. The network must have no buffers (batch norm): the
    posterior is over its parameters.

    :param int burn_in: local epochs before the first sample, >= 0. Default 1.
    :param float rho: the covariance's shrinkage, >= 0 (0: identity, FedAvg). Default 1.
    :param float server_lr: ``eta``, the server's learning rate, > 0. Default 0.5: a delta is up to ``1 + (l - 1)
        rho`` times FedAvg's (in the directions the samples do not spread), so a step of 1 overshoots with a few
        samples (on the bundled digits its accuracy swings from round to round; at 0.5 it rises steadily).
    :param float server_momentum: ``beta``, in [0, 1). Default 0.
    """

    def __init__(self, *, burn_in: int = 1, rho: float = 1.0, server_lr: float = 0.5, server_momentum: float = 0.0):
        if isinstance(burn_in, bool) or not isinstance(burn_in, int) or burn_in < 0:
            raise ValueError(f"burn_in: expected an int >= 0 (epochs), got {burn_in!r}")
        if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not math.isfinite(rho) or rho < 0:
            raise ValueError(f"rho: expected a finite number >= 0, got {rho!r}")
        if isinstance(server_lr, bool) or not isinstance(server_lr, (int, float)) or not 0 < server_lr < math.inf:
            raise ValueError(f"server_lr: expected a finite number > 0, got {server_lr!r}")
        if isinstance(server_momentum, bool) or not isinstance(server_momentum, (int, float)) \
                or not 0 <= server_momentum < 1:
            raise ValueError(f"server_momentum: expected a number in [0, 1), got {server_momentum!r}")
        self.burn_in, self.rho = burn_in, float(rho)
        self.server_lr, self.server_momentum = float(server_lr), float(server_momentum)

    def __repr__(self):
        return (f"FedPA(burn_in={self.burn_in}, rho={self.rho:g}, server_lr={self.server_lr:g}, "
                f"server_momentum={self.server_momentum:g})")

    def initial_state(self, network: nn.Module) -> dict[str, Tensor]:
        buffers = [name for name, _ in network.named_buffers()]
        if buffers:
            raise ValueError(f"network: FedPA's posterior is over the network's parameters; expected an architecture "
                             f"without buffers (batch norm), got {buffers}")
        return super().initial_state(network)

    def client_step(self, task: ClientTask) -> ClientUpdate:
        training = task.training
        if training.optimizer != "sgd":
            raise ValueError(f"training.optimizer: FedPA's posterior samples are averages of SGD's iterates; expected "
                             f"'sgd', got {training.optimizer!r}")
        if training.augment != "none":
            raise ValueError(f"training.augment: FedPA samples the posterior of the client's own data; expected "
                             f"'none', got {training.augment!r}")
        schedule = training.schedule(task.round)
        if schedule.epochs <= self.burn_in:
            raise ValueError(f"training.epochs: FedPA burns in for {self.burn_in} epoch(s), then draws one sample per "
                             f"epoch; expected more than {self.burn_in} epochs in round {task.round}, got "
                             f"{schedule.epochs}")
        device = torch.device(training.device)
        net = task.network.to(device).train()
        names, params = zip(*net.named_parameters())
        theta = _flat(params).to("cpu", torch.float64)
        x, y = task.x.to(device), task.y.to(device)
        optimizer = torch.optim.SGD(params, lr=schedule.lr, momentum=training.momentum or 0.0,
                                    weight_decay=training.weight_decay)
        generator = task.generator()
        samples, losses = [], []
        for epoch in range(schedule.epochs):
            order = torch.randperm(len(y), generator=generator).to(device)
            iterates, steps, loss_sum = torch.zeros_like(theta), 0, 0.0
            for start in range(0, len(y), training.batch_size):
                batch = order[start:start + training.batch_size]
                optimizer.zero_grad()
                loss = F.cross_entropy(net(x[batch]), y[batch])
                loss.backward()
                optimizer.step()
                loss_sum += float(loss.detach()) * len(batch)
                if epoch >= self.burn_in:
                    iterates += _flat(params).to("cpu", torch.float64)
                    steps += 1
            losses.append(loss_sum / len(y))
            if epoch >= self.burn_in:
                samples.append(iterates / steps)
        delta = posterior_delta(torch.stack(samples), theta, self.rho)
        update, offset = {}, 0
        for name, p in zip(names, params):
            update[name] = delta[offset:offset + p.numel()].reshape(p.shape).to(p.dtype)
            offset += p.numel()
        return ClientUpdate(update, metrics={"train_loss": losses[-1], "samples": len(samples)})

    def server_step(self, task: ServerTask) -> ServerUpdate:
        state, kept = {}, {}
        norm = 0.0
        for name, theta in task.state.items():
            delta = sum(b * update[name] for b, update in zip(task.weights, task.updates))
            m = delta + self.server_momentum * task.server_state.get(f"momentum/{name}", torch.zeros_like(theta))
            state[name] = theta - self.server_lr * m
            kept[f"momentum/{name}"] = m
            norm += float((delta.double() ** 2).sum())
        return ServerUpdate(state, server_state=kept, metrics={"delta_norm": math.sqrt(norm)})


register_federated_method("fedpa", FedPA())
