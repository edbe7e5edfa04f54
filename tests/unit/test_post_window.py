"""The steps after the SDE window (MixGRPO-Flash): DPM-Solver++ 2M against its formulas, and a rollout whose
window is the same whichever solver follows it."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from models import backbone_names, load_backbone
from samplers.post_window import dpmpp_2m_step, post_window_step
from samplers.rollout import group_noise, rollout, transition
from samplers.sampler_config import PostWindowConfig, SamplerConfig
from samplers.schedule import dynamic_sigmas, post_window_sigmas, schedule_shift, shifted_sigmas
from samplers.sde import ODE, step


def _reference_2m(v: Tensor, z: Tensor, s: float, t: float, prev: tuple[Tensor, float] | None) -> Tensor:
    """DPM-Solver++ 2M written from its formulas, one element at a time in Python floats."""
    out = torch.empty_like(z)
    lam = [math.log((1 - s) / s), math.log((1 - t) / t) if t > 0 else math.inf]
    for i in range(z.numel()):
        d0 = z.flatten()[i].item() - s * v.flatten()[i].item()
        if t == 0:
            out.view(-1)[i] = d0
            continue
        h = lam[1] - lam[0]
        x = (t / s) * z.flatten()[i].item() - (1 - t) * (math.exp(-h) - 1) * d0
        if prev is not None:
            r0 = (lam[0] - math.log((1 - prev[1]) / prev[1])) / h
            d1 = (d0 - prev[0].flatten()[i].item()) / r0
            x -= 0.5 * (1 - t) * (math.exp(-h) - 1) * d1
        out.view(-1)[i] = x
    return out


@pytest.mark.parametrize("case", ["second order", "first order", "last step"])
def test_dpmpp_2m_step_matches_its_formulas(case, float64):
    gen = torch.Generator().manual_seed(0)
    z, v, x0_prev = (torch.randn(3, 2, 4, generator=gen) for _ in range(3))
    prev = None if case == "first order" else (x0_prev, 0.83)
    s, t = 0.71, 0.0 if case == "last step" else 0.42
    got, x0 = dpmpp_2m_step(v, z, s, t, prev)
    torch.testing.assert_close(got, _reference_2m(v, z, s, t, prev), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x0, z - s * v, rtol=0, atol=0)
    if prev is not None and t > 0:  # the history term moves the step: the check can fail
        assert (got - dpmpp_2m_step(v, z, s, t, None)[0]).abs().min() > 1e-6


def test_first_order_step_is_exact_on_a_linear_velocity_field(float64):
    """v(z, sigma) = (z - a) / sigma is the field of the straight paths z = a + sigma c that end at x0 = a: a
    first-order step from sigma to sigma' lands on a + (sigma' / sigma)(z - a), for any step size."""
    gen = torch.Generator().manual_seed(1)
    a, z = torch.randn(2, 5, generator=gen), torch.randn(2, 5, generator=gen)
    for s, t in [(0.9, 0.2), (0.5, 0.49), (0.3, 0.0)]:
        got, _ = dpmpp_2m_step((z - a) / s, z, s, t, None)
        torch.testing.assert_close(got, a + (t / s) * (z - a), rtol=1e-13, atol=1e-13)
    # on this field every x0 is a, so the second-order term vanishes too
    got, _ = dpmpp_2m_step((z - a) / 0.6, z, 0.6, 0.3, (a.clone(), 0.8))
    torch.testing.assert_close(got, a + 0.5 * (z - a), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("shift", [1.0, 3.0])
@pytest.mark.parametrize("stop,points", [(4, 3), (1, 2), (10, 5)])
def test_the_rebuilt_schedule_runs_from_sigma_stop_to_zero(stop, points, shift):
    sigmas = shifted_sigmas(20, shift)
    rebuilt = torch.tensor(post_window_sigmas(sigmas, stop, points), dtype=torch.float64)
    assert rebuilt.shape == (points,) and rebuilt[0] == sigmas[stop] and rebuilt[-1] == 0
    assert (rebuilt[1:] < rebuilt[:-1]).all()
    u = rebuilt / (shift - (shift - 1.0) * rebuilt)  # the unshifted time, uniform from u_stop to 0
    torch.testing.assert_close(u, torch.linspace(1.0 - stop / 20, 0.0, points, dtype=torch.float64))


def test_a_rebuilt_schedule_with_every_point_is_the_schedule():
    sigmas = shifted_sigmas(9, 3.0)
    assert post_window_sigmas(sigmas, 4, 6) == sigmas[4:].tolist()
    assert post_window_sigmas(sigmas, 4, 8) == sigmas[4:].tolist()  # never more points than the schedule has
    assert len(post_window_sigmas(sigmas, 4, 5)) == 5


def test_the_dynamic_schedule_is_shifted_by_its_own_shift():
    """Without a terminal stretch the dynamic schedule is the fixed-shift one with s = e^mu (float32); with one
    it is no shifted schedule, and compressing it is refused."""
    sigmas = dynamic_sigmas(12, 0.8)
    assert schedule_shift(sigmas) == pytest.approx(math.exp(0.8), rel=1e-5)  # float32 sigmas
    rebuilt = post_window_sigmas(sigmas, 3, 4)
    assert len(rebuilt) == 4 and rebuilt[0] == float(sigmas[3]) and rebuilt[-1] == 0
    stretched = dynamic_sigmas(12, 0.8, shift_terminal=0.02)
    assert schedule_shift(stretched) is None
    with pytest.raises(ValueError, match="needs a shifted schedule"):
        post_window_sigmas(stretched, 3, 4)
    assert len(post_window_sigmas(stretched, 3, 10)) == 10  # nothing to compress: the schedule's own


def _field(z: Tensor, t: Tensor, cond) -> Tensor:
    """A cheap nonlinear velocity field, so that a second-order step differs from Euler's."""
    return torch.tanh(z) - t.view(-1, *([1] * (z.ndim - 1))) * z


def _sample(sampler: SamplerConfig, *, window=(2, 4), num_steps: int = 9):
    noise = torch.randn(4, 2, 2, 4, generator=torch.Generator().manual_seed(0))
    return rollout(
        _field, None, noise, sampler, sigmas=shifted_sigmas(num_steps, 3.0), sde_window=window,
        generator=torch.Generator().manual_seed(1),
    )  # fmt: skip


def test_the_window_is_the_same_whichever_solver_follows():
    euler = SamplerConfig(sde="flow")
    flash = SamplerConfig(sde="flow", post_window=PostWindowConfig(solver="dpmpp_2m"))
    a, b = _sample(euler), _sample(flash)
    assert torch.equal(a.latents[:, :5], b.latents[:, :5]) and torch.equal(a.log_probs, b.log_probs)
    assert b.trainable_steps() == [2, 3] and (b.log_probs[:, 4:] == 0).all()
    assert not torch.equal(a.latents[:, -1], b.latents[:, -1])  # the steps after the window differ
    assert torch.isfinite(b.latents).all()


def test_dpmpp_2m_after_the_window_takes_its_steps():
    """Each step after the window is dpmpp_2m_step on the sampling schedule, the first seeded with the window's
    last x0, the last landing on x0."""
    traj = _sample(SamplerConfig(sde="dance", post_window=PostWindowConfig(solver="dpmpp_2m")))
    sig = traj.sigmas.tolist()
    v3 = _field(traj.latents[:, 3], traj.timesteps[3].expand(4), None)
    history = (traj.latents[:, 3] - sig[3] * v3, sig[3])
    for k in range(4, 9):
        v = _field(traj.latents[:, k], traj.timesteps[k].expand(4), None)
        z, x0 = dpmpp_2m_step(v, traj.latents[:, k], sig[k], sig[k + 1], history)
        torch.testing.assert_close(traj.latents[:, k + 1], z, rtol=0, atol=0)
        history = (x0, sig[k])
    assert torch.equal(traj.latents[:, -1], x0)


def test_an_unknown_solver_and_bad_ranges_are_named():
    with pytest.raises(ValueError, match="solver='heun' is not valid; accepted values: euler, dpmpp_2m"):
        PostWindowConfig(solver="heun")
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\], got 0.0 \(1 = every step"):
        PostWindowConfig(ratio=0.0)
    with pytest.raises(ValueError, match="min_steps must be >= 1, got 0"):
        PostWindowConfig(min_steps=0)


def test_the_points_after_the_window():
    """P = max(int((N - L) rho), min_steps + 1): the default job's 5 steps after [0, 4) of 9 become 2."""
    flash = PostWindowConfig(ratio=0.4)
    assert flash.points(9, 4) == 3 and flash.points(25, 4) == 8 and PostWindowConfig(ratio=0.2).points(25, 4) == 4
    assert PostWindowConfig(ratio=0.4, min_steps=4).points(9, 4) == 5 and PostWindowConfig().points(9, 4) == 6


@pytest.mark.parametrize("solver", ["euler", "dpmpp_2m"])
def test_a_compressed_schedule_runs_fewer_steps_and_keeps_the_window(solver):
    calls: list[Tensor] = []

    def counted(z: Tensor, t: Tensor, cond) -> Tensor:
        calls.append(t[0].clone())
        return _field(z, t, cond)

    noise = torch.randn(4, 2, 2, 4, generator=torch.Generator().manual_seed(0))
    sigmas = shifted_sigmas(9, 3.0)
    flash = SamplerConfig(sde="flow", post_window=PostWindowConfig(solver=solver, ratio=0.4))
    traj = rollout(
        counted, None, noise, flash, sigmas=sigmas, sde_window=(0, 4), generator=torch.Generator().manual_seed(1)
    )
    full = _sample(SamplerConfig(sde="flow"), window=(0, 4))
    assert len(calls) == 4 + 2  # the window's 4 steps, then P - 1 = 2 instead of 5
    rebuilt = torch.tensor(post_window_sigmas(sigmas, 4, 3), dtype=torch.float64)
    torch.testing.assert_close(torch.stack(calls[4:]), rebuilt[:2].float(), rtol=0, atol=0)
    assert torch.equal(traj.latents[:, :5], full.latents[:, :5]) and torch.equal(traj.log_probs, full.log_probs)
    assert traj.latents[:, 5:9].isnan().all() and torch.isfinite(traj.latents[:, -1]).all()
    z, grid = traj.latents[:, 4], [float(sigmas[3]), *rebuilt.tolist()]
    v3 = _field(traj.latents[:, 3], traj.timesteps[3].expand(4), None)
    history = (traj.latents[:, 3] - grid[0] * v3, grid[0])
    for i in range(2):  # the solver's steps on the rebuilt points, seeded with the window's last x0
        v = _field(z, rebuilt[i].float().expand(4), None)
        z, history = post_window_step(flash.post_window.solver, v, z, grid[i + 1], grid[i + 2], history)
    assert torch.equal(traj.latents[:, -1], z)


def _tiny_sample(backbone, post: PostWindowConfig, *, window=(1, 3)):
    cond = backbone.encode(["a photo of a cat", "a red dog on the grass"]).repeat(2)
    noise = group_noise(backbone.initial_noise, [11, 12], group_size=2, height=32, width=32)
    sampler = SamplerConfig(sde="flow", post_window=post)
    return rollout(
        backbone.predict, cond, noise, sampler, sigmas=shifted_sigmas(7, 3.0), sde_window=window,
        generator=torch.Generator().manual_seed(0), group_size=2,
    )  # fmt: skip


@pytest.mark.parametrize("name", backbone_names())
def test_euler_with_every_step_is_the_euler_rollout_bit_for_bit(name, tiny_dir):
    """With every step given back, the steps after the window are the ODE's Euler steps of the sampling
    schedule (as samplers.sde.step takes them on the trajectory's own sigmas), to the last bit, images too."""
    backbone = load_backbone(name, tiny_dir(name), dtype="float32")
    traj = _tiny_sample(backbone, PostWindowConfig(solver="euler", ratio=1.0))
    z = traj.latents[:, 3]
    for k in range(3, 7):
        v = backbone.predict(z, traj.timesteps[k].expand(4), traj.cond)
        z = step(ODE, v, z, traj.sigmas[k], traj.sigmas[k + 1]).next_z
        assert torch.equal(traj.latents[:, k + 1], z)
    assert (traj.log_probs[:, 3:] == 0).all()
    images = backbone.decode(traj.latents[:, -1], height=32, width=32)
    assert torch.equal(images, backbone.decode(z, height=32, width=32))


@pytest.mark.parametrize("name", backbone_names())
def test_the_first_ratio_is_one_with_the_solver_on(name, tiny_dir):
    """The trained transitions and their old log-probs do not depend on the solver after the window: recomputed
    with the sampling weights on the rollout's own batch, every trained step's ratio is exactly 1."""
    backbone = load_backbone(name, tiny_dir(name), dtype="float32")
    flash = _tiny_sample(backbone, PostWindowConfig(solver="dpmpp_2m", ratio=0.4))
    plain = _tiny_sample(backbone, PostWindowConfig())
    assert flash.trainable_steps() == [1, 2]
    assert torch.equal(flash.latents[:, :4], plain.latents[:, :4]) and torch.equal(flash.log_probs, plain.log_probs)
    for k in flash.trainable_steps():
        v = backbone.predict(flash.latents[:, k], flash.timesteps[k].expand(4), flash.cond)
        assert torch.equal(transition(flash, k, v).log_prob, flash.log_probs[:, k])
    assert not torch.equal(flash.latents[:, -1], plain.latents[:, -1])
