"""The GRPO training loop: resume, then train steps (train/step.py), evaluation and checkpoints on
their own cadences, and the export at the end.

Departures from the reference trainers, on purpose: every random draw comes from its own stream
of (seed, purpose, index) (train/seeds.py): a group's SDE noise from its group id, the training
plan from the step, LoRA's initialisation from the seed alone, so a resumed run replays exactly
and a step does not depend on how its groups are spread over ranks;
a NaN reward or a non-finite gradient skips the update (all ranks together) instead of
corrupting the weights.

Faults of a cluster: SIGTERM (a scheduler's notice) makes every rank stop after the same step,
write a checkpoint and exit with ``Preempted`` (train/preemption.py); ``resume=auto`` then replays
from it bit for bit, with the rows of replayed steps dropped from metrics.jsonl, and falls back to
the previous checkpoint when the latest is damaged. The last step is always checkpointed.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from train.build import (
    Run,
    build_eval_scorers,
    load_config,
    open_run,
    policy_predictor,
    process_group,
    read_eval_prompts,
    read_heldout_prompts,
)
from train.checkpoint import export_model
from train.distributed import activity
from train.errors import CheckpointError, Preempted
from train.evaluation import evaluate
from train.logger import progress_bar
from train.preemption import Preemption, sigterm_requests
from train.step import train_step

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> None:
    """Entry point behind ``python -m train``: validate, build, train, export."""
    config = load_config(cfg)
    with process_group(config.dist.timeout_s) as dist, open_run(config, dist) as state:
        fit(state)


def _save(run: Run, step: int) -> Path:
    extra: dict[str, Any] = {"step": step}
    if run.ema is not None:
        extra["ema"] = run.ema.state_dict()
    with activity(f"the checkpoint save after step {step}"):
        return run.checkpoints.save(step, model=run.backbone.transformer, optimizer=run.optimizer, extra=extra)


def _configured_optimizer(run: Run) -> None:
    """The optimizer state restores the checkpoint's hyperparameters; the configured ones win."""
    g = run.cfg.grpo
    wanted = {"lr": g.lr, "weight_decay": g.weight_decay, "betas": (g.betas[0], g.betas[1])}
    for group in run.optimizer.param_groups:
        for key, value in wanted.items():
            if group[key] != value:
                log.warning("grpo.%s: the checkpoint has %s, training goes on with %s", key, group[key], value)
                group[key] = value


def resume(run: Run) -> int:
    """The step to start from: 0, or the step of the checkpoint ``resume`` names.

    ``run.resume_from`` passed the file checks before the model loaded; a checkpoint whose tensors
    still do not read back is damaged, and ``resume=auto`` falls back to the previous one.
    """
    # The EMA copies may be sharded DTensors: they load in place into the live EMA's state.
    template = {"ema": run.ema.state_dict()} if run.ema is not None else None
    for path in run.resume_from:
        try:
            extra = run.checkpoints.load(
                path, model=run.backbone.transformer, optimizer=run.optimizer, extra_template=template
            )
        except CheckpointError as err:
            if run.cfg.resume != "auto" or not err.damaged:
                raise
            log.warning("resume=auto: %s; trying the previous checkpoint", err)
            continue
        if run.ema is not None:
            run.ema.load_state_dict(extra["ema"])
        _configured_optimizer(run)
        log.info("resumed from %s at step %d", path, extra["step"])
        return int(extra["step"])
    if run.resume_from:
        raise CheckpointError(f"resume=auto: no checkpoint under {run.checkpoints.root} could be loaded", damaged=True)
    return 0


def run_eval(run: Run, step: int) -> dict[str, float]:
    """The evaluation protocol of train/evaluation.py on all ranks, with the EMA weights when kept:
    eval/<metric> on the evaluation prompts, eval/<metric>/held-out on data.heldout_prompts."""
    if run.eval_records is None or run.heldout_records is None or run.eval_scorers is None:
        run.eval_records = read_eval_prompts(run.cfg)
        run.heldout_records = read_heldout_prompts(run.cfg)
        run.eval_scorers = build_eval_scorers(run.cfg, run.device)
    sets = {"": run.eval_records, "/held-out": run.heldout_records}
    metrics = {}
    swap = run.ema.swapped() if run.ema is not None else nullcontext()
    with swap:
        for suffix, records in sets.items():
            if not records:
                continue
            summary = evaluate(
                run.backbone,
                policy_predictor(run),
                run.eval_scorers,
                records,
                run.cfg,
                run.dist,
                device=run.device,
                tag=f"step_{step:08d}{suffix.replace('/', '_')}",
            )
            metrics.update(_eval_keys(summary, suffix))
    return metrics


def _eval_keys(summary: dict[str, float], suffix: str) -> dict[str, float]:
    """eval/<metric><suffix>[/<category>] for a summary's <metric>[/<category>] keys."""
    keyed = {}
    for key, value in summary.items():
        metric, _, category = key.partition("/")
        keyed[f"eval/{metric}{suffix}" + (f"/{category}" if category else "")] = value
    return keyed


def _after_step(run: Run, done: int, preemption: Preemption) -> None:
    """Evaluation and checkpoint on their cadences once ``done`` steps are trained; SIGTERM stops here."""
    cfg = run.cfg
    if cfg.logging.eval_every and done % cfg.logging.eval_every == 0:
        with activity(f"the evaluation after step {done}"):
            run.logger.log(run_eval(run, done), done)
    stop = preemption.requested(run.device)
    every = cfg.checkpoint.every
    if stop or done == cfg.num_steps or (every and done % every == 0):
        path = _save(run, done)
    if stop:
        raise Preempted(f"SIGTERM: wrote checkpoint {path} after step {done}; rerun with resume=auto to continue")


def fit(run: Run) -> None:
    cfg = run.cfg
    start = resume(run)
    if cfg.resume is not None:
        run.logger.rewind(start)  # a resumed run logs every step once: rows of the steps it replays go
    if start == cfg.num_steps:
        log.warning("the checkpoint holds all num_steps=%d steps: nothing to train (raise num_steps to go on)", start)
    # eval/<metric> at step k is the policy after k training steps: k = 0 is the model as loaded.
    if cfg.logging.eval_every and start == 0:
        with activity("the evaluation before training"):
            run.logger.log(run_eval(run, 0), 0)
    bar = progress_bar(cfg.num_steps, is_main=run.dist.is_main and cfg.logging.progress_bar, initial=start)
    with sigterm_requests() as preemption:
        try:
            for step in range(start, cfg.num_steps):
                with activity(f"training step {step}"):
                    metrics = train_step(run, step)
                    run.logger.log(metrics, step)
                    bar.update(1)
                    bar.set_postfix(reward=f"{metrics.get('reward/total', float('nan')):.4f}")
                    _after_step(run, step + 1, preemption)
        finally:
            bar.close()
    if cfg.checkpoint.export:
        with activity("the export"):
            export_model(run.backbone.transformer, Path(cfg.run_dir) / "export")
    if run.dist.is_main:
        print(
            f"run folder: {cfg.run_dir}\n  metrics: {Path(cfg.run_dir) / 'metrics.jsonl'}\n"
            f"  samples: {Path(cfg.run_dir) / 'samples'}\n  export:  {Path(cfg.run_dir) / 'export'}"
        )
