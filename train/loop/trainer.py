"""The GRPO training loop: a ``Trainer`` over a run's parts (train/run/parts.py) resumes, trains steps
(train/loop/step.py), evaluates and checkpoints on their own cadences, exports (the weights the evaluations scored: the
EMA when kept), and writes the summary (train/loop/epilogue.py) at the end.

The console (and the run folder's log file) shows a progress bar or, without it, a heartbeat line;
a line per evaluation; and the summary. Evaluation (train/parts/eval/evaluator.py) runs before
training, every ``eval.every`` steps and after the last step; each one after step 0 also
writes a before/after sheet (``eval/before_after_<tag>.png``) of the same prompts and noise.

Departures from the reference trainers, on purpose: every random draw comes from its own stream
of (seed, purpose, index) (train/distributed/seeds.py): a group's SDE noise from its group id, the training
plan from the step, LoRA's initialisation from the seed alone, so a resumed run replays exactly
and a step does not depend on how its groups are spread over ranks;
a NaN reward or a non-finite gradient skips the update (all ranks together) instead of
corrupting the weights.

Checkpoints on their cadence: train/parts/checkpoint/checkpointer.py; what ends a run early (a stop request, a lost run
folder, a diverged run, one that cannot learn, an error) and what it saves first: train/loop/faults.py. ``resume=auto``
replays from a checkpoint bit for bit, the rows of replayed steps dropped from metrics.jsonl, and falls back to the
previous checkpoint when the latest is damaged; ``resume=<an older checkpoint>`` starts a new timeline
(train/run/timeline.py).

A record with no hole: the run folder is the first console line; a resumed run evaluates again the evaluation
of its checkpoint's step that a crash lost (no row in metrics.jsonl), and names one lost at an earlier step
(its weights are gone) in the console, the summary and ``eval/curve.png``, the curve of the run's evaluations
written at the end (train/parts/config/record.py, train/loop/epilogue.py).
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from contextlib import nullcontext
from pathlib import Path

from omegaconf import DictConfig
from tqdm.contrib.logging import logging_redirect_tqdm

from train.distributed.collectives import activity, agreed, broadcast_object
from train.ground.disk import write_failure
from train.ground.errors import CheckpointError
from train.loop.epilogue import run_summary, write_curve
from train.loop.faults import Faults
from train.loop.step import train_step
from train.loop.watching import Watching
from train.parts.checkpoint.export import export_weights
from train.parts.config.record import after_steps, due_evaluations, missing_evaluations
from train.parts.eval.evaluator import Evaluator, evaluates
from train.parts.observe.console import Heartbeat, progress_bar
from train.parts.observe.health import Verdict
from train.parts.optim.optimizer import adamw_settings
from train.parts.policy.builder import non_finite
from train.run.build import open_run
from train.run.parts import Run
from train.run.start import load_config, process_group
from train.run.timeline import branch

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> None:
    """Entry point behind ``python -m train``: validate, build, train, export; the run folder named first."""
    with process_group(cfg.dist.timeout_s) as dist:
        # a file missing on some ranks stops every rank with their lines, none waiting for the others
        config = agreed(lambda: load_config(cfg))
        if dist.is_main:
            log.info("run folder: %s", Path(config.run_dir).absolute())
        with open_run(config, dist) as state:
            Trainer(state).train()


class Trainer:
    """The training loop over a run's parts, built once by ``build_run``: ``resume`` from a checkpoint, ``train``
    (the evaluations, the steps, the export, the summary), ``export`` the weights; its checkpoints are the
    ``checkpointer``'s, what ends a run early the fault policy's (``faults``)."""

    def __init__(self, run: Run) -> None:
        self.run, self.health, self.checkpointer = run, run.loop.health, run.loop.checkpointer
        self.check_owner = self.checkpointer.check_owner  # every write asks first (a collective)
        self.faults = Faults(self.checkpointer, run.io.lock, world_size=run.dist.world_size, device=run.device)
        self.watching = Watching(run)  # the best evaluation and the guard (train/loop/watching.py)

    def resume(self) -> int:
        """The step to start from: 0, or the step of the checkpoint ``resume`` names, whose health counters the
        session goes on from (none in one saved before they were kept).

        ``run.io.resume_from[0]`` passed the file checks before the model loaded; a checkpoint whose tensors
        still do not read back, or whose weights are not finite, is damaged, and ``resume=auto`` falls back
        to the previous one (checked first).
        """
        run = self.run
        # The EMA copies may be sharded DTensors: they load in place into the live EMA's state.
        ema, checkpoints, transformer = run.optim.ema, run.io.checkpoints, run.model.backbone.transformer
        template = {"ema": ema.state_dict()} if ema is not None else None
        for index, path in enumerate(run.io.resume_from):
            if index > 0 and (problem := checkpoints.problem(path)):
                log.warning("resume=auto: skipping the damaged %s", problem)
                continue
            try:
                extra = checkpoints.load(
                    path, model=transformer, optimizer=run.optim.optimizer, extra_template=template
                )
                if problem := non_finite(transformer):
                    raise CheckpointError(f"checkpoint {path} holds {problem} among its weights", damaged=True)
            except CheckpointError as err:
                if run.cfg.resume != "auto" or not err.damaged:
                    raise
                log.warning("resume=auto: %s; trying the previous checkpoint", err)
                continue
            if ema is not None and "ema" in extra:  # a checkpoint without one (ema allowed to change) starts it here
                ema.load_state_dict(extra["ema"])
            # the configured hyperparameters win over the checkpoint's (a change is named before the model loads:
            # train/run/startup_checks.py's check_settings)
            for group in run.optim.optimizer.param_groups:
                group.update(adamw_settings(run.cfg.optimizer))
            log.info("resumed from %s at step %d", path, extra["step"])
            self.health.load_state_dict(extra.get("health", {}))
            self.health.first = self.checkpointer.saved = int(extra["step"])  # this session starts there
            return self.health.first
        if run.io.resume_from:
            raise CheckpointError(f"resume=auto: no checkpoint under {checkpoints.root} could be loaded", damaged=True)
        return 0

    def train(self) -> None:
        """Resume, evaluate the model as loaded, train the steps, export, then the curve and the summary."""
        run, cfg = self.run, self.run.cfg
        began = time.perf_counter()
        start = self.resume()  # the disk's room for a checkpoint was checked before the model loaded (build.py)
        if cfg.resume not in (None, "auto"):  # one timeline in the folder: a branch retires the later checkpoints
            branch(
                cfg.resume, run.io.resume_from[0], run.io.checkpoints, start, run.io.logger, is_main=run.dist.is_main
            )
        if cfg.resume is not None:
            run.io.logger.rewind(start)  # a resumed run logs every step once: rows of the steps it replays go
        if start == cfg.num_steps:
            log.warning(
                "the checkpoint holds all num_steps=%d steps: nothing to train (raise num_steps to go on)", start
            )
        self.watching.resume(start)  # after the rewind: the rows it kept are what the watch had seen
        lost = self._lost_evaluations(start)
        missing = [step for step in lost if step < start]  # the one at ``start`` is evaluated again
        evaluator = self._evaluator(start, again=start in lost)
        self._evaluate_first(evaluator, start, again=start in lost, missing=missing)
        history = self._steps(evaluator, start)
        if cfg.checkpoint.export:
            self.export()
            self.watching.export_best()
        if run.dist.is_main:
            try:  # eval/curve.png of the run's evaluations, the missing ones marked
                write_curve(run.io.layout.metrics, run.io.layout.eval_curve, missing)
            except OSError as err:
                raise write_failure(err, run.io.layout.eval_curve, "the curve of the evaluations") or err from None
            seconds = time.perf_counter() - began
            summary = run_summary(
                cfg,
                start=start,
                history=history,
                seconds=seconds,
                peak=run.perf.peak,
                missing=missing,
                end=self.faults.done,
                notes=self.watching.notes(),
            )
            log.info(summary)
        if self.watching.stopped is not None:
            raise self.watching.stop(self.faults.done)

    def _evaluator(self, start: int, *, again: bool) -> Evaluator | None:
        """The evaluation of the policy (the EMA's weights when kept) for a session that starts at step ``start``, or
        None when it evaluates nothing; ``again``: the evaluation after step ``start`` is done again."""
        run, cfg, parts = self.run, self.run.cfg, self.run.data.eval
        if parts is None or not evaluates(cfg.eval, start=start, num_steps=cfg.num_steps, again=again):
            return None
        return Evaluator(
            parts,
            train_prompts=cfg.data.train_prompts,
            folder=run.io.layout.eval,
            num_steps=cfg.num_steps,
            start=start,
            ema=run.optim.ema,
            logger=run.io.logger,
            before_writing=self.check_owner,  # a holder suspended while it sampled writes nothing
        )

    def _steps(self, evaluator: Evaluator | None, start: int) -> list[dict[str, float]]:
        """Training steps ``start`` to the last, with the bar or the heartbeat; the metrics of each step."""
        run, cfg, main = self.run, self.run.cfg, self.run.dist.is_main
        show_bar = main and cfg.logging.progress_bar
        bar = progress_bar(cfg.num_steps, is_main=show_bar, initial=start)
        heartbeat = Heartbeat(cfg.logging, cfg.num_steps, start=start, enabled=main and not show_bar)
        history = []
        # console lines go through tqdm.write while the bar is shown, so they do not break it
        with (
            logging_redirect_tqdm() if show_bar else nullcontext(),
            bar,
            self.faults.guard(run.optim.optimizer, start=start),
        ):
            for step in range(start, cfg.num_steps):
                with activity(f"training step {step}"):
                    self.faults.step = step
                    metrics = train_step(run, step, self.faults.stop_asked) | self.health.measure(run.model.params)
                    stop = self.faults.step_end(step)
                    run.io.logger.log(metrics, step)
                    history.append(metrics)
                    self.watching.trained(metrics)
                    reward = metrics.get("reward/total", math.nan)
                    bar.update(1)
                    bar.set_postfix(reward=f"{reward:.4f}")
                    heartbeat.tick(step + 1, reward)
                    self._after_step(evaluator, step + 1, self.health.observe(metrics, step), stop)
                    if self.watching.stopped is not None:
                        break
        return history

    def _after_step(self, evaluator: Evaluator | None, done: int, verdict: Verdict | None, stop: int) -> None:
        """Checkpoint, then evaluation, on their cadences once ``done`` steps are trained; a stop request (``stop``:
        SIGTERM, SIGHUP, Ctrl+C) and a run that cannot learn (``verdict``) stop here, after their checkpoint; a
        diverged run before it."""
        self.faults.check_divergence(verdict)
        evaluating = verdict is None and evaluator is not None and evaluator.due(done)
        last = bool(stop or verdict) or done == self.run.cfg.num_steps or self.watching.checkpoint_due(evaluating)
        path = self.checkpointer.maybe_save(done, last=last)
        if evaluating and evaluator is not None:
            with activity(f"the evaluation after step {done}"):
                self.check_owner()
                self.watching.evaluated(done, evaluator(done))
        self.faults.check_stop(verdict, stop, path)

    def export(self) -> None:
        """``export/``: the weights the evaluations scored (the EMA when kept), and with an EMA ``export_raw/``:
        the trained weights; each with a ``weights.json`` saying which it is and its checksums (the main rank writes
        it). Without an EMA, an ``export_raw/`` of an earlier session (one that kept an EMA) goes."""
        run, ema, layout = self.run, self.run.optim.ema, self.run.io.layout
        exports = [(layout.export, "ema" if ema is not None else "trained")]
        exports += [(layout.export_raw, "trained")] if ema is not None else []
        with activity("the export"):
            self.check_owner()
            if ema is None and run.dist.is_main and layout.export_raw.is_dir():
                shutil.rmtree(layout.export_raw)
            transformer, done, decay = run.model.backbone.transformer, self.faults.done, run.cfg.ema.decay
            for folder, weights in exports:
                export_weights(
                    transformer, folder, ema, weights=weights, step=done, ema_decay=decay, what="the export's note"
                )

    def _lost_evaluations(self, start: int) -> list[int]:
        """The evaluations due after steps ``<= start`` of a run resumed from a checkpoint of its folder that
        metrics.jsonl holds no row of (lost to a crash or a full disk), on the cadence that checkpoint recorded
        (``eval.every``; today's for one that recorded none); rank 0 reads, every rank gets them."""
        run, cfg, checkpoints = self.run, self.run.cfg, self.run.io.checkpoints
        path = checkpoints.path_for(start)  # none for another run's checkpoint: its evaluations are in its folder
        lost = []
        if run.dist.is_main and cfg.resume is not None and start > 0 and path.is_dir():
            every = (checkpoints.settings_of(path) or {}).get("eval.every", cfg.eval.every)
            lost = missing_evaluations(run.io.layout.metrics, due_evaluations(int(every), cfg.num_steps, start))
        return list(broadcast_object(lost))

    def _evaluate_first(self, evaluator: Evaluator | None, start: int, *, again: bool, missing: list[int]) -> None:
        """Before the first step: the evaluation of the model as loaded (step 0), or of the resumed checkpoint's
        weights when its evaluation was lost (``again``: the same weights, done again); an evaluation lost at an
        earlier step (``missing``) cannot be done again (those weights are gone) and is named, as the curve and the
        summary name it."""
        # eval/<metric> at step k is the policy after k training steps: k = 0 is the model as loaded.
        if evaluator is not None and (start == 0 or again):
            if again and self.run.dist.is_main:
                log.warning(
                    "the evaluation after step %d was lost (no row in metrics.jsonl): evaluating it again", start
                )
            with activity(f"the evaluation after step {start}" if again else "the evaluation before training"):
                self.watching.evaluated(start, evaluator(start))
        if missing and self.run.dist.is_main:
            log.warning(
                "the evaluations %s were lost (no row in metrics.jsonl) and their weights are gone: the "
                "curve (%s) and the summary mark them missing",
                after_steps(missing),
                self.run.io.layout.eval_curve,
            )
