"""The GRPO training loop: resume, then train steps (train/step.py), evaluation and checkpoints on
their own cadences, the export (the weights the evaluations scored: the EMA when kept), and the
summary (train/evaluation/summary.py) at the end.

The console (and the run folder's log file) shows a progress bar or, without it, a heartbeat line;
a line per evaluation; and the summary. Evaluation (train/evaluation/evaluator.py) runs before
training, every ``eval.every`` steps and after the last step; each one after step 0 also
writes a before/after sheet (``eval/before_after_<tag>.png``) of the same prompts and noise.

Departures from the reference trainers, on purpose: every random draw comes from its own stream
of (seed, purpose, index) (train/distributed/seeds.py): a group's SDE noise from its group id, the training
plan from the step, LoRA's initialisation from the seed alone, so a resumed run replays exactly
and a step does not depend on how its groups are spread over ranks;
a NaN reward or a non-finite gradient skips the update (all ranks together) instead of
corrupting the weights.

Faults of a cluster: SIGTERM (a scheduler's notice), SIGHUP (a closed terminal) or the first Ctrl+C makes
every rank stop after the same step, write a checkpoint and exit with ``Preempted``
(train/distributed/preemption.py); a second
Ctrl+C stops at once with ``Interrupted``, naming the steps not saved. ``resume=auto`` then replays
from the checkpoint bit for bit, with the rows of replayed steps dropped from metrics.jsonl, and falls back to
the previous checkpoint when the latest is damaged; ``resume=<an older checkpoint>`` starts a new timeline,
its later checkpoints retired (train/run/timeline.py). The last step is always checkpointed. A process
that was suspended past its lease and finds its run folder's lock taken over stops with ``FolderLost``
before it writes anything more: the step's end, every checkpoint save, evaluation and the export ask first.

Nothing lost, nothing silent: a step's checkpoint is written before its evaluation; when the loop
fails after steps that are not saved yet (and the weights are still those after the last of them),
their checkpoint is written before the error ends the run when every rank can take part (one process,
an error raised alike, or one rank's exception in the reward phase, which the ranks share there:
train/step.py); every save first checks the disk's free space (``DiskFull`` names the disk);
``health.max_bad_steps`` steps in a row that cannot change the weights (or a session none of whose steps could)
end the run with ``NotLearning`` after a checkpoint; weights or images that left any sane range end it with
``Diverged`` before the diverged weights are saved, naming the last checkpoint before them (train/observe/health.py);
the health counters go into every checkpoint and a resumed session goes on counting.

A record with no hole: the run folder is the first console line; a resumed run evaluates again the evaluation
of its checkpoint's step that a crash lost (no row in metrics.jsonl), and names one lost at an earlier step
(its weights are gone) in the console, the summary and ``eval/curve.png``, the curve of the run's evaluations
written at the end (train/config/record.py, train/evaluation/curve.py).
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torch import nn
from torch.optim import Optimizer
from tqdm.contrib.logging import logging_redirect_tqdm

from train.checkpoint.export import EXPORT_NOTE, export_model, write_export_note
from train.checkpoint.files import state_bytes, write_failure
from train.checkpoint.manager import CheckpointManager
from train.checkpoint.settings import LORA_MODULES, recorded_settings
from train.config.record import after_steps, due_evaluations, missing_evaluations
from train.config.schema import TrainConfig
from train.distributed.collectives import activity, agreed, broadcast_object
from train.distributed.preemption import SIGNAL_NAMES, Preemption, RepeatedInterrupt, stop_requests
from train.evaluation.curve import write_curve
from train.evaluation.evaluator import Evaluator, build_evaluator
from train.evaluation.summary import run_summary
from train.ground.errors import (
    CheckpointError,
    Diverged,
    Interrupted,
    NotLearning,
    Preempted,
    SaveFailed,
    ranks_agreed,
)
from train.ground.layout import RunLayout
from train.model.builder import non_finite
from train.observe.console import Heartbeat, progress_bar
from train.observe.health import Health, Verdict, weight_norm
from train.optim.ema import EMA
from train.optim.optimizer import adamw_settings
from train.run.build import open_run
from train.run.folder import FolderLost
from train.run.parts import Run
from train.run.start import load_config, process_group
from train.run.timeline import branch
from train.step import train_step

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> None:
    """Entry point behind ``python -m train``: validate, build, train, export; the run folder named first."""
    with process_group(cfg.dist.timeout_s) as dist:
        # a file missing on some ranks stops every rank with their lines, none waiting for the others
        config = agreed(lambda: load_config(cfg))
        if dist.is_main:
            log.info("run folder: %s", Path(config.run_dir).absolute())
        with open_run(config, dist) as state:
            fit(state)


def _needed_bytes(run: Run) -> int:
    """About the size of the run's next checkpoint: its latest one's, else an estimate from the state (a collective)."""
    latest = broadcast_object(run.io.checkpoints.latest())
    if latest is not None:
        return run.io.checkpoints.size_of(latest)
    return state_bytes(run.model.backbone.transformer, run.optim.optimizer, run.optim.ema)


def _lost(run: Run) -> str | None:
    """Why rank 0 no longer owns the run folder (its lock taken over), or None; asked on rank 0 only."""
    return run.io.lock.lost() if run.io.lock is not None else None


def _check_owner(run: Run) -> None:
    """FolderLost on every rank when rank 0's lock of the run folder was taken over (a collective)."""
    lost = broadcast_object(_lost(run))
    if lost is not None:
        raise FolderLost(lost)


def _save(run: Run, step: int, health: Health) -> Path:
    """The checkpoint of ``step`` steps with the ``health`` counters, once the disk has room for it (DiskFull
    otherwise) and while the run folder is still this run's (FolderLost otherwise)."""
    extra: dict[str, Any] = {"step": step, "health": health.state_dict()}
    ema, checkpoints = run.optim.ema, run.io.checkpoints
    if ema is not None:
        extra["ema"] = ema.state_dict()
    with activity(f"the checkpoint save after step {step}"):
        _check_owner(run)
        checkpoints.check_space(_needed_bytes(run), f"the checkpoint of step {step}")
        return checkpoints.save(
            step,
            model=run.model.backbone.transformer,
            optimizer=run.optim.optimizer,
            extra=extra,
            settings={
                **recorded_settings(run.cfg, prompts=run.data.prompts.digest),
                LORA_MODULES: run.model.lora_modules,
            },
            run_id=run.io.run_id,
            check_owner=lambda: _check_owner(run),
        )


def export(
    transformer: nn.Module, ema: EMA | None, layout: RunLayout, *, step: int, ema_decay: float, is_main: bool
) -> None:
    """``export/``: the weights the evaluations scored (the EMA when kept), and with an EMA ``export_raw/``:
    the trained weights; each with a ``weights.json`` saying which it is and its checksums (the main rank writes
    it). Without an EMA, an ``export_raw/`` of an earlier session (one that kept an EMA) goes."""
    exports = [(layout.export, "ema" if ema is not None else "trained")]
    exports += [(layout.export_raw, "trained")] if ema is not None else []
    if ema is None and is_main and layout.export_raw.is_dir():
        shutil.rmtree(layout.export_raw)
    for folder, weights in exports:
        with ema.swapped() if weights == "ema" and ema is not None else nullcontext():
            export_model(transformer, folder)
        if is_main:
            try:
                write_export_note(folder, weights=weights, step=step, ema_decay=ema_decay)
            except OSError as err:
                raise write_failure(err, folder / EXPORT_NOTE, "the export's note") or err from None


def _configured_optimizer(optimizer: Optimizer, cfg: TrainConfig) -> None:
    """The optimizer state restores the checkpoint's hyperparameters; the configured ones win (a change is named
    before the model loads: train/run/startup_checks.py's check_settings)."""
    for group in optimizer.param_groups:
        group.update(adamw_settings(cfg.optimizer))


def resume(run: Run) -> int:
    """The step to start from: 0, or the step of the checkpoint ``resume`` names (``resumed``)."""
    return resumed(run)[0]


def resumed(run: Run) -> tuple[int, dict[str, Any]]:
    """The step to start from and the health counters to go on from: (0, {}), or the step and the counters of
    the checkpoint ``resume`` names ({} for one saved before they were kept).

    ``run.io.resume_from[0]`` passed the file checks before the model loaded; a checkpoint whose tensors
    still do not read back, or whose weights are not finite, is damaged, and ``resume=auto`` falls back
    to the previous one (checked first).
    """
    # The EMA copies may be sharded DTensors: they load in place into the live EMA's state.
    ema, checkpoints, transformer = run.optim.ema, run.io.checkpoints, run.model.backbone.transformer
    template = {"ema": ema.state_dict()} if ema is not None else None
    for index, path in enumerate(run.io.resume_from):
        if index > 0 and (problem := checkpoints.problem(path)):
            log.warning("resume=auto: skipping the damaged %s", problem)
            continue
        try:
            extra = checkpoints.load(path, model=transformer, optimizer=run.optim.optimizer, extra_template=template)
            if problem := non_finite(transformer):
                raise CheckpointError(f"checkpoint {path} holds {problem} among its weights", damaged=True)
        except CheckpointError as err:
            if run.cfg.resume != "auto" or not err.damaged:
                raise
            log.warning("resume=auto: %s; trying the previous checkpoint", err)
            continue
        if ema is not None and "ema" in extra:  # a checkpoint without one (ema allowed to change) starts it here
            ema.load_state_dict(extra["ema"])
        _configured_optimizer(run.optim.optimizer, run.cfg)
        log.info("resumed from %s at step %d", path, extra["step"])
        return int(extra["step"]), dict(extra.get("health", {}))
    if run.io.resume_from:
        raise CheckpointError(f"resume=auto: no checkpoint under {checkpoints.root} could be loaded", damaged=True)
    return 0, {}


@dataclass
class _Session:
    """Where the loop stands: steps trained, the last step checkpointed, optimizer steps taken (a hook counts them),
    and the health counters (checkpointed with the weights)."""

    done: int
    saved: int
    health: Health
    moved: int = 0
    moved_when_done: int = 0  # ``moved`` when step ``done`` ended: more since then means the weights changed

    def count(self, *_: Any) -> None:
        self.moved += 1

    def unsaved(self) -> bool:
        """Steps are trained since the last checkpoint and the weights are still those after the last one."""
        return self.done > self.saved and self.moved == self.moved_when_done


def _step_end(run: Run, preemption: Preemption) -> int:
    """The signal any rank received (0: none), once every rank knows the run folder is still this run's
    (FolderLost otherwise, before anything of the step is written); one collective."""
    lost = _lost(run)
    stop, folder_lost = preemption.requested(run.device, folder_lost=lost is not None)
    if folder_lost:
        raise FolderLost(lost or "rank 0 lost the run folder's lock to another launch")
    return stop


def _last_good(checkpoints: CheckpointManager, bad_from: int, lr: float) -> str:
    """What a diverged run leaves: the last checkpoint before the step count ``bad_from``, and how to go on."""
    if bad_from == 0:
        return "nothing was saved: check the model"
    saved = checkpoints.complete()
    good = [path for path in saved if checkpoints.step_of(path) < bad_from]
    fix = f"lower optimizer.lr (now {lr:g}), then"
    if not good:
        return f"no checkpoint holds weights from before it: {fix} start again with checkpoint.overwrite=true"
    if good[-1] == saved[-1]:
        return f"the last checkpoint before it is {good[-1]}: {fix} resume=auto continues from it"
    later = ", ".join(path.name for path in saved[len(good) :])
    return f"the last checkpoint before it is {good[-1]} ({later} after it): {fix} resume={good[-1]} continues from it"


def _after_step(run: Run, evaluator: Evaluator | None, session: _Session, verdict: Verdict | None, stop: int) -> None:
    """Checkpoint, then evaluation, on their cadences once ``session.done`` steps are trained; a signal (``stop``:
    SIGTERM, SIGHUP, Ctrl+C) and a run that cannot learn (``verdict``) stop here, after their checkpoint; a
    diverged run before it."""
    cfg, done = run.cfg, session.done
    if verdict is not None and verdict.bad_from is not None:
        with activity("the search for the last checkpoint before the divergence"):
            left = broadcast_object(_last_good(run.io.checkpoints, verdict.bad_from, cfg.optimizer.lr))
        raise Diverged(f"{verdict.line}; {left}")
    every = cfg.checkpoint.every
    if stop or verdict or done == cfg.num_steps or (every and done % every == 0):
        path = _save(run, done, session.health)
        session.saved = done
    if verdict:
        raise NotLearning(f"{verdict.line}; wrote checkpoint {path}")
    if evaluator is not None and evaluator.due(done):
        with activity(f"the evaluation after step {done}"):
            _check_owner(run)
            evaluator(done)
    if stop:
        name = SIGNAL_NAMES.get(stop, f"signal {stop}")
        message = f"{name}: wrote checkpoint {path} after step {done}; rerun with resume=auto to continue"
        raise Preempted(message, signum=stop)


def _unsaved(checkpoints: CheckpointManager, step: int) -> Interrupted:
    """What a second Ctrl+C during training ``step`` (0-based) leaves unsaved."""
    latest = checkpoints.latest()
    if latest is None:
        return Interrupted(f"a second Ctrl+C stopped training step {step} at once: no checkpoint was written")
    saved = checkpoints.step_of(latest)
    lost = f"steps {saved}-{step} were" if step > saved else f"step {step} was"
    return Interrupted(
        f"a second Ctrl+C stopped training step {step} at once: {lost} not saved; "
        f"resume=auto continues from {latest} (after step {saved})"
    )


def _rescue(run: Run, session: _Session, err: Exception) -> None:
    """Checkpoint the trained steps that an error is about to lose, when that is safe: the weights are those
    after the last step, and every rank takes part (one process, an error every rank raised alike, or one
    the ranks learned of together: an exception in some rank's reward phase)."""
    everyone = run.dist.world_size == 1 or ranks_agreed(err)
    if isinstance(err, SaveFailed | FolderLost | Diverged) or not session.unsaved() or not everyone:
        return
    try:
        path = _save(run, session.done, session.health)
    except Exception as failed:  # the original error is the one to report
        log.warning(
            "could not checkpoint the %d steps trained since the last checkpoint: %s",
            session.done - session.saved,
            failed,
        )
        return
    log.warning("wrote checkpoint %s of the steps trained before this error; resume=auto continues from it", path)


def _train(
    run: Run, evaluator: Evaluator | None, start: int, start_norm: float, counters: dict[str, Any]
) -> list[dict[str, float]]:
    """Training steps ``start`` to the last, with the bar or the heartbeat; the metrics of each step.
    ``start_norm``: the norm of the trainable weights at the start of the run (health/weight_growth's unit);
    ``counters``: the health counters the resumed checkpoint kept."""
    cfg, main = run.cfg, run.dist.is_main
    show_bar = main and cfg.logging.progress_bar
    bar = progress_bar(cfg.num_steps, is_main=show_bar, initial=start)
    heartbeat = Heartbeat(cfg.num_steps, start=start, every_s=cfg.logging.heartbeat_s, enabled=main and not show_bar)
    health = Health(
        cfg.health,
        optimizer_steps=cfg.grpo.group_size * cfg.batch.prompts_per_rank // cfg.batch.gradient_accumulation_steps,
        first=start,
        last=cfg.num_steps - 1,
        start_norm=start_norm,
    )
    health.load_state_dict(counters)
    session = _Session(done=start, saved=start, health=health)
    hook = run.optim.optimizer.register_step_post_hook(session.count)
    history = []
    # console lines go through tqdm.write while the bar is shown, so they do not break it
    step = start
    with stop_requests() as preemption, logging_redirect_tqdm() if show_bar else nullcontext():
        try:
            for step in range(start, cfg.num_steps):
                with activity(f"training step {step}"):
                    metrics = train_step(run, step)
                    metrics |= health.measure(run.model.params)
                    stop = _step_end(run, preemption)
                    session.done, session.moved_when_done = step + 1, session.moved
                    run.io.logger.log(metrics, step)
                    history.append(metrics)
                    reward = metrics.get("reward/total", math.nan)
                    bar.update(1)
                    bar.set_postfix(reward=f"{reward:.4f}")
                    heartbeat.tick(step + 1, reward)
                    _after_step(run, evaluator, session, health.observe(metrics, step), stop)
        except RepeatedInterrupt:
            raise _unsaved(run.io.checkpoints, step) from None
        except Exception as err:
            _rescue(run, session, err)
            raise
        finally:
            hook.remove()
            bar.close()
    return history


def fit(run: Run) -> None:
    cfg = run.cfg
    began = time.perf_counter()
    start_norm = weight_norm(run.model.params)  # before a checkpoint loads: the start of the run, in every session
    start, counters = resumed(run)  # the disk's room for a checkpoint was checked before the model loaded (build.py)
    if cfg.resume not in (None, "auto"):  # one timeline in the folder: a branch retires the later checkpoints
        branch(cfg.resume, run.io.resume_from[0], run.io.checkpoints, start, run.io.logger, is_main=run.dist.is_main)
    if cfg.resume is not None:
        run.io.logger.rewind(start)  # a resumed run logs every step once: rows of the steps it replays go
    if start == cfg.num_steps:
        log.warning("the checkpoint holds all num_steps=%d steps: nothing to train (raise num_steps to go on)", start)
    lost = _lost_evaluations(run, start)
    evaluator = build_evaluator(
        cfg,
        run.dist,
        start=start,
        device=run.device,
        backbone=run.model.backbone,
        predict=run.model.policy,
        ema=run.optim.ema,
        logger=run.io.logger,
        before_writing=lambda: _check_owner(run),  # a holder suspended while it sampled writes nothing
        again=start in lost,
    )
    _evaluate_first(run, evaluator, start, lost)
    history = _train(run, evaluator, start, start_norm, counters)
    if cfg.checkpoint.export:
        with activity("the export"):
            _check_owner(run)
            export(
                run.model.backbone.transformer,
                run.optim.ema,
                run.io.layout,
                step=cfg.num_steps,
                ema_decay=cfg.ema.decay,
                is_main=run.dist.is_main,
            )
    if run.dist.is_main:
        missing = [step for step in lost if step < start]  # the one at ``start`` was evaluated again
        _curve(run.io.layout, missing)
        seconds = time.perf_counter() - began
        summary = run_summary(cfg, start=start, history=history, seconds=seconds, peak=run.perf.peak, missing=missing)
        log.info(summary)


def _curve(layout: RunLayout, missing: list[int]) -> None:
    """Rank 0 at the end: ``eval/curve.png`` of the run's evaluations, the ``missing`` ones marked."""
    try:
        write_curve(layout.metrics, layout.eval_curve, missing)
    except OSError as err:
        raise write_failure(err, layout.eval_curve, "the curve of the evaluations") or err from None


def _lost_evaluations(run: Run, start: int) -> list[int]:
    """The evaluations due after steps ``<= start`` of a run resumed from a checkpoint of its folder that
    metrics.jsonl holds no row of (lost to a crash or a full disk), on the cadence that checkpoint recorded
    (``eval.every``; today's for one that recorded none); rank 0 reads, every rank gets them."""
    cfg, checkpoints = run.cfg, run.io.checkpoints
    path = checkpoints.path_for(start)  # none for another run's checkpoint: its evaluations are in its folder
    lost = []
    if run.dist.is_main and cfg.resume is not None and start > 0 and path.is_dir():
        every = (checkpoints.settings_of(path) or {}).get("eval.every", cfg.eval.every)
        lost = missing_evaluations(run.io.layout.metrics, due_evaluations(int(every), cfg.num_steps, start))
    return list(broadcast_object(lost))


def _evaluate_first(run: Run, evaluator: Evaluator | None, start: int, lost: list[int]) -> None:
    """Before the first step: the evaluation of the model as loaded (step 0), or of the resumed checkpoint's
    weights when its evaluation was lost (the same weights: done again); an evaluation lost at an earlier step
    cannot be done again (those weights are gone) and is named, as the curve and the summary name it."""
    # eval/<metric> at step k is the policy after k training steps: k = 0 is the model as loaded.
    again = start > 0 and start in lost
    if evaluator is not None and (start == 0 or again):
        if again and run.dist.is_main:
            log.warning("the evaluation after step %d was lost (no row in metrics.jsonl): evaluating it again", start)
        with activity(f"the evaluation after step {start}" if again else "the evaluation before training"):
            evaluator(start)
    earlier = [step for step in lost if step < start]
    if earlier and run.dist.is_main:
        log.warning(
            "the evaluations %s were lost (no row in metrics.jsonl) and their weights are gone: the "
            "curve (%s) and the summary mark them missing",
            after_steps(earlier),
            run.io.layout.eval_curve,
        )
