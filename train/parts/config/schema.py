"""The trainer's configuration tree: TrainConfig, the run's own settings and one group per component, each group a
dataclass beside the component that reads it (the sampler's in samplers/, the model's in models/, the rewards' in
rewards/, extended by the reward stage's in train/parts/scoring/, the update's and GRPO's in train/algorithm/, the
optimizer's in train/parts/optim/, the logger's, the health's and perf's in train/parts/observe/, the data's in
train/parts/data/, the process group's in train/distributed/, the checkpoints' in train/parts/checkpoint/, the
evaluation's in train/parts/eval/). This module only composes them.

Every field says its unit and whether it is per rank or global, in its attribute docstring (what ``--help``
prints). The YAML tree under ``configs/`` fills these dataclasses (Hydra's ConfigStore registers them as
option ``train`` of the ``schema`` group, the first entry of ``configs/train.yaml``'s defaults list), so a
misspelled key, a wrong type or an unknown choice (an Enum) fails at compose time. Each group checks its own
ranges in ``__post_init__`` with a plain ValueError that starts with the field's name in the group; the trainer
prefixes the group's path (train/parts/config/keys.py: "optimizer.lr must be > 0, got 0"). The rules across groups
are train/run/checks.py's ``validate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from models.model_config import ModelConfig
from samplers.sampler_config import SamplerConfig
from settings import Choice, positive
from train.algorithm.grpo_config import BatchConfig, GRPOConfig
from train.algorithm.update_config import UpdateConfig
from train.distributed.collectives import DistConfig
from train.parts.checkpoint.checkpoint_config import CheckpointConfig
from train.parts.config.shipped import shipped
from train.parts.data.prompts import DataConfig
from train.parts.eval.eval_config import EvalConfig
from train.parts.observe.health import HealthConfig
from train.parts.observe.observe_config import LoggingConfig, PerfConfig
from train.parts.optim.optim_config import EMAConfig, OptimizerConfig
from train.parts.scoring.stage import RewardStageConfig


class Device(Choice):
    """device: where the transformer, the latents and the rewards live."""

    auto = "auto"  # CUDA when the launch has a GPU, else CPU
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class TrainConfig:
    """The trainer's settings: the run itself, then one group per component."""

    experiment: str = "demo"
    """Name used for the wandb group and the run folder."""
    run_dir: str = ""
    """Shared run folder of all ranks; "" = Hydra's output folder (hydra.run.dir)."""
    seed: int = 42
    """Every random stream derives from (seed, purpose, index) (train/distributed/seeds.py)."""
    num_steps: int = 10
    """Training steps (rollout + update)."""
    resume: str | None = None
    """null | auto (latest checkpoint in run_dir) | path to a checkpoint folder."""
    device: Device = Device.auto
    """auto | cpu | cuda."""
    model: ModelConfig = field(default_factory=ModelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    reward: RewardStageConfig = field(default_factory=RewardStageConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)

    def __post_init__(self) -> None:
        if not self.experiment.strip():
            raise ValueError("experiment must name the run (it is the wandb group and part of the run folder)")
        positive(self.num_steps, "num_steps")
        if self.device is Device.cuda and not torch.cuda.is_available():
            raise ValueError("device=cuda but CUDA is not available on this machine; use device=cpu or device=auto")


def register_schema(name: str = "train", schema: type = TrainConfig) -> None:
    """Store ``schema`` as option ``name`` of the ``schema`` group: configs/train.yaml composes the
    trainer's; a command with settings of its own (configs/probe.yaml) overrides it with a subclass. The shipped
    defaults' resolver (``${shipped:<package>/<path>}``) comes with it: every composition of configs/ needs it."""
    ConfigStore.instance().store(group="schema", name=name, node=schema)
    OmegaConf.register_new_resolver("shipped", lambda reference: str(shipped(reference)), replace=True)
