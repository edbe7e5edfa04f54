"""The rollout: stored transitions re-score to ratio 1, SDE windows, group noise, bookkeeping,
and the JAGG update paths on real (tiny) backbones."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import Tensor

from models import backbone_names, load_backbone
from models.flux import FluxConditioning
from samplers.rollout import ODE, KeptVelocities, group_noise, rollout, stochastic_flags, transition
from samplers.sampler_config import SamplerConfig
from samplers.sde import step
from samplers.window import draw_sde_window
from train.algorithm.grpo import ppo_step_loss
from train.algorithm.jagg import backward_segment

SDES = {
    "dance": SamplerConfig(sde="dance", eta=0.3),
    "flow": SamplerConfig(sde="flow", noise_level=0.7),
    "cps": SamplerConfig(sde="cps", noise_level=0.8),
}
ODE_SAMPLER = SamplerConfig(sde="ode")


def _sample(backbone, sampler: SamplerConfig, *, num_steps: int = 6, group_size: int = 2, seed: int = 0, **kwargs):
    prompts = ["a photo of a cat", "a red dog on the grass"]
    cond = backbone.encode(prompts).repeat(group_size)
    noise = group_noise(backbone.initial_noise, [11, 12], group_size=group_size, height=32, width=32)
    shift = 3.0 if sampler.sde == "dance" else None  # DanceGRPO's fixed shift; Flow-GRPO: the model's own
    sigmas = backbone.sigmas(num_steps, height=32, width=32, shift=shift)
    group_ids = torch.tensor([11, 12]).repeat_interleave(group_size)
    generator = torch.Generator().manual_seed(seed)
    return rollout(
        backbone.predict, cond, noise, sampler, sigmas=sigmas, group_ids=group_ids, generator=generator, **kwargs
    )


@pytest.mark.parametrize("kind", ["dance", "flow", "cps"])
@pytest.mark.parametrize("name", backbone_names())
def test_recomputed_log_probs_give_ratio_one(name, kind, backbones):
    """Same weights, stored float32 latents: every transition re-scores to its sampling log-prob,
    also when recomputed on a different split of rows (as a training micro-batch would)."""
    backbone = backbones[name]
    quantize = "float64" if kind == "dance" else "none"
    traj = _sample(backbone, replace(SDES[kind], quantize_timesteps=quantize))
    assert traj.log_probs.dtype == torch.float32 and traj.latents.dtype == torch.float32
    assert traj.trainable.tolist() == [True] * 5 + [False]  # the last transition never trains
    for k in range(traj.num_steps):
        for rows in ([0, 3], [1, 2]):
            v = backbone.predict(traj.latents[rows, k], traj.timesteps[k].expand(2), traj.cond.index(rows))
            log_ratio = transition(traj, k, v, rows).log_prob - traj.log_probs[rows, k]
            assert log_ratio.abs().max() < 1e-5, (k, log_ratio)


def test_log_prob_detects_a_different_velocity(backbones):
    """The ratio check can fail: perturbing v moves the log-prob."""
    backbone = backbones["flux"]
    traj = _sample(backbone, SDES["flow"], num_steps=3)
    v = backbone.predict(traj.latents[:, 1], traj.timesteps[1].expand(4), traj.cond)
    moved = transition(traj, 1, v + 0.05).log_prob - traj.log_probs[:, 1]
    assert moved.abs().min() > 1e-4


def test_group_rows_share_initial_noise_and_differ_after_sde(backbones):
    traj = _sample(backbones["qwenimage"], SDES["dance"], num_steps=3)
    z0 = traj.latents[:, 0]
    assert torch.equal(z0[0], z0[1]) and torch.equal(z0[2], z0[3]) and not torch.equal(z0[1], z0[2])
    assert not torch.equal(traj.latents[0, -1], traj.latents[1, -1])
    again = group_noise(backbones["qwenimage"].initial_noise, [12], group_size=1, height=32, width=32)
    torch.testing.assert_close(again[0], z0[2])  # a group's noise depends on its seed only
    assert traj.group_ids.tolist() == [11, 11, 12, 12]


def _linear_predict(calls: list[tuple[int, Tensor]]):
    """A cheap velocity field v = 0.5 z - t that records each call's batch size and t."""

    def predict(z: Tensor, t: Tensor, cond) -> Tensor:
        calls.append((z.shape[0], t.clone()))
        return 0.5 * z - t.view(-1, 1, 1, 1)

    return predict


def test_one_batched_call_per_step_quantized_t_and_kept_velocities():
    calls: list[tuple[int, Tensor]] = []
    sigmas = torch.tensor([1.0, 0.7777, 0.3333, 0.0], dtype=torch.float64)
    noise = torch.randn(5, 2, 2, 4, generator=torch.Generator().manual_seed(0))
    traj = rollout(
        _linear_predict(calls), None, noise, replace(SDES["dance"], quantize_timesteps="float64"), sigmas=sigmas,
        velocities=KeptVelocities(), generator=torch.Generator().manual_seed(1),
    )  # fmt: skip
    assert [b for b, _ in calls] == [5, 5, 5]
    torch.testing.assert_close(traj.timesteps, torch.tensor([1.0, 0.777, 0.333]))
    torch.testing.assert_close(torch.stack([t[0] for _, t in calls]), traj.timesteps)
    for k in range(3):
        expected_v = 0.5 * traj.latents[:, k] - traj.timesteps[k]
        torch.testing.assert_close(traj.velocities[:, k], expected_v)
    no_v = rollout(_linear_predict([]), None, noise, SDES["dance"], sigmas=sigmas)
    assert no_v.velocities is None and no_v.group_ids.tolist() == [0, 1, 2, 3, 4]


def test_sde_window_steps_and_ode_elsewhere():
    sigmas = torch.linspace(1.0, 0.0, 9, dtype=torch.float64)
    noise = torch.randn(3, 2, 2, 4, generator=torch.Generator().manual_seed(0))
    cond = FluxConditioning(prompt_embeds=torch.arange(3.0).view(3, 1, 1), pooled=torch.zeros(3, 2))
    traj = rollout(_linear_predict([]), cond, noise, SDES["flow"], sigmas=sigmas, sde_window=(2, 5))
    assert traj.stochastic.tolist() == [False, False, True, True, True, False, False, False]
    assert traj.trainable_steps() == [2, 3, 4]
    assert (traj.log_probs[:, [0, 1, 5, 6, 7]] == 0).all() and (traj.log_probs[:, 2:5] != 0).all()
    for k in (0, 1, 5, 6, 7):  # outside the window the step is the deterministic Euler step
        v = 0.5 * traj.latents[:, k] - traj.timesteps[k]
        torch.testing.assert_close(
            traj.latents[:, k + 1], step(ODE, v, traj.latents[:, k], sigmas[k], sigmas[k + 1]).next_z
        )
    with pytest.raises(ValueError, match="ODE step"):
        transition(traj, 0, torch.zeros_like(noise))
    rows = traj.index([2, 0])
    assert traj.num_transitions == 7 and rows.latents.shape == (2, 9, 2, 2, 4)
    assert rows.cond.prompt_embeds.flatten().tolist() == [2.0, 0.0] and rows.group_ids.tolist() == [2, 0]
    torch.testing.assert_close(rows.log_probs, traj.log_probs[[2, 0]])
    assert not any(stochastic_flags(8, ODE, None))


def test_draw_sde_window_covers_its_range():
    generator = torch.Generator().manual_seed(0)
    starts = {draw_sde_window(10, size=2, window_range=(1, 6), generator=generator)[0] for _ in range(200)}
    assert starts == {1, 2, 3, 4}  # start in [lo, hi - size]
    assert draw_sde_window(10, size=3, window_range=(4, 7)) == (4, 7)
    with pytest.raises(ValueError, match="window_range"):
        draw_sde_window(10, size=4, window_range=(0, 3))
    with pytest.raises(ValueError, match="sde_window"):
        rollout(_linear_predict([]), None, torch.zeros(1, 1, 1, 4), SDES["flow"], sigmas=torch.linspace(1, 0, 4),
                sde_window=(2, 5))  # fmt: skip


def _grads(module: torch.nn.Module) -> list[Tensor]:
    return [p.grad.clone() for p in module.parameters() if p.grad is not None]


def _jagg_grads(backbone, traj, mode: str, start: int, width: int, *, reuse: bool = False) -> list[Tensor]:
    """Gradient of the PPO loss of transitions [start, start + width) by ``mode``; ``reuse`` hands it the
    rollout's velocities."""
    transformer = backbone.transformer
    transformer.requires_grad_(True)
    transformer.zero_grad(set_to_none=True)
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])[: traj.batch_size]
    ks = list(range(start, start + width))
    velocities = traj.velocities[:, start : start + width].transpose(0, 1) if reuse else None

    def predict(z: Tensor, t: Tensor) -> Tensor:
        cond = type(traj.cond).cat([traj.cond] * (z.shape[0] // traj.batch_size))
        return backbone.predict(z, t, cond)

    def step_loss(j: int, v: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        log_prob = transition(traj, ks[j], v).log_prob
        return ppo_step_loss(log_prob, traj.log_probs[:, ks[j]], advantages, clip_range=0.2)

    z = [traj.latents[:, k] for k in ks]
    backward_segment(mode, predict, step_loss, z, traj.timesteps[ks], velocities=velocities)
    grads = _grads(transformer)
    transformer.zero_grad(set_to_none=True)
    transformer.requires_grad_(False)
    return grads


@pytest.mark.parametrize("kind", ["dance", "cps"])
@pytest.mark.parametrize("name", backbone_names())
def test_jagg_paths_on_real_backbones(name, kind, backbones):
    """W = 2: JAGG is the exact gradient; any W: the sequential variant equals the joint one."""
    backbone = backbones[name]
    traj = _sample(backbone, SDES[kind], num_steps=5)
    exact, jagg = _jagg_grads(backbone, traj, "exact", 1, 2), _jagg_grads(backbone, traj, "jagg", 1, 2)
    assert len(exact) == len(jagg) > 0 and any(g.abs().max() > 0 for g in exact)
    for a, b in zip(exact, jagg):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)
    joint, sequential = _jagg_grads(backbone, traj, "jagg", 0, 3), _jagg_grads(backbone, traj, "jagg_sequential", 0, 3)
    for a, b in zip(joint, sequential):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)


def _relative_difference(a: list[Tensor], b: list[Tensor]) -> float:
    flat_a, flat_b = torch.cat([g.flatten() for g in a]), torch.cat([g.flatten() for g in b])
    return float((flat_a - flat_b).norm() / flat_b.norm())


@pytest.mark.parametrize("mode", ["jagg", "jagg_sequential"])
@pytest.mark.parametrize("name", backbone_names())
def test_rollout_velocities_give_the_recomputed_gradient(name, mode, backbones):
    """The rollout ran the transformer on all 4 rows per step; the update's middle forward runs a
    micro-batch of 2 rows over W - 2 = 2 steps in one call. The same weights give the same v up to the
    float32 rounding of other batch shapes, so the gradients agree to 1e-5 relative."""
    backbone = backbones[name]
    traj = _sample(backbone, SDES["dance"], num_steps=6, velocities=KeptVelocities())
    micro = traj.index([1, 2])
    recomputed = _jagg_grads(backbone, micro, mode, 0, 4)
    reused = _jagg_grads(backbone, micro, mode, 0, 4, reuse=True)
    assert _relative_difference(reused, recomputed) < 1e-5
    ablate = _jagg_grads(backbone, micro, "ablate", 0, 4)
    assert _relative_difference(ablate, recomputed) > 1e-3  # the middle steps do count


def test_kept_velocities_in_the_model_dtype_and_on_the_host():
    """A bfloat16 transformer's v, upcast by predict, is stored in bfloat16 without loss, where asked."""
    calls: list[tuple[int, Tensor]] = []
    linear = _linear_predict(calls)

    def bf16_predict(z: Tensor, t: Tensor, cond) -> Tensor:
        return linear(z, t, cond).bfloat16().float()

    sigmas = torch.tensor([1.0, 0.6, 0.2, 0.0])
    noise = torch.randn(4, 2, 2, 4, generator=torch.Generator().manual_seed(0))
    velocities = KeptVelocities(torch.bfloat16, "cpu")
    traj = rollout(bf16_predict, None, noise, SDES["dance"], sigmas=sigmas, generator=torch.Generator().manual_seed(1),
                   velocities=velocities)  # fmt: skip
    assert traj.velocities.dtype == torch.bfloat16 and traj.velocities.shape == (4, 3, 2, 2, 4)
    for k in range(3):
        torch.testing.assert_close(
            traj.velocities[:, k].float(),
            bf16_predict(traj.latents[:, k], traj.timesteps[k].expand(4), None),
            rtol=0,
            atol=0,
        )


@pytest.mark.parametrize("kind", ["dance", "cps", "ode"])
@pytest.mark.parametrize("name", backbone_names())
def test_rollout_never_reads_device_values(name, kind, tiny_dir):
    """On the meta device any host copy or sync (.item(), .tolist(), .cpu(), bool(tensor)) raises,
    so a full rollout there proves the loop and the adapter's predict keep latents on the device.
    (The flow SDE is left out: samplers.sde checks sigma >= 1 with a host sync per step.)"""
    backbone = load_backbone(name, tiny_dir(name), dtype="float32")
    cond = backbone.encode(["a cat", "a red dog"]).to("meta")
    backbone.to("meta")
    noise = torch.empty(2, 8, 8, 16, device="meta")
    sigmas = backbone.sigmas(3, height=32, width=32)
    group_ids = torch.arange(2, device="meta")
    traj = rollout(backbone.predict, cond, noise, SDES.get(kind, ODE_SAMPLER), sigmas=sigmas, group_ids=group_ids,
                   velocities=KeptVelocities())  # fmt: skip
    assert traj.latents.device.type == "meta" and traj.latents.shape == (2, 4, 8, 8, 16)


def test_per_group_generators_make_a_group_independent_of_its_batch():
    """With one SDE-noise generator per group, a group samples the same trajectories alone or
    batched with other groups (so a step does not depend on how groups spread over ranks)."""
    sigmas = torch.linspace(1.0, 0.0, 5, dtype=torch.float64)
    noise = torch.randn(2, 2, 2, 4, generator=torch.Generator().manual_seed(0)).repeat_interleave(2, dim=0)

    def sample(rows: list[int], seeds: list[int]):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return rollout(_linear_predict([]), None, noise[rows], SDES["dance"], sigmas=sigmas, generator=gens)

    both, alone = sample([0, 1, 2, 3], [7, 8]), sample([2, 3], [8])
    torch.testing.assert_close(both.latents[2:], alone.latents)
    torch.testing.assert_close(both.log_probs[2:], alone.log_probs)
    assert not torch.equal(both.latents[0, -1], both.latents[1, -1])  # rows of a group still differ
    with pytest.raises(ValueError, match="do not split a batch of 4 rows"):
        sample([0, 1, 2, 3], [7, 8, 9])
