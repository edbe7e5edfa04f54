"""The one line about a disk that refused a write: full, read-only or gone (named by its mount point, with the
fix and what is kept), and its free space; for every writer of the run folder (checkpoints, metrics rows, the
logger's files, the evaluations, the export)."""

from __future__ import annotations

import errno
import re
import shutil
from pathlib import Path

from train.ground.errors import DiskFull, SaveFailed


def mount_point(path: Path) -> Path:
    """The mount point of the file system that holds ``path`` (an existing folder)."""
    device = path.stat().st_dev
    while path.parent != path and path.parent.stat().st_dev == device:
        path = path.parent
    return path


def existing(path: Path) -> Path:
    """``path``, or its nearest existing parent."""
    while not path.exists():
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Free bytes of the file system of ``path`` (or of its nearest existing parent)."""
    return shutil.disk_usage(existing(path)).free


def gb(n: float) -> str:
    """A size for a message: GB from 1 GB on, else MB."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


KEPT = "the checkpoints already written are intact, and resume=auto continues"


def disk_line(path: Path, why: str, fix: str = "free space there or move the run", kept: str = KEPT) -> str:
    """The one line about the disk of ``path`` (named by its mount point) that ``why`` happened on, then the fix
    and what is ``kept``."""
    return f"the disk of {path} (the file system mounted at {mount_point(existing(path))}) {why}: {fix}; {kept}"


NO_SPACE = re.compile(r"No space left|unexpected pos|Errno 28|disk quota", re.IGNORECASE)


def is_no_space(err: BaseException) -> bool:
    return (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)) or bool(NO_SPACE.search(str(err)))


TOO_LARGE = re.compile(r"File too large|Errno 27", re.IGNORECASE)


def is_too_large(err: BaseException) -> bool:
    """A write past the process's file-size limit (``ulimit -f``; Python ignores SIGXFSZ, so the write fails)."""
    return (isinstance(err, OSError) and err.errno == errno.EFBIG) or bool(TOO_LARGE.search(str(err)))


def write_failure(err: BaseException, path: Path, what: str, kept: str = KEPT) -> SaveFailed | None:
    """The one line for ``what`` (``the export``, ``the evaluation after step 4``) that the disk of ``path``
    refused (full, read-only, gone, a file past the file-size limit; a writer's own error that says the disk is
    full), or None for another error."""
    if is_no_space(err):
        return DiskFull(disk_line(path, f"filled up while {what} was written", kept=kept))
    if is_too_large(err):
        why = f"refused a file past this process's file-size limit while {what} was written"
        return SaveFailed(
            disk_line(path, why, "raise or remove the limit (ulimit -f unlimited) and launch again", kept)
        )
    if isinstance(err, OSError):
        words = err.strerror or str(err)
        return SaveFailed(
            disk_line(path, f"cannot be written ({words}) while {what} was written", "make it writable", kept)
        )
    return None
