"""Rewards: scorers mapping (images [B, 3, H, W] in [0, 1], prompts) to float32 scores [B].

Scorers are built by name (``build_scorer``); ``RewardCombiner`` mixes several with weights.
Model weights are read from local paths only (docs/rewards.md lists the expected files).
"""

from rewards.base import SCORER_NAMES, Scorer, build_scorer
from rewards.combine import RewardCombiner
from rewards.reward_config import CombineMode, RewardConfig

__all__ = ["SCORER_NAMES", "CombineMode", "RewardCombiner", "RewardConfig", "Scorer", "build_scorer"]
