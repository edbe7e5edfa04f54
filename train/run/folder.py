"""One run per folder: what a run folder already holds, and the lock of the process that owns it.

* ``held_run(folder)`` describes the run a folder holds (its checkpoints, its logged steps, its
  export), or None. ``check_one_run`` refuses to start in such a folder unless the launch says what it
  wants: ``resume=auto|<path>`` continues that run, ``checkpoint.overwrite=true`` replaces it
  (``clear_run`` deletes its files first). train/cli/run_folder.py asks before Hydra writes into the folder;
  the trainer asks again before any model loads, for launches that name ``run_dir=`` themselves.
* ``RunLock``: one owner per run folder. Rank 0 writes ``<run>/LOCK`` (JSON: host, pid, the time it
  last renewed it) and a thread renews it every ``lease_s / 3`` seconds. A second process refuses to
  start while the holder is alive: on the same host its pid must be running, elsewhere its lease must
  be younger than ``lease_s`` (clocks of the hosts are assumed to agree within seconds). A holder that
  died (killed, or its node lost before the job restarted elsewhere) is taken over, with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from train.run.errors import ConfigError, UserError
from train.run.layout import RunLayout

log = logging.getLogger(__name__)
LEASE_S = 60.0  # a holder that has not renewed its lock for this long is taken for dead


def _logged_steps(folder: Path) -> int:
    path = RunLayout(folder).metrics
    if not path.is_file():
        return 0
    with path.open("rb") as file:
        return sum(1 for line in file if line.strip())


def held_run(folder: str | Path) -> str | None:
    """What run ``folder`` holds ("3 checkpoints (the latest step_00000003), 4 rows of metrics.jsonl"), or None."""
    folder = Path(folder)
    layout = RunLayout(folder)
    checkpoints = sorted(p.name for p in layout.checkpoints.glob("step_*")) if folder.is_dir() else []
    parts = []
    if checkpoints:
        parts.append(
            f"{len(checkpoints)} checkpoint{'s' if len(checkpoints) > 1 else ''} (the latest {checkpoints[-1]})"
        )
    if rows := _logged_steps(folder):
        parts.append(f"{rows} row{'s' if rows > 1 else ''} of metrics.jsonl")
    if layout.export.is_dir():
        parts.append("an export")
    return ", ".join(parts) or None


def check_one_run(folder: str | Path, *, resume: str | None, overwrite: bool) -> None:
    """ConfigError when ``folder`` holds a run and the launch neither resumes nor overwrites it."""
    if resume or overwrite:
        return
    held = held_run(folder)
    if held:
        raise ConfigError(
            f"run_dir={str(folder)!r} already holds a run ({held}): continue it with resume=auto, replace it "
            "with checkpoint.overwrite=true, or pass another hydra.run.dir=<folder>"
        )


def clear_run(folder: str | Path) -> None:
    """Delete what a run wrote in ``folder`` (``checkpoint.overwrite=true``); Hydra's files stay."""
    folder = Path(folder)
    for path in RunLayout(folder).run_files():
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    for config in folder.glob("config*.yaml"):
        config.unlink()


class FolderInUse(UserError):
    """Another live process holds the run folder's lock."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    renewed: float  # seconds since the epoch (the holder's clock) of its last renewal


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


class RunLock:
    """The lock of one run folder, held by rank 0 of the run that trains in it.

    ``clock`` (seconds since the epoch), ``host`` and ``pid`` are injectable for tests.
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        lease_s: float = LEASE_S,
        clock: Callable[[], float] = time.time,
        host: str | None = None,
        pid: int | None = None,
    ) -> None:
        self.path = RunLayout(folder).lock
        self.lease_s, self.clock = lease_s, clock
        self.me = (host or socket.gethostname(), os.getpid() if pid is None else pid)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holder(self) -> Holder | None:
        """Who holds the lock (None: nobody, or a file that does not read as a lock, taken for no lock)."""
        try:
            info = json.loads(self.path.read_text(encoding="utf-8"))
            return Holder(str(info["host"]), int(info["pid"]), float(info["renewed"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _mine(self, holder: Holder | None) -> bool:
        return holder is not None and (holder.host, holder.pid) == self.me

    def live_holder(self) -> Holder | None:
        """The holder when it is another process that is alive, else None."""
        holder = self.holder()
        if holder is None or self._mine(holder):
            return None
        if holder.host == self.me[0]:
            return holder if _alive(holder.pid) else None
        return holder if self.clock() - holder.renewed < self.lease_s else None

    def busy(self) -> str | None:
        """Why this process may not own the folder (the live holder, named), or None."""
        holder = self.live_holder()
        if holder is None:
            return None
        ago = max(self.clock() - holder.renewed, 0.0)
        return (
            f"run_dir={str(self.path.parent)!r} is in use by pid {holder.pid} on host {holder.host} (its lock "
            f"{self.path} was renewed {ago:.0f} s ago): stop that run first; a holder that died is taken over "
            f"once it is gone from this host, or {self.lease_s:g} s after its last renewal on another host"
        )

    def _write(self) -> None:
        tmp = self.path.with_name(f"{self.path.name}.{self.me[1]}.tmp")
        host, pid = self.me
        tmp.write_text(json.dumps(asdict(Holder(host, pid, self.clock()))), encoding="utf-8")
        os.replace(tmp, self.path)  # atomic: a reader sees the old lock or the new one

    def acquire(self) -> None:
        """Take the lock (FolderInUse naming a live holder); a dead holder's lock is taken over."""
        problem = self.busy()
        if problem:
            raise FolderInUse(problem)
        stale = self.holder()
        if stale is not None and not self._mine(stale):
            log.warning(
                "taking over the lock of %s from pid %d on host %s, which is gone", self.path, stale.pid, stale.host
            )
        self._write()
        if not self._mine(self.holder()):  # two starters at once: the last rename won
            raise FolderInUse(self.busy() or f"run_dir={str(self.path.parent)!r}: another process took its lock")

    def renew(self) -> bool:
        """Renew the lease; False (and the lock left alone) when another process has taken it over."""
        if not self._mine(self.holder()):
            return False
        self._write()
        return True

    def start_renewing(self) -> None:
        """Renew every ``lease_s / 3`` seconds on a daemon thread until ``release``."""

        def loop() -> None:
            while not self._stop.wait(self.lease_s / 3):
                try:
                    if not self.renew():
                        log.warning("the lock %s was taken over by another process", self.path)
                        return
                except OSError as err:  # a full disk or a lost mount: the next renewal may succeed
                    log.warning("cannot renew the lock %s (%s)", self.path, err)

        self._thread = threading.Thread(target=loop, name="run-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and remove the lock if this process still holds it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._mine(self.holder()):
            self.path.unlink(missing_ok=True)
