"""``checkpoints/best/``: the checkpoint of the best evaluation (``checkpoint.keep_best``; the watch of
train/parts/eval/watch.py says which), beside the last ``checkpoint.keep_last`` ones and never pruned.

It holds hard links to the files of ``checkpoints/step_XXXXXXXX/`` (copies where the file system has none), so it
costs no disk while that checkpoint is kept, and stays whole when the rotation deletes it; its ``COMPLETE`` marker
is that checkpoint's, so it is a checkpoint like the others (``python -m train.eval eval.transformer=`` reads it).
A new best replaces it through ``best.tmp/``: a crash in between leaves no ``best/``, and the next session, which
knows the best step from metrics.jsonl, links it again while that step's checkpoint is kept.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from train.ground.layout import RunLayout
from train.parts.checkpoint.files import is_complete, read_marker
from train.parts.checkpoint.manager import CheckpointManager

log = logging.getLogger(__name__)


def best_folder(checkpoints: CheckpointManager) -> Path:
    """``checkpoints/best/`` of the run whose checkpoints ``checkpoints`` manages."""
    return RunLayout(checkpoints.root.parent).best_checkpoint


def best_step(folder: Path) -> int | None:
    """The step of the checkpoint in ``folder``, a run's ``checkpoints/best/``, or None when it holds none."""
    return int(read_marker(folder)["step"]) if is_complete(folder) else None


def keep_best(checkpoints: CheckpointManager, step: int) -> None:
    """Make ``checkpoints/best/`` the checkpoint of ``step`` (rank 0; that checkpoint is complete)."""
    source, folder = checkpoints.path_for(step), best_folder(checkpoints)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        _link(file, tmp / file.name)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def _link(file: Path, to: Path) -> None:
    """``to`` as a hard link to ``file``, or a copy of it where the file system cannot link."""
    try:
        os.link(file, to)
    except OSError:
        shutil.copy2(file, to)


def restore_best(checkpoints: CheckpointManager, step: int | None) -> None:
    """A resumed session's ``checkpoints/best/`` for the best ``step`` its rows name (rank 0): linked again when it
    holds another step (a crash before the link, a branch) and that checkpoint is kept; removed, in one line, when
    the checkpoint is gone; none while there is no best (``step`` None)."""
    folder = best_folder(checkpoints)
    kept = best_step(folder)
    if kept == step:
        return
    if step is not None and is_complete(checkpoints.path_for(step)):
        keep_best(checkpoints, step)
        return
    if folder.exists():
        shutil.rmtree(folder)
    if step is not None:
        log.warning(
            "checkpoint.keep_best: the checkpoint of the best evaluation (after step %d) is no longer kept: "
            "checkpoints/best/ comes back with the next best evaluation",
            step,
        )
