"""PickScore (Kirstain et al. 2023) as an evaluation metric: PickScore_v1 weights, CLIP-H processor.

PickScore_v1 is a CLIP ViT-H-14 fine-tuned on Pick-a-Pic; its reference code preprocesses and
tokenizes with the processor of ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, hence two local paths:
``PickScoreScorer(model_path, processor_path, *, device, dtype)``. We report the cosine of the
normalised features, like the other CLIP-family rewards; the reference multiplies it by
``logit_scale.exp()`` (about 100), which only rescales.
"""

from __future__ import annotations

from rewards.clip_similarity import CLIPSimilarityScorer


class PickScoreScorer(CLIPSimilarityScorer):
    """PickScore from ``model_path`` (PickScore_v1) and ``processor_path`` (the CLIP-H processor)."""

    name = "pickscore"
