"""A Pyro user's own program by name, for the command line and Flower: the issue's network, registered in one line.

In Python a program is one argument, ``BayesianConfig(program=Net)`` (a factory: each client calls it for a fresh
program); a command or a Flower run config names its program, so this plugin registers :class:`Net` as
``"digits-net"``. It is written as the Pyro docs teach a Bayesian network: its ``PyroSample`` statements are its
prior (a per-layer scale ``tau ~ HalfNormal(1)`` on the first layer's weights, fixed ``N(0, 1)`` on the others), its
observed site ``obs`` its likelihood; each client fits it with Pyro's ``AutoNormal`` and the server fuses every
latent site, ``tau`` included (in its guide's unconstrained space, ``log tau``).

Usage (from the repository root, so that ``examples`` is importable; on Flower every machine needs it importable)::

    bnpfed fuse --plugin examples.pyro_program --program digits-net --rule all --rounds 3 --epochs 10 --lr 0.01
    bnpfed flower sim --plugin examples.pyro_program --run-config 'method="fusion" program="digits-net" rounds=3'

    >>> from bnpfed.federated import BayesianConfig
    >>> model, guide = BayesianConfig(program="digits-net").build_program()
    >>> type(model).__name__, guide is None                 # the clients' default guide: AutoNormal
    ('Net', True)
"""

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroSample
from torch import nn

from bnpfed.models import register_program


class Net(PyroModule):
    """64 -> 32 -> 10 with a per-layer scale: ``tau ~ HalfNormal(1)``, ``fc1.weight | tau ~ N(0, tau^2)``, the
    other weights and biases ``N(0, 1)``; ``obs ~ Categorical(logits)``. The inputs are flattened first (the bundled
    digits are ``(B, 1, 8, 8)`` images, as every client receives them)."""

    def __init__(self):
        super().__init__()
        self.tau = PyroSample(dist.HalfNormal(torch.tensor(1.0)))
        self.fc1 = PyroModule[nn.Linear](64, 32)
        self.fc1.weight = PyroSample(lambda m: dist.Normal(0.0, self.tau).expand([32, 64]).to_event(2))
        self.fc1.bias = PyroSample(dist.Normal(0.0, 1.0).expand([32]).to_event(1))
        self.fc2 = PyroModule[nn.Linear](32, 10)
        self.fc2.weight = PyroSample(dist.Normal(0.0, 1.0).expand([10, 32]).to_event(2))
        self.fc2.bias = PyroSample(dist.Normal(0.0, 1.0).expand([10]).to_event(1))

    def forward(self, x, y=None):
        logits = self.fc2(torch.relu(self.fc1(x.reshape(x.shape[0], -1))))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


register_program("digits-net", Net, overwrite=True)
