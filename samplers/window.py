"""Where the SDE window of a training step lies (``SamplerConfig.sde_window_schedule``).

* ``fixed`` and ``random``: the start drawn per step uniformly in [lo, hi - size] with the ``generator`` given,
  which every rank seeds alike from the step (a resumed run then replays it); with
  hi - lo = size there is one start, the fixed window of the Flow-GRPO-Fast presets;
* ``progressive`` (MixGRPO): the start is lo + (floor(step / iters) mod positions) * stride over the
  positions lo, lo + stride, ... <= hi - size: it moves by ``stride`` every ``iters`` steps and goes back to
  lo past the last start that fits (stride 0: it stays at lo). It depends on the step alone.
"""

from __future__ import annotations

import torch

from samplers.sampler_config import SamplerConfig, WindowSchedule


def draw_sde_window(
    num_steps: int, *, size: int, window_range: tuple[int, int], generator: torch.Generator | None = None
) -> tuple[int, int]:
    """Flow-GRPO-Fast: (start, start + size) with start uniform in [lo, hi - size], drawn with the
    CPU ``generator`` (share it across ranks: the window decides how many transitions train)."""
    lo, hi = window_range
    if size < 1 or lo < 0 or lo + size > hi or hi > num_steps:
        raise ValueError(
            f"window_range={tuple(window_range)} with size={size} needs 0 <= lo, lo + size <= hi <= "
            f"num_steps = {num_steps}"
        )
    start = lo + int(torch.randint(hi - size - lo + 1, (1,), generator=generator))
    return start, start + size


def progressive_start(step: int, *, window_range: tuple[int, int], size: int, iters: int, stride: int) -> int:
    """MixGRPO's progressive window: the start at training step ``step`` (module docstring)."""
    lo, hi = window_range
    positions = (hi - size - lo) // stride + 1 if stride > 0 else 1
    return lo + (step // iters) % positions * stride


def sde_window(sampler: SamplerConfig, step: int, generator: torch.Generator | None) -> tuple[int, int] | None:
    """The SDE window (start, stop) of training step ``step``, None without one (``sde_window_size`` 0);
    ``generator`` draws the fixed and random schedules' start (share it across ranks)."""
    size, (lo, hi) = sampler.sde_window_size, sampler.sde_window_range
    if size <= 0:
        return None
    if sampler.sde_window_schedule is WindowSchedule.progressive:
        start = progressive_start(
            step, window_range=(lo, hi), size=size, iters=sampler.sde_window_iters, stride=sampler.sde_window_stride
        )
        return start, start + size
    return draw_sde_window(sampler.num_steps, size=size, window_range=(lo, hi), generator=generator)


def rollout_forwards(sampler: SamplerConfig, window: tuple[int, int] | None) -> int:
    """Transformer calls per row of a rollout whose SDE window is ``window``: the steps up to the window's stop,
    then those after it (``post_window.steps``); N without a window."""
    if window is None or not sampler.transition.stochastic:
        return sampler.num_steps
    return window[1] + sampler.post_window.steps(sampler.num_steps, window[1])
