"""The GRPO objective's settings (the ``grpo`` group) and how a step's samples split (the ``batch`` group), each
checking its own ranges when it is built, in its own words (``group_size must be >= 2 ...``); whoever reads them
from a larger configuration adds the group's path in front."""

from __future__ import annotations

from dataclasses import dataclass

from settings import Choice, check_range, non_negative, positive


class AdvStd(Choice):
    """grpo.adv_std: the group standard deviation that divides the advantages."""

    population = "population"  # Flow-GRPO's, over n
    unbiased = "unbiased"  # DanceGRPO's torch.std, over n - 1


@dataclass
class GRPOConfig:
    """The GRPO objective: groups, advantages, the clipped ratio and the KL term (train/algorithm/grpo.py)."""

    group_size: int = 12
    """G: samples per prompt, all on one rank, sharing one initial noise; >= 2."""
    clip_range: float = 1e-4
    """PPO clip epsilon of the ratio, > 0."""
    adv_clip_max: float = 5.0
    """Advantages are clamped to +-adv_clip_max, > 0."""
    adv_eps: float = 1e-8
    """Added to the group std, >= 0 (Flow-GRPO's stat tracker: 1e-4)."""
    adv_std: AdvStd = AdvStd.population
    """population (Flow-GRPO's, n) | unbiased (DanceGRPO's torch.std, n - 1)."""
    global_std: bool = False
    """Normalize by the std of all rewards of the step (all ranks) instead of per group."""
    ratio_norm: bool = False
    """GRPO-Guard's RatioNorm: the PPO log-ratio (logp - logp_old + mean (mu - mu_old)^2 / (2 s^2)) s, s the step's
    transition std (train/algorithm/grpo.py), so the ratio stays centred at every step; the rollout then keeps its
    velocities (the sampling weights' mu_old). For sampler.sde=dance or flow (CPS's log-prob has no 1 / (2 s^2)).
    """
    kl_beta: float = 0.0
    """Flow-GRPO's beta (the paper's Table 4 values as they are): beta * mean (mu - mu_ref)^2 / (2 g^2) over the
    trained steps' transition means, g the step's diffusion coefficient, >= 0 (0 = off, no reference forwards).
    """
    inner_epochs: int = 1
    """Update passes over each rollout's samples, >= 1 (flow_grpo's num_inner_epochs): pass 1 in the rollout's
    order, each later one reshuffled (train/loop/passes.py ``pass_order``) and run at the weights the passes before
    it moved, so its PPO ratio leaves 1 and the clip acts."""

    def __post_init__(self) -> None:
        check_range(self.group_size, "group_size", low=2, why=" (advantages are relative within a group)")
        positive(self.clip_range, "clip_range")
        positive(self.adv_clip_max, "adv_clip_max")
        non_negative(self.adv_eps, "adv_eps")
        non_negative(self.kl_beta, "kl_beta", " (0 = no KL term)")
        check_range(self.inner_epochs, "inner_epochs", low=1, why=" (update passes per rollout; 1 = one pass)")


@dataclass
class BatchConfig:
    """How a step's samples are split: prompts per rank, micro-batches, optimizer steps (all per rank)."""

    prompts_per_rank: int = 1
    """Prompts per rank per training step (per rank)."""
    micro_batch: int = 1
    """Samples per forward/backward in the update (per rank); divides gradient_accumulation_steps."""
    gradient_accumulation_steps: int = 12
    """Samples per rank per optimizer step; divides grpo.group_size * prompts_per_rank."""

    def __post_init__(self) -> None:
        for name in ("prompts_per_rank", "micro_batch", "gradient_accumulation_steps"):
            positive(getattr(self, name), name)
        if self.gradient_accumulation_steps % self.micro_batch:
            raise ValueError(
                f"micro_batch={self.micro_batch} must divide "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}"
            )
