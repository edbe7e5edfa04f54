"""The transformer traced at a few blocks of each kind and every figure extended linearly to its full depth
(``plan.depth=extended``): the blocks of one kind are alike, so from ``BASE_BLOCKS`` blocks on each adds the same
shards, gradients, optimizer state, saved inputs and FLOPs; the trace of every block costs minutes.

The base trace holds ``BASE_BLOCKS`` blocks of each kind (fewer where the model has fewer); one more trace per
kind deeper than ``BASE_BLOCKS + STEP_BLOCKS`` adds ``STEP_BLOCKS`` of it. A figure at full depth is the base's
plus, per kind, what its ``STEP_BLOCKS`` blocks added, times (blocks - base) / ``STEP_BLOCKS``. The base keeps
FSDP2's prefetch as at full depth (it gathers the next block from 3 blocks on:
docs/benchmarks/2026-12-planner-speed.md)."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from train.tools.plan.frozen import read_json

BLOCK_KEYS = ("num_layers", "num_single_layers")  # the block counts of the transformer's config, one per kind
BASE_BLOCKS = 4
STEP_BLOCKS = 2

T = TypeVar("T")


def full_depths(arch: Path) -> dict[str, int]:
    """The transformer's blocks of each kind, by its config key."""
    config = read_json(arch / "transformer" / "config.json")
    return {key: int(config[key]) for key in BLOCK_KEYS if key in config}


def traced_depths(full: dict[str, int]) -> list[dict[str, int]]:
    """The base depths, then one per kind deeper than the base by more than STEP_BLOCKS; [] when no kind is
    (the full trace is then as cheap)."""
    base = {key: min(n, BASE_BLOCKS) for key, n in full.items()}
    deeper = [key for key, n in full.items() if n > BASE_BLOCKS + STEP_BLOCKS]
    return [base, *({**base, key: base[key] + STEP_BLOCKS} for key in deeper)] if deeper else []


@contextmanager
def cut_arch(arch: Path, depths: dict[str, int]) -> Iterator[Path]:
    """A folder like ``arch`` whose transformer has ``depths`` blocks (the other components linked, not copied)."""
    with tempfile.TemporaryDirectory(prefix="plan-arch-") as tmp:
        folder = Path(tmp)
        for entry in arch.iterdir():
            if entry.name != "transformer":
                (folder / entry.name).symlink_to(entry.resolve())
        (folder / "transformer").mkdir()
        config = read_json(arch / "transformer" / "config.json") | depths
        (folder / "transformer" / "config.json").write_text(json.dumps(config))
        yield folder


def extended(full: dict[str, int], trace_at: Callable[[dict[str, int]], T]) -> T:
    """What ``trace_at`` gives at ``full`` depths, from its traces at ``traced_depths(full)`` extended linearly."""
    base_depths, *steps = traced_depths(full)
    base = trace_at(base_depths)
    added = [(trace_at(depths), next(k for k in depths if depths[k] != base_depths[k])) for depths in steps]
    return _combine(base, [(step, (full[key] - base_depths[key]) / STEP_BLOCKS) for step, key in added])


def _combine(base: Any, steps: list[tuple[Any, float]]) -> Any:
    """``base`` plus, for each (traced, times), (traced - base) * times, field by field; what is not a number
    (names, flags, tensors) is the base's."""
    if base is None or isinstance(base, bool | str):
        return base
    if isinstance(base, int | float):
        value = base + sum((other - base) * times for other, times in steps)
        return round(value) if isinstance(base, int) else value
    if isinstance(base, dict):
        keys = set(base).union(*(other for other, _ in steps))
        return {k: _combine(base.get(k, 0), [(other.get(k, 0), t) for other, t in steps]) for k in keys}
    if isinstance(base, list | tuple):
        return type(base)(_combine(b, [(other[i], t) for other, t in steps]) for i, b in enumerate(base))
    if dataclasses.is_dataclass(base) and not isinstance(base, type):
        changes = {
            f.name: _combine(getattr(base, f.name), [(getattr(o, f.name), t) for o, t in steps])
            for f in dataclasses.fields(base)
        }
        return dataclasses.replace(base, **changes)
    return base
