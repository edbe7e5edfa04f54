"""SIGTERM, the notice a scheduler gives before it kills a job, as a request to checkpoint and stop.

Slurm, Kubernetes and torchrun's agent (which forwards it to every worker) send SIGTERM, wait a grace
period, then SIGKILL. The handler only sets a flag; the training loop asks ``requested()`` after every
step, a collective (one all-reduce of the flag), so when any rank got the signal every rank stops
after the same step, writes the same checkpoint and exits. Further SIGTERMs are ignored while the
flag is set: a worker often gets the scheduler's signal and torchrun's forwarded copy, and the second
must not cut the save short. The grace period bounds the save: torchrun's agent kills its workers
30 s after forwarding the signal, Slurm after KillWait (30 s by default).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import torch

from train.distributed.collectives import all_reduce_max


class Preemption:
    """Whether this rank received SIGTERM, and whether any rank did (``requested``)."""

    def __init__(self) -> None:
        self.received = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def requested(self, device: torch.device) -> bool:
        """True on every rank when any rank received SIGTERM; every rank must call it at the same point."""
        flag = torch.tensor(1.0 if self.received else 0.0, device=device)
        return bool(all_reduce_max(flag) > 0)


@contextmanager
def sigterm_requests() -> Iterator[Preemption]:
    """SIGTERM sets a flag instead of ending the process, for the duration of the block.

    Python delivers signals to the main thread only: a loop run in another thread gets a flag that
    never rises, and SIGTERM keeps its default action there.
    """
    notice = Preemption()
    if threading.current_thread() is not threading.main_thread():
        yield notice
        return
    previous = signal.signal(signal.SIGTERM, notice.handle)
    try:
        yield notice
    finally:
        signal.signal(signal.SIGTERM, previous)
