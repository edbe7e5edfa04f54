"""The model side of a run as a step reads it, built once by ``train.parts.policy.builder.build_model``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.base import Backbone
from samplers.rollout import Predict


@dataclass
class ModelParts:
    """The transformer's side of a run."""

    backbone: Backbone
    params: list[nn.Parameter]  # the trainable parameters (LoRA's, or every weight of the transformer)
    reference: nn.Module | None  # frozen copy for the KL term of full fine-tuning; None with LoRA or no KL
    compute_dtype: torch.dtype
    lora_modules: list[str]  # the full names of the modules LoRA wrapped (recorded with each checkpoint)
    policy: Predict  # predict(z, t, cond) with the backbone's transformer, counted by the FLOP meter
    kl_reference: Predict | None  # the KL term's reference predictor; None without a KL term
