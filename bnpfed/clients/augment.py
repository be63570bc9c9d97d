"""Random image transforms of local training: the crops and flips of CIFAR-10 training.

Every local fit may draw each mini-batch's images through a random transform before its step (data augmentation);
the evaluation, the matching and every statistic a client reports see its images as they are. The transforms are
the standard CIFAR-10 ones (He et al. 2016; NIID-Bench, Li et al., ICDE 2022, trains its CIFAR-10 parties with them):

* ``"crop"``: pad the image by :data:`PADDING` pixels on every side by reflection (``x[-1] = x[1]``, the edge
  itself not repeated: ``numpy.pad``'s ``"reflect"``), then cut a window of the original size at an offset drawn
  uniformly from the ``(2 * PADDING + 1)^2`` possible ones;
* ``"crop-flip"``: the crop, then a left-right flip with probability 1/2 (right for photographs; a digit flipped
  left-right is another glyph, so digits take ``"crop"``);
* ``"none"``: the images as they are (the default everywhere).

Reflection and cropping commute with a per-channel affine map, so transforming standardised images is the same as
standardising transformed ones. The draws come from a ``torch.Generator`` the caller seeds (a fit seeds it from its
own seed, apart from the mini-batch order), so the same seed gives the same images.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from bnpfed.validation import check_choice

__all__ = ["AUGMENTATIONS", "PADDING", "augmenter", "check_augment", "random_crop_flip"]

#: The transforms a local fit can draw its mini-batches through.
AUGMENTATIONS = ("none", "crop", "crop-flip")
#: The crop's reflection padding on every side, in pixels (CIFAR-10's usual 4).
PADDING = 4


def check_augment(augment: str, input_shape: Optional[Sequence[int]] = None, name: str = "augment") -> str:
    """``augment`` one of :data:`AUGMENTATIONS`; with ``input_shape`` (one example's shape), a transform other than
    ``"none"`` needs images ``(C, H, W)`` larger than :data:`PADDING` in both directions (a reflection of 4 pixels
    needs 5). Returns ``augment``."""
    check_choice(augment, AUGMENTATIONS, name)
    if augment != "none" and input_shape is not None:
        shape = tuple(int(s) for s in input_shape)
        if len(shape) != 3 or min(shape[1:]) <= PADDING:
            raise ValueError(f"{name}: {augment!r} crops images; expected inputs of shape (C, H, W) with H and W > "
                             f"{PADDING}, got {shape} (use augment 'none' for other data)")
    return augment


def random_crop_flip(x: Tensor, generator: torch.Generator, *, padding: int = PADDING, flip: bool = True) -> Tensor:
    """Each image of the batch ``x`` ``(B, C, H, W)`` reflected by ``padding`` pixels on every side, cut back to
    ``(H, W)`` at an offset ``(i, j)`` drawn uniformly from ``{0, ..., 2 padding}^2``, and with ``flip`` mirrored left
    to right with probability 1/2. Draws (the rows' offsets, then the columns', then the flips, one per image) come
    from ``generator`` (a CPU generator: the same draws on every device). Returns a new tensor on ``x`` 's device."""
    if x.dim() != 4:
        raise ValueError(f"x: expected a batch of images (B, C, H, W), got shape {tuple(x.shape)}")
    b, c, h, w = x.shape
    if padding < 0 or padding >= min(h, w):
        raise ValueError(f"padding: expected an int in [0, {min(h, w)}) for images of {h} x {w}, got {padding}")
    size = 2 * padding + 1
    rows = torch.randint(size, (b,), generator=generator).to(x.device)
    cols = torch.randint(size, (b,), generator=generator).to(x.device)
    padded = F.pad(x, (padding,) * 4, mode="reflect") if padding else x
    r = rows[:, None] + torch.arange(h, device=x.device)              # (B, H): the padded rows each image keeps
    k = cols[:, None] + torch.arange(w, device=x.device)              # (B, W)
    if flip:
        mirror = torch.rand(b, generator=generator).to(x.device) < 0.5
        k = torch.where(mirror[:, None], k.flip(1), k)                # a mirrored image reads its columns backwards
    index = torch.arange(b, device=x.device)[:, None, None, None]
    channel = torch.arange(c, device=x.device)[None, :, None, None]
    return padded[index, channel, r[:, None, :, None], k[:, None, None, :]]


def augmenter(augment: str) -> Optional[Callable[[Tensor, torch.Generator], Tensor]]:
    """The transform of ``augment`` (one of :data:`AUGMENTATIONS`) as ``f(batch, generator)``; None for ``"none"``."""
    check_augment(augment)
    if augment == "none":
        return None
    flip = augment == "crop-flip"
    return lambda x, generator: random_crop_flip(x, generator, flip=flip)
