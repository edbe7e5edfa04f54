"""The checkpoints of the training loop (train/parts/checkpoint/manager.py writes them): due every ``checkpoint.every``
steps and at the last one the loop saves; each written once the disk has room for it (``DiskFull`` names the disk)
and while the run folder is still this run's (``check_owner``, asked again before the save replaces anything).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim import Optimizer

from train.distributed.collectives import activity, broadcast_object
from train.parts.checkpoint.checkpoint_config import CheckpointConfig
from train.parts.checkpoint.files import state_bytes
from train.parts.checkpoint.manager import CheckpointManager
from train.parts.optim.ema import EMA


@dataclass
class Checkpointer:
    """Save the checkpoints of a run's training loop (every rank holds one; each save is a collective)."""

    cfg: CheckpointConfig
    manager: CheckpointManager
    model: nn.Module
    optimizer: Optimizer
    ema: EMA | None
    states: Mapping[str, Stateful]  # the loop's counters, each saved as its ``state_dict()``
    settings: dict[str, Any]  # what gives the weights their meaning, recorded and compared on resume
    run_id: str | None
    check_owner: Callable[[], None]  # a collective that raises when the run folder is no longer this run's
    saved: int = 0  # the step of the last checkpoint this session wrote or resumed from

    def maybe_save(self, step: int, *, last: bool = False) -> Path | None:
        """The checkpoint of ``step`` steps when one is due (``last``, or on ``checkpoint.every``'s cadence); its
        folder, or None."""
        if last or (self.cfg.every and step % self.cfg.every == 0):
            return self.save(step)
        return None

    def save(self, step: int) -> Path:
        """The checkpoint of ``step`` steps, once the disk has room for it and while the folder is this run's."""
        extra: dict[str, Any] = {"step": step, **{name: state.state_dict() for name, state in self.states.items()}}
        if self.ema is not None:
            extra["ema"] = self.ema.state_dict()
        with activity(f"the checkpoint save after step {step}"):
            self.check_owner()
            self.manager.check_space(self._needed_bytes(), f"the checkpoint of step {step}")
            path = self.manager.save(
                step,
                model=self.model,
                optimizer=self.optimizer,
                extra=extra,
                settings=self.settings,
                run_id=self.run_id,
                check_owner=self.check_owner,
            )
        self.saved = step
        return path

    def _needed_bytes(self) -> int:
        """About the size of the next checkpoint: the latest one's, else an estimate from the state (a collective)."""
        latest = broadcast_object(self.manager.latest())
        if latest is not None:
            return self.manager.size_of(latest)
        return state_bytes(self.model, self.optimizer, self.ema)
