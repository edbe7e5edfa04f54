"""The optimization parts of a run beside the parameters: AdamW's settings and the EMA."""

from __future__ import annotations

from typing import Any

from torch import nn

from train.components.config import TrainConfig
from train.optim.ema import EMA


def adamw_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The optimizer's hyperparameters (grpo.lr, grpo.weight_decay, grpo.betas) as AdamW's keywords."""
    g = cfg.grpo
    return {"lr": g.lr, "weight_decay": g.weight_decay, "betas": (g.betas[0], g.betas[1])}


def build_ema(params: list[nn.Parameter], decay: float) -> EMA | None:
    """The EMA of ``params`` (grpo.ema_decay); None when the decay is 0."""
    return EMA(params, decay) if decay > 0 else None
