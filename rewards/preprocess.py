"""Tensor image preprocessing for the CLIP-family rewards: differentiable, batched, any device.

Input images are float [B, 3, H, W] in [0, 1]; ``to_uint8`` gives the pixels of an image file, which the
weight-free and served rewards encode. Resizing is bicubic with antialiasing, exactly
``torch.nn.functional.interpolate(mode="bicubic", align_corners=False, antialias=True)``, which is
what torchvision's ``Resize`` runs on float tensors (also when upsampling: the antialiased kernel
is Pillow's a = -0.5 cubic, not the plain a = -0.75 one).

* ``resize_longest_and_pad`` is HPSv2's scoring transform (``ResizeMaxSize`` in hpsv2's open_clip
  fork, chosen by ``light_augmentation=True`` in every HPS scoring script): scale so the longer
  side is ``size`` (new sides rounded with Python's ``round``), then pad with black (0 before
  normalization) to a square, the odd pixel going right / bottom.
* ``resize_shortest`` + ``center_crop`` are the transformers ``CLIPImageProcessor``: shorter side to
  ``shortest_edge`` (longer side ``int(shortest_edge * long / short)``), center crop with the top
  left corner at ``int((side - crop) / 2)``. The processor resizes uint8 pixels, which rounds and
  clamps; we clamp the resized floats to [0, 1] for the same range and skip the rounding. On a GPU
  the processor resizes in float, and we agree with it to that rounding. On CPU it calls torch's
  native uint8 bicubic kernel, whose upsampling of pixel noise differs by up to ~12/255; on
  smooth images we stay within one 1/255 step, about 0.015 after normalization (tested).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

# PIL resample codes, as stored in image processor configs -> interpolate modes.
_PIL_RESAMPLE_MODES = {0: "nearest", 2: "bilinear", 3: "bicubic"}


def interpolation_mode(resample: int) -> str:
    """``F.interpolate`` mode for a PIL resample code (0 nearest, 2 bilinear, 3 bicubic)."""
    if int(resample) not in _PIL_RESAMPLE_MODES:
        raise ValueError(f"image processor resample={resample} is not supported; use one of {_PIL_RESAMPLE_MODES}")
    return _PIL_RESAMPLE_MODES[int(resample)]


def resize(images: Tensor, size: tuple[int, int], *, mode: str = "bicubic") -> Tensor:
    """Resize [B, C, H, W] to ``size`` = (height, width); antialiased for bilinear and bicubic."""
    if tuple(images.shape[-2:]) == tuple(size):
        return images
    if mode == "nearest":
        return F.interpolate(images, size=size, mode=mode)
    return F.interpolate(images, size=size, mode=mode, align_corners=False, antialias=True)


def resize_longest_and_pad(images: Tensor, size: int) -> Tensor:
    """HPSv2: longer side to ``size`` (bicubic), then zero-pad to [B, C, size, size]."""
    height, width = images.shape[-2:]
    scale = size / float(max(height, width))
    if scale != 1.0:
        images = resize(images, (round(height * scale), round(width * scale)))
    pad_h, pad_w = size - images.shape[-2], size - images.shape[-1]
    # F.pad takes (left, right, top, bottom) for the last two dims.
    return F.pad(images, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=0.0)


def resize_shortest(images: Tensor, shortest_edge: int, *, mode: str = "bicubic") -> Tensor:
    """CLIPImageProcessor's resize: shorter side to ``shortest_edge``, aspect kept, clamped to [0, 1]."""
    height, width = images.shape[-2:]
    short, long = (height, width) if height <= width else (width, height)
    new_long = int(shortest_edge * long / short)
    new_size = (shortest_edge, new_long) if height <= width else (new_long, shortest_edge)
    # The processor resizes uint8 pixels, so its bicubic overshoot is clipped to the valid range.
    return resize(images, new_size, mode=mode).clamp(0.0, 1.0)


def center_crop(images: Tensor, crop: tuple[int, int], *, round_offset: bool = False) -> Tensor:
    """Center crop to (h, w), zero-padding first where the image is smaller (as the processor does).
    The processor truncates the offset ``(side - crop) / 2``; torchvision's ``CenterCrop`` rounds it
    (``round_offset``, half to even): the two differ by a pixel when ``side - crop`` is 3 mod 4."""
    crop_h, crop_w = crop
    height, width = images.shape[-2:]
    if crop_h > height or crop_w > width:
        pad_h, pad_w = max(crop_h - height, 0), max(crop_w - width, 0)
        images = F.pad(images, (pad_w // 2, (pad_w + 1) // 2, pad_h // 2, (pad_h + 1) // 2), value=0.0)
        height, width = images.shape[-2:]

    def offset(excess: int) -> int:
        return int(round(excess / 2.0)) if round_offset else int(excess / 2.0)

    top, left = offset(height - crop_h), offset(width - crop_w)
    return images[..., top : top + crop_h, left : left + crop_w]


def to_uint8(images: Tensor) -> Tensor:
    """Images [..., 3, H, W] in [0, 1] as the pixels of an image file: uint8 round(255 x), [..., H, W, 3], on CPU."""
    return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).movedim(-3, -1).cpu()


def normalize(images: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """(images - mean) / std per channel, with mean and std in the images' dtype and device."""
    mean_t = torch.as_tensor(mean, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    std_t = torch.as_tensor(std, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    return (images - mean_t) / std_t
