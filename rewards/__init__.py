"""Rewards: scorers mapping (images [B, 3, H, W] in [0, 1], prompts) to float32 scores [B].

Scorers are built by name (``build_scorer``); ``RewardCombiner`` mixes several with weights.
Model weights are read from local paths only (docs/rewards.md lists the expected files).
"""

from rewards.base import SCORER_NAMES, Scorer, build_scorer
from rewards.combine import COMBINE_MODES, RewardCombiner

__all__ = ["COMBINE_MODES", "SCORER_NAMES", "RewardCombiner", "Scorer", "build_scorer"]
