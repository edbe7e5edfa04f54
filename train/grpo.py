"""GRPO math as pure tensor functions: group advantages, the PPO-clipped per-step loss, the KL
term to a reference policy.

* Advantage of sample i in its group: A_i = (r_i - mean_group) / (std_group + eps), clamped to
  [-adv_clip_max, adv_clip_max]. std is the population std (unbiased=False) of the group, or, with
  ``global_std``, one std over every reward of the batch (a caller under torch.distributed passes
  the all-reduced value). A group of identical rewards gets A = 0.
* Per-step loss: r = exp(logp_new - logp_old),
  L = mean_b max(-A r, -A clip(r, 1 - eps_c, 1 + eps_c)); a row whose ratio left the trust
  region on the side the advantage pushes gets zero gradient.
* KL to a reference: both transitions are Gaussians with the same std, so the exact KL is
  ||mean_theta - mean_ref||^2 / (2 std^2) per element; we average it over non-batch dims and the
  batch. The denominator is the transition variance std^2 = g^2 |dt| (Flow-GRPO's code drops the
  |dt|; with our choice beta keeps its meaning of nats per element).
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    eps: float = 1e-8,
    adv_clip_max: float = 5.0,
    global_std: Tensor | None = None,
) -> Tensor:
    """rewards [B], group_ids [B] (any integer labels) -> advantages [B] in the rewards' dtype."""
    if rewards.ndim != 1 or rewards.shape != group_ids.shape:
        raise ValueError(f"rewards and group_ids must both be [B], got {rewards.shape} and {group_ids.shape}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf; refusing to compute advantages")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1
    count = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, inverse, torch.ones_like(rewards)
    )
    mean = torch.zeros_like(count).index_add_(0, inverse, rewards) / count
    centered = rewards - mean[inverse]
    if global_std is None:
        var = torch.zeros_like(count).index_add_(0, inverse, centered**2) / count
        std = var.sqrt()[inverse]
    else:
        std = torch.as_tensor(global_std, dtype=rewards.dtype, device=rewards.device)
    return (centered / (std + eps)).clamp(-adv_clip_max, adv_clip_max)


def ppo_step_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_range: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clipped loss of one denoising step. All inputs [B]; returns (scalar loss, metrics).

    Metrics (detached scalars): clip_frac (rows whose ratio left [1 - eps, 1 + eps]),
    approx_kl = 0.5 mean (logp - logp_old)^2, ratio_mean, ratio_max, ratio_min.
    """
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    with torch.no_grad():
        metrics = {
            "clip_frac": ((ratio - 1.0).abs() > clip_range).float().mean(),
            "approx_kl": 0.5 * (log_ratio**2).mean(),
            "ratio_mean": ratio.mean(),
            "ratio_max": ratio.max(),
            "ratio_min": ratio.min(),
        }
    return loss, metrics


def kl_to_reference(mean: Tensor, ref_mean: Tensor, std: Tensor) -> Tensor:
    """Scalar mean over batch and elements of (mean - ref_mean)^2 / (2 std^2); std is [B]."""
    std = std.reshape(-1, *([1] * (mean.ndim - 1)))
    return ((mean - ref_mean) ** 2 / (2.0 * std**2)).mean()
