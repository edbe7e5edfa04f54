"""Before any model loads: the run folder claimed (writable, not another run's, locked), the checkpoints to
resume from checked, the device mesh checked."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from train.distributed.collectives import DistInfo, agreed, broadcast_object, main_decides
from train.distributed.parallelize import mesh_shape
from train.ground.errors import ConfigError
from train.ground.layout import RunLayout
from train.parts.checkpoint.manager import CheckpointManager
from train.parts.checkpoint.settings import (
    GLOBAL_BATCH,
    LORA_MODULES,
    NOTED_SETTINGS,
    change,
    changed_keys,
    changed_refusal,
    compared,
    covered,
    global_batch_refusal,
    recorded_settings,
    unrecorded,
)
from train.parts.config.record import (
    lost_rows,
    no_complete_checkpoint,
    not_a_folder,
    recorded_config,
    run_folder_of,
    settings_from_config,
    steps_text,
    unfinished,
)
from train.parts.config.schema import TrainConfig
from train.parts.observe.metrics import metrics_problem
from train.run.folder import RunLock, check_one_run, clear_run, held_run

log = logging.getLogger(__name__)


def unwritable(run_dir: Path) -> str | None:
    """Why the run folder or its checkpoints/ cannot be written, or None (tried by creating a file)."""
    for folder in (run_dir, RunLayout(run_dir).checkpoints):
        probe = folder / f".write_test_{os.getpid()}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            return f"cannot write in {folder} ({err.strerror})"
    return None


def _claim(cfg: TrainConfig, *, training: bool) -> RunLock:
    """Rank 0's part of ``claim_folder``; raises the UserError that refuses the folder."""
    run_dir = Path(cfg.run_dir)
    problem = unwritable(run_dir) or (not_a_folder(RunLayout(run_dir)) if training and cfg.checkpoint.export else None)
    if problem:
        raise ConfigError(f"run_dir={cfg.run_dir!r}: {problem}; pass a writable hydra.run.dir=<folder>")
    lock = RunLock(run_dir)
    if training:
        check_one_run(run_dir, resume=cfg.resume, overwrite=cfg.checkpoint.overwrite)
    lock.acquire()
    if training and cfg.checkpoint.overwrite and (held := held_run(run_dir)):
        log.warning("checkpoint.overwrite=true: deleting the run in %s (%s)", run_dir, held)
        clear_run(run_dir)
    return lock


def claim_folder(cfg: TrainConfig, dist: DistInfo, *, training: bool) -> RunLock | None:
    """Make the run folder this run's before anything is written there; rank 0's lock (None elsewhere).

    Rank 0 writes the run folder: it must be writable, a training run may not start in a folder that
    holds a run unless it resumes or overwrites it, and no other live process may hold its lock
    (train/run/folder.py). Rank 0 tries; every rank gets the verdict.
    """
    lock = main_decides(dist, lambda: _claim(cfg, training=training))
    if lock is not None:
        lock.start_renewing()
    return lock


def check_resume(
    cfg: TrainConfig, dist: DistInfo, checkpoints: CheckpointManager, *, max_step: int | None, prompts: str
) -> list[Path]:
    """The checks of the checkpoints to resume from, before any model loads; returns them, newest first.

    The checkpoints ``resume`` names are checked file by file (``CheckpointManager.usable``); a training
    run must not start from a checkpoint past its last step (``max_step``, num_steps), nor with settings
    that change what the checkpoint's weights mean or what the next steps compute (``check_settings``).
    ``prompts``: the training prompts as a checkpoint records them (``prompts_digest``).
    """
    found = checkpoints.usable(cfg.resume)
    if max_step is not None and found:  # before the logger writes: room for a checkpoint like it
        checkpoints.check_space(checkpoints.size_of(found[0]), "a checkpoint of this run")
    if not found and cfg.resume == "auto" and (cut := unfinished(checkpoints.root)):
        raise no_complete_checkpoint(checkpoints.root, cut)
    if found and max_step is not None and (step := checkpoints.step_of(found[0])) > max_step:
        raise ConfigError(
            f"resume={cfg.resume}: checkpoint {found[0]} holds step {step}, past "
            f"num_steps={max_step}: set num_steps to at least that to train on, or use a new run folder"
        )
    if found and max_step is not None:
        agreed(lambda: check_settings(cfg, dist, checkpoints, found[0], prompts=prompts))  # each rank's settings
        check_metrics(cfg, dist, checkpoints, found[0])
    return found


def check_settings(
    cfg: TrainConfig, dist: DistInfo, checkpoints: CheckpointManager, path: Path, *, prompts: str
) -> None:
    """Resuming checkpoint ``path`` keeps the settings it recorded (RESUME_SETTINGS, unless
    checkpoint.allow_changed names them: each key of it must name what the two compare) and its global batch; a
    change of NOTED_SETTINGS is named in one line."""
    now = recorded_settings(cfg, prompts=prompts)
    saved, where = _saved_settings(cfg, checkpoints, path, now)
    pairs, allowed = compared(saved, now), cfg.checkpoint.allow_changed
    for key in allowed:
        if problem := unrecorded(key, pairs):
            raise ConfigError(f"resume={cfg.resume}: checkpoint.allow_changed: {problem} (checkpoint {where})")
    changed = [key for key in changed_keys(saved, now, allowed) if not covered(key, GLOBAL_BATCH)]
    refused = [change(key, *pairs[key]) for key in changed if not covered(key, NOTED_SETTINGS)]
    if refused:
        raise changed_refusal(cfg.resume, where, refused)
    batch = global_batch_refusal(saved, checkpoints.world_size_of(path), now, dist.world_size, allowed)
    if batch:
        raise ConfigError(f"resume={cfg.resume}: checkpoint {path} was trained with another batch: {batch}")
    noted = [change(key, *pairs[key]) for key in changed if covered(key, NOTED_SETTINGS)]
    if noted:
        log.warning("resume=%s: changed since checkpoint %s, used as given: %s", cfg.resume, path, "; ".join(noted))


def _saved_settings(
    cfg: TrainConfig, checkpoints: CheckpointManager, path: Path, now: dict[str, Any]
) -> tuple[dict[str, Any], str]:
    """The settings checkpoint ``path`` was trained with, and where they were read: its own record, completed by
    the run folder's recorded configuration for the keys an older checkpoint did not record
    (train/parts/config/record.py)."""
    saved = checkpoints.settings_of(path) or {}  # read from its marker: ours to change
    saved.pop(LORA_MODULES, None)  # known once LoRA is on (train/parts/policy/builder.py checks it)
    recorded = recorded_config(run_folder_of(path)) if now.keys() - saved.keys() else None
    if recorded is None and not saved:
        log.warning(
            "resume=%s: checkpoint %s records no settings and its run folder no configuration of its own: the "
            "settings it was trained with cannot be compared with these (resume with the same ones)",
            cfg.resume,
            path,
        )
    if recorded is None:
        return saved, str(path)
    tree, config = recorded
    older = {k: v for k, v in settings_from_config(tree, now, cfg.data.train_prompts).items() if k not in saved}
    return {**older, **saved}, f"{path} (as its run folder's {config} records the settings it did not)"


def check_metrics(cfg: TrainConfig, dist: DistInfo, checkpoints: CheckpointManager, path: Path) -> None:
    """A resumed run's metrics.jsonl reads (rank 0 looks; every rank gets the verdict), and the rows of the steps
    before the resumed checkpoint of this folder lost since it was written are named in one line."""
    metrics = RunLayout(cfg.run_dir).metrics
    if problem := broadcast_object(metrics_problem(metrics) if dist.is_main else None):
        raise ConfigError(f"resume={cfg.resume}: {problem}")
    own = path.resolve().parent == checkpoints.root.resolve()  # not a retired timeline's, nor another run's
    if dist.is_main and own and (lost := lost_rows(metrics, checkpoints.step_of(path))):
        log.warning(
            "resume=%s: %s holds no row of steps %s, which checkpoint %s trained (the file was emptied or cut "
            "short since): those rows are lost (put back a copy of the file to keep them); the run goes on from "
            "step %d",
            cfg.resume,
            metrics,
            steps_text(lost),
            path,
            checkpoints.step_of(path),
        )


def check_mesh(cfg: TrainConfig, world_size: int) -> None:
    """HSDP's replicate degree divides the world size, before any model loads."""
    try:
        mesh_shape(world_size, cfg.dist.replicate_degree)
    except ValueError as err:
        raise ConfigError(f"{err}: pick a divisor of it, or dist.replicate_degree=1") from None
