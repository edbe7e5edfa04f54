"""One run and one timeline per run folder.

* Identity: the first launch that trains in a folder (a new one, one replaced with
  ``checkpoint.overwrite=true``, or a new run with no ``resume``) gives its run a random id, kept in
  ``<run>/run_id``; the COMPLETE marker of every checkpoint records it. A resume checks it before any
  model loads: a checkpoint of another run (copied over this folder's latest, or named by ``resume=`` from
  another run's folder into a folder that holds its own run) would mix that run's weights with this run's
  history, and is refused in one line. Continuing another run from its checkpoint on purpose is a resume
  into a new folder (``resume=<checkpoint> hydra.run.dir=<new folder>``), which gets an id of its own,
  said in one line. Checkpoints written before ids were recorded, and folders without one, are not checked.
* Branching: a resume from a checkpoint older than the folder's latest (``resume=<run>/checkpoints/step_N``)
  starts a new timeline at step N. The later checkpoints (checkpoints/best/ too), and an export of a later step, move to
  ``checkpoints/retired/<time>_after_step_N/`` (named in one line) with the rows of metrics.jsonl after step N
  (``RunLogger.rewind``); ``resume=auto`` never looks there. ``resume=<a retired checkpoint>`` goes back to
  that timeline: the folder's own after step N retires in turn, and the retired checkpoints and rows up to the
  resumed step come back. So the folder holds one timeline, and a later ``resume=auto`` continues it.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from train.distributed.collectives import DistInfo, broadcast_object
from train.ground.errors import CheckpointError
from train.ground.layout import RunLayout
from train.parts.checkpoint.best import best_step
from train.parts.checkpoint.export import EXPORT_NOTE
from train.parts.checkpoint.files import complete_in
from train.parts.checkpoint.manager import CheckpointManager

if TYPE_CHECKING:
    from train.parts.observe.logger import RunLogger

log = logging.getLogger(__name__)
AFTER_STEP = re.compile(r"_after_step_(\d+)$")  # a retired timeline's folder: the step it parted from the run's


def folder_run_id(layout: RunLayout) -> str | None:
    """The id of the run a folder holds, None when it has none."""
    try:
        return layout.run_id.read_text(encoding="utf-8").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _check_identity(resume: str | None, checkpoint: Path, saved_id: str | None, layout: RunLayout) -> None:
    """CheckpointError when ``checkpoint`` was written by another run than the one ``layout``'s folder holds."""
    own = folder_run_id(layout)
    if saved_id is None or own is None or saved_id == own:
        return
    raise CheckpointError(
        f"resume={resume}: checkpoint {checkpoint} was written by run {saved_id}, but {layout.root} holds run {own} "
        f"(its {layout.run_id.name} file): resuming would mix the other run's weights with this run's history; put "
        f"this run's own checkpoint back, or continue the other run in a new folder: resume={checkpoint} "
        "hydra.run.dir=<new folder>",
        damaged=False,
    )


def _own_id(resume: str | None, layout: RunLayout, checkpoint: Path | None, saved_id: str | None) -> str:
    """The folder's run id (a checkpoint of its own gives it back when the folder lost its file), else a new one,
    written to ``<run>/run_id``; a checkpoint of another run continued here is said in one line."""
    own = folder_run_id(layout) if resume else None
    if own is None and checkpoint is not None and checkpoint.resolve().is_relative_to(layout.checkpoints.resolve()):
        own = saved_id
    if own is None:
        own = uuid.uuid4().hex[:16]
    layout.run_id.write_text(own + "\n", encoding="utf-8")
    if saved_id not in (None, own):
        log.warning(
            "resume=%s: continuing checkpoint %s of run %s as a new run %s in %s (the other run's history stays "
            "in its own folder)",
            resume,
            checkpoint,
            saved_id,
            own,
            layout.root,
        )
    return own


def run_identity(resume: str | None, checkpoints: CheckpointManager, resume_from: list[Path], dist: DistInfo) -> str:
    """The id of the run that trains in the folder (rank 0's, on every rank), after the checkpoint it resumes
    from is checked against the folder's."""
    layout = RunLayout(checkpoints.root.parent)
    checkpoint = resume_from[0] if resume_from else None
    saved_id = checkpoints.run_id_of(checkpoint) if checkpoint is not None else None
    if checkpoint is not None:
        _check_identity(resume, checkpoint, saved_id, layout)
    run_id = _own_id(resume, layout, checkpoint, saved_id) if dist.is_main else None
    return str(broadcast_object(run_id))


def _later_export(folder: Path, step: int) -> bool:
    """Whether ``folder`` holds an export of a step after ``step`` (one that does not say which step: yes)."""
    if not folder.is_dir():
        return False
    try:
        return int(json.loads((folder / EXPORT_NOTE).read_text(encoding="utf-8"))["step"]) > step
    except (OSError, ValueError, KeyError, TypeError):
        return True


def _branch_point(checkpoint: Path, layout: RunLayout, step: int) -> tuple[int, Path | None]:
    """Where the resumed timeline parts from the folder's: at ``step``, the resumed checkpoint's; for a checkpoint
    in ``checkpoints/retired/<time>_after_step_B/``, at step B, with that folder (its steps up to ``step`` come
    back)."""
    folder = checkpoint.resolve().parent
    match = AFTER_STEP.search(folder.name)
    if match and folder.parent == layout.retired.resolve():
        return int(match.group(1)), folder
    return step, None


def _retire_after(step: int, checkpoints: CheckpointManager, layout: RunLayout) -> tuple[Path | None, list[str]]:
    """Move the checkpoints of steps after ``step``, and exports of a later step, to
    ``checkpoints/retired/<time>_after_step_<step>/``: that folder (None when nothing is later) and what moved."""
    later = [path for path, saved in complete_in(checkpoints.root).items() if saved > step]
    exports = (layout.export, layout.export_raw, layout.export_best)
    later += [folder for folder in exports if _later_export(folder, step)]
    if (best := best_step(layout.best_checkpoint)) is not None and best > step:
        later.append(layout.best_checkpoint)  # checkpoint.keep_best's, of a later step
    if not later:
        return None, []
    stamp = time.strftime("%Y-%m-%dT%H-%M-%S", time.gmtime())
    aside, n = layout.retired / f"{stamp}_after_step_{step:08d}", 2
    while aside.exists():  # two branches in one second
        aside, n = layout.retired / f"{stamp}-{n}_after_step_{step:08d}", n + 1
    aside.mkdir(parents=True)
    for path in later:
        path.rename(aside / path.name)
    return aside, [path.name for path in later]


def _bring_back(source: Path, step: int, checkpoints: CheckpointManager) -> list[str]:
    """Move the checkpoints of ``source`` (a retired timeline) up to ``step`` back into the run's checkpoints."""
    back = [path for path, saved in complete_in(source).items() if saved <= step]
    for path in back:
        path.rename(checkpoints.root / path.name)
    return [path.name for path in back]


def branch(
    resume: str, checkpoint: Path, checkpoints: CheckpointManager, step: int, logger: RunLogger, *, is_main: bool
) -> None:
    """A resume from ``checkpoint`` (of ``step``) named by its path keeps one timeline in the folder (rank 0 moves
    the files; one line says what moved). From a checkpoint of the folder's timeline or of another folder: the
    checkpoints and exports of later steps retire to ``checkpoints/retired/<time>_after_step_<step>/`` with their
    rows of metrics.jsonl. From a retired one (``retired/<time>_after_step_B/``): the folder's timeline after
    step B retires likewise, and the retired one's checkpoints and rows up to ``step`` come back."""
    if not is_main:
        return
    layout = RunLayout(checkpoints.root.parent)
    at, source = _branch_point(checkpoint, layout, step)
    aside, retired = _retire_after(at, checkpoints, layout)
    logger.rewind(at, aside=aside / layout.metrics.name if aside is not None else None)
    moved = f"the later {', '.join(retired)} moved to {aside} with their rows of metrics.jsonl" if retired else ""
    if source is None:
        if retired:
            log.warning(
                "resume=%s starts a new timeline after step %d: %s (resume=auto does not look there; "
                "resume=<its path> still resumes one)",
                resume,
                step,
                moved,
            )
        return
    back = _bring_back(source, step, checkpoints)
    logger.bring_back(source / layout.metrics.name, step)
    if not any(source.iterdir()):
        source.rmdir()
    log.warning(
        "resume=%s goes back to the timeline retired after step %d: %s%s came back into %s with their rows of "
        "metrics.jsonl",
        resume,
        at,
        f"{moved}; " if moved else "",
        ", ".join(back),
        checkpoints.root,
    )
