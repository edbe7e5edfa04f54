"""CLIPScore (Hessel et al. 2021) as the cosine of normalised CLIP features, from a local CLIPModel.

The paper's reward uses ``openai/clip-vit-large-patch14``; its directory holds both the model and
its processor, so ``processor_path`` defaults to ``model_path``. We report the raw cosine (see
``rewards.clip_similarity``), not Hessel's 2.5 * max(cos, 0) nor flow_grpo's logits / 30: combine
weights, not per-reward constants, set the scale of each component.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rewards.clip_similarity import CLIPSimilarityScorer


class CLIPScoreScorer(CLIPSimilarityScorer):
    """CLIPScore from ``model_path`` (a CLIPModel saved with save_pretrained, e.g. clip-vit-large-patch14)."""

    name = "clipscore"

    def __init__(
        self,
        model_path: str | Path,
        *,
        processor_path: str | Path | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str = torch.float32,
    ) -> None:
        processor = model_path if processor_path is None else processor_path
        super().__init__(model_path, processor, device=device, dtype=dtype)
