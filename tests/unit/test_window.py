"""Where the SDE window of each training step lies (samplers/window.py), and the rollout's forwards with it."""

from __future__ import annotations

import pytest

from samplers.sampler_config import PostWindowConfig, SamplerConfig
from samplers.window import draw_sde_window, progressive_start, rollout_forwards, sde_window
from train.distributed.seeds import stream_generator


def _sampler(**kwargs) -> SamplerConfig:
    return SamplerConfig(sde="flow", num_steps=9, sde_window_size=4, sde_window_range=[0, 8], **kwargs)


@pytest.mark.parametrize(
    "window_range,iters,stride,starts",
    [
        ((0, 8), 2, 1, [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 0, 0, 1]),  # 5 starts fit, then back to lo
        ((0, 8), 1, 2, [0, 2, 4, 0, 2, 4, 0]),  # 0, 2, 4 fit; 6 does not
        ((1, 9), 3, 3, [1, 1, 1, 4, 4, 4, 1, 1]),  # from lo, and back to it
        ((2, 8), 1, 0, [2, 2, 2, 2]),  # stride 0: the window stays
    ],
)
def test_the_progressive_start_at_each_step(window_range, iters, stride, starts):
    got = [
        progressive_start(s, window_range=window_range, size=4, iters=iters, stride=stride) for s in range(len(starts))
    ]
    assert got == starts


def test_the_progressive_window_of_the_sampler():
    sampler = _sampler(sde_window_schedule="progressive", sde_window_iters=25, sde_window_stride=1)
    assert [sde_window(sampler, step, None) for step in (0, 24, 25, 100, 124, 125)] == [
        (0, 4), (0, 4), (1, 5), (4, 8), (4, 8), (0, 4),
    ]  # fmt: skip


def test_the_random_window_is_the_runs_stream_per_step():
    """random and fixed draw the start in [lo, hi - size] from (seed, "sde_window", step): the same for a step
    whenever it is drawn (every rank, a resumed run), other steps elsewhere."""
    sampler, fixed = _sampler(sde_window_schedule="random"), _sampler()

    def windows(cfg: SamplerConfig, seed: int) -> list[tuple[int, int] | None]:
        return [sde_window(cfg, step, stream_generator(seed, "sde_window", step)) for step in range(40)]

    drawn = windows(sampler, 0)
    assert drawn == windows(sampler, 0) == windows(fixed, 0) and drawn != windows(sampler, 1)
    assert {w[0] for w in drawn if w is not None} == {0, 1, 2, 3, 4}
    again = draw_sde_window(9, size=4, window_range=(0, 8), generator=stream_generator(0, "sde_window", 17))
    assert drawn[17] == again
    assert sde_window(SamplerConfig(), 3, None) is None  # no window


def test_window_settings_are_checked():
    with pytest.raises(ValueError, match="sde_window_schedule='sliding' is not valid; accepted values: fixed"):
        _sampler(sde_window_schedule="sliding")
    with pytest.raises(ValueError, match="sde_window_iters must be >= 1, got 0"):
        _sampler(sde_window_iters=0)
    with pytest.raises(ValueError, match=r"sde_window_stride must be >= 0, got -1 \(0 = the window stays at lo\)"):
        _sampler(sde_window_stride=-1)


def test_the_rollouts_forwards_per_sample():
    """The default job's 9 steps with the window [0, 4): 4 + 5; with rho 0.4 the 5 after it become 2."""
    assert rollout_forwards(_sampler(), (0, 4)) == 9 and rollout_forwards(_sampler(), None) == 9
    flash = _sampler(post_window=PostWindowConfig(solver="dpmpp_2m", ratio=0.4))
    assert [rollout_forwards(flash, (s, s + 4)) for s in range(5)] == [6, 7, 8, 9, 9]
    assert rollout_forwards(SamplerConfig(sde="ode", num_steps=9), (0, 4)) == 9  # no SDE step, no window
