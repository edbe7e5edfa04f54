"""Evaluation summaries: mean scores overall and per prompt category, and an image grid for logging.

``summarize`` returns a flat dict, ready for a logger: ``{name: mean}`` for every metric and
``{f"{name}/{category}": mean}`` for every category (e.g. the HPSv2 benchmark's anime,
concept-art, paintings and photo), where a category's mean is over the images of that category.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torchvision
from PIL import Image
from torch import Tensor


def summarize(scores: Mapping[str, Tensor], categories: Sequence[str] | None = None) -> dict[str, float]:
    """Means of each score [N] overall and, when ``categories`` (N labels) is given, per category."""
    summary: dict[str, float] = {}
    for name, values in scores.items():
        values = values.detach().float().flatten().cpu()
        if values.numel() == 0 or not torch.isfinite(values).all():
            raise ValueError(f"metric {name!r} is empty or holds NaN/inf; cannot summarize it")
        summary[name] = values.mean().item()
        if categories is None:
            continue
        if len(categories) != values.numel():
            raise ValueError(f"got {len(categories)} categories for {values.numel()} {name!r} scores")
        for category in sorted(set(categories)):
            mask = torch.tensor([label == category for label in categories])
            summary[f"{name}/{category}"] = values[mask].mean().item()
    return summary


def image_grid(images: Tensor, nrow: int | None = None, *, padding: int = 2) -> Image.Image:
    """Images [B, 3, H, W] in [0, 1] tiled ``nrow`` per row (default ceil(sqrt(B))), with white gaps of
    ``padding`` px, as an RGB PIL image."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"image_grid needs images [B, 3, H, W], got {tuple(images.shape)}")
    nrow = math.ceil(math.sqrt(images.shape[0])) if nrow is None else nrow
    if nrow < 1:
        raise ValueError(f"image_grid needs nrow >= 1, got {nrow}")
    grid = torchvision.utils.make_grid(
        images.detach().float().clamp(0, 1).cpu(), nrow=nrow, padding=padding, pad_value=1.0
    )
    pixels = (grid * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    return Image.fromarray(pixels)
