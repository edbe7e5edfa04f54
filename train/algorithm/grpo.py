"""GRPO math as pure tensor functions: group advantages, the PPO-clipped per-step loss, the KL
term to a reference policy.

* Advantage of sample i in its group: A_i = (r_i - mean_group) / (std_group + eps), clamped to
  [-adv_clip_max, adv_clip_max]. std is the population std of the group (Flow-GRPO's), or with
  ``unbiased`` the n - 1 one (DanceGRPO's ``torch.std``; the population std is that times
  sqrt((n - 1) / n)), or, with ``global_std``, one std over every reward of the batch (a caller under
  torch.distributed passes the all-reduced value). The statistics are computed in float64 and a
  group whose rewards are all equal gets exactly A = 0 in every dtype: in float32 the mean of
  eight copies of 1/3 is off by one rounding step, the std equals that residue, and
  residue / (residue + eps) would give every sample an advantage of about 0.75 for nothing.
* Per-step loss: r = exp(logp_new - logp_old),
  L = mean_b max(-A r, -A clip(r, 1 - eps_c, 1 + eps_c)); a row whose ratio left the trust
  region on the side the advantage pushes gets zero gradient.
* KL to a reference, in Flow-GRPO's convention so the paper's beta values are copied as they are:
  KL = mean over non-batch dims and batch of (mean_theta - mean_ref)^2 / (2 g^2), with g the SDE's
  diffusion coefficient (eta for DanceGRPO's SDE, noise_level sqrt(sigma / (1 - sigma)) for
  Flow-GRPO's). The exact Gaussian KL of the two transitions divides by the transition variance
  g^2 |dt| instead; Flow-GRPO's form is that times |dt|, which weighs the large steps of the
  high-noise end more. Under CPS the ``diffusion`` of a step is its std sigma_t = sigma'
  sin(noise_level pi / 2) (samplers/sde.py), and the same formula is then the exact Gaussian KL of
  the two transitions, as flow_grpo computes it for CPS.
* GRPO-Guard's RatioNorm (``ratio_norm_log_ratio``): with s the transition std g sqrt(-dt) and
  s_bar its mean over the rows given, the log-ratio becomes
  (logp - logp_old + mean_elems (mu - mu_old)^2 / (2 s_bar^2)) s_bar. For a Gaussian step of std s
  = s_bar this is mean_elems (z' - mu_old)(mu - mu_old) / s = mean_elems eps (mu - mu_old): zero-mean
  under the sampling noise and O(|mu - mu_old|), whatever the step's s, where the plain log-ratio's
  mean drifts by -(mu - mu_old)^2 / (2 s^2), large at the small-s steps. s_bar is taken over the rows
  of one transition k, which all share sigma_k and sigma_{k+1} (one schedule per rollout), so s_bar
  is each row's own s: the result does not depend on how rows are split into micro-batches nor on
  which other rows share the call. Defined for the Gaussian kinds (dance, flow); CPS's log-prob has
  no 1 / (2 s^2) to normalise.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from train.algorithm.metrics import Metric, Reduce


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    eps: float = 1e-8,
    adv_clip_max: float = 5.0,
    global_std: Tensor | None = None,
    unbiased: bool = False,
) -> Tensor:
    """rewards [B], group_ids [B] (any integer labels) -> advantages [B] in the rewards' dtype."""
    if rewards.ndim != 1 or rewards.shape != group_ids.shape:
        raise ValueError(f"rewards and group_ids must both be [B], got {rewards.shape} and {group_ids.shape}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf; refusing to compute advantages")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1
    r = rewards.to(torch.float64)
    count = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, inverse, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add_(0, inverse, r) / count
    centered = r - mean[inverse]
    if global_std is None:
        # a one-row group is tied (zero advantage below), so its 0 / 0 never reaches the result
        var = torch.zeros_like(count).index_add_(0, inverse, centered**2) / (count - 1 if unbiased else count)
        std = var.sqrt()[inverse]
    else:
        std = torch.as_tensor(global_std, dtype=torch.float64, device=r.device)
    low = torch.full_like(count, math.inf).scatter_reduce(0, inverse, r, "amin")
    high = torch.full_like(count, -math.inf).scatter_reduce(0, inverse, r, "amax")
    tied = (low == high)[inverse]  # a float64 mean can still be off by a rounding step: test equality
    adv = torch.where(tied, torch.zeros_like(r), centered / (std + eps))
    return adv.clamp(-adv_clip_max, adv_clip_max).to(rewards.dtype)


def ppo_step_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_range: float,
) -> tuple[Tensor, dict[str, Metric]]:
    """PPO-clipped loss of one denoising step. All inputs [B]; returns (scalar loss, metrics).

    Metrics (detached scalars, each with its reduction over steps and ranks): clip_frac (rows whose
    ratio left [1 - eps, 1 + eps]), approx_kl = 0.5 mean (logp - logp_old)^2, ratio_mean (means),
    ratio_max (a maximum), ratio_min (a minimum).
    """
    return ppo_clip_loss(log_prob - old_log_prob, advantages, clip_range=clip_range)


def ppo_clip_loss(log_ratio: Tensor, advantages: Tensor, *, clip_range: float) -> tuple[Tensor, dict[str, Metric]]:
    """``ppo_step_loss`` on a given log-ratio [B] (GRPO-Guard's normalised one, or logp - logp_old)."""
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    with torch.no_grad():
        metrics = {
            "clip_frac": Metric(((ratio - 1.0).abs() > clip_range).float().mean()),
            "approx_kl": Metric(0.5 * (log_ratio**2).mean()),
            "ratio_mean": Metric(ratio.mean()),
            "ratio_max": Metric(ratio.max(), Reduce.max),
            "ratio_min": Metric(ratio.min(), Reduce.min),
        }
    return loss, metrics


def kl_to_reference(mean: Tensor, ref_mean: Tensor, diffusion: Tensor) -> Tensor:
    """Scalar mean over batch and elements of (mean - ref_mean)^2 / (2 g^2); g = ``diffusion`` [B]."""
    g = diffusion.reshape(-1, *([1] * (mean.ndim - 1)))
    return ((mean - ref_mean) ** 2 / (2.0 * g**2)).mean()


def ratio_norm_log_ratio(log_prob: Tensor, old_log_prob: Tensor, mean: Tensor, old_mean: Tensor, std: Tensor) -> Tensor:
    """GRPO-Guard's normalised log-ratio [B] (module docstring). log_prob, old_log_prob, std: [B];
    mean, old_mean: [B, ...], the transition means under the current and the sampling weights."""
    std_bar = std.mean()
    shift = ((mean - old_mean) ** 2).flatten(1).mean(1) / (2.0 * std_bar**2)
    return (log_prob - old_log_prob + shift) * std_bar
