"""JPEG compressibility and incompressibility: the weight-free rewards of DDPO, for CPU runs.

Each image is quantized to uint8 (round(255 x)), encoded as JPEG at ``quality`` (95, as in DDPO)
into memory, and its size s is measured in kilobytes (1 kB = 1000 bytes):

    jpeg_incompressibility = s,     jpeg_compressibility = -s

A flat image compresses well, so it scores high on compressibility. The encoder is not
differentiable: the scores carry no gradient. Nothing is written to disk.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import torch
from PIL import Image
from torch import Tensor

from rewards.base import Scorer
from rewards.preprocess import to_uint8


def jpeg_sizes_kb(images: Tensor, *, quality: int = 95) -> Tensor:
    """Size in kB of each image [B, 3, H, W] in [0, 1] encoded as JPEG -> float32 [B] on CPU."""
    sizes = []
    for array in to_uint8(images).numpy():
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


class JPEGIncompressibilityScorer(Scorer):
    """Reward = JPEG size in kB (prompts are ignored)."""

    name = "jpeg_incompressibility"
    sign = 1.0

    def __init__(self, *, quality: int = 95) -> None:
        if not 1 <= quality <= 95:
            raise ValueError(f"quality must be in [1, 95] (PIL's useful range), got {quality}")
        self.quality = quality

    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        return self.sign * jpeg_sizes_kb(images, quality=self.quality)

    def to(self, device: torch.device | str) -> JPEGIncompressibilityScorer:
        # No weights: scores are computed on CPU and returned on the images' device.
        return self


class JPEGCompressibilityScorer(JPEGIncompressibilityScorer):
    """Reward = minus the JPEG size in kB (prompts are ignored)."""

    name = "jpeg_compressibility"
    sign = -1.0
