"""The take-back of a refused launch: the run folder as it was before Hydra wrote into it.

A launch refused before it did any work (a setting, a file, a checkpoint that does not fit) takes back
what it wrote: the folder it created goes, and in a folder that existed ``.hydra/``, ``config*.yaml``
and the log file are as they were. train/cli/run_folder.py records the folder before Hydra writes;
train/cli/reporting.py takes the launch back when it reports a user's error.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from train.run.layout import LOCK_FILE


@dataclass
class Launch:
    """The run folder as it was before Hydra wrote into it, so that a refused launch can take back what it wrote.

    What a launch writes before its first step (bookkeeping): Hydra's ``.hydra/`` and log file, the
    trainer's ``config*.yaml`` and lock. Anything else that changed means the launch did work: it stays.
    """

    folder: Path
    created: Path | None  # the outermost folder that did not exist (None: the run folder existed)
    saved: dict[Path, bytes]  # the bookkeeping files' contents (log files: their lengths in ``lengths``)
    lengths: dict[Path, int]
    others: dict[Path, tuple[int, int]]  # every other file: (size, mtime in ns)
    folders: set[Path]  # the folders under it

    @staticmethod
    def bookkeeping(relative: Path) -> bool:
        parts = relative.parts
        top = len(parts) == 1 and (
            parts[0].endswith(".log") or parts[0] == LOCK_FILE or re.fullmatch(r"config.*\.yaml", parts[0]) is not None
        )
        return top or parts[0] == ".hydra"

    @classmethod
    def before(cls, folder: Path, *, within: Path | None = None) -> Launch:
        """``folder`` now; ``within``: a folder never to take back (a sweep's, which holds its other jobs)."""
        created = None
        for candidate in (folder, *folder.parents):
            if candidate.exists() or candidate == within:
                break
            created = candidate
        folders = {p for p in folder.rglob("*") if p.is_dir()} if folder.is_dir() else set()
        launch = cls(folder, created, {}, {}, {}, folders)
        for path in launch._files():
            if not cls.bookkeeping(path.relative_to(folder)):
                launch.others[path] = (path.stat().st_size, path.stat().st_mtime_ns)
            elif path.suffix == ".log":
                launch.lengths[path] = path.stat().st_size
            else:
                launch.saved[path] = path.read_bytes()
        return launch

    def _files(self) -> list[Path]:
        return [p for p in self.folder.rglob("*") if p.is_file()] if self.folder.is_dir() else []

    def did_work(self) -> bool:
        now = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in self._files()}
        return {p: v for p, v in now.items() if not self.bookkeeping(p.relative_to(self.folder))} != self.others

    def undo(self) -> None:
        """Take back the bookkeeping of a launch refused before it did any work (else leave everything)."""
        if not self.folder.is_dir() or self.did_work():
            return
        for handler in logging.getLogger().handlers[:]:  # Hydra's log file in the folder
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).is_relative_to(self.folder):
                handler.close()
                logging.getLogger().removeHandler(handler)
        if self.created is not None:
            shutil.rmtree(self.created, ignore_errors=True)
            return
        for path in self._files():
            if not self.bookkeeping(path.relative_to(self.folder)):
                continue
            if path in self.saved:
                path.write_bytes(self.saved[path])
            elif path in self.lengths:
                os.truncate(path, self.lengths[path])
            else:
                path.unlink()
        for folder in sorted(self.folder.rglob("*"), reverse=True):  # folders the launch created, now empty
            if folder.is_dir() and folder not in self.folders and not any(folder.iterdir()):
                folder.rmdir()
