"""A small classification problem in which some inputs are 0 in every example: the first layer's weights from them
are touched by no datum, so their posterior is their prior (the variational clients' and the Laplace clients' tests
both check that)."""

import torch

#: inputs 3, 4, 5 are 0 in every example.
UNTOUCHED = slice(3, 6)


def untouched_data(n: int, seed: int = 0):
    """``(x, y)``: n examples of 6 inputs (3 of them always 0), 3 classes decided by the first 3 inputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    x[:, UNTOUCHED] = 0.0
    y = (x[:, :3] @ torch.tensor([[1.0, -1.0, 0.0], [0.5, 1.0, -1.0], [-1.0, 0.0, 1.0]])).argmax(1)
    return x, y
