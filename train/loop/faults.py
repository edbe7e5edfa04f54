"""The training loop's fault policy: what ends a run early, and what it saves first.

* SIGTERM, SIGHUP or the first Ctrl+C: every rank stops after the same step, writes a checkpoint and exits with
  ``Preempted`` (train/distributed/preemption.py); a second Ctrl+C stops at once with ``Interrupted``. A served
  reward's request in flight stops at the signal (``stop_asked``): that step ends untrained on every rank
  (``StepStopped``), the steps before it are checkpointed, and a resume runs it again.
* A run folder whose lock was taken over (a process suspended past its lease): ``FolderLost`` before anything more
  is written (the step's end, every checkpoint save, evaluation and the export ask first).
* The health's verdict (train/parts/observe/health.py): ``Diverged`` before the diverged weights are saved, naming the
  last checkpoint before them; ``NotLearning`` after the checkpoint.
* Any other error: the trained steps it would lose are checkpointed first when the weights are those after the
  last step and every rank takes part (one process, an error raised alike, or one the ranks learned of together,
  as an exception in some rank's reward phase).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.optim import Optimizer

from train.distributed.collectives import activity, broadcast_object
from train.distributed.preemption import SIGNAL_NAMES, Preemption, RepeatedInterrupt, stop_requests
from train.ground.errors import Diverged, Interrupted, NotLearning, Preempted, SaveFailed, StepStopped, ranks_agreed
from train.parts.checkpoint.checkpointer import Checkpointer
from train.parts.checkpoint.manager import CheckpointManager
from train.parts.observe.health import Verdict
from train.run.folder import FolderLost, RunLock

log = logging.getLogger(__name__)


class Faults:
    """The fault policy of the loop over its ``checkpointer``: the loop runs its steps inside ``guard`` and names
    the one in progress (``step``); after each it calls ``step_end``, ``check_divergence`` before its checkpoint
    and ``check_stop`` after it."""

    def __init__(
        self, checkpointer: Checkpointer, lock: RunLock | None, *, world_size: int, device: torch.device
    ) -> None:
        self.checkpointer, self.lock, self.world_size, self.device = checkpointer, lock, world_size, device
        self.step = self.done = 0  # the step in progress, the steps trained
        # optimizer steps taken (a hook counts them); ``moved`` when step ``done`` ended: more means the weights changed
        self.moved = self.moved_when_done = 0
        self.preemption = Preemption()  # the stop requests while ``guard`` runs

    @contextmanager
    def guard(self, optimizer: Optimizer, *, start: int) -> Iterator[None]:
        """The loop's steps from ``start``: signals become stop requests, a second Ctrl+C ends them with
        Interrupted, and any other error first checkpoints the trained steps it would lose, when that is safe."""
        self.step = self.done = start
        hook = optimizer.register_step_post_hook(self._count)
        with stop_requests() as self.preemption:
            try:
                yield
            except RepeatedInterrupt:
                raise self._unsaved() from None
            except StepStopped:
                raise self._stopped_in_step() from None
            except Exception as err:
                self._rescue(err)
                raise
            finally:
                hook.remove()

    def _count(self, *_: Any) -> None:
        self.moved += 1

    def stop_asked(self) -> bool:
        """This rank received a signal to stop (it needs no collective: a step's served requests ask it while they
        wait, and stop at once)."""
        return self.preemption.received != 0

    def step_end(self, step: int) -> int:
        """After training step ``step``: the signal any rank received (0: none), once every rank knows the run
        folder is still this run's (FolderLost otherwise, before anything of the step is written); one collective."""
        stop = self._agreed_stop()
        self.done, self.moved_when_done = step + 1, self.moved
        return stop

    def _agreed_stop(self) -> int:
        """The signal any rank received (0: none); FolderLost when rank 0 lost the run folder (one collective)."""
        lost = self.lock.lost() if self.lock is not None else None
        stop, folder_lost = self.preemption.requested(self.device, folder_lost=lost is not None)
        if folder_lost:
            raise FolderLost(lost or "rank 0 lost the run folder's lock to another launch")
        return stop

    def _stopped_in_step(self) -> Preempted:
        """A signal stopped step ``self.step``'s served requests (``StepStopped``, on every rank together): the
        steps trained before it checkpointed, the step itself left for the resume to run again."""
        stop = self._agreed_stop() or signal.SIGTERM
        saved = self.checkpointer.saved
        path = self.checkpointer.save(self.done) if self.done > saved else self.checkpointer.manager.latest()
        name = SIGNAL_NAMES.get(stop, f"signal {stop}")
        kept = f"wrote checkpoint {path} after step {self.done}" if path is not None else "no step was trained yet"
        message = (
            f"{name} during the served rewards of step {self.step}, which is not trained: {kept}; rerun with "
            f"resume=auto to continue (step {self.step} runs again)"
        )
        return Preempted(message, signum=stop)

    def check_divergence(self, verdict: Verdict | None) -> None:
        """Diverged when the health's ``verdict`` says the weights left any sane range, naming what is left."""
        if verdict is not None and verdict.bad_from is not None:
            with activity("the search for the last checkpoint before the divergence"):
                lr = self.checkpointer.optimizer.param_groups[0]["lr"]  # optimizer.lr: the run keeps it constant
                left = broadcast_object(last_good(self.checkpointer.manager, verdict.bad_from, lr))
            raise Diverged(f"{verdict.line}; {left}")

    def check_stop(self, verdict: Verdict | None, stop: int, path: Path | None) -> None:
        """After the checkpoint ``path`` of the steps trained: NotLearning on the health's ``verdict``, Preempted on a
        stop request (``stop``: the signal)."""
        if verdict:
            raise NotLearning(f"{verdict.line}; wrote checkpoint {path}")
        if stop:
            name = SIGNAL_NAMES.get(stop, f"signal {stop}")
            message = f"{name}: wrote checkpoint {path} after step {self.done}; rerun with resume=auto to continue"
            raise Preempted(message, signum=stop)

    def _rescue(self, err: Exception) -> None:
        """Checkpoint the steps trained since the last checkpoint that ``err`` is about to lose, when the weights
        are still those after the last of them and every rank takes part; a failed save is named, ``err`` stays
        the error to report."""
        saved, everyone = self.checkpointer.saved, self.world_size == 1 or ranks_agreed(err)
        unsaved = self.done > saved and self.moved == self.moved_when_done
        if isinstance(err, SaveFailed | FolderLost | Diverged) or not unsaved or not everyone:
            return
        try:
            path = self.checkpointer.save(self.done)
        except Exception as failed:  # the original error is the one to report
            log.warning(
                "could not checkpoint the %d steps trained since the last checkpoint: %s", self.done - saved, failed
            )
            return
        log.warning("wrote checkpoint %s of the steps trained before this error; resume=auto continues from it", path)

    def _unsaved(self) -> Interrupted:
        """What a second Ctrl+C during training step ``self.step`` (0-based) leaves unsaved."""
        step, manager = self.step, self.checkpointer.manager
        latest = manager.latest()
        if latest is None:
            return Interrupted(f"a second Ctrl+C stopped training step {step} at once: no checkpoint was written")
        saved = manager.step_of(latest)
        lost = f"steps {saved}-{step} were" if step > saved else f"step {step} was"
        return Interrupted(
            f"a second Ctrl+C stopped training step {step} at once: {lost} not saved; "
            f"resume=auto continues from {latest} (after step {saved})"
        )


def last_good(checkpoints: CheckpointManager, bad_from: int, lr: float) -> str:
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
