"""The settings of ``python -m train.plan``: the trainer's schema and ``plan.*`` (configs/plan.yaml)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from settings import Choice
from train.ground.errors import ConfigError
from train.parts.config.schema import TrainConfig, register_schema
from train.parts.observe.perf import GPU_PEAK_TFLOPS
from train.tools.plan.comm import INTER_NODE_GBPS, INTRA_NODE_GBPS


class Depth(Choice):
    """How deep the planner traces the transformer (plan.depth)."""

    extended = "extended"
    full = "full"


@dataclass
class PlanConfig:
    """``python -m train.plan``: per-rank memory and FLOPs of one training step, traced on CPU (train/tools/plan/)."""

    world_size: int = 8
    """ranks (GPUs) the transformer is sharded over with FSDP2; >= 2"""
    gpu_memory_gib: float = 80.0
    """memory of one GPU, GiB"""
    reserved_gib: float = 4.0
    """GiB per GPU kept out of the budget for what the trace cannot see: the CUDA context, NCCL buffers and the
    caching allocator's fragmentation. A run fits when its traced peak <= gpu_memory_gib - reserved_gib.
    """
    arch: str | None = None
    """Folder of architecture configs in the diffusers layout (<arch>/transformer/config.json, vae/, text encoders;
    config files only, no weights). null = model.path when it is given, else configs/arch/<the backbone's model>.
    """
    output: str | None = None
    """also write the report as JSON to this file (null = print only)"""
    gpus_per_node: int = 8
    """The time estimate (train/tools/plan/comm.py): ranks per node (rank r on node r // gpus_per_node); link
    rates per GPU and direction, Gb/s: NVLink 4 (H100/H200 SXM, 450 GB/s a direction) inside a node, InfiniBand NDR
    across nodes
    """
    intra_node_gbps: float = INTRA_NODE_GBPS
    """Gb/s per GPU and direction inside a node (NVLink 4: 3600)"""
    inter_node_gbps: float = INTER_NODE_GBPS
    """Gb/s per GPU and direction across nodes (InfiniBand NDR: 400)"""
    gpu: str = "H100"
    """the GPU whose dense bf16 peak (train/parts/observe/perf.py's table) the compute time assumes; perf.peak_tflops,
    when set, replaces it, as for the MFU logging
    """
    mfu: float = 0.35
    """the model FLOP utilization assumed for the compute time, in (0, 1]"""
    depth: Depth = Depth.extended
    """extended: trace the transformer with 4 and 6 blocks of each kind and extend every figure linearly to its full
    depth (a preset in one to two minutes of CPU; the peaks within 1% of the full trace's, parameters, FLOPs and bytes
    sent equal, docs/planner.md); full: trace every block (several minutes)"""
    served_reward_seconds: float = 2.0
    """seconds a served reward (the remote scorer, the judge) is assumed to take to answer one chunk of a rank's
    images (reward.chunk_groups groups), whatever its size: the planner cannot see the server; the preflight measures
    it. > 0"""


@dataclass
class PlanRunConfig(TrainConfig):
    plan: PlanConfig = field(default_factory=PlanConfig)
    """the planner's own settings"""


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
    _check_cluster(p)
    if not 0 <= p.reserved_gib < p.gpu_memory_gib:
        raise ConfigError(
            f"plan.reserved_gib must be in [0, plan.gpu_memory_gib={p.gpu_memory_gib}), got {p.reserved_gib}"
        )


def _check_cluster(p: PlanConfig) -> None:
    if p.gpus_per_node < 1:
        raise ConfigError(f"plan.gpus_per_node must be >= 1, got {p.gpus_per_node}")
    if p.world_size > p.gpus_per_node and p.world_size % p.gpus_per_node:
        raise ConfigError(
            f"plan.world_size={p.world_size} fills no whole nodes of plan.gpus_per_node={p.gpus_per_node}: "
            "make it a multiple of it (or at most one node)"
        )
    for name in ("intra_node_gbps", "inter_node_gbps"):
        if not getattr(p, name) > 0:
            raise ConfigError(f"plan.{name} must be > 0 (Gb/s per GPU and direction), got {getattr(p, name)}")
    if p.gpu not in GPU_PEAK_TFLOPS:
        raise ConfigError(f"plan.gpu={p.gpu!r} is not one of {sorted(GPU_PEAK_TFLOPS)}; or set perf.peak_tflops")
    if not 0 < p.mfu <= 1:
        raise ConfigError(f"plan.mfu must be in (0, 1], got {p.mfu}")
    if not p.served_reward_seconds > 0:
        raise ConfigError(f"plan.served_reward_seconds must be > 0 (seconds per chunk), got {p.served_reward_seconds}")
