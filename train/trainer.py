"""The GRPO training loop: resume, then train steps (train/step.py), evaluation and checkpoints on
their own cadences, the export, and the summary (train/components/summary.py) at the end.

The console (and the run folder's log file) shows a progress bar or, without it, a heartbeat line;
a line per evaluation; and the summary. Evaluation runs before training, every
``logging.eval_every`` steps and after the last step; each one after step 0 also writes a
before/after sheet (``eval/before_after_<tag>.png``) of the same prompts and noise.

Departures from the reference trainers, on purpose: every random draw comes from its own stream
of (seed, purpose, index) (train/distributed/seeds.py): a group's SDE noise from its group id, the training
plan from the step, LoRA's initialisation from the seed alone, so a resumed run replays exactly
and a step does not depend on how its groups are spread over ranks;
a NaN reward or a non-finite gradient skips the update (all ranks together) instead of
corrupting the weights.

Faults of a cluster: SIGTERM (a scheduler's notice) makes every rank stop after the same step,
write a checkpoint and exit with ``Preempted`` (train/distributed/preemption.py); ``resume=auto`` then replays
from it bit for bit, with the rows of replayed steps dropped from metrics.jsonl, and falls back to
the previous checkpoint when the latest is damaged. The last step is always checkpointed.
"""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from tqdm.contrib.logging import logging_redirect_tqdm

from rewards.summary import overall
from train.components.build import (
    Run,
    adamw_settings,
    build_eval_scorers,
    load_config,
    open_run,
    policy_predictor,
    process_group,
    read_eval_prompts,
    read_heldout_prompts,
)
from train.components.checkpoint import export_model
from train.components.config import TrainConfig
from train.components.errors import CheckpointError, Preempted
from train.components.evaluation import EvalResult, before_after, evaluate, read_scores
from train.components.logger import Heartbeat, progress_bar
from train.components.summary import eval_line, eval_tag, run_summary
from train.distributed.collectives import activity
from train.distributed.preemption import Preemption, sigterm_requests
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
    for group in run.optimizer.param_groups:
        for key, value in adamw_settings(run.cfg).items():
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


def run_eval(run: Run, step: int, *, heldout: bool = False) -> EvalResult:
    """The evaluation protocol of train/components/evaluation.py on all ranks, with the EMA weights when kept, on
    the evaluation prompts or (``heldout``) on data.heldout_prompts."""
    if run.eval_records is None or run.heldout_records is None or run.eval_scorers is None:
        run.eval_records = read_eval_prompts(run.cfg)
        run.heldout_records = read_heldout_prompts(run.cfg)
        run.eval_scorers = build_eval_scorers(run.cfg, run.device)
    records = run.heldout_records if heldout else run.eval_records
    swap = run.ema.swapped() if run.ema is not None else nullcontext()
    with swap:
        return evaluate(
            run.backbone,
            policy_predictor(run),
            run.eval_scorers,
            records,
            run.cfg,
            run.dist,
            device=run.device,
            tag=eval_tag(step) + ("_held-out" if heldout else ""),
        )


def _eval_keys(summary: dict[str, float], suffix: str) -> dict[str, float]:
    """eval/<metric><suffix>[/<category>] for a summary's <metric>[/<category>] keys."""
    keyed = {}
    for key, value in summary.items():
        metric, _, category = key.partition("/")
        keyed[f"eval/{metric}{suffix}" + (f"/{category}" if category else "")] = value
    return keyed


def _load_before(run: Run) -> EvalResult | None:
    """The step-0 evaluation of this run (saved by an earlier session when resumed), or None."""
    folder = Path(run.cfg.run_dir) / "eval"
    tag = eval_tag(0)
    if not (folder / f"{tag}.json").is_file() or not (folder / f"{tag}.grid.pt").is_file():
        return None
    summary = json.loads((folder / f"{tag}.json").read_text())
    grid = torch.load(folder / f"{tag}.grid.pt")
    rows = read_scores(folder / f"{tag}.scores.jsonl")
    return EvalResult(tag, summary, rows, grid["images"].float() / 255, grid["indices"])


def _before(run: Run, result: EvalResult, step: int) -> EvalResult | None:
    """The step-0 evaluation (kept, with its grid saved for a resumed session, when ``result`` is it)."""
    if step == 0:
        run.eval_before = result
        pixels = (result.images.clamp(0, 1) * 255).round().to(torch.uint8)
        folder = Path(run.cfg.run_dir) / "eval"
        torch.save({"images": pixels, "indices": result.indices}, folder / f"{result.tag}.grid.pt")
    elif run.eval_before is None:
        run.eval_before = _load_before(run)
    return run.eval_before


def evaluate_and_report(run: Run, step: int) -> None:
    """Evaluate; log eval/<metric>; on rank 0 print the line, send the images to wandb and write the
    before/after sheet against step 0."""
    result = run_eval(run, step)
    metrics = _eval_keys(result.summary, "")
    if run.heldout_records:
        metrics |= _eval_keys(run_eval(run, step, heldout=True).summary, "/held-out")
    run.logger.log(metrics, step)
    if not run.dist.is_main:
        return
    before = _before(run, result, step)
    log.info(eval_line(step, result.summary, before.summary if before is not None else None))
    metric = next(iter(overall(result.summary)))
    scores = result.scores(metric, result.indices)
    prompts = [run.eval_records[i].prompt for i in result.indices] if run.eval_records else []
    captions = [f"#{i} {metric} {v:.4f}: {p}" for i, v, p in zip(result.indices, scores, prompts)]
    run.logger.log_wandb_images("eval/images", result.images, captions, step)
    if step > 0 and before is not None and before.indices == result.indices:
        _before_after(run, before, result, prompts, metric, step)


def _before_after(run: Run, before: EvalResult, after: EvalResult, prompts: list[str], metric: str, step: int) -> None:
    """``eval/before_after_<tag>.png``: the same prompts and noise at step 0 and after ``step`` steps."""
    sheet = before_after(before, after, prompts, metric, ("step 0", f"step {step}"))
    path = Path(run.cfg.run_dir) / "eval" / f"before_after_{after.tag}.png"
    sheet.save(path)
    run.logger.log_wandb_images("eval/before_after", path, [f"step 0 | step {step}: {metric}"], step)


def _eval_due(cfg: TrainConfig, done: int) -> bool:
    """After ``done`` steps: every eval_every steps, and after the last step whatever its number."""
    every = cfg.logging.eval_every
    return bool(every) and (done % every == 0 or done == cfg.num_steps)


def _after_step(run: Run, done: int, preemption: Preemption) -> None:
    """Evaluation and checkpoint on their cadences once ``done`` steps are trained; SIGTERM stops here."""
    cfg = run.cfg
    if _eval_due(cfg, done):
        with activity(f"the evaluation after step {done}"):
            evaluate_and_report(run, done)
    stop = preemption.requested(run.device)
    every = cfg.checkpoint.every
    if stop or done == cfg.num_steps or (every and done % every == 0):
        path = _save(run, done)
    if stop:
        raise Preempted(f"SIGTERM: wrote checkpoint {path} after step {done}; rerun with resume=auto to continue")


def _train(run: Run, start: int) -> list[dict[str, float]]:
    """Training steps ``start`` to the last, with the bar or the heartbeat; the metrics of each step."""
    cfg, main = run.cfg, run.dist.is_main
    show_bar = main and cfg.logging.progress_bar
    bar = progress_bar(cfg.num_steps, is_main=show_bar, initial=start)
    heartbeat = Heartbeat(cfg.num_steps, start=start, every_s=cfg.logging.heartbeat_s, enabled=main and not show_bar)
    history = []
    # console lines go through tqdm.write while the bar is shown, so they do not break it
    with sigterm_requests() as preemption, logging_redirect_tqdm() if show_bar else nullcontext():
        try:
            for step in range(start, cfg.num_steps):
                with activity(f"training step {step}"):
                    metrics = train_step(run, step)
                    run.logger.log(metrics, step)
                    history.append(metrics)
                    reward = metrics.get("reward/total", math.nan)
                    bar.update(1)
                    bar.set_postfix(reward=f"{reward:.4f}")
                    heartbeat.tick(step + 1, reward)
                    _after_step(run, step + 1, preemption)
        finally:
            bar.close()
    return history


def fit(run: Run) -> None:
    cfg = run.cfg
    began = time.perf_counter()
    start = resume(run)
    if cfg.resume is not None:
        run.logger.rewind(start)  # a resumed run logs every step once: rows of the steps it replays go
    if start == cfg.num_steps:
        log.warning("the checkpoint holds all num_steps=%d steps: nothing to train (raise num_steps to go on)", start)
    # eval/<metric> at step k is the policy after k training steps: k = 0 is the model as loaded.
    if cfg.logging.eval_every and start == 0:
        with activity("the evaluation before training"):
            evaluate_and_report(run, 0)
    history = _train(run, start)
    if cfg.checkpoint.export:
        with activity("the export"):
            export_model(run.backbone.transformer, Path(cfg.run_dir) / "export")
    if run.dist.is_main:
        log.info(run_summary(cfg, start=start, history=history, seconds=time.perf_counter() - began))
