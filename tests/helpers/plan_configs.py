"""The planner's settings as ``python -m train.plan`` composes them, for tests/tools/test_plan*.py."""

from __future__ import annotations

import torch
from hydra import compose, initialize_config_module

from train.parts.config.schema import register_schema
from train.tools.plan.command import plan_config
from train.tools.plan.plan_config import register

register_schema()
register()


def config(overrides: list[str]):
    """(the planner's config of ``overrides``, whether model.path was given)."""
    with initialize_config_module(config_module="configs", version_base=None):
        return plan_config(compose(config_name="plan", overrides=overrides))


def num_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
