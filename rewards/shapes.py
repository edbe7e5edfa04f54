"""Shape alignment: a prompt-aware, weight-free reward for captions of coloured shapes (GenEval-like).

Captions name one or two objects, each with a colour and a shape and optionally a size and a
position: "a small red circle at the top left", "a blue square and a green triangle". The
vocabulary (``COLOURS``, ``SHAPES``, ``SIZES``, ``POSITIONS``) and the shapes themselves
(``inside_shape``) are this module's, for whoever draws images of such captions.

Measurement on an image [3, H, W] in [0, 1]:
    * every pixel takes the nearest of the background (black) and the palette colours, and stays
      background when farther than ``COLOUR_RADIUS`` from all of them;
    * each colour's mask is split into 4-connected components; components smaller than
      ``MIN_AREA`` pixels are noise;
    * a named object is the largest component of its colour. Its parts:
        colour   = min(1, area / MIN_AREA)         (is the colour there at all)
        shape    = clip(1/2 + margin / (2 SHAPE_MARGIN), 0, 1), margin = IoU(named) - max IoU(other):
                   IoU of the component with each shape drawn (``inside_shape``) in the
                   square around the component's bounding box. Clean shapes have |margin| >=
                   SHAPE_MARGIN, so the part is 1 for the named shape and 0 for another; a blurred,
                   in-between shape gets a graded part, which gives GRPO a signal to follow
        size     = 1 if the bounding box's longer side is on the named side of ``SIZE_SPLIT``
        position = 1 if the centroid is nearest the named anchor among ``POSITIONS``
    * count = 1 if the number of components (all colours) equals the number of named objects.

    score = count_factor x mean over objects of [colour x mean(shape, size?, position?)]

with count_factor = 1 when the count matches and 1/2 otherwise; size and position enter only when
the caption names them. A caption naming colours absent from the image scores 0. Parts are
reported per image (NaN where the caption does not name that attribute) by ``score_parts``; the
scorer call returns the score only, like every scorer. No gradient flows through the score.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rewards.base import Scorer, check_inputs

COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.9, 0.1, 0.1),
    "green": (0.1, 0.8, 0.2),
    "blue": (0.15, 0.3, 1.0),
    "yellow": (0.95, 0.85, 0.1),
}
BACKGROUND = (0.0, 0.0, 0.0)
SHAPES = ("circle", "square", "triangle")
SHAPE_MARGIN = 0.09  # IoU margin of a clean shape (>= 0.099 on the testbed's rasterized shapes)
SIZES: dict[str, int] = {"small": 8, "large": 14}  # bounding-box side in pixels at 32x32
SIZE_SPLIT = 11 / 32  # fraction of the image side between small and large
POSITIONS: dict[str, tuple[float, float]] = {  # (x, y) anchor as fractions of width and height
    "top left": (0.27, 0.27),
    "top right": (0.73, 0.27),
    "bottom left": (0.27, 0.73),
    "bottom right": (0.73, 0.73),
    "center": (0.5, 0.5),
}
COLOUR_RADIUS = 0.45  # max RGB distance from a palette colour (farther pixels are background)
MIN_AREA_FRACTION = 12 / 1024  # smallest object, as a fraction of the image area (12 px at 32x32)
PART_NAMES = ("colour", "shape", "size", "position", "count")

_OBJECT = re.compile(
    r"^(?:a|an)\s+(?:(?P<size>{sizes})\s+)?(?P<colour>{colours})\s+(?P<shape>{shapes})"
    r"(?:\s+(?:at|in)\s+the\s+(?P<position>{positions}))?$".format(
        sizes="|".join(SIZES), colours="|".join(COLOURS), shapes="|".join(SHAPES), positions="|".join(POSITIONS)
    )
)


@dataclass(frozen=True)
class ObjectSpec:
    """One named object of a caption."""

    colour: str
    shape: str
    size: str | None = None
    position: str | None = None

    def phrase(self) -> str:
        size = f"{self.size} " if self.size else ""
        where = f" at the {self.position}" if self.position else ""
        return f"a {size}{self.colour} {self.shape}{where}"


def caption(objects: Sequence[ObjectSpec]) -> str:
    """The caption of one or more objects ("a red circle and a blue square")."""
    return " and ".join(obj.phrase() for obj in objects)


def parse_caption(text: str) -> list[ObjectSpec]:
    """The objects a caption names; ValueError for text outside the vocabulary."""
    phrases = text.strip().lower().rstrip(".").split(" and ")
    objects = []
    for phrase in phrases:
        match = _OBJECT.match(" ".join(phrase.split()))
        if match is None:
            raise ValueError(
                f"reward 'shape_alignment': cannot parse {phrase!r} of caption {text!r}; expected "
                f"'a [{'|'.join(SIZES)}] <{'|'.join(COLOURS)}> <{'|'.join(SHAPES)}> [at the <position>]' "
                "joined by ' and '"
            )
        objects.append(ObjectSpec(**match.groupdict()))
    return objects


def colour_labels(images: Tensor) -> Tensor:
    """Per pixel: 0 for background, k + 1 for the k-th palette colour. [B, 3, H, W] -> long [B, H, W]."""
    palette = torch.tensor([BACKGROUND, *COLOURS.values()], dtype=torch.float32, device=images.device)
    dist = torch.cdist(images.float().permute(0, 2, 3, 1).flatten(1, 2), palette[None].expand(images.shape[0], -1, -1))
    nearest, labels = dist.min(dim=-1)
    labels[nearest > COLOUR_RADIUS] = 0
    return labels.view(images.shape[0], images.shape[2], images.shape[3])


def connected_components(mask: Tensor) -> Tensor:
    """4-connected component ids of a bool mask [N, H, W]: 0 off the mask, else the largest flat
    index + 1 of the component (label propagation: each pass takes the max over the 4-neighbourhood,
    until nothing changes)."""
    n, h, w = mask.shape
    ids = torch.arange(1, h * w + 1, device=mask.device, dtype=torch.long).view(1, h, w).expand(n, -1, -1)
    labels = torch.where(mask, ids, torch.zeros_like(ids))
    for _ in range(h * w):
        padded = F.pad(labels, (1, 1, 1, 1))
        spread = torch.stack(
            [labels, padded[:, :-2, 1:-1], padded[:, 2:, 1:-1], padded[:, 1:-1, :-2], padded[:, 1:-1, 2:]]
        ).amax(dim=0)
        updated = torch.where(mask, spread, labels)
        if torch.equal(updated, labels):
            break
        labels = updated
    return labels


def inside_shape(shape: str, dx: Tensor, dy: Tensor, half: float) -> Tensor:
    """Pixel-centre inside-test of ``shape`` of half-side ``half`` centred at the origin (dx, dy:
    offsets of the pixel centres). The triangle is isosceles, apex up."""
    if shape == "circle":
        return dx**2 + dy**2 <= half**2
    if shape == "square":
        return (dx.abs() <= half) & (dy.abs() <= half)
    frac = (dy + half) / (2 * half)  # its half-width grows linearly from 0 at the top to half at the base
    return (dy.abs() <= half) & (dx.abs() <= half * frac)


@dataclass
class Blob:
    """The largest component of one colour in one image (coordinates as fractions of the side)."""

    area: float  # fraction of the image area
    extent: float  # longer bounding-box side / image side
    centre: tuple[float, float]  # (x, y)
    iou: dict[str, float]  # shape -> IoU with that shape drawn in the square around the bounding box


def measure(labels: Tensor) -> tuple[list[dict[str, Blob]], list[int]]:
    """Per image: the largest blob of each colour present, and the number of components of at least
    ``MIN_AREA_FRACTION`` over all colours. labels: [B, H, W] from ``colour_labels``."""
    b, h, w = labels.shape
    min_pixels = MIN_AREA_FRACTION * h * w
    masks = torch.stack([labels == k + 1 for k in range(len(COLOURS))], dim=1)  # [B, K, H, W]
    flat = masks.flatten(0, 1)
    present = flat.flatten(1).any(dim=1)  # most images show one or two colours: skip the empty masks
    comps = torch.zeros(flat.shape, dtype=torch.long)
    comps[present] = connected_components(flat[present])
    comps = comps.view(b, len(COLOURS), h, w)
    blobs: list[dict[str, Blob]] = []
    counts: list[int] = []
    for i in range(b):
        found: dict[str, Blob] = {}
        count = 0
        for k, name in enumerate(COLOURS):
            ids, areas = comps[i, k][comps[i, k] > 0].unique(return_counts=True)
            if ids.numel() == 0:
                continue
            count += int((areas >= min_pixels).sum())
            found[name] = _blob(comps[i, k] == ids[areas.argmax()])
        blobs.append(found)
        counts.append(count)
    return blobs, counts


def _blob(mask: Tensor) -> Blob:
    h, w = mask.shape
    ys, xs = mask.nonzero(as_tuple=True)
    box_h = int(ys.max() - ys.min()) + 1
    box_w = int(xs.max() - xs.min()) + 1
    area = float(ys.numel())
    centre = ((xs.float().mean().item() + 0.5) / w, (ys.float().mean().item() + 0.5) / h)
    # the shapes drawn in the square of side max(box) centred on the bounding box, in pixel units
    box_x, box_y = (int(xs.min()) + int(xs.max()) + 1) / 2, (int(ys.min()) + int(ys.max()) + 1) / 2
    gy, gx = torch.meshgrid(torch.arange(h) + 0.5, torch.arange(w) + 0.5, indexing="ij")
    iou = {}
    for shape in SHAPES:
        drawn = inside_shape(shape, gx - box_x, gy - box_y, max(box_h, box_w) / 2)
        iou[shape] = float((drawn & mask).sum() / (drawn | mask).sum())
    return Blob(area=area / (h * w), extent=max(box_h / h, box_w / w), centre=centre, iou=iou)


def shape_part(blob: Blob, named: str) -> float:
    """1 when the blob is clearly the named shape, 0 when clearly another, graded in between."""
    margin = blob.iou[named] - max(v for shape, v in blob.iou.items() if shape != named)
    return min(1.0, max(0.0, 0.5 + margin / (2 * SHAPE_MARGIN)))


def object_parts(obj: ObjectSpec, blob: Blob | None) -> dict[str, float]:
    """colour / shape / size / position of one named object measured on its blob (NaN: not named)."""
    nan = float("nan")
    if blob is None:
        return {"colour": 0.0, "shape": 0.0, "size": 0.0 if obj.size else nan, "position": 0.0 if obj.position else nan}
    x, y = blob.centre
    nearest = min(POSITIONS, key=lambda p: (POSITIONS[p][0] - x) ** 2 + (POSITIONS[p][1] - y) ** 2)
    return {
        "colour": min(1.0, blob.area / MIN_AREA_FRACTION),
        "shape": shape_part(blob, obj.shape),
        "size": float((blob.extent > SIZE_SPLIT) == (obj.size == "large")) if obj.size else nan,
        "position": float(nearest == obj.position) if obj.position else nan,
    }


def caption_parts(objects: Sequence[ObjectSpec], blobs: dict[str, Blob], count: int) -> dict[str, float]:
    """The parts of one image (means over its objects) and its ``score``."""
    per_object = [object_parts(obj, blobs.get(obj.colour)) for obj in objects]
    scores = []
    for parts in per_object:
        attrs = [parts[k] for k in ("shape", "size", "position") if not math.isnan(parts[k])]
        scores.append(parts["colour"] * sum(attrs) / len(attrs))
    count_ok = float(count == len(objects))
    out = {"count": count_ok}
    for key in ("colour", "shape", "size", "position"):
        values = [p[key] for p in per_object if not math.isnan(p[key])]
        out[key] = sum(values) / len(values) if values else float("nan")
    out["score"] = (1.0 if count_ok else 0.5) * sum(scores) / len(scores)
    return out


class ShapeAlignmentScorer(Scorer):
    """Reward in [0, 1]: how well an image shows the coloured shapes its caption names."""

    name = "shape_alignment"

    def __init__(self) -> None:
        self.last_parts: dict[str, Tensor] = {}

    def score_parts(self, images: Tensor, prompts: Sequence[str]) -> dict[str, Tensor]:
        """``score`` and each of ``PART_NAMES`` per image, float32 [B] on CPU (NaN: not named)."""
        check_inputs(images, prompts, scorer=self.name)
        objects = [parse_caption(p) for p in prompts]
        blobs, counts = measure(colour_labels(images.detach().float().cpu()))
        rows = [caption_parts(o, b, c) for o, b, c in zip(objects, blobs, counts)]
        return {key: torch.tensor([row[key] for row in rows]) for key in ("score", *PART_NAMES)}

    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        self.last_parts = self.score_parts(images, prompts)
        return self.last_parts["score"]

    def to(self, device: torch.device | str) -> ShapeAlignmentScorer:
        # no weights: measured on CPU, returned on the images' device
        return self
