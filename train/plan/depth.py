"""The full-depth plan from plans of the transformer cut to a few blocks.

A transformer's blocks of one kind are alike (Flux's double and single blocks, Qwen-Image's blocks): each adds the
same parameters, shards, gradients, optimizer state and activations, the same FLOPs and the same bytes to gather
and reduce, so a plan's figures grow by the same amount with each block of a kind once the peak of each phase
sits at the same point of the step. The planner traces the model cut to ``PROBE_BLOCKS`` blocks of each kind,
then to one and two blocks more of each kind in turn, and where every figure grew by the same amount with both
added blocks, extends every figure to the configured depth d:

    v(d) = v(p) + sum over kinds k of (d_k - p_k) (v(p + e_k) - v(p))

Otherwise (a peak that moved between the probes) it traces the configured depth. Three traces of 3-5 blocks
(Qwen-Image) or five (Flux) instead of one of 60 or 57 blocks; with 2 blocks a step never has a block gathered
ahead of the one it runs (FSDP2's prefetch), hence 3; tests/tools/test_plan.py holds the extension equal
to the full trace.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

DEPTH_KEYS = ("num_layers", "num_single_layers")  # blocks of each kind in Flux's and Qwen-Image's configs
PROBE_BLOCKS = 3  # blocks of each kind in the smallest probe: a first, a last, and one between them
T = TypeVar("T")


def depth_of(config: dict[str, Any]) -> dict[str, int]:
    """Blocks of each kind of a transformer's config."""
    return {key: int(config[key]) for key in DEPTH_KEYS if key in config}


def probes(depth: dict[str, int]) -> list[dict[str, int]] | None:
    """The depths to trace: PROBE_BLOCKS of each kind, then one and two more of each kind in turn; None when the
    model is no deeper than they are (traced as it is)."""
    if all(n <= PROBE_BLOCKS + 2 for n in depth.values()):
        return None
    base = dict.fromkeys(depth, PROBE_BLOCKS)
    return [base, *({**base, key: PROBE_BLOCKS + more} for key in depth for more in (1, 2))]


@contextmanager
def cut_arch(arch: Path, transformer_config: str, depth: dict[str, int]) -> Iterator[Path]:
    """A temporary architecture folder: ``arch``'s components linked, its transformer's config cut to ``depth``."""
    with tempfile.TemporaryDirectory(prefix="plan_depth_") as tmp:
        folder = Path(tmp)
        for entry in arch.absolute().iterdir():
            if entry.name != "transformer":
                (folder / entry.name).symlink_to(entry)
        config = json.loads((arch / "transformer" / transformer_config).read_text())
        (folder / "transformer").mkdir()
        (folder / "transformer" / transformer_config).write_text(json.dumps({**config, **depth}))
        yield folder


def extend(probe: T, steps: list[tuple[T, float]]) -> T:
    """``probe``'s figures moved by ``factor`` times each (other - probe) of ``steps``: every int and float,
    inside dataclasses, lists, tuples and dicts; other values (text, flags) as ``probe`` has them."""
    return _extend(probe, steps)


def _extend(value: Any, steps: list[tuple[Any, float]]) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        moved = value + sum(factor * (other - value) for other, factor in steps)
        return round(moved) if isinstance(value, int) else moved
    if isinstance(value, (list, tuple)):
        items = [_extend(v, [(other[i], f) for other, f in steps]) for i, v in enumerate(value)]
        return type(value)(items)
    if isinstance(value, dict):
        return {k: _extend(v, [(other[k], f) for other, f in steps]) for k, v in value.items()}
    if is_dataclass(value) and not isinstance(value, type):
        moved = {f.name: _extend(getattr(value, f.name), [(getattr(o, f.name), fc) for o, fc in steps])
                 for f in fields(value)}  # fmt: skip
        return replace(value, **moved)
    raise TypeError(f"plan: cannot extend a {type(value).__name__} to full depth")


def figures(value: Any) -> list[float]:
    """Every int and float of ``value``, in order (as ``extend`` moves them)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in figures(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in figures(v)]
    return [x for f in fields(value) for x in figures(getattr(value, f.name))]


def _affine(base: Any, one: Any, two: Any) -> bool:
    """The second added block moved every figure as the first did (within float64 rounding)."""
    expected, found = figures(extend(base, [(one, 2.0)])), figures(two)
    return len(expected) == len(found) and all(
        math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6) for a, b in zip(expected, found, strict=True)
    )


def at_depth(depth: dict[str, int], plan_at: Callable[[dict[str, int]], T]) -> T | None:
    """The plan at ``depth`` from ``plan_at`` the probes' depths (``probes``), their figures extended; None where
    a figure did not grow alike with each added block (trace the full depth instead)."""
    cuts = probes(depth)
    assert cuts is not None
    base, *more = [plan_at(cut) for cut in cuts]
    ones, twos = more[0::2], more[1::2]
    if not all(_affine(base, one, two) for one, two in zip(ones, twos, strict=True)):
        return None
    return extend(base, [(one, float(depth[key] - PROBE_BLOCKS)) for one, key in zip(ones, depth, strict=True)])
