"""The settings of ``python -m train.preflight``: the trainer's schema, the planner's ``plan.*`` (it re-makes the
plan with what it measured) and ``preflight.*`` (configs/preflight.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field

from settings import check_range
from train.parts.config.schema import register_schema
from train.tools.plan.plan_config import PlanRunConfig


@dataclass
class PreflightConfig:
    """``python -m train.preflight``: whether the run will work on this cluster, how fast, what to change."""

    blocks: int = 1
    """transformer blocks of each kind kept for the measured step (the configured model cut to this depth, at full
    width, with random weights); >= 1"""
    steps: int = 2
    """training steps run at reduced depth; the last one is measured (the first pays for compiling and warming up)"""
    stand_in_rewards: bool = False
    """score the step with the JPEG-compressibility reward (no weights) instead of the configured rewards, for
    reward models that are not at hand yet; the reward files are still checked"""
    collective_repeats: int = 5
    """timed repeats of each collective (after one untimed), the median kept"""
    slow_link: float = 0.25
    """warn when a link achieves less than this share of plan.intra_node_gbps / plan.inter_node_gbps, in (0, 1]"""

    def __post_init__(self) -> None:
        check_range(self.blocks, "blocks", low=1)
        check_range(self.steps, "steps", low=1)
        check_range(self.collective_repeats, "collective_repeats", low=1)
        check_range(self.slow_link, "slow_link", low=0, low_open=True, high=1)


@dataclass
class PreflightRunConfig(PlanRunConfig):
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    """the preflight's own settings"""


def register() -> None:
    register_schema("preflight", PreflightRunConfig)
