"""The take-back of a refused launch: the run folder as it was before Hydra wrote into it.

A launch refused before it did any work (a setting, a file, a checkpoint that does not fit) takes back
what it wrote, and only that: the folders it created itself go (the run folder with what it wrote there,
its parents when they are empty), and in a folder that existed ``.hydra/``, ``config*.yaml``, ``run_id``
and the log file are as they were. train/cli/run_folder.py records the folder and takes its lock
before Hydra writes (``claimed``: of two launches that meet, the one refused has written nothing);
train/cli/reporting.py takes the launch back when it reports a user's error. Only rank 0 takes back: the other
ranks' Hydra writes neither ``.hydra/`` nor the log file into the folder (train/cli/run_folder.py; their lines go to
their own output), so the bookkeeping there is rank 0's alone; a launch whose lock was taken over
takes back nothing (the folder is another launch's). A rank other than 0 that comes first creates the
folder marked as its launch's (``made_for_rank_zero``), so that rank 0 takes it for one it made.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path

from train.ground.layout import LOCK_FILE, RUN_ID_FILE
from train.run.folder import RunLock

PEER_MARK = ".made_by_launch"  # a folder another rank of this launch created: its launch and its outermost folder


def _stat(path: Path) -> tuple[int, int] | None:
    """(size, mtime in ns) of a file, None when it is gone (another process removed it meanwhile)."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_size, stat.st_mtime_ns


@dataclass
class Launch:
    """The run folder as it was before Hydra wrote into it, so that a refused launch can take back what it wrote.

    What a launch writes before its first step (bookkeeping): Hydra's ``.hydra/`` and log file, the
    trainer's ``config*.yaml``, ``run_id`` and lock. Anything else that changed means the launch did work:
    it stays.
    """

    folder: Path
    made: list[Path]  # the folders this launch created, outermost first (the run folder last, when it made it)
    saved: dict[Path, bytes]  # the bookkeeping files' contents (log files: their lengths in ``lengths``)
    lengths: dict[Path, int]
    others: dict[Path, tuple[int, int]]  # every other file: (size, mtime in ns)
    folders: set[Path]  # the folders under it
    lock: RunLock | None = None  # the folder's lock, when this launch took it (``claimed``)

    @staticmethod
    def bookkeeping(relative: Path) -> bool:
        parts = relative.parts
        top = len(parts) == 1 and (
            parts[0].endswith(".log")
            or parts[0] in (LOCK_FILE, RUN_ID_FILE, PEER_MARK)
            or re.fullmatch(r"config.*\.yaml", parts[0]) is not None
        )
        return top or parts[0] == ".hydra"

    @classmethod
    def before(cls, folder: Path, *, within: Path | None = None) -> Launch:
        """``folder`` now; ``within``: a folder never to take back (a sweep's, which holds its other jobs)."""
        missing = list(takewhile(lambda p: not p.exists() and p != within, (folder, *folder.parents)))
        folders = {p for p in folder.rglob("*") if p.is_dir()} if folder.is_dir() else set()
        launch = cls(folder, missing[::-1], {}, {}, {}, folders)
        for path in launch._files():
            stat = _stat(path)
            if stat is None or path.name == LOCK_FILE:  # a lock is released, never restored
                continue
            if not cls.bookkeeping(path.relative_to(folder)):
                launch.others[path] = stat
            elif path.suffix == ".log":
                launch.lengths[path] = stat[0]
            else:
                launch.saved[path] = path.read_bytes()
        return launch

    @classmethod
    def claimed(cls, folder: Path) -> Launch:
        """Create the run folder (noting the folders this launch made) and take its lock, atomically, then
        record it: FolderInUse when another live process holds it, and then nothing was written (the folders
        this launch made go while they are empty: the other launch may have begun to write there)."""
        made = []
        for parent in (*reversed(folder.parents), folder):
            try:
                parent.mkdir()
                made.append(parent)
            except FileExistsError:
                continue
        made = made if folder in made else _made_by_peer(folder) or made
        lock = RunLock(folder)
        try:
            lock.acquire()
        except BaseException:
            _remove_empty(made)
            raise
        launch = cls.before(folder)
        launch.made, launch.lock = made, lock
        return launch

    def _files(self) -> list[Path]:
        return [p for p in self.folder.rglob("*") if p.is_file()] if self.folder.is_dir() else []

    def did_work(self) -> bool:
        now = {p: _stat(p) for p in self._files() if not self.bookkeeping(p.relative_to(self.folder))}
        return {p: v for p, v in now.items() if v is not None} != self.others

    def undo(self) -> None:
        """Take back the bookkeeping of a launch refused before it did any work (else leave everything); the
        lock goes last, so that no other launch begins to write in the folder while this one takes back."""
        if not self.folder.is_dir() or self.did_work():
            return
        if self.lock is not None and self.lock.taken():
            return  # another launch owns the folder now: what is there is its own (the task released this one's)
        for handler in logging.getLogger().handlers[:]:  # Hydra's log file in the folder
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).is_relative_to(self.folder):
                handler.close()
                logging.getLogger().removeHandler(handler)
        if self.folder in self.made:
            for path in self.folder.iterdir():
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                elif path.name != LOCK_FILE:
                    path.unlink(missing_ok=True)
        else:
            self._restore()
        if self.lock is not None:
            self.lock.release()
        _remove_empty(self.made)

    def _restore(self) -> None:
        """The bookkeeping of a folder that existed as it was (the lock aside: ``undo`` releases it)."""
        for path in self._files():
            if not self.bookkeeping(path.relative_to(self.folder)) or path.name == LOCK_FILE:
                continue
            if path in self.saved:
                path.write_bytes(self.saved[path])
            elif path in self.lengths:
                os.truncate(path, self.lengths[path])
            else:
                path.unlink(missing_ok=True)
        for folder in sorted(self.folder.rglob("*"), reverse=True):  # folders the launch created, now empty
            if folder.is_dir() and folder not in self.folders and not any(folder.iterdir()):
                folder.rmdir()


def _launch_id() -> str:
    """What the ranks of one launch share and another launch does not: its rendezvous."""
    return ":".join(os.environ.get(key, "") for key in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"))


def made_for_rank_zero(folder: Path) -> None:
    """On a rank other than 0, before Hydra creates the run folder: when it is missing, create it (and its missing
    parents) marked as this launch's, at once (a folder renamed into place), so that rank 0, which comes later,
    counts it among the folders its launch made and a refused launch removes it instead of restoring it."""
    missing = list(takewhile(lambda p: not p.exists(), (folder, *folder.parents)))
    if not missing:
        return
    top = missing[-1]
    staged = Path(tempfile.mkdtemp(prefix=f".{top.name}.", dir=top.parent))
    inner = staged / folder.relative_to(top)
    inner.mkdir(parents=True, exist_ok=True)
    (inner / PEER_MARK).write_text(f"{_launch_id()}\n{top}", encoding="utf-8")
    try:
        staged.rename(top)
    except OSError:  # rank 0 (or another launch) created it meanwhile
        shutil.rmtree(staged, ignore_errors=True)


def _made_by_peer(folder: Path) -> list[Path]:
    """The folders another rank of this launch made for ``folder`` (``made_for_rank_zero``), outermost first; the
    mark is taken away."""
    mark = folder / PEER_MARK
    try:
        launch, top = mark.read_text(encoding="utf-8").split("\n")
    except (OSError, ValueError):
        return []
    mark.unlink(missing_ok=True)
    if launch != _launch_id() or not folder.is_relative_to(top):
        return []
    return [Path(top), *reversed([p for p in folder.parents if p.is_relative_to(top) and p != Path(top)]), folder]


def _remove_empty(made: list[Path]) -> None:
    """The folders a launch made (outermost first), innermost first, while they are empty: one that is not
    holds another launch's files, and so do the folders above it."""
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:
            return
