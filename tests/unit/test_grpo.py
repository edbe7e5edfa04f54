"""GRPO math on hand-made tensors; comments say why each expected number is what it is."""

import math

import pytest
import torch

from samplers.sde import SDE, step
from train.algorithm.grpo import group_advantages, kl_to_reference, ppo_step_loss, ratio_norm_log_ratio
from train.algorithm.metrics import Reduce

pytestmark = pytest.mark.usefixtures("float64")


def test_group_advantages_hand_made():
    # group 0: rewards 1, 3 -> mean 2, population std 1 -> -1, +1
    # group 7: rewards 5, 5, 5 -> all equal -> 0 (not NaN)
    rewards = torch.tensor([1.0, 3.0, 5.0, 5.0, 5.0])
    groups = torch.tensor([0, 0, 7, 7, 7])
    adv = group_advantages(rewards, groups, eps=0.0 + 1e-12)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("value", [1 / 3, 2 / 3, 0.1, 0.7])
def test_tied_group_gets_exactly_zero_advantage(dtype, value):
    # Eight copies of 1/3 in float32: the float32 group mean is off by one rounding step, so the
    # population std equals that residue and residue / (residue + 1e-8) ~ 0.75 would be handed to
    # every sample. A tie carries no preference: the advantage must be exactly zero, in any dtype.
    rewards = torch.full((8,), value, dtype=dtype)
    adv = group_advantages(torch.cat([rewards, torch.tensor([0.0, 1.0], dtype=dtype)]), torch.tensor([3] * 8 + [5, 5]))
    assert adv.dtype == dtype
    assert torch.equal(adv[:8], torch.zeros(8, dtype=dtype))
    torch.testing.assert_close(adv[8:].double(), torch.tensor([-1.0, 1.0]), rtol=1e-2, atol=0)  # the other group


def test_float32_rewards_give_the_float64_advantages():
    # The statistics are float64 whatever the rewards' dtype: a float32 group of thirds and halves
    # gets the advantages of the same values in float64, to float32 rounding.
    values = [1 / 3, 1 / 3, 2 / 3, 0.5, 1 / 3, 2 / 3, 0.5, 0.5]
    groups = torch.zeros(8, dtype=torch.long)
    a32 = group_advantages(torch.tensor(values, dtype=torch.float32), groups)
    a64 = group_advantages(torch.tensor(values, dtype=torch.float32).double(), groups)
    torch.testing.assert_close(a32, a64.float(), rtol=0, atol=0)


def test_group_advantages_clamp_and_global_std():
    rewards = torch.tensor([0.0, 10.0, 2.0, 4.0])
    groups = torch.tensor([1, 1, 2, 2])
    # global std 0.5: group 1 -> (-5, 5)/0.5 = (-10, 10) clamped to +-3; group 2 -> (-1, 1)/0.5 = -2, 2
    adv = group_advantages(rewards, groups, eps=0.0, adv_clip_max=3.0, global_std=torch.tensor(0.5))
    torch.testing.assert_close(adv, torch.tensor([-3.0, 3.0, -2.0, 2.0]))


def test_unbiased_std_is_dancegrpo_torch_std():
    # group of 3: rewards 0, 1, 2 -> mean 1, sum of squares 2; population std sqrt(2/3), unbiased 1
    rewards = torch.tensor([0.0, 1.0, 2.0, 4.0, 4.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    adv = group_advantages(rewards, groups, eps=0.0, unbiased=True)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0]))  # the tied group stays 0
    g = torch.randn(12, generator=torch.Generator().manual_seed(0))
    dance = (g - g.mean()) / (g.std() + 1e-8)  # DanceGRPO's own line
    torch.testing.assert_close(group_advantages(g, torch.zeros(12), unbiased=True), dance)
    # ours (population) = DanceGRPO's x sqrt(G / (G - 1)), 1.0445 at G = 12
    ratio = group_advantages(g, torch.zeros(12)) / dance
    torch.testing.assert_close(ratio, torch.full((12,), math.sqrt(12 / 11)), rtol=1e-6, atol=0)


def test_group_advantages_reject_nan():
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))


def test_ratio_is_one_and_loss_is_minus_advantage_on_policy():
    g = torch.Generator().manual_seed(0)
    z, v = torch.randn(4, 8, 3, generator=g), torch.randn(4, 8, 3, generator=g)
    sde = SDE("dance", eta=0.3)
    old = step(sde, v, z, 0.6, 0.5, generator=g)
    new = step(sde, v.clone(), z, 0.6, 0.5, next_z=old.next_z)
    adv = torch.tensor([1.0, -2.0, 0.5, 0.0])
    loss, metrics = ppo_step_loss(new.log_prob, old.log_prob, adv, clip_range=1e-4)
    assert metrics["ratio_max"].value == 1.0 and metrics["ratio_min"].value == 1.0  # exactly, not approximately
    torch.testing.assert_close(loss, -adv.mean())
    assert metrics["clip_frac"].value == 0.0 and metrics["approx_kl"].value == 0.0
    # each metric says how it combines over steps and ranks: extremes as extremes, the rest as means
    reduces = {name: metric.reduce for name, metric in metrics.items()}
    assert reduces == {
        "clip_frac": Reduce.mean,
        "approx_kl": Reduce.mean,
        "ratio_mean": Reduce.mean,
        "ratio_max": Reduce.max,
        "ratio_min": Reduce.min,
    }


def test_clipped_rows_give_zero_gradient():
    # Row 0: A > 0 and r = e^{0.5} > 1 + eps -> the clipped branch is active -> zero gradient.
    # Row 1: A < 0 and r = e^{-0.5} < 1 - eps -> clipped as well -> zero gradient.
    # Row 2: inside the trust region -> gradient -A r / B = -1 * 1 / 3.
    logp = torch.tensor([0.5, -0.5, 0.0], requires_grad=True)
    old = torch.zeros(3)
    adv = torch.tensor([1.0, -1.0, 1.0])
    loss, metrics = ppo_step_loss(logp, old, adv, clip_range=0.2)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 0.0, -1.0 / 3]))
    torch.testing.assert_close(metrics["clip_frac"].value, torch.tensor(2.0 / 3, dtype=torch.float32))


def test_zero_advantage_zero_gradient():
    logp = torch.tensor([0.3, -0.1], requires_grad=True)
    loss, _ = ppo_step_loss(logp, torch.zeros(2), torch.zeros(2), clip_range=0.1)
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2))


def test_kl_is_flow_grpo_convention():
    # Flow-GRPO: beta * mean((mean_theta - mean_ref)^2) / (2 g^2), g the diffusion coefficient,
    # no |dt|. Row 0: (1^2 + 0 + 2^2) / 3 / (2 * 0.5^2) = 10/3; row 1: (0 + 3^2 + 0) / 3 / (2 * 1^2) = 1.5.
    mean = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 0.0]])
    g = torch.tensor([0.5, 1.0])
    torch.testing.assert_close(kl_to_reference(mean, torch.zeros(2, 3), g), torch.tensor((10 / 3 + 1.5) / 2))
    assert kl_to_reference(mean, mean, g) == 0.0


def test_kl_is_the_gaussian_kl_times_dt():
    # Both transitions are Gaussians with std g sqrt(|dt|): the exact KL divides by 2 g^2 |dt|,
    # so the Flow-GRPO form used here is the exact KL times |dt|, whatever the SDE.
    gen = torch.Generator().manual_seed(1)
    z, v, v_ref = (torch.randn(2, 6, 4, generator=gen) for _ in range(3))
    for sde in (SDE("dance", eta=0.3), SDE("flow", noise_level=0.7)):
        out, ref = step(sde, v, z, 0.6, 0.45, generator=gen), step(sde, v_ref, z, 0.6, 0.45, generator=gen)
        s = out.std[:, None, None].expand_as(out.mean)
        normal = torch.distributions.Normal
        exact = torch.distributions.kl_divergence(normal(out.mean, s), normal(ref.mean, s)).mean()
        torch.testing.assert_close(kl_to_reference(out.mean, ref.mean, out.diffusion), exact * 0.15)


def test_ratio_norm_hand_made():
    # s_bar = 0.5. Row 0: (0.1 + 0.04 / (2 * 0.25)) * 0.5 = (0.1 + 0.08) * 0.5 = 0.09.
    # Row 1: the means agree, so only the log-ratio is rescaled: -0.2 * 0.5 = -0.1.
    mean = torch.tensor([[0.2, 0.2], [1.0, -1.0]])
    old_mean = torch.tensor([[0.0, 0.0], [1.0, -1.0]])
    out = ratio_norm_log_ratio(
        torch.tensor([0.1, -0.3]), torch.tensor([0.0, -0.1]), mean, old_mean, torch.tensor([0.5, 0.5])
    )
    torch.testing.assert_close(out, torch.tensor([0.09, -0.1]))


def test_ratio_norm_is_the_noise_times_the_mean_shift_and_split_invariant():
    # Flow-GRPO's SDE, one transition: RatioNorm's log-ratio = mean eps (mu - mu_old), exactly;
    # 0 on policy (ratio exactly 1); the same for any split of the rows into micro-batches.
    g = torch.Generator().manual_seed(0)
    z, v = torch.randn(4, 8, 3, generator=g), torch.randn(4, 8, 3, generator=g)
    sde, eps = SDE("flow", noise_level=0.7), torch.randn(4, 8, 3, generator=g)
    old = step(sde, v, z, 0.6, 0.5, noise=eps)
    new = step(sde, v + 0.05 * torch.randn(4, 8, 3, generator=g), z, 0.6, 0.5, next_z=old.next_z)
    out = ratio_norm_log_ratio(new.log_prob, old.log_prob, new.mean, old.mean, new.std)
    torch.testing.assert_close(out, (eps * (new.mean - old.mean)).flatten(1).mean(1))
    on_policy = ratio_norm_log_ratio(old.log_prob, old.log_prob, old.mean, old.mean, old.std)
    assert torch.equal(on_policy, torch.zeros(4))
    halves = [
        ratio_norm_log_ratio(new.log_prob[r], old.log_prob[r], new.mean[r], old.mean[r], new.std[r])
        for r in (slice(0, 1), slice(1, 4))
    ]
    torch.testing.assert_close(torch.cat(halves), out, rtol=0, atol=1e-15)
