"""The predictors of a run: ``predict(z, t, cond)`` of the backbone's transformer (or of another, the
reference), and the KL reference (the frozen copy of full fine-tuning, else the LoRA-disabled policy)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from models.base import Backbone, Conditioning
from samplers.rollout import Predict
from train.parts.observe.perf import FlopMeter


def predictor(
    backbone: Backbone,
    *,
    compute_dtype: torch.dtype,
    world_size: int,
    device: torch.device,
    transformer: nn.Module | None = None,
    flops: FlopMeter | None = None,
) -> Predict:
    """predict(z, t, cond) with the backbone's transformer, or with ``transformer`` (the reference);
    each call counted by ``flops`` when given.

    Single-process runs compute in ``compute_dtype`` by autocast over float32 master weights;
    under FSDP2 the mixed-precision policy does it.
    """
    wanted = compute_dtype != torch.float32 and world_size == 1

    def predict(z: Tensor, t: Tensor, cond: Conditioning) -> Tensor:
        if flops is not None:
            flops.count(z, t, cond)
        with torch.autocast(device.type, dtype=compute_dtype) if wanted else nullcontext():
            return backbone.predict(z, t, cond, transformer=transformer)

    return predict


def kl_reference(backbone: Backbone, reference: nn.Module | None, policy: Callable[..., Predict]) -> Predict:
    """The KL reference: the frozen copy ``reference`` of full fine-tuning, else the LoRA-disabled
    policy. ``policy(transformer=None)``: the predictor of the backbone's transformer, or of another."""
    if reference is not None:
        return policy(transformer=reference)
    lora = policy()
    transformer: Any = backbone.transformer  # diffusers' PEFT mixin: enable/disable_adapters

    def predict(z: Tensor, t: Tensor, cond: Conditioning) -> Tensor:
        transformer.disable_adapters()
        try:
            return lora(z, t, cond)
        finally:
            transformer.enable_adapters()

    return predict
