"""The settings of ``python -m train.plan``: the trainer's schema and ``plan.*`` (configs/plan.yaml)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from train.components.config import TrainConfig, register_schema
from train.components.errors import ConfigError


@dataclass
class PlanConfig:
    """``python -m train.plan``: per-rank memory and FLOPs of one training step, traced on CPU (train/plan/)."""

    world_size: int = 8  # ranks (GPUs) the transformer is sharded over with FSDP2; >= 2
    gpu_memory_gib: float = 80.0  # memory of one GPU, GiB
    # GiB per GPU kept out of the budget for what the trace cannot see: the CUDA context, NCCL buffers
    # and the caching allocator's fragmentation. A run fits when its traced peak <= gpu_memory_gib - reserved_gib.
    reserved_gib: float = 4.0
    # Folder of architecture configs in the diffusers layout (<arch>/transformer/config.json, vae/, text encoders;
    # config files only, no weights). null = model.path when it is given, else configs/arch/<the backbone's model>.
    arch: str | None = None
    output: str | None = None  # also write the report as JSON to this file (null = print only)


@dataclass
class PlanRunConfig(TrainConfig):
    plan: PlanConfig = field(default_factory=PlanConfig)  # the planner's own settings


def register() -> None:
    register_schema("plan", PlanRunConfig)


def _output_problem(output: str) -> str | None:
    """Why the report cannot be written to ``output`` (checked before the trace, which takes minutes), or None."""
    path = Path(output)
    if path.is_dir():
        return "is a folder; name a file in it, e.g. plan.output=<folder>/plan.json"
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        return f"names a file in {str(folder)!r}, which is not a folder"
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        return "cannot be written (permission denied)"
    return None


def validate_plan(p: PlanConfig) -> None:
    if p.output is not None and (problem := _output_problem(p.output)):
        raise ConfigError(f"plan.output={p.output!r} {problem}")
    if p.world_size < 2:
        raise ConfigError(f"plan.world_size must be >= 2 (FSDP2 shards over the ranks), got {p.world_size}")
    if not p.gpu_memory_gib > 0:
        raise ConfigError(f"plan.gpu_memory_gib must be > 0, got {p.gpu_memory_gib}")
    if not 0 <= p.reserved_gib < p.gpu_memory_gib:
        raise ConfigError(
            f"plan.reserved_gib must be in [0, plan.gpu_memory_gib={p.gpu_memory_gib}), got {p.reserved_gib}"
        )
