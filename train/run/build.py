"""The assembly of a run, shared by the trainer and the probe.  ``build_run`` assembles the run
(``train.run.parts.Run``) in a fixed order: seeds, the checks of the checkpoints to resume from
(train/run/startup_checks.py) and of the run they belong to (train/run/timeline.py), the model's folder (and for a new
run room on the disk for its checkpoint, estimated from the transformer's shapes), the rewards and the evaluation's
scorers (a wrong reward path or a served scorer that does not answer fails in seconds, before the transformer loads:
train/parts/scoring/scorers.py; the ranks agree on them, a served scorer's server reached from each), the backbone, the
trainable parameters
and the KL reference (then sharding: train/parts/policy/builder.py), the optimizer, the logger, the predictors and the
router, the evaluation's parts, and the loop's health and checkpointer. The trainer receives the built run and runs it.
``open_run`` builds it in the run folder claimed for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, cast

import torch
from omegaconf import OmegaConf
from torch import nn

from rewards.base import Scorer
from train.algorithm.routing import build_router
from train.distributed.collectives import DistInfo, agreed, broadcast_object
from train.distributed.parallelize import compile_unavailable
from train.distributed.seeds import seed_everything
from train.ground.errors import ConfigError
from train.ground.layout import RunLayout
from train.parts.checkpoint.checkpointer import Checkpointer
from train.parts.checkpoint.manager import CheckpointManager
from train.parts.checkpoint.settings import LORA_MODULES, recorded_settings
from train.parts.config.schema import TrainConfig
from train.parts.data.prompts import PromptRecord, PromptSampler, prompts_digest, read_prompts
from train.parts.eval.protocol import EvalParts
from train.parts.observe.health import weight_norm
from train.parts.observe.logger import RunLogger
from train.parts.observe.perf import CompileWatch, device_peak
from train.parts.optim.optimizer import adamw_settings, build_ema
from train.parts.policy.builder import build_model, check_room, model_folder, resolve_device
from train.parts.policy.parts import ModelParts
from train.parts.scoring.scorers import build_eval_scorers, build_rewards
from train.parts.scoring.stage import advantage_fn
from train.run.folder import RunLock, check_owner
from train.run.parts import DataParts, IOParts, LoopParts, OptimParts, PerfParts, Run
from train.run.startup_checks import check_mesh, check_resume, claim_folder
from train.run.timeline import run_identity


def build_logger(cfg: TrainConfig, dist: DistInfo, layout: RunLayout, *, resumed: bool) -> RunLogger:
    """The run's logger (``logging.*``) into ``layout``, the run folder's: wandb's group, name and tags carry the
    experiment and the update mode."""
    return RunLogger(
        cfg.logging,
        layout,
        is_main=dist.is_main,
        experiment=cfg.experiment,
        name=f"{cfg.experiment}-{cfg.update.mode}-s{cfg.seed}",
        tags=[cfg.update.mode, f"seed{cfg.seed}", cfg.sampler.sde],
        config=cast(dict[str, Any], OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)),
        resumed=resumed,
    )


def _own_checks(cfg: TrainConfig, dist: DistInfo) -> tuple[list[PromptRecord], torch.device, nn.Module]:
    """What this rank reads and runs on, before any model loads: the training prompts, the mesh, its device (and
    inductor on it), the model's folder (``model_folder``); the prompts, the device and the transformer's skeleton."""
    records = read_prompts(cfg.data.train_prompts)
    check_mesh(cfg, dist.world_size)
    device = resolve_device(cfg, dist)
    if cfg.model.compile and (why := compile_unavailable(device.type)):
        raise ConfigError(f"model.compile=true: {why}; or set model.compile=false")
    return records, device, model_folder(cfg, dist)


def build_run(cfg: TrainConfig, dist: DistInfo, *, training: bool = True, lock: RunLock | None = None) -> Run:
    """The run state in the claimed run folder (``lock``: rank 0's); ``training``: refuse a checkpoint past
    num_steps, of other settings or of another run (the probe only measures one)."""
    seed_everything(cfg.seed, dist.rank)
    layout = RunLayout(cfg.run_dir)
    checkpoints = CheckpointManager(layout.root, cfg.checkpoint)
    # each rank's own checks first, agreed on before the collectives of the checkpoints and the disk
    records, device, skeleton = agreed(lambda: _own_checks(cfg, dist))
    max_step = cfg.num_steps if training else None
    resume_from = check_resume(cfg, dist, checkpoints, max_step=max_step, prompts=prompts_digest(records))
    run_id = run_identity(cfg.resume, checkpoints, resume_from, dist) if training else None
    if training and not resume_from:  # a resumed run checked room for a checkpoint like its own (check_resume)
        check_room(cfg, checkpoints, skeleton)
    # before the transformer: a wrong reward path fails in seconds, and likewise the evaluation's scorers (a served
    # one's first contact with its server) when the run evaluates; agreed on: a server one rank cannot reach stops
    # every rank, that rank with its own line
    rewards = agreed(lambda: build_rewards(cfg.reward, device))
    evaluates = training and bool(cfg.eval.every)
    eval_scorers = agreed(lambda: build_eval_scorers(cfg.eval.scorers, device)) if evaluates else None
    # the checkpoint must have wrapped the modules LoRA wraps now: its weights load by their names
    lora_checkpoint = (checkpoints, resume_from) if training else None
    model, flops = build_model(cfg, dist, device, lora_checkpoint=lora_checkpoint)
    optimizer = torch.optim.AdamW(model.params, **adamw_settings(cfg.optimizer))
    logger = build_logger(cfg, dist, layout, resumed=bool(resume_from))
    prompts = PromptSampler(
        records, seed=cfg.seed, rank=dist.rank, world_size=dist.world_size, prompts_per_rank=cfg.batch.prompts_per_rank
    )
    reward_stage = cfg.reward.build(rewards=rewards, advantage=advantage_fn(cfg.grpo), dist=dist, device=device)
    optim = OptimParts(optimizer, build_ema(model.params, cfg.ema), build_router(cfg.update))
    io = IOParts(
        layout=layout, checkpoints=checkpoints, logger=logger, resume_from=resume_from, run_id=run_id, lock=lock
    )
    evaluation = _eval_parts(cfg, model, eval_scorers, dist, device) if eval_scorers is not None else None
    return Run(
        cfg=cfg,
        dist=dist,
        device=device,
        model=model,
        optim=optim,
        data=DataParts(prompts=prompts, reward_stage=reward_stage, eval=evaluation),
        io=io,
        loop=_loop_parts(cfg, model, optim, io, prompts=prompts.digest),
        perf=PerfParts(flops, device_peak(cfg.perf, device), CompileWatch() if cfg.model.compile else None),
    )


def _eval_parts(
    cfg: TrainConfig, model: ModelParts, scorers: dict[str, Scorer], dist: DistInfo, device: torch.device
) -> EvalParts:
    """What the run's evaluations sample (the policy, as it trains) and score with (``scorers``, of eval.scorers)."""
    return EvalParts(
        backbone=model.backbone,
        predict=model.policy,
        scorers=scorers,
        cfg=cfg.eval,
        sampler=cfg.sampler,
        model=cfg.model,
        dist=dist,
        device=device,
    )


def _loop_parts(cfg: TrainConfig, model: ModelParts, optim: OptimParts, io: IOParts, *, prompts: str) -> LoopParts:
    """The loop's health, its counters from step 0 (a resume loads a checkpoint's), and the checkpointer that saves
    them with the weights and the settings that give them their meaning (``prompts``: the prompt file's digest)."""
    health = cfg.health.build(
        optimizer_steps=optimizer_steps_per_step(cfg),
        first=0,
        last=cfg.num_steps - 1,
        start_norm=weight_norm(model.params),  # before a checkpoint loads: the start of the run, in every session
    )
    checkpointer = Checkpointer(
        cfg.checkpoint,
        io.checkpoints,
        model.backbone.transformer,
        optim.optimizer,
        optim.ema,
        states={"health": health},
        settings={**recorded_settings(cfg, prompts=prompts), LORA_MODULES: model.lora_modules},
        run_id=io.run_id,
        check_owner=partial(check_owner, io.lock),  # every write asks first (a collective)
    )
    return LoopParts(health=health, checkpointer=checkpointer)


def optimizer_steps_per_step(cfg: TrainConfig) -> int:
    """Optimizer steps a training step makes on each rank: one per ``gradient_accumulation_steps`` samples, per
    pass (``grpo.inner_epochs``)."""
    b = cfg.batch
    return cfg.grpo.inner_epochs * cfg.grpo.group_size * b.prompts_per_rank // b.gradient_accumulation_steps


@contextmanager
def open_run(cfg: TrainConfig, dist: DistInfo, *, training: bool = True) -> Iterator[Run]:
    """``build_run`` in the run folder claimed for it; the logger finished and the lock released however
    the block ends."""
    cfg.run_dir = str(broadcast_object(cfg.run_dir))  # every rank writes where rank 0 does
    lock = claim_folder(cfg, dist, training=training)
    try:
        run = build_run(cfg, dist, training=training, lock=lock)
        try:
            yield run
        finally:
            run.io.logger.finish()
    finally:
        if lock is not None:
            lock.release()
