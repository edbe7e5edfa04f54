"""Image grids: images tiled with captions and a title (the logger's sample grids, the evaluations' captioned
grids), and the before/after sheet of two models on the same prompts and noise."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image, ImageDraw, ImageFont
from torch import Tensor

from rewards.preprocess import to_uint8

MIN_TILE = 128  # px: the trainer's grids upscale smaller images (nearest neighbour) to at least this size


def _wrap(text: str, font: ImageFont.FreeTypeFont | ImageFont.ImageFont, width: int, max_lines: int) -> list[str]:
    """``text`` broken at spaces into lines of at most ``width`` px; the last kept line ends in "..." when cut."""
    lines: list[str] = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split(" "):
            candidate = f"{line} {word}" if line else word
            if line and font.getlength(candidate) > width:
                lines.append(line)
                line = word
            else:
                line = candidate
        lines.append(line)
    if len(lines) > max_lines:
        last = lines[max_lines - 1]
        while last and font.getlength(last + "...") > width:
            last = last[:-1]
        lines = lines[: max_lines - 1] + [last + "..."]
    return lines


def _per_row(images: Tensor, nrow: int | None, labels: Sequence[str] | None) -> int:
    """Images per row of ``image_grid`` (default ceil(sqrt(B))), its arguments checked."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"image_grid needs images [B, 3, H, W], got {tuple(images.shape)}")
    count = images.shape[0]
    nrow = math.ceil(math.sqrt(count)) if nrow is None else nrow
    if nrow < 1:
        raise ValueError(f"image_grid needs nrow >= 1, got {nrow}")
    if labels is not None and len(labels) != count:
        raise ValueError(f"image_grid got {len(labels)} labels for {count} images")
    return nrow


def _tiles(images: Tensor, min_tile: int) -> Any:
    """Images [B, 3, H, W] in [0, 1] as uint8 [B, H, W, 3] numpy tiles, upscaled by an integer factor with
    nearest neighbour until the longer side reaches ``min_tile``."""
    pixels = images.detach().float().cpu()
    scale = max(1, math.ceil(min_tile / max(pixels.shape[2:])))
    if scale > 1:
        pixels = torch.nn.functional.interpolate(pixels, scale_factor=scale, mode="nearest")
    return to_uint8(pixels).numpy()


def image_grid(
    images: Tensor,
    nrow: int | None = None,
    *,
    padding: int = 2,
    labels: Sequence[str] | None = None,
    title: str | None = None,
    min_tile: int = 0,
    label_lines: int = 3,
) -> Image.Image:
    """Images [B, 3, H, W] in [0, 1] tiled ``nrow`` per row (default ceil(sqrt(B))), with white gaps of
    ``padding`` px, as an RGB PIL image.

    ``min_tile``: images smaller than this (px, the longer side) are upscaled by an integer factor with
    nearest neighbour, so a 32 px sample stays crisp. ``labels``: one text per image, written under it
    in up to ``label_lines`` lines ("\\n" starts a line; a longer text is cut with "..."). ``title``:
    one line above the grid.
    """
    nrow = _per_row(images, nrow, labels)
    count = images.shape[0]
    tiles = _tiles(images, min_tile)
    height, width = tiles.shape[1:3]
    font = ImageFont.load_default(size=max(11, min(32, width // 11)))
    line_height = round(font.size * 1.25) if isinstance(font, ImageFont.FreeTypeFont) else 11
    strip = line_height * label_lines + padding if labels is not None else 0
    top = line_height + 2 * padding if title else 0
    rows = math.ceil(count / nrow)
    canvas = Image.new(
        "RGB",
        (nrow * (width + padding) + padding, top + rows * (height + strip + padding) + padding),
        (255, 255, 255),
    )
    draw = ImageDraw.Draw(canvas)
    if title:
        draw.text((padding, padding), title, fill=(0, 0, 0), font=font)
    for index, tile in enumerate(tiles):
        row, col = divmod(index, nrow)
        x = padding + col * (width + padding)
        y = top + padding + row * (height + strip + padding)
        canvas.paste(Image.fromarray(tile), (x, y))
        if labels is not None:
            for number, line in enumerate(_wrap(labels[index], font, width, label_lines)):
                draw.text((x, y + height + number * line_height), line, fill=(0, 0, 0), font=font)
    return canvas


def before_after_sheet(
    before: Tensor,
    after: Tensor,
    captions: Sequence[str],
    *,
    before_scores: Sequence[float],
    after_scores: Sequence[float],
    names: tuple[str, str] = ("before", "after"),
    indices: Sequence[int] | None = None,
    metric: str = "score",
) -> Image.Image:
    """The same prompts and noise under two models, pair by pair: [before | after] tiles, ``metric`` under
    each (the caption under the first, the change under the second); ``indices`` number the prompts
    (default 0, 1, ...)."""
    if before.shape != after.shape or len(captions) != before.shape[0]:
        raise ValueError(
            f"before_after_sheet: before {tuple(before.shape)}, after {tuple(after.shape)} and "
            f"{len(captions)} captions must describe the same images"
        )
    numbers = list(indices) if indices is not None else list(range(len(captions)))
    tiles, labels = [], []
    for k, caption in enumerate(captions):
        tiles += [before[k], after[k]]
        change = after_scores[k] - before_scores[k]
        labels += [
            f"#{numbers[k]} {names[0]}: {before_scores[k]:.4f}\n{caption}",
            f"{names[1]}: {after_scores[k]:.4f}\nchange {change:+.4f}",
        ]
    pairs_per_row = math.ceil(math.sqrt(len(captions)))
    title = f"{names[0]} | {names[1]}: same prompts and noise, {metric} under each image"
    return image_grid(torch.stack(tiles), 2 * pairs_per_row, labels=labels, title=title, min_tile=MIN_TILE, padding=3)
