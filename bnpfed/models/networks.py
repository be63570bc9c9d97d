"""Plain torch networks used by the experiments: a ReLU MLP and the LeNet-5 CNN.

They are ordinary ``nn.Module`` s with no Pyro in them; :class:`~bnpfed.models.bayesian.BayesianNetwork` makes a
Bayesian copy of any of them (or of a network of your own) with a prior object.

Usage::

    net = mlp(64, [100, 100], 10)            # Flatten, then Linear-ReLU-Linear-ReLU-Linear
    cnn = LeNet()                            # (N, 1, 28, 28) MNIST / Fashion-MNIST images
    small = LeNet(image_size=8)              # (N, 1, 8, 8) bundled digits
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

__all__ = ["LeNet", "mlp", "reference_init_"]


def mlp(in_features: int, hidden: Sequence[int], out_features: int) -> nn.Sequential:
    """A ReLU multi-layer perceptron that flattens its input first.

    :param int in_features: number of input features after flattening (64 for 8x8 digits, 784 for MNIST).
    :param hidden: widths of the hidden layers, e.g. ``[100]``; empty for a linear (softmax regression) model.
    :param int out_features: number of outputs (classes).
    :returns: ``nn.Sequential(Flatten, Linear, ReLU, ..., Linear)``; parameter names are ``"1.weight"``,
        ``"1.bias"``, ``"3.weight"``, ... as numbered by ``nn.Sequential``.
    """
    _check_positive_int(in_features, "in_features")
    _check_positive_int(out_features, "out_features")
    hidden = list(hidden)
    for i, width in enumerate(hidden):
        _check_positive_int(width, f"hidden[{i}]")
    layers: list[nn.Module] = [nn.Flatten()]
    widths = [in_features, *hidden]
    for fan_in, fan_out in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    layers.append(nn.Linear(widths[-1], out_features))
    return nn.Sequential(*layers)


class LeNet(nn.Module):
    """The LeNet-5 CNN that Ozer et al. (2022) train on (Fashion-)MNIST.

    ``conv1(in_channels->6, 5x5, padding 2) - ReLU - maxpool 2 - conv2(6->16, 5x5) - ReLU - maxpool 2 -
    fc1(flat->120) - ReLU - fc2(120->84) - ReLU - fc3(84->num_classes)``; for 28x28 images ``flat = 16*5*5 = 400``.

    Smaller images do not leave room for conv2's 5x5 kernel after the first pooling (8x8 digits give 4x4 maps), so
    when the map after the first pooling is smaller than 5 pixels conv2 gets padding 2 (a "same" convolution) as
    well; ``flat`` is then computed by a forward pass of a zero image at construction (8x8 digits: ``16*2*2 = 64``).

    Usage::

        net = LeNet()                                  # MNIST
        net = LeNet(in_channels=1, image_size=8)       # bundled digits
        logits = net(torch.zeros(32, 1, 8, 8))         # (32, 10)

    :param int in_channels: input channels (1 for greyscale). Default 1.
    :param int image_size: height = width of the input images in pixels, at least 4. Default 28.
    :param int num_classes: number of outputs. Default 10.
    """

    #: Kernel size of both convolutions in LeNet-5.
    KERNEL = 5

    def __init__(self, in_channels: int = 1, image_size: int = 28, num_classes: int = 10):
        super().__init__()
        _check_positive_int(in_channels, "in_channels")
        _check_positive_int(num_classes, "num_classes")
        _check_positive_int(image_size, "image_size")
        if image_size < 4:
            raise ValueError(f"image_size: LeNet needs images of at least 4x4 pixels, got {image_size}")
        self.conv1 = nn.Conv2d(in_channels, 6, self.KERNEL, padding=2)
        pooled = image_size // 2
        self.conv2 = nn.Conv2d(6, 16, self.KERNEL, padding=0 if pooled >= self.KERNEL else 2)
        self.pool = nn.MaxPool2d(2)
        with torch.no_grad():
            flat = self.features(torch.zeros(1, in_channels, image_size, image_size)).shape[1]
        self.fc1 = nn.Linear(flat, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def features(self, x: Tensor) -> Tensor:
        """The convolutional part: ``(N, C, H, W)`` images to ``(N, flat)`` features."""
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        return torch.flatten(x, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.fc1(self.features(x)))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


def _check_positive_int(value, argument: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{argument}: expected a positive int, got {value!r}")


def reference_init_(net: nn.Module, *, generator: torch.Generator, weight_std: float = 0.1,
                    bias: float = 0.1) -> nn.Module:
    """Initialise every ``nn.Linear`` and ``nn.Conv2d`` of ``net`` in place as the PFNM reference code does
    (Yurochkin et al. 2019, ``model.py``): weights N(0, weight_std^2), biases ``bias``. Returns ``net``."""
    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * weight_std)
                if module.bias is not None:
                    module.bias.fill_(bias)
    return net
