"""PickScore (Kirstain et al. 2023): PickScore_v1 weights, CLIP-H processor.

PickScore_v1 is a CLIP ViT-H-14 fine-tuned on Pick-a-Pic; its reference code preprocesses and
tokenizes with the processor of ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, hence two local paths:
``PickScoreScorer(model_path, processor_path, *, scale, device, dtype)``.

``scale`` picks the number reported:
    * ``cosine`` (default, the evaluation metric): the cosine of the normalised features, like the
      other CLIP-family rewards;
    * ``flow_grpo`` (flow_grpo's training reward): flow_grpo's
      ``logit_scale.exp() * cosine / 26`` (flow_grpo/pickscore_scorer.py), about 0.85 for a good image,
      so that its clip ranges, KL betas and learning rates carry over with its recipe.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from rewards.clip_similarity import CLIPSimilarityScorer

SCALES = ("cosine", "flow_grpo")
FLOW_GRPO_DIVISOR = 26.0  # flow_grpo divides PickScore's logit by 26 to bring it near 1


class PickScoreScorer(CLIPSimilarityScorer):
    """PickScore from ``model_path`` (PickScore_v1) and ``processor_path`` (the CLIP-H processor)."""

    name = "pickscore"

    def __init__(
        self,
        model_path: str | Path,
        processor_path: str | Path,
        *,
        scale: str = "cosine",
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str = torch.float32,
    ) -> None:
        if scale not in SCALES:
            raise ValueError(f"scale={scale!r} is not valid; accepted values: {', '.join(SCALES)}")
        super().__init__(model_path, processor_path, device=device, dtype=dtype)
        self.scale = scale

    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        cosine = super().score(images, prompts)
        if self.scale == "cosine":
            return cosine
        return self.model.logit_scale.exp().float() * cosine / FLOW_GRPO_DIVISOR
