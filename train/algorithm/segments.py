"""The segments of W transitions a micro-batch trains, and the path each takes (the routers' building blocks).

``split_segments`` cuts the trainable transitions into consecutive segments of W; ``pick_segments`` draws
``int(timestep_fraction * num_segments)`` of them with the step's shared generator; ``prefix_path`` is
the paper's jagg_frac rule; ``route_segments`` applies it to the picked segments. The routers of
train/algorithm/routing.py call these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from train.algorithm.update_config import UpdateMode

Span = tuple[int, int]  # transitions [start, stop)


@dataclass(frozen=True)
class RoutedSegment:
    """One segment of W consecutive transitions [start, stop) and the path that trains it."""

    start: int
    stop: int
    mode: UpdateMode


def split_segments(trainable: Sequence[int], segment_length: int) -> list[Span]:
    """Cut the trainable transitions (sorted indices) into consecutive segments of ``segment_length``.

    Every contiguous run of trainable transitions must split into whole segments.
    """
    length = segment_length
    assert length >= 2, "UpdateConfig checks segment_length"
    steps = sorted(int(k) for k in trainable)
    if not steps:
        raise ValueError("no trainable transitions to split into segments")
    runs, run_start = [], steps[0]
    for prev, cur in zip(steps, [*steps[1:], -1]):  # -1 closes the last run
        if cur != prev + 1:
            runs.append((run_start, prev + 1))
            run_start = cur
    segments = []
    for a, b in runs:
        if (b - a) % length:
            raise ValueError(
                f"segment_length={length} does not split the trainable transitions {a}..{b - 1} "
                f"({b - a} steps) into whole segments; pick a length that divides {b - a}, or other trainable "
                "transitions"
            )
        segments += [(k, k + length) for k in range(a, b, length)]
    return segments


def prefix_path(start: int, stop: int, *, mode: UpdateMode, jagg_frac: float, num_transitions: int) -> UpdateMode:
    """The path of segment [start, stop): ``mode`` when stop <= round(jagg_frac * M), else exact.

    M = ``num_transitions``, the trainable transitions of the whole trajectory (sampling steps
    minus the ignored last one), so jagg_frac picks the same high-noise region whatever window
    of the trajectory is trained.
    """
    return mode if stop <= round(jagg_frac * num_transitions) else UpdateMode.exact


def pick_segments(
    trainable: Sequence[int],
    *,
    length: int,
    timestep_fraction: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[Span]:
    """Split, then pick int(timestep_fraction * num_segments) segments at random (at least one; all when
    the fraction is 1). Returned high noise first."""
    segments = split_segments(trainable, length)
    num_picked = max(1, int(len(segments) * timestep_fraction + 1e-9))
    if num_picked < len(segments):
        picked = torch.randperm(len(segments), generator=generator)[:num_picked].tolist()
        segments = [segments[i] for i in sorted(picked)]
    return segments


def route_segments(
    trainable: Sequence[int],
    *,
    length: int,
    mode: UpdateMode,
    jagg_frac: float,
    num_transitions: int,
    timestep_fraction: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[RoutedSegment]:
    """``pick_segments``, then route each picked segment by the jagg_frac rule (``prefix_path``)."""
    segments = pick_segments(trainable, length=length, timestep_fraction=timestep_fraction, generator=generator)
    return [
        RoutedSegment(a, b, prefix_path(a, b, mode=mode, jagg_frac=jagg_frac, num_transitions=num_transitions))
        for a, b in segments
    ]
