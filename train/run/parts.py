"""A run of built parts: everything a training step uses, built once at start-up by
``train.run.build.build_run`` and held in a few named parts. A step reads them; it never builds.

    Run
      cfg, dist, device
      model  ModelParts   the backbone, what trains, the KL reference's module, the predictors
      optim  OptimParts   the optimizer, the EMA, the router
      data   DataParts    the prompt sampler, the reward stage and what the evaluation samples and scores with
      io     IOParts      the run folder's layout, checkpoints, the logger, the checkpoints to resume from,
                          the run's id and the folder's lock
      loop   LoopParts    the health's counters and the checkpointer that saves them with the weights
      perf   PerfParts    the FLOP meter, the device's peak rate, the compile watch
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from train.algorithm.routing import Router
from train.distributed.collectives import DistInfo
from train.ground.layout import RunLayout
from train.parts.checkpoint.checkpointer import Checkpointer
from train.parts.checkpoint.manager import CheckpointManager
from train.parts.config.schema import TrainConfig
from train.parts.data.prompts import PromptSampler
from train.parts.eval.protocol import EvalParts
from train.parts.observe.health import Health
from train.parts.observe.logger import RunLogger
from train.parts.observe.perf import CompileWatch, FlopMeter, Peak
from train.parts.optim.ema import EMA
from train.parts.policy.parts import ModelParts
from train.parts.scoring.stage import RewardStage
from train.run.folder import RunLock


@dataclass
class OptimParts:
    """What changes the weights, and the router that picks each segment's path (the update stage reads
    its config, ``cfg.update``, itself)."""

    optimizer: torch.optim.Optimizer
    ema: EMA | None
    router: Router  # update.routing: which segments train and by which path (train/algorithm/routing.py)


@dataclass
class DataParts:
    """What a step draws and scores."""

    prompts: PromptSampler
    reward_stage: RewardStage  # the rewards, scored chunk by chunk (train/parts/scoring/stage.py)
    eval: EvalParts | None  # the model and eval.scorers (built before the model); None: the run does not evaluate


@dataclass
class IOParts:
    """The run folder and what is written to it."""

    layout: RunLayout
    checkpoints: CheckpointManager
    logger: RunLogger
    resume_from: list[Path]  # the checkpoints ``resume`` names that passed the file checks, newest first
    run_id: str | None  # the run's identity, recorded in its checkpoints (train/run/timeline.py); None: not training
    lock: RunLock | None  # rank 0's lock of the run folder, asked before every write (None on the other ranks)


@dataclass
class LoopParts:
    """What the training loop keeps across its steps and saves with the weights."""

    health: Health  # the run's health (train/parts/observe/health.py): its counters go on from a checkpoint's
    checkpointer: Checkpointer  # the checkpoints on their cadence (train/parts/checkpoint/checkpointer.py)


@dataclass
class PerfParts:
    """The performance counters of a run (train/parts/observe/perf.py)."""

    flops: FlopMeter  # the FLOPs of the transformer's calls
    peak: Peak  # one device's peak rate, for perf/mfu/<phase>
    compiles: CompileWatch | None  # model.compile: what compiling costs, step by step


@dataclass
class Run:
    """Everything a training step needs, built once by ``build_run``."""

    cfg: TrainConfig
    dist: DistInfo
    device: torch.device  # where the transformer, the latents and the rewards live
    model: ModelParts
    optim: OptimParts
    data: DataParts
    io: IOParts
    loop: LoopParts
    perf: PerfParts
