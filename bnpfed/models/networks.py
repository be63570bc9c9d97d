"""Plain torch networks used by the experiments: a ReLU MLP, the LeNet-5 CNN and FedMA's simple CNN.

They are ordinary ``nn.Module`` s with no Pyro in them; :class:`~bnpfed.models.bayesian.BayesianNetwork` makes a
Bayesian copy of any of them (or of a network of your own) with a prior object.

Usage::

    >>> net = mlp(64, [100, 100], 10)        # Flatten, then Linear-ReLU-Linear-ReLU-Linear
    >>> net(torch.zeros(32, 1, 8, 8)).shape
    torch.Size([32, 10])
    >>> cnn = LeNet()                        # (N, 1, 28, 28) MNIST / Fashion-MNIST images
    >>> paper = LeNet.paper()                # the same, without conv1's padding, as Ozer et al. (2022) publish it
    >>> cnn.fc1.in_features, paper.fc1.in_features
    (400, 256)
    >>> small = LeNet(image_size=8)          # (N, 1, 8, 8) bundled digits
    >>> small(torch.zeros(32, 1, 8, 8)).shape
    torch.Size([32, 10])
    >>> simple_cnn()(torch.zeros(32, 3, 32, 32)).shape     # FedMA's CIFAR-10 network; simple_cnn_bn with batch norm
    torch.Size([32, 10])
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch
from torch import Tensor, nn

from bnpfed.validation import check_int, check_ints

__all__ = ["LeNet", "mlp", "reference_init_", "simple_cnn", "simple_cnn_bn"]


def mlp(in_features: int, hidden: Sequence[int], out_features: int) -> nn.Sequential:
    """A ReLU multi-layer perceptron that flattens its input first.

    >>> mlp(64, [100], 10)
    Sequential(
      (0): Flatten(start_dim=1, end_dim=-1)
      (1): Linear(in_features=64, out_features=100, bias=True)
      (2): ReLU()
      (3): Linear(in_features=100, out_features=10, bias=True)
    )

    :param int in_features: number of input features after flattening (64 for 8x8 digits, 784 for MNIST).
    :param hidden: widths of the hidden layers, e.g. ``[100]``; empty for a linear (softmax regression) model.
    :param int out_features: number of outputs (classes).
    :returns: ``nn.Sequential(Flatten, Linear, ReLU, ..., Linear)``; parameter names are ``"1.weight"``,
        ``"1.bias"``, ``"3.weight"``, ... as numbered by ``nn.Sequential``.
    """
    in_features = check_int(in_features, "in_features", low=1)
    out_features = check_int(out_features, "out_features", low=1)
    hidden = check_ints(list(hidden), "hidden", low=1, nonempty=False)
    layers: list[nn.Module] = [nn.Flatten()]
    widths = [in_features, *hidden]
    for fan_in, fan_out in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    layers.append(nn.Linear(widths[-1], out_features))
    return nn.Sequential(*layers)


class LeNet(nn.Module):
    """The LeNet-5 CNN that Ozer et al. (2022) train on (Fashion-)MNIST, in two variants that differ only in conv1's
    padding.

    ``conv1(in_channels->6, 5x5, padding conv1_padding) - ReLU - maxpool 2 - conv2(6->16, 5x5) - ReLU - maxpool 2 -
    fc1(flat->120) - ReLU - fc2(120->84) - ReLU - fc3(84->num_classes)``.

    - ``LeNet()`` (``conv1_padding=2``, the default, kept for backwards compatibility): conv1 keeps the image size,
      as in LeCun's 32x32 LeNet-5 fed 28x28 images. On 28x28 images ``flat = 16*5*5 = 400``; the fully connected
      layers hold 400*120 + 120*84 + 84*10 = 58,920 weights (59,134 with biases), the whole network 61,706
      parameters.
    - ``LeNet.paper()`` (``conv1_padding=0``): the network of Ozer et al.'s published code, no padding. On 28x28
      images ``flat = 16*4*4 = 256``; the fully connected layers hold 256*120 + 120*84 + 84*10 = 41,640 weights
      (41,854 with biases), the whole network 44,426 parameters.

    The convolutions hold 156 + 2,416 parameters in both (for one input channel); the Bayesian clients put priors on
    the fully connected weights only (:func:`~bnpfed.models.priors.only_linear_weights`), so those counts are the
    size of their posteriors.

    Small images: when the map after the first pooling is under 6 pixels wide, an unpadded conv2 would leave less
    than the 2x2 the second pooling needs, so conv2 gets padding 2 (a "same" convolution) instead; ``flat`` is
    computed by a forward pass of a zero image at construction. 8x8 digits give ``flat = 16*2*2 = 64`` with the
    default and ``16*1*1 = 16`` with the paper's network. The smallest images are 4x4 with the default and 8x8 with
    the paper's network (``8 - 2 * conv1_padding``); smaller ones raise a ``ValueError`` naming ``image_size``.

    Usage::

        >>> net = LeNet()                                          # MNIST
        >>> sum(net.get_parameter(f"fc{i}.weight").numel() for i in (1, 2, 3))
        58920
        >>> paper = LeNet.paper()                                  # as published by Ozer et al. (2022)
        >>> sum(paper.get_parameter(f"fc{i}.weight").numel() for i in (1, 2, 3))
        41640
        >>> digits = LeNet(in_channels=1, image_size=8)            # bundled digits
        >>> digits(torch.zeros(32, 1, 8, 8)).shape
        torch.Size([32, 10])

    :param int in_channels: input channels (1 for greyscale). Default 1.
    :param int image_size: height = width of the input images in pixels, at least ``8 - 2 * conv1_padding``.
        Default 28.
    :param int num_classes: number of outputs. Default 10.
    :param int conv1_padding: zero padding of conv1 in pixels, >= 0. Default 2 (this library's LeNet); 0 is the
        paper's, also built by :meth:`paper`.
    """

    #: Kernel size of both convolutions in LeNet-5.
    KERNEL = 5
    #: conv1's padding in the published code of Ozer et al. (2022).
    PAPER_CONV1_PADDING = 0

    def __init__(self, in_channels: int = 1, image_size: int = 28, num_classes: int = 10, *,
                 conv1_padding: int = 2):
        super().__init__()
        in_channels = check_int(in_channels, "in_channels", low=1)
        num_classes = check_int(num_classes, "num_classes", low=1)
        image_size = check_int(image_size, "image_size", low=1)
        conv1_padding = check_int(conv1_padding, "conv1_padding", low=0)
        # Each 2x2 pooling needs a map at least 2 wide: conv1's map (image_size + 2p - 4) must pool to >= 2.
        smallest = max(1, 2 * 2 + self.KERNEL - 1 - 2 * conv1_padding)
        if image_size < smallest:
            raise ValueError(
                f"image_size: expected at least {smallest} pixels for LeNet with conv1_padding={conv1_padding} "
                f"(a 5x5 convolution and two 2x2 poolings must fit), got {image_size}"
            )
        self.conv1 = nn.Conv2d(in_channels, 6, self.KERNEL, padding=conv1_padding)
        pooled = (image_size + 2 * conv1_padding - self.KERNEL + 1) // 2
        unpadded_fits = pooled - self.KERNEL + 1 >= 2
        self.conv2 = nn.Conv2d(6, 16, self.KERNEL, padding=0 if unpadded_fits else (self.KERNEL - 1) // 2)
        self.pool = nn.MaxPool2d(2)
        with torch.no_grad():
            flat = self.features(torch.zeros(1, in_channels, image_size, image_size)).shape[1]
        self.fc1 = nn.Linear(flat, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    @classmethod
    def paper(cls, in_channels: int = 1, image_size: int = 28, num_classes: int = 10) -> LeNet:
        """The LeNet-5 of Ozer et al.'s (2022) published code: ``LeNet(..., conv1_padding=0)``, 256 features into
        fc1 and 41,640 fully connected weights on 28x28 images; images must be at least 8x8."""
        return cls(in_channels, image_size, num_classes, conv1_padding=cls.PAPER_CONV1_PADDING)

    def features(self, x: Tensor) -> Tensor:
        """The convolutional part: ``(N, C, H, W)`` images to ``(N, flat)`` features."""
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        return torch.flatten(x, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.fc1(self.features(x)))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


#: Channels of the two convolutions and widths of the two hidden fully connected layers of FedMA's simple CNN.
SIMPLE_CNN_WIDTHS = (6, 16, 120, 84)


def simple_cnn(in_channels: int = 3, image_size: int = 32, num_classes: int = 10, *,
               batch_norm: bool = False) -> nn.Sequential:
    """FedMA's "simple-cnn" (Wang et al., ICLR 2020, IBM/FedMA ``SimpleCNN``), the CIFAR-10 network of its
    experiments, as an ``nn.Sequential`` with named layers.

    ``conv1(in_channels->6, 5x5) - ReLU - maxpool 2 - conv2(6->16, 5x5) - ReLU - maxpool 2 - flatten -
    fc1(flat->120) - ReLU - fc2(120->84) - ReLU - fc3(84->num_classes)``, no padding: on 32x32x3 images
    ``flat = 16*5*5 = 400`` (62,006 parameters), on 28x28 MNIST ``16*4*4 = 256``. As in :class:`LeNet`, when the map
    after the first pooling is under 6 pixels wide conv2 gets padding 2 (a "same" convolution) so that the second
    pooling has a 2x2 map to pool; ``flat`` comes from a forward pass of a zero image. Images must be at least 8x8
    (8x8 digits give ``flat = 16``).

    With ``batch_norm=True`` (:func:`simple_cnn_bn`) a ``BatchNorm2d`` follows each convolution (before its ReLU) and
    the convolutions have no bias: a bias before batch norm is cancelled by the batch mean, so it would only add a
    coordinate that training never moves.

    Usage::

        >>> net = simple_cnn()                                     # CIFAR-10
        >>> net.fc1.in_features, sum(p.numel() for p in net.parameters())
        (400, 62006)
        >>> [name for name, _ in simple_cnn_bn(1, 28).named_children()][:4]
        ['conv1', 'bn1', 'relu1', 'pool1']
        >>> simple_cnn_bn(1, 28).fc1.in_features                  # MNIST
        256

    :param int in_channels: input channels (3 for colour). Default 3.
    :param int image_size: height = width of the input images in pixels, at least 8. Default 32.
    :param int num_classes: number of outputs. Default 10.
    :param bool batch_norm: a ``BatchNorm2d`` after each convolution. Default False.
    :returns: ``nn.Sequential`` with children ``conv1, [bn1,] relu1, pool1, conv2, [bn2,] relu2, pool2, flatten, fc1,
        relu3, fc2, relu4, fc3``; parameter names ``"conv1.weight"``, ... as in :class:`LeNet`.
    """
    in_channels = check_int(in_channels, "in_channels", low=1)
    image_size = check_int(image_size, "image_size", low=1)
    num_classes = check_int(num_classes, "num_classes", low=1)
    kernel = LeNet.KERNEL
    smallest = 2 * 2 + kernel - 1  # conv1's map must pool to at least 2 pixels
    if image_size < smallest:
        raise ValueError(f"image_size: expected at least {smallest} pixels for simple_cnn (a 5x5 convolution and two "
                         f"2x2 poolings must fit), got {image_size}")
    c1, c2, h1, h2 = SIMPLE_CNN_WIDTHS
    pooled = (image_size - kernel + 1) // 2
    conv2_padding = 0 if pooled - kernel + 1 >= 2 else (kernel - 1) // 2
    layers: list[tuple[str, nn.Module]] = [("conv1", nn.Conv2d(in_channels, c1, kernel, bias=not batch_norm))]
    if batch_norm:
        layers.append(("bn1", nn.BatchNorm2d(c1)))
    layers += [("relu1", nn.ReLU()), ("pool1", nn.MaxPool2d(2)),
               ("conv2", nn.Conv2d(c1, c2, kernel, padding=conv2_padding, bias=not batch_norm))]
    if batch_norm:
        layers.append(("bn2", nn.BatchNorm2d(c2)))
    layers += [("relu2", nn.ReLU()), ("pool2", nn.MaxPool2d(2)), ("flatten", nn.Flatten())]
    features = nn.Sequential(OrderedDict(layers))
    with torch.no_grad():
        flat = features.eval()(torch.zeros(1, in_channels, image_size, image_size)).shape[1]
    layers += [("fc1", nn.Linear(flat, h1)), ("relu3", nn.ReLU()), ("fc2", nn.Linear(h1, h2)), ("relu4", nn.ReLU()),
               ("fc3", nn.Linear(h2, num_classes))]
    return nn.Sequential(OrderedDict(layers))


def simple_cnn_bn(in_channels: int = 3, image_size: int = 32, num_classes: int = 10) -> nn.Sequential:
    """FedMA's simple CNN with a ``BatchNorm2d`` after each convolution: ``simple_cnn(..., batch_norm=True)``."""
    return simple_cnn(in_channels, image_size, num_classes, batch_norm=True)


def reference_init_(net: nn.Module, *, generator: torch.Generator, weight_std: float = 0.1,
                    bias: float = 0.1) -> nn.Module:
    """Initialise every ``nn.Linear`` and ``nn.Conv2d`` of ``net`` in place as the PFNM reference code does
    (Yurochkin et al. 2019, ``model.py``): weights N(0, weight_std^2), biases ``bias``. Returns ``net``.

    >>> net = reference_init_(mlp(4, [3], 2), generator=torch.Generator().manual_seed(0))
    >>> net[1].bias
    Parameter containing:
    tensor([0.1000, 0.1000, 0.1000], requires_grad=True)
    """
    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * weight_std)
                if module.bias is not None:
                    module.bias.fill_(bias)
    return net
