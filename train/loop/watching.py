"""The loop's watch over its evaluations (train/parts/eval/watch.py): ``checkpoint.keep_best`` keeps the checkpoint
of the best one in ``checkpoints/best/`` (train/parts/checkpoint/best.py) and exports it to ``export_best/``, and
``eval.guard`` warns, or ends the run, when the watched metric falls while the training reward rises.

With either (the guard's stop), a checkpoint is saved after every evaluation, before it: the best evaluation's
weights are then on disk to keep, and a stop leaves its step checkpointed. Every rank watches the same logged rows
and reaches the same verdicts; rank 0 alone links the files. A resumed session replays the rows of metrics.jsonl
that its rewind kept (rank 0 reads them, every rank gets the watch) and links ``checkpoints/best/`` again when it
is not the best step's.
"""

from __future__ import annotations

import logging
from typing import Any

from train.distributed.collectives import agree_on_write, broadcast_object
from train.ground.errors import GuardStopped
from train.parts.checkpoint.best import best_folder, best_step, keep_best, restore_best
from train.parts.checkpoint.export import export_weights
from train.parts.config.record import rows
from train.parts.eval.eval_config import GuardAction
from train.parts.eval.watch import Watch
from train.run.parts import Run

log = logging.getLogger(__name__)


class Watching:
    """The watch of one session of ``run``: fed the steps' metrics (``trained``) and the evaluations'
    (``evaluated``); ``stopped`` holds the guard's line once it asked the run to end."""

    def __init__(self, run: Run) -> None:
        self.run, self.watch = run, Watch.of(run.cfg.eval)
        self.keep, self.action = run.cfg.checkpoint.keep_best, run.cfg.eval.guard.action
        self.stopped: str | None = None

    def checkpoint_due(self, due: bool) -> bool:
        """Whether a step whose evaluation is ``due`` needs a checkpoint before it (keep_best, the guard's stop)."""
        return due and (self.keep or self.action is GuardAction.stop)

    def resume(self, start: int) -> None:
        """A session that starts at step ``start`` > 0: the watch as the rows kept by the rewind leave it, and
        ``checkpoints/best/`` the best step's again."""
        run = self.run
        if start == 0 or not run.cfg.eval.every:
            return
        if run.dist.is_main:
            self.watch.replay(rows(run.io.layout.metrics))
        self.watch = broadcast_object(self.watch)
        if self.keep:
            best, checkpoints = (self.watch.best.step if self.watch.best is not None else None), run.io.checkpoints
            write = (lambda: restore_best(checkpoints, best)) if run.dist.is_main else (lambda: None)
            agree_on_write(write, checkpoints.root, "checkpoints/best/")

    def trained(self, metrics: dict[str, Any]) -> None:
        self.watch.trained(metrics)

    def evaluated(self, step: int, metrics: dict[str, float]) -> None:
        """The evaluation after ``step`` steps was logged (``metrics``: its row; empty when nothing was scored)."""
        verdict = self.watch.evaluated(step, metrics)
        checkpoints = self.run.io.checkpoints
        if verdict.best and self.keep:
            write = (lambda: keep_best(checkpoints, step)) if self.run.dist.is_main else (lambda: None)
            agree_on_write(write, checkpoints.root, f"checkpoints/best/ (the checkpoint of step {step})")
        if verdict.alarm is None:
            return
        if self.action is GuardAction.stop:
            self.stopped = verdict.alarm
        elif self.run.dist.is_main:
            log.warning(verdict.alarm)

    def notes(self) -> list[str]:
        """The summary's lines of the watch: the best evaluation against the last, the guard's stop."""
        lines = [line] if (line := self.watch.margin_line()) is not None else []
        return lines + ([f"stopped: {self.stopped}"] if self.stopped is not None else [])

    def stop(self, step: int) -> GuardStopped:
        """The end of a run the guard stopped after ``step`` steps (its checkpoint written), in one line."""
        path = self.run.io.checkpoints.path_for(step)
        return GuardStopped(
            f"{self.stopped}; stopped (eval.guard.action=stop): wrote checkpoint {path}; "
            "resume=auto continues, e.g. with eval.guard.action=warn"
        )

    def export_best(self) -> None:
        """``export_best/``: the weights of checkpoints/best/ as export/ holds the last ones (the EMA when kept), with
        its ``weights.json``; loaded into the model, which the run no longer trains (a collective)."""
        run, checkpoints = self.run, self.run.io.checkpoints
        step = broadcast_object(best_step(best_folder(checkpoints)) if run.dist.is_main else None)
        if not self.keep or step is None:
            return
        ema, transformer, folder = run.optim.ema, run.model.backbone.transformer, run.io.layout.export_best
        template = {"ema": ema.state_dict()} if ema is not None else None
        extra = checkpoints.load(best_folder(checkpoints), model=transformer, optimizer=None, extra_template=template)
        if ema is not None and "ema" in extra:
            ema.load_state_dict(extra["ema"])
        weights = "ema" if ema is not None else "trained"
        export_weights(
            transformer,
            folder,
            ema,
            weights=weights,
            step=step,
            ema_decay=run.cfg.ema.decay,
            what="the best export's note",
        )
