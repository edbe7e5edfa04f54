"""The shared start: a group's rows run their common prefix once (samplers/rollout.py, the update's
first trainable step in train/algorithm/update.py), and every result equals the one without it.

The update's gradient is compared in float64, where only the rounding of other batch shapes and
summation orders differs: 1e-12 relative on a float64 toy network, float32's epsilon on the tiny
backbones (whose diffusers modules keep some float32 arithmetic); the rollout in float32, to float32
rounding.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from probe_toys import ToyCond, ToySettings, ToyVelocity, toy_batch, toy_settings, toy_trajectory
from torch import Tensor, nn

from samplers.rollout import group_noise, rollout, shared_start_steps, stochastic_flags
from samplers.sampler_config import SamplerConfig
from samplers.schedule import shifted_sigmas
from train.algorithm.routing import PrefixRouter
from train.algorithm.update import UpdateStats, shared_start, update_micro_batch
from train.algorithm.update_config import UpdateConfig

G, NUM_GROUPS = 4, 2
SDES = {
    "dance": SamplerConfig(sde="dance", eta=0.3),
    "flow": SamplerConfig(sde="flow", noise_level=0.7),
    "cps": SamplerConfig(sde="cps", noise_level=0.8),
}


def _recording(predict, calls: list[int]):
    def recorded(z: Tensor, t: Tensor, cond) -> Tensor:
        calls.append(z.shape[0])
        return predict(z, t, cond)

    return recorded


def _sample(
    backbone, sampler: SamplerConfig, *, num_steps: int, window: tuple[int, int] | None, group_size: int, calls=None
):
    """Two groups of G rows from their group noise; the rollout shares their start in blocks of ``group_size``."""
    cond = backbone.encode(["a photo of a cat", "a red dog on the grass"]).repeat(G)
    noise = group_noise(backbone.initial_noise, [11, 12], group_size=G, height=32, width=32)
    sigmas = backbone.sigmas(num_steps, height=32, width=32, shift=3.0)
    generators = [torch.Generator().manual_seed(seed) for seed in (5, 6)]  # one per group, as the trainer draws
    predict = backbone.predict if calls is None else _recording(backbone.predict, calls)
    return rollout(
        predict, cond, noise, sampler, sigmas=sigmas, sde_window=window, generator=generators, group_size=group_size
    )


def test_shared_start_steps():
    assert shared_start_steps([True] * 5) == 1  # full SDE: step 0's input is the group's z_0
    assert shared_start_steps([False, False, True, True, False]) == 3  # ODE prefix and the window's first step
    assert shared_start_steps([False] * 4) == 4  # an ODE rollout never parts the rows


@pytest.mark.parametrize(
    "name, kind, window", [("flux", "dance", None), ("qwenimage", "flow", (2, 6)), ("flux", "cps", (1, 5))]
)
def test_rollout_with_shared_start_equals_g_rows(name, kind, window, backbones):
    """The shared steps run one row per group; the latents and log-probs equal those of G rows per call
    to float32 rounding (the transformer ran other batch shapes), and rows still part at the first SDE noise."""
    backbone, sde = backbones[name], SDES[kind]
    calls: list[int] = []
    shared = _sample(backbone, sde, num_steps=8, window=window, group_size=G, calls=calls)
    alone = _sample(backbone, sde, num_steps=8, window=window, group_size=1)
    steps = shared_start_steps(stochastic_flags(8, sde.transition, window))
    assert calls == [NUM_GROUPS] * steps + [NUM_GROUPS * G] * (8 - steps)
    # float32: 1e-7 relative per transformer call, carried over 8 steps of latents of order 1
    torch.testing.assert_close(shared.latents, alone.latents, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared.log_probs, alone.log_probs, rtol=1e-5, atol=1e-4)
    z = shared.latents[:, steps]  # after the first SDE step: rows of a group differ
    assert not torch.equal(z[0], z[1]) and torch.equal(shared.latents[0, steps - 1], shared.latents[1, steps - 1])


def test_rollout_refuses_a_batch_that_is_not_whole_groups():
    with pytest.raises(ValueError, match="group_size=3 does not split a batch of 4 rows"):
        rollout(lambda z, t, c: z, None, torch.zeros(4, 2), SDES["dance"], sigmas=torch.linspace(1, 0, 3),
                group_size=3)  # fmt: skip


def _float64(backbone):
    """The backbone with a float64 copy of its transformer (the adapter computes in its dtype)."""
    return backbone.with_parts(transformer=copy.deepcopy(backbone.transformer).double().requires_grad_(True))


def _gradient(predict, params, traj, settings: ToySettings, *, micro_batch: int, reference):
    """The update of the trajectory as train/loop/step.py runs it: per optimizer step, the micro-batches' routes
    drawn in order, the shared start (when rows share it), the micro-batches, its backward."""
    for p in params:
        p.grad = None
    advantages = torch.linspace(-1.0, 1.2, traj.batch_size, dtype=torch.float64)
    batch = toy_batch(predict, traj, settings, advantages=advantages, reference=reference)
    router = PrefixRouter(UpdateConfig(mode=settings.mode, timestep_fraction=settings.timestep_fraction, jagg_frac=1.0))
    route_gen, stats, accumulation = (
        torch.Generator().manual_seed(3),
        UpdateStats(),
        settings.gradient_accumulation_steps,
    )
    for chunk in range(0, traj.batch_size, accumulation):
        micro = [range(r, r + micro_batch) for r in range(chunk, chunk + accumulation, micro_batch)]
        routes = [router.route(traj, route_gen) for _ in micro]
        start = shared_start(batch, micro, routes)
        for rows, route in zip(micro, routes):
            stats += update_micro_batch(batch, torch.arange(rows.start, rows.stop), route, start=start)
        if start is not None:
            stats += start.backward()
    return torch.cat([p.grad.flatten() for p in params if p.grad is not None]), stats.counts


MODES = ["exact", "exact_batched", "jagg", "jagg_sequential", "ablate"]
# (SDE, sampling steps, Flow-GRPO-Fast window, micro_batch, gradient_accumulation_steps, timestep_fraction,
# kl_beta): 8 trainable transitions (2 segments of W = 4) but for the window of 4 that starts at step 2
CASES = {
    "dance-mb1": ("dance", 9, None, 1, G, 1.0, 0.1),
    "flow-window-mbG": ("flow", 8, (2, 6), G, G, 1.0, 0.0),
    "cps-window-accum2-fraction": ("cps", 10, (1, 9), 1, 2, 0.5, 0.1),
}


def _settings(mode: str, case: str) -> ToySettings:
    *_, accumulation, fraction, kl_beta = CASES[case]
    return ToySettings(
        mode="exact" if mode == "exact_batched" else mode,
        segment_length=4,
        timestep_fraction=fraction,
        clip_range=0.2,
        kl_beta=kl_beta,
        gradient_accumulation_steps=accumulation,
        group_size=G,
        exact_batched=mode == "exact_batched",
    )


def _compare(predict, params, traj, settings, *, micro_batch: int, reference) -> float:
    """|g(shared start) - g(G rows)| / |g(G rows)|, after checking that rows did share."""
    kwargs = dict(micro_batch=micro_batch, reference=reference)
    with_start, counts = _gradient(predict, params, traj, settings, **kwargs)
    without, plain = _gradient(predict, params, traj, replace(settings, share_group_start=False), **kwargs)
    assert counts.shared_start_grad_rows > 0 and plain.shared_start_grad_rows == 0
    assert (counts.shared_start_forward_rows > 0) == (settings.kl_beta > 0)
    assert float(without.norm()) > 0
    return float((with_start - without).norm() / without.norm())


class ToyNet(nn.Module):
    """v = tanh(z W1 + t u) W2 + c: nonlinear in z, t and the weights, float64 throughout."""

    def __init__(self, seed: int = 0, dim: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter(torch.randn(dim, 16, generator=g, dtype=torch.float64) / 3)
        self.u = nn.Parameter(torch.randn(16, generator=g, dtype=torch.float64))
        self.w2 = nn.Parameter(torch.randn(16, dim, generator=g, dtype=torch.float64) / 4)
        self.c = nn.Parameter(torch.randn(dim, generator=g, dtype=torch.float64))

    def forward(self, z: Tensor, t: Tensor, cond) -> Tensor:
        return torch.tanh(z.double() @ self.w1 + t.double()[:, None] * self.u) @ self.w2 + self.c


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_update_gradient_with_shared_start_equals_without_in_float64(case, mode):
    """Float64: the gradient with the shared start equals the one of G rows per call to 1e-12 relative,
    for every path, the three SDE kinds, windows that start after step 0, micro-batches of 1 and G and
    optimizer steps of fewer rows than G (with segments drawn at random per micro-batch)."""
    kind, num_steps, window, micro_batch, *_ = CASES[case]
    model, frozen = ToyNet(), ToyNet(seed=1).requires_grad_(False)
    noise = torch.randn(NUM_GROUPS, 8, generator=torch.Generator().manual_seed(1)).repeat_interleave(G, 0)
    cond = ToyCond(torch.zeros(NUM_GROUPS * G, 1))
    generators = [torch.Generator().manual_seed(seed) for seed in (5, 6)]
    sigmas = shifted_sigmas(num_steps, 3.0)
    traj = rollout(model, cond, noise, SDES[kind], sigmas=sigmas, sde_window=window, generator=generators,
                   group_size=G)  # fmt: skip
    error = _compare(model, list(model.parameters()), traj, _settings(mode, case), micro_batch=micro_batch,
                     reference=frozen)  # fmt: skip
    assert error < 1e-12


# The tiny backbones in float64: diffusers applies rotary embeddings and RMSNorm's variance in float32
# whatever the model's dtype, so their backward is linear only to float32 rounding (measured on the tiny
# Flux: J^T (s_1 + s_2) against J^T s_1 + J^T s_2, 1e-9 relative over all weights, 5e-8 in the attention's
# q and k). The two gradients differ by 2e-10 to 5e-10 (measured); one row's share lost would be 1e-2.
BACKBONE_CASES = [("flux", "dance-mb1", "jagg"), ("qwenimage", "flow-window-mbG", "exact_batched"),
                  ("flux", "cps-window-accum2-fraction", "jagg_sequential")]  # fmt: skip


@pytest.mark.parametrize("name, case, mode", BACKBONE_CASES)
def test_update_gradient_with_shared_start_on_the_tiny_backbones(name, case, mode, backbones):
    kind, num_steps, window, micro_batch, *_ = CASES[case]
    backbone = _float64(backbones[name])
    traj = _sample(backbone, SDES[kind], num_steps=num_steps, window=window, group_size=G)
    frozen = copy.deepcopy(backbone.transformer).requires_grad_(False)
    with torch.no_grad():
        for p in frozen.parameters():
            p.mul_(1.01)  # a reference a little away from the policy: the KL term has a gradient

    def reference(z, t, cond):
        return backbone.predict(z, t, cond, transformer=frozen)

    params = list(backbone.transformer.parameters())
    error = _compare(backbone.predict, params, traj, _settings(mode, case), micro_batch=micro_batch,
                     reference=reference)  # fmt: skip
    assert error < torch.finfo(torch.float32).eps


def test_no_start_is_shared_when_no_two_rows_of_a_group_train_it_together():
    """One row per optimizer step, or the setting off: nothing is shared and nothing changes."""
    model = ToyVelocity()
    settings = replace(toy_settings(), group_size=2)
    batch = toy_batch(model, toy_trajectory(model), settings)
    router = PrefixRouter(UpdateConfig(jagg_frac=1.0))
    route = router.route(batch.traj, None)
    assert shared_start(batch, [range(0, 1)], [route]) is None
    assert shared_start(batch, [range(0, 1), range(2, 3)], [route, route]) is None  # rows of two groups
    start = shared_start(batch, [range(0, 1), range(1, 2)], [route, route])
    assert start is not None and start.v.shape[0] == 1 and start.num_rows == 2
    assert shared_start(batch, [range(0, 1), range(1, 2)], [route, route[1:]]) is None  # row 1 skips step 0
    off = toy_batch(model, batch.traj, replace(settings, share_group_start=False))
    assert shared_start(off, [range(0, 2)], [route]) is None
