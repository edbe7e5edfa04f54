"""A procedural captioned image set: one or two coloured shapes on black, 32x32 by default.

A scene is drawn from a ``torch.Generator``, so the set is a pure function of its seed:
    * one object (probability 1/2): a colour, a shape, a size (small | large) and a position (one of
      ``POSITIONS``), jittered by up to ``JITTER`` of the side; caption "a small red circle at the
      top left";
    * two objects: distinct colours, any shapes, small, one in the left half and one in the right
      (order random), vertically anywhere they fit; caption "a blue square and a green triangle"
      (the left one first is not implied: the order of the caption is random too).
Shapes are rasterized at pixel centres (inside-test, no anti-aliasing), so colours are exact and
the reward's measurement (rewards/shapes.py, which owns the vocabulary) sees clean masks.
Images are float32 [3, H, W] in [0, 1].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rewards.shapes import BACKGROUND, COLOURS, POSITIONS, SHAPES, SIZES, ObjectSpec, caption, inside_shape

IMAGE_SIZE = 32
JITTER = 2 / 32  # max offset of a single object from its anchor, as a fraction of the side


@dataclass(frozen=True)
class Placed:
    """An object with its drawn geometry: centre (x, y) and side, as fractions of the image side."""

    spec: ObjectSpec
    centre: tuple[float, float]
    side: float


def _choice(options: Sequence[str], generator: torch.Generator) -> str:
    return options[int(torch.randint(len(options), (1,), generator=generator))]


def _uniform(low: float, high: float, generator: torch.Generator) -> float:
    return low + (high - low) * float(torch.rand((), generator=generator))


def sample_scene(generator: torch.Generator, *, size: int = IMAGE_SIZE) -> list[Placed]:
    """One scene (one or two objects) drawn from ``generator``."""
    colours, shapes = list(COLOURS), list(SHAPES)
    if float(torch.rand((), generator=generator)) < 0.5:
        colour, shape = _choice(colours, generator), _choice(shapes, generator)
        size_name, position = _choice(list(SIZES), generator), _choice(list(POSITIONS), generator)
        spec = ObjectSpec(colour=colour, shape=shape, size=size_name, position=position)
        ax, ay = POSITIONS[position]
        centre = (ax + _uniform(-JITTER, JITTER, generator), ay + _uniform(-JITTER, JITTER, generator))
        return [Placed(spec, centre, SIZES[size_name] / IMAGE_SIZE)]
    first = _choice(colours, generator)
    second = _choice([c for c in colours if c != first], generator)
    side = SIZES["small"] / IMAGE_SIZE
    margin = side / 2 + 1 / size
    objects = []
    for colour, (low, high) in zip((first, second), ((margin, 0.5 - margin), (0.5 + margin, 1 - margin))):
        spec = ObjectSpec(colour=colour, shape=_choice(shapes, generator))
        centre = (_uniform(low, high, generator), _uniform(margin, 1 - margin, generator))
        objects.append(Placed(spec, centre, side))
    if float(torch.rand((), generator=generator)) < 0.5:
        objects.reverse()
    return objects


def render(scene: Sequence[Placed], *, size: int = IMAGE_SIZE) -> Tensor:
    """The image of a scene: float32 [3, size, size] in [0, 1]."""
    image = torch.tensor(BACKGROUND, dtype=torch.float32)[:, None, None].repeat(1, size, size)
    coords = (torch.arange(size, dtype=torch.float32) + 0.5) / size
    ys, xs = torch.meshgrid(coords, coords, indexing="ij")
    for obj in scene:
        mask = inside_shape(obj.spec.shape, xs - obj.centre[0], ys - obj.centre[1], obj.side / 2)
        image[:, mask] = torch.tensor(COLOURS[obj.spec.colour])[:, None]
    return image


def make_dataset(num_images: int, *, seed: int = 0, size: int = IMAGE_SIZE) -> tuple[Tensor, list[str]]:
    """``num_images`` images [N, 3, size, size] and their captions, a pure function of ``seed``."""
    if num_images <= 0:
        raise ValueError(f"make_dataset: num_images must be positive, got {num_images}")
    generator = torch.Generator().manual_seed(seed)
    scenes = [sample_scene(generator, size=size) for _ in range(num_images)]
    images = torch.stack([render(scene, size=size) for scene in scenes])
    return images, [caption([obj.spec for obj in scene]) for scene in scenes]


def all_captions() -> list[str]:
    """Every single-object caption and every two-object caption (distinct colours), sorted."""
    singles = [
        caption([ObjectSpec(colour=c, shape=s, size=z, position=p)])
        for c in COLOURS
        for s in SHAPES
        for z in SIZES
        for p in POSITIONS
    ]
    pairs = [
        caption([ObjectSpec(colour=c1, shape=s1), ObjectSpec(colour=c2, shape=s2)])
        for c1 in COLOURS
        for c2 in COLOURS
        if c1 != c2
        for s1 in SHAPES
        for s2 in SHAPES
    ]
    return sorted(singles + pairs)
