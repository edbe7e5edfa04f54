"""The optimizer's settings (the ``optimizer`` group) and the EMA's (the ``ema`` group), each checking its own
ranges when it is built; the trainer adds the group's path in front (train/parts/config/keys.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from settings import check_range, non_negative, positive


@dataclass
class OptimizerConfig:
    """AdamW and the gradient clip (AdamW's own checks run only once the model is loaded: the same, up front)."""

    lr: float = 1e-5
    """AdamW learning rate, in (0, 1) (on resume the configured value replaces the checkpoint's): AdamW moves every
    weight by about lr per step, so 1 or more can only be a typo (usual values: 1e-5 to 1e-3)."""
    weight_decay: float = 1e-4
    """AdamW decoupled weight decay, >= 0."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW (beta1, beta2), each in [0, 1)."""
    eps: float = 1e-8
    """AdamW's epsilon, added to the root of the second moment, > 0 (Flow-GRPO's adam_epsilon; raise it to damp
    the steps of weights whose gradients are tiny, e.g. in bf16)."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip, across all shards, > 0."""

    def __post_init__(self) -> None:
        positive(self.lr, "lr")
        typo = " (AdamW moves every weight by about lr per step: usual values are 1e-5 to 1e-3)"
        check_range(self.lr, "lr", high=1, high_open=True, why=typo)
        non_negative(self.weight_decay, "weight_decay")
        if len(self.betas) != 2:
            raise ValueError(f"betas must be two numbers [beta1, beta2], got {list(self.betas)}")
        for i, beta in enumerate(self.betas):
            check_range(beta, f"betas[{i}]", low=0, high=1, high_open=True)
        positive(self.eps, "eps")
        positive(self.max_grad_norm, "max_grad_norm")


@dataclass
class EMAConfig:
    """An exponential moving average of the trainable weights, for evaluation and the export."""

    decay: float = 0.0
    """EMA of trainable weights for evaluation, in [0, 1) (0 = off)."""

    def __post_init__(self) -> None:
        check_range(self.decay, "decay", low=0, high=1, high_open=True, why=" (0 = no EMA)")
