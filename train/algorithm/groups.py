"""The groups of W transitions a micro-batch trains, and the path each takes (the routers' building blocks).

``split_groups`` cuts the trainable transitions into consecutive groups of W; ``pick_groups`` draws
``int(timestep_fraction * num_groups)`` of them with the step's shared generator; ``prefix_path`` is
the paper's jagg_frac rule; ``route_groups`` applies it to the picked groups. The routers of
train/algorithm/routing.py call these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from train.algorithm.jagg import UPDATE_MODES

Group = tuple[int, int]  # transitions [start, stop)


@dataclass(frozen=True)
class RoutedGroup:
    """One group of W consecutive transitions [start, stop) and the path that trains it."""

    start: int
    stop: int
    mode: str


def split_groups(trainable: Sequence[int], window: int) -> list[Group]:
    """Cut the trainable transitions (sorted indices) into consecutive groups of ``window``.

    Every contiguous run of trainable transitions must split into whole groups.
    """
    if window < 2:
        raise ValueError(f"update.window must be >= 2 (JAGG needs two endpoints), got {window}")
    steps = sorted(int(k) for k in trainable)
    if not steps:
        raise ValueError("no trainable transitions: check sampler.num_steps and the SDE window")
    runs, run_start = [], steps[0]
    for prev, cur in zip(steps, [*steps[1:], -1]):  # -1 closes the last run
        if cur != prev + 1:
            runs.append((run_start, prev + 1))
            run_start = cur
    groups = []
    for a, b in runs:
        if (b - a) % window:
            raise ValueError(
                f"update.window={window} does not split the trainable transitions {a}..{b - 1} "
                f"({b - a} steps) into whole groups; pick a window that divides {b - a} or change "
                "sampler.num_steps / the SDE window"
            )
        groups += [(k, k + window) for k in range(a, b, window)]
    return groups


def prefix_path(start: int, stop: int, *, mode: str, jagg_frac: float, num_transitions: int) -> str:
    """The path of group [start, stop): ``mode`` when stop <= round(jagg_frac * M), else exact.

    M = ``num_transitions``, the trainable transitions of the whole trajectory (sampling steps
    minus the ignored last one), so jagg_frac picks the same high-noise region whatever window
    of the trajectory is trained.
    """
    if mode not in UPDATE_MODES:
        raise ValueError(f"update.mode must be one of {UPDATE_MODES}, got {mode!r}")
    if not 0.0 <= jagg_frac <= 1.0:
        raise ValueError(f"update.jagg_frac must be in [0, 1], got {jagg_frac}")
    return mode if stop <= round(jagg_frac * num_transitions) else "exact"


def pick_groups(
    trainable: Sequence[int],
    *,
    window: int,
    timestep_fraction: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[Group]:
    """Split, then pick int(timestep_fraction * num_groups) groups at random (at least one; all when
    the fraction is 1). Returned high noise first."""
    if not 0.0 < timestep_fraction <= 1.0:
        raise ValueError(f"update.timestep_fraction must be in (0, 1], got {timestep_fraction}")
    groups = split_groups(trainable, window)
    num_picked = max(1, int(len(groups) * timestep_fraction + 1e-9))
    if num_picked < len(groups):
        picked = torch.randperm(len(groups), generator=generator)[:num_picked].tolist()
        groups = [groups[i] for i in sorted(picked)]
    return groups


def route_groups(
    trainable: Sequence[int],
    *,
    window: int,
    mode: str,
    jagg_frac: float,
    num_transitions: int,
    timestep_fraction: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[RoutedGroup]:
    """``pick_groups``, then route each picked group by the jagg_frac rule (``prefix_path``)."""
    groups = pick_groups(trainable, window=window, timestep_fraction=timestep_fraction, generator=generator)
    return [
        RoutedGroup(a, b, prefix_path(a, b, mode=mode, jagg_frac=jagg_frac, num_transitions=num_transitions))
        for a, b in groups
    ]
