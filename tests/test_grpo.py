"""GRPO math on hand-made tensors; comments say why each expected number is what it is."""

import pytest
import torch

from samplers.sde import SDE, step
from train.grpo import group_advantages, kl_to_reference, ppo_step_loss

pytestmark = pytest.mark.usefixtures("float64")


def test_group_advantages_hand_made():
    # group 0: rewards 1, 3 -> mean 2, population std 1 -> -1, +1
    # group 7: rewards 5, 5, 5 -> all equal -> 0 (not NaN)
    rewards = torch.tensor([1.0, 3.0, 5.0, 5.0, 5.0])
    groups = torch.tensor([0, 0, 7, 7, 7])
    adv = group_advantages(rewards, groups, eps=0.0 + 1e-12)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, 0.0, 0.0, 0.0]))


def test_group_advantages_clamp_and_global_std():
    rewards = torch.tensor([0.0, 10.0, 2.0, 4.0])
    groups = torch.tensor([1, 1, 2, 2])
    # global std 0.5: group 1 -> (-5, 5)/0.5 = (-10, 10) clamped to +-3; group 2 -> (-1, 1)/0.5 = -2, 2
    adv = group_advantages(rewards, groups, eps=0.0, adv_clip_max=3.0, global_std=torch.tensor(0.5))
    torch.testing.assert_close(adv, torch.tensor([-3.0, 3.0, -2.0, 2.0]))


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
    assert metrics["ratio_max"] == 1.0 and metrics["ratio_min"] == 1.0  # exactly, not approximately
    torch.testing.assert_close(loss, -adv.mean())
    assert metrics["clip_frac"] == 0.0 and metrics["approx_kl"] == 0.0


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
    torch.testing.assert_close(metrics["clip_frac"], torch.tensor(2.0 / 3, dtype=torch.float32))


def test_zero_advantage_zero_gradient():
    logp = torch.tensor([0.3, -0.1], requires_grad=True)
    loss, _ = ppo_step_loss(logp, torch.zeros(2), torch.zeros(2), clip_range=0.1)
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2))


def test_kl_matches_gaussian_kl():
    g = torch.Generator().manual_seed(1)
    mean, ref = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    std = torch.tensor([0.3, 0.7])
    s = std[:, None].expand(2, 5)
    exact = torch.distributions.kl_divergence(torch.distributions.Normal(mean, s), torch.distributions.Normal(ref, s))
    torch.testing.assert_close(kl_to_reference(mean, ref, std), exact.mean())
    assert kl_to_reference(mean, mean, std) == 0.0
