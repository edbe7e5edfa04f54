"""One run per folder: what a run folder already holds, and the lock of the process that owns it.

* ``held_run(folder)`` describes the run a folder holds (its checkpoints, its logged steps, its
  export), or None. ``check_one_run`` refuses to start in such a folder unless the launch says what it
  wants: ``resume=auto|<path>`` continues that run, ``checkpoint.overwrite=true`` replaces it
  (``clear_run`` deletes its files first). train/cli/run_folder.py asks before Hydra writes into the folder;
  the trainer asks again before any model loads, for launches that name ``run_dir=`` themselves.
* ``RunLock``: one owner per run folder. Rank 0 creates ``<run>/LOCK`` (JSON: host, pid, the time it
  last renewed it, its lease) atomically, as a hard link of a file of its own, so of two launches that meet
  exactly one owns the folder, before either writes anything else there (train/cli/run_folder.py takes it
  before Hydra writes). A thread renews it every ``lease_s / 3`` seconds. A second process refuses to
  start while the holder is alive: on the same host its pid must be running, elsewhere its lease must
  be younger than the holder's ``lease_s`` (clocks of the hosts are assumed to agree within seconds). A
  holder that died (killed, or its node lost before the job restarted elsewhere) is taken over, with a
  warning. A holder that was only stopped (Slurm's suspend, a frozen VM, an NFS stall) past its lease may
  wake up to find its lock taken over: ``lost`` says so, and the trainer asks it before every write
  (``FolderLost``: it stops before writing anything more).
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

from train.distributed.collectives import broadcast_object
from train.ground.errors import ConfigError, Stop, UserError
from train.ground.layout import RunLayout

log = logging.getLogger(__name__)
LEASE_S = 60.0  # a holder that has not renewed its lock for this long is taken for dead


def held_run(folder: str | Path) -> str | None:
    """What run ``folder`` holds ("3 checkpoints (the latest step_00000003), 4 rows of metrics.jsonl"), or None."""
    layout = RunLayout(folder)
    checkpoints = sorted(p.name for p in layout.checkpoints.glob("step_*")) if layout.root.is_dir() else []
    parts = []
    if checkpoints:
        parts.append(
            f"{len(checkpoints)} checkpoint{'s' if len(checkpoints) > 1 else ''} (the latest {checkpoints[-1]})"
        )
    metrics = layout.metrics.read_bytes().split(b"\n") if layout.metrics.is_file() else []
    if rows := sum(1 for line in metrics if line.strip()):
        parts.append(f"{rows} row{'s' if rows > 1 else ''} of metrics.jsonl")
    if layout.export.is_dir():
        parts.append("an export")
    return ", ".join(parts) or None


def check_one_run(folder: str | Path, *, resume: str | None, overwrite: bool) -> None:
    """ConfigError when ``folder`` holds a run and the launch neither resumes nor overwrites it."""
    if resume or overwrite:
        return
    if held := held_run(folder):
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


class FolderLost(Stop):
    """This process's lock of its run folder was taken over (or removed) while it ran: it stops before writing
    anything more, and nothing is taken back (the folder is another launch's now)."""

    same_on_every_rank = True  # rank 0 looks, every rank gets the verdict (train/loop/faults.py)


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    renewed: float  # seconds since the epoch (the holder's clock) of its last renewal
    lease_s: float = LEASE_S  # how long after ``renewed`` the holder is taken for dead on another host


def _read_lock(path: Path) -> Holder | None:
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
        lease_s = float(info.get("lease_s", LEASE_S))
        return Holder(str(info["host"]), int(info["pid"]), float(info["renewed"]), lease_s)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


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

    ``lease_s`` (default ``LEASE_S``, recorded in the lock for the processes that find it), ``clock`` (seconds
    since the epoch), ``host`` and ``pid`` are injectable for tests.
    """

    def __init__(
        self,
        folder: str | Path,
        *,
        lease_s: float | None = None,
        clock: Callable[[], float] = time.time,
        host: str | None = None,
        pid: int | None = None,
    ) -> None:
        self.path = RunLayout(folder).lock
        self.lease_s, self.clock = LEASE_S if lease_s is None else lease_s, clock
        self.me = (host or socket.gethostname(), os.getpid() if pid is None else pid)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._shared = False  # taken when this process already held it (another RunLock of it removes it)

    def holder(self) -> Holder | None:
        """Who holds the lock (None: nobody, or a file that does not read as a lock, taken for no lock)."""
        return _read_lock(self.path)

    def _mine(self, holder: Holder | None) -> bool:
        return holder is not None and (holder.host, holder.pid) == self.me

    def taken(self) -> bool:
        """Whether another process holds the lock now (absent, or this process's: no)."""
        holder = self.holder()
        return holder is not None and not self._mine(holder)

    def busy(self) -> str | None:
        """Why this process may not own the folder (another process that holds it and is alive, named), or None."""
        holder = self.holder()
        if holder is None or self._mine(holder):
            return None
        if not (_alive(holder.pid) if holder.host == self.me[0] else self.clock() - holder.renewed < holder.lease_s):
            return None
        ago = max(self.clock() - holder.renewed, 0.0)
        return (
            f"run_dir={str(self.path.parent)!r} is in use by pid {holder.pid} on host {holder.host} (its lock "
            f"{self.path} was renewed {ago:.0f} s ago): stop that run first; a holder that died is taken over "
            f"once it is gone from this host, or {holder.lease_s:g} s after its last renewal on another host"
        )

    def lost(self) -> str | None:
        """Why this process no longer owns its folder (its lock taken over or removed), or None while it does."""
        holder = self.holder()
        if self._mine(holder):
            return None
        now = "it was removed" if holder is None else f"pid {holder.pid} on host {holder.host} holds it now"
        return (
            f"run_dir={str(self.path.parent)!r} is no longer this run's: its lock {self.path} was taken over after "
            f"this process (pid {self.me[1]} on host {self.me[0]}) went past its {self.lease_s:g} s lease without "
            f"renewing it (suspended, frozen or cut off), and {now}; stopped before writing anything more: the "
            "folder holds the other launch's run (resume=auto continues it once that one has ended)"
        )

    def _tmp_lock(self) -> Path:
        host, pid = self.me
        tmp = self.path.with_name(f"{self.path.name}.{host}.{pid}.tmp")
        tmp.write_text(json.dumps(asdict(Holder(host, pid, self.clock(), self.lease_s))), encoding="utf-8")
        return tmp

    def _write(self) -> None:
        os.replace(self._tmp_lock(), self.path)  # atomic: a reader sees the old lock or the new one

    def _create(self) -> bool:
        """Create the lock if there is none, atomically (a hard link fails when the name exists); False when
        there is one."""
        tmp = self._tmp_lock()
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links: exclusive creation (a reader may see it empty)
            try:
                with open(self.path, "x", encoding="utf-8") as file:
                    file.write(tmp.read_text(encoding="utf-8"))
                return True
            except FileExistsError:
                return False
        finally:
            tmp.unlink(missing_ok=True)

    def _remove_stale(self, stale: Holder | None) -> None:
        """Remove the lock judged dead (``stale``); one that changed meanwhile (a new holder's) is put back."""
        aside = self.path.with_name(f"{self.path.name}.{self.me[0]}.{self.me[1]}.stale")
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:  # another starter removed it first
            return
        try:
            if _read_lock(aside) != stale:
                os.link(aside, self.path)  # a new holder's lock: back (unless yet another one exists)
        except OSError:
            pass
        finally:
            aside.unlink(missing_ok=True)

    def acquire(self) -> None:
        """Take the lock atomically (FolderInUse naming a live holder); a dead holder's lock is taken over.

        Of launches that start at once, exactly one creates the lock: the others are refused."""
        for _ in range(3):
            if self._create():
                return
            holder = self.holder()
            if self._mine(holder):
                self._write()
                self._shared = True
                return
            if problem := self.busy():
                raise FolderInUse(problem)
            if holder is not None:
                log.warning(
                    "taking over the lock of %s from pid %d on host %s, which is gone",
                    self.path,
                    holder.pid,
                    holder.host,
                )
            self._remove_stale(holder)
        raise FolderInUse(self.busy() or f"run_dir={str(self.path.parent)!r}: another process took its lock")

    def renew(self) -> bool:
        """Renew the lease; False (and the lock left alone) when another process has taken it over."""
        if not self._mine(self.holder()):
            return False
        self._write()
        return True

    def start_renewing(self) -> None:
        """Renew every ``lease_s / 3`` seconds on a daemon thread until ``release`` or the lock is lost (the
        trainer then stops at its next write: ``lost``)."""

        def loop() -> None:
            while not self._stop.wait(self.lease_s / 3):
                try:
                    if not self.renew():
                        return
                except OSError as err:  # a full disk or a lost mount: the next renewal may succeed
                    log.warning("cannot renew the lock %s (%s)", self.path, err)

        self._thread = threading.Thread(target=loop, name="run-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and remove the lock if this process still holds it and took it first (a launch's
        lock outlives the trainer's: train/cli/launch.py takes back what it wrote before it lets the folder go)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self._shared and self._mine(self.holder()):
            try:
                self.path.unlink(missing_ok=True)
            except OSError as err:  # the folder turned read-only or its disk went: the error that ended the run
                # is the one to report; a lock left behind is taken over once this process is gone
                log.warning(
                    "could not remove the lock %s (%s): it is taken for dead once this process ends",
                    self.path,
                    err.strerror or err,
                )


def check_owner(lock: RunLock | None) -> None:
    """FolderLost on every rank when rank 0's ``lock`` of the run folder was taken over (a collective; the lock is
    None on the other ranks)."""
    if (lost := broadcast_object(lock.lost() if lock is not None else None)) is not None:
        raise FolderLost(lost)
