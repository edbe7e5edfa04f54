"""SIGTERM (a scheduler's notice before it kills a job), SIGHUP (the terminal or ssh session that started
the run closed) and the first Ctrl+C (SIGINT) as a request to checkpoint and stop.

Slurm, Kubernetes and torchrun's agent (which forwards the signal it gets to every worker) send
SIGTERM, wait a grace period, then SIGKILL; a closed terminal sends SIGHUP to the processes it started
(torchrun's agent forwards it). The handler only sets a flag; the training loop asks ``requested()`` after
every step, a collective (one all-reduce of the signal number, and of whether rank 0 found its run folder's
lock taken over: train/run/folder.py), so when any rank got a signal every rank stops after the same step,
writes the same checkpoint and exits. Further
SIGTERMs are ignored while the flag is set: a worker often gets the scheduler's signal and torchrun's
forwarded copy, and the second must not cut the save short. The grace period bounds the save:
torchrun's agent kills its workers ``--shutdown-timeout`` seconds (30 by default) after forwarding the
signal, Slurm after KillWait (30 s by default).

Ctrl+C reaches every process of the terminal's foreground group (torchrun's agent and its workers),
and the agent forwards its own copy: a worker gets two at once. A second SIGINT more than
``REPEAT_S`` after the first is the user's second Ctrl+C: it raises ``RepeatedInterrupt`` at once, and
the trainer says which steps were not saved.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import torch

from train.distributed.collectives import all_reduce_max

log = logging.getLogger(__name__)
REPEAT_S = 1.0  # SIGINTs closer than this to the first are copies of one Ctrl+C (terminal and torchrun)
SIGNAL_NAMES: dict[int, str] = {
    signal.SIGTERM: "SIGTERM",
    signal.SIGINT: "Ctrl+C (SIGINT)",
    signal.SIGHUP: "SIGHUP (the terminal or ssh session closed)",
}


class RepeatedInterrupt(KeyboardInterrupt):
    """The second Ctrl+C: stop at once, unsaved."""


class Preemption:
    """Which signal this rank received (``received``: 0 = none), and which any rank did (``requested``)."""

    def __init__(self) -> None:
        self.received = 0
        self._first_at = math.inf

    def handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if signum == signal.SIGINT and self.received and now - self._first_at > REPEAT_S:
            raise RepeatedInterrupt
        if self.received:
            return  # a copy of the signal already being handled
        self.received, self._first_at = signum, now
        if signum == signal.SIGINT and int(os.environ.get("RANK", "0")) == 0:
            log.warning("Ctrl+C: finishing this step, then writing a checkpoint (Ctrl+C again stops at once, unsaved)")

    def requested(self, device: torch.device, *, folder_lost: bool = False) -> tuple[int, bool]:
        """(The signal number any rank received (SIGTERM over SIGINT over SIGHUP), 0 when none; whether any rank
        found the run folder lost), the same on every rank; every rank must call it at the same point."""
        flags = torch.tensor([float(self.received), float(folder_lost)], device=device)
        signum, lost = all_reduce_max(flags).tolist()
        return int(signum), bool(lost)


@contextmanager
def stop_requests() -> Iterator[Preemption]:
    """SIGTERM, SIGHUP and the first SIGINT set a flag instead of ending the process, for the duration of the block.

    Python delivers signals to the main thread only: a loop run in another thread gets a flag that
    never rises, and the signals keep their default actions there.
    """
    notice = Preemption()
    if threading.current_thread() is not threading.main_thread():
        yield notice
        return
    # a run started under nohup ignores SIGHUP, and keeps doing so
    nohup = signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    caught = [signum for signum in SIGNAL_NAMES if not (nohup and signum == signal.SIGHUP)]
    previous = {signum: signal.signal(signum, notice.handle) for signum in caught}
    try:
        yield notice
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
