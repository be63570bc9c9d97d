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
