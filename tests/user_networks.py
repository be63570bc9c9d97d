"""A network a user wrote with their own code (not one of bnpfed's): conv, batch norm, pooling, flatten, linear."""

from torch import nn


class UserCNN(nn.Module):
    def __init__(self, channels: int = 6, hidden: int = 24, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
                                      nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(channels * 4 * 4, hidden), nn.ReLU(),
                                  nn.Linear(hidden, classes))

    def forward(self, x):
        return self.head(self.features(x))


def make():
    """The factory ``bnpfed match --module user_networks:make`` calls."""
    return UserCNN()


class UserPlainCNN(nn.Module):
    """The same without batch norm: what posterior fusion takes (running statistics are no posterior)."""

    def __init__(self, channels: int = 6, hidden: int = 24, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(channels * 4 * 4, hidden), nn.ReLU(),
                                  nn.Linear(hidden, classes))

    def forward(self, x):
        return self.head(self.features(x))


class UserMixingNet(nn.Module):
    """Hidden units mixed by a fixed non-elementwise step (a cumulative sum): no permutation of them is a symmetry,
    so no spec of this network verifies."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 16), nn.Linear(16, 10)

    def forward(self, x):
        return self.fc2(self.fc1(x.flatten(1)).relu().cumsum(-1))


class BasicBlock(nn.Module):
    """He et al.'s basic block: two 3x3 convolutions with batch norms, and an identity skip, or a projection skip
    (a 1x1 convolution and its batch norm) where the stride or the width changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.conv1(x)
        out = self.bn1(out).relu()
        out = self.bn2(self.conv2(out))
        out += self.shortcut(x)
        return out.relu()


class ResNet(nn.Module):
    """A ResNet for CIFAR-10 (He et al. 2016, section 4.2): a 3x3 stem, three stages of ``blocks`` basic blocks at
    widths ``width``, 2 ``width``, 4 ``width`` (the second and third open with a stride-2 projection block), a global
    average and a linear classifier. ``blocks=3, width=16``: ResNet-20 (with projection skips, option B)."""

    def __init__(self, blocks: int = 1, width: int = 4, classes: int = 10, channels: int = 3):
        super().__init__()
        self.conv = nn.Conv2d(channels, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        stages, cin = [], width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            for b in range(blocks):
                stages.append(BasicBlock(cin, cout, stride=2 if stage and not b else 1))
                cin = cout
        self.layers = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        out = self.layers(self.bn(self.conv(x)).relu())
        return self.fc(out.mean((2, 3)))


def make_resnet():
    """The factory ``bnpfed match --module user_networks:make_resnet`` calls: a small ResNet (one block per stage)."""
    return ResNet(blocks=1, width=4, classes=10, channels=1)
