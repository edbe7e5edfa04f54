"""The optimization parts of a run beside the parameters: AdamW's settings and the EMA."""

from __future__ import annotations

from typing import Any

from torch import nn

from train.parts.optim.ema import EMA
from train.parts.optim.optim_config import EMAConfig, OptimizerConfig


def adamw_settings(o: OptimizerConfig) -> dict[str, Any]:
    """The optimizer's hyperparameters (optimizer.lr, weight_decay, betas, eps) as AdamW's keywords."""
    return {"lr": o.lr, "weight_decay": o.weight_decay, "betas": (o.betas[0], o.betas[1]), "eps": o.eps}


def build_ema(params: list[nn.Parameter], settings: EMAConfig) -> EMA | None:
    """The EMA of ``params`` (``ema``); None when its decay is 0."""
    return EMA(params, settings.decay) if settings.decay > 0 else None
