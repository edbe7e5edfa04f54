"""The settings of ``python -m train.probe``: the trainer's schema and ``probe.*`` (configs/probe.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field

from train.algorithm.jagg import UPDATE_MODES
from train.ground.errors import ConfigError
from train.parts.config.schema import TrainConfig, register_schema


@dataclass
class ProbeConfig:
    """``python -m train.probe``: gradient quality of a JAGG path per group (train/tools/probe/command.py)."""

    num_rollouts: int = 20
    """K: trajectories measured, all ranks together (the paper: >= 20)"""
    mode: str = "jagg"
    """the path compared with exact: jagg | jagg_sequential | ablate"""
    threshold: float = 0.5
    """a group qualifies for the path when its mean cos(g_mode, g_exact) >= threshold"""
    output: str | None = None
    """JSON report; null = <run_dir>/probe.json"""


@dataclass
class ProbeRunConfig(TrainConfig):
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    """the probe's own settings"""


def register() -> None:
    register_schema("probe", ProbeRunConfig)


def probe_settings(config: TrainConfig) -> ProbeConfig:
    """The validated ``probe.*`` of a config composed from configs/probe.yaml."""
    if not isinstance(config, ProbeRunConfig):
        raise TypeError(f"the probe's settings come from configs/probe.yaml, got a {type(config).__name__}")
    p, modes = config.probe, tuple(m for m in UPDATE_MODES if m != "exact")
    if p.num_rollouts < 1:
        raise ConfigError(f"probe.num_rollouts must be >= 1, got {p.num_rollouts}")
    if p.mode not in modes:
        raise ConfigError(f"probe.mode={p.mode!r} is not valid; accepted values: {', '.join(modes)}")
    if not -1 <= p.threshold <= 1:
        raise ConfigError(f"probe.threshold must be in [-1, 1] (a cosine), got {p.threshold}")
    return p
