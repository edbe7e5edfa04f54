"""Resumable checkpoints (torch.distributed.checkpoint); the export is train/parts/checkpoint/export.py.

Layout of ``run_dir/checkpoints/step_00000040/``:

* DCP files (``.metadata``, ``__<rank>_*.distcp``): ``{"model", "optim", "extra"}`` where model and
  optimizer states come from ``get_state_dict`` (FSDP2-aware, resharding-capable) and ``extra``
  holds the DTensor leaves of the caller's ``extra`` dict (e.g. an FSDP2 EMA, saved sharded).
* ``rank{r}.pt``, one per rank: the rest of ``extra`` (step, data position, plain tensors, any
  picklable object) and this rank's RNG states (torch CPU, CUDA if any, python, numpy). RNG
  states differ per rank, so they are per-rank files, not DCP entries (DCP would keep rank 0's).
* ``COMPLETE``: a JSON marker: step, world size, the settings that give the weights their meaning
  (``RESUME_SETTINGS`` of train/parts/checkpoint/settings.py, compared on resume), the id of the run that wrote it
  (train/run/timeline.py, checked on resume), and the size and SHA-256 of
  every other file of the folder. The ranks share the hashing: with R ranks, rank r hashes every R-th
  file of the sorted listing, at save and again when the checkpoint is checked.

Atomicity: every rank writes into ``step_XXXXXXXX.tmp/``; after a barrier, rank 0 writes
``COMPLETE`` there and renames the folder to ``step_XXXXXXXX/`` (an atomic rename on one file
system). A crash at any earlier point leaves only a ``.tmp`` folder, which ``latest()`` ignores and
the next save deletes, so the previous checkpoint stays the latest usable one.

Damage after the fact (a disk error, a copy cut short, a file overwritten, files of two checkpoints
mixed up) is caught before any model loads by ``usable``: the marker must be the JSON written here,
``.metadata`` must read, every ``.distcp`` shard must be as long as the metadata says, each rank's
``rank<r>.pt`` must load, and every file must have the size and checksum the marker recorded (a
checkpoint written before checksums were recorded is checked without them). Hashing reads every byte,
so the ranks share the files, at save (the files are still in the page cache) and at each resume or
evaluation of it (plus reading them from disk; what it costs: docs/benchmarks/). A checkpoint that
does not fit the model (another size, LoRA against full weights) raises ``CheckpointError`` from
``load``, saying which. The ranks agree on every verdict, so they resume from the same checkpoint;
with ``resume=auto`` a damaged one is reported and the previous complete one is used.

In a single process there is no process group: DCP is called with ``no_dist=True`` (it would
otherwise guess the same; its warning is silenced) and ``get_state_dict`` works on the unsharded model.
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    set_model_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer

from train.distributed.collectives import (
    barrier,
    broadcast_object,
    gather_objects,
    get_rank,
    get_world_size,
    is_distributed,
)
from train.ground.disk import disk_line, free_bytes, gb, write_failure
from train.ground.errors import CheckpointError, DiskFull, SaveFailed
from train.ground.layout import RunLayout
from train.parts.checkpoint.checkpoint_config import CheckpointConfig
from train.parts.checkpoint.files import (
    MARKER,
    checksums,
    complete_in,
    files_problem,
    is_complete,
    rank_file,
    read_marker,
)
from train.parts.checkpoint.state import flat_keys, merge_trees, rng_state, set_rng_state, split_extra, train_state

log = logging.getLogger(__name__)


@contextmanager
def _single_process_ok() -> Iterator[None]:
    """Silence DCP's "assuming ... a single process" warning: that is our explicit no_dist choice."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


class CheckpointManager:
    """Save, find and load the checkpoints of one run (every rank constructs one, same run_dir)."""

    def __init__(self, run_dir: str | Path, settings: CheckpointConfig | None = None) -> None:
        """``settings``: the run's ``checkpoint`` group (None: its defaults, to read a folder's checkpoints)."""
        self.root = RunLayout(run_dir).checkpoints
        self.keep_last = (settings or CheckpointConfig()).keep_last

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first (folders ending in .tmp are ignored)."""
        return list(complete_in(self.root))

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        return next(reversed(complete_in(self.root)), None)

    def usable(self, resume: str | None) -> list[Path]:
        """The checkpoints ``resume`` names whose files are whole, newest first; a collective.

        None or "" -> none. A path -> [path], or CheckpointError naming what is wrong with it. "auto"
        -> the newest complete checkpoint of this run that passes the check (a damaged one is logged and
        skipped), then the older ones, unchecked (checking reads every byte: the trainer checks one only
        when it falls back to it); CheckpointError when there are some and every one is damaged.
        """
        if resume in (None, ""):
            return []
        if resume != "auto":
            if problem := self.problem(Path(resume)):
                raise CheckpointError(
                    f"resume={resume}: {problem}; resume from another checkpoint, or use resume=auto",
                    damaged=True,
                )
            return [Path(resume)]
        damaged = []
        # Rank 0's listing for every rank: each candidate is checked by a collective, so all ranks must
        # walk the same list even when a shared file system shows them the folder at different moments.
        candidates = broadcast_object(list(reversed(self.complete())))
        for index, path in enumerate(candidates):
            problem = self.problem(path)
            if not problem:
                return candidates[index:]
            log.warning("resume=auto: skipping the damaged %s", problem)
            damaged.append(problem)
        if damaged:
            raise CheckpointError(
                f"resume=auto: no checkpoint under {self.root} can be resumed from ({'; '.join(damaged)}); "
                "delete the damaged ones to start from step 0",
                damaged=True,
            )
        return []

    def problem(self, path: Path) -> str | None:
        """What is wrong with the files of checkpoint ``path`` on any rank ("checkpoint <path>: ..."), or None.

        A collective. Rank 0 checks the shared files (marker, metadata, shard lengths), every rank its
        own ``rank<r>.pt``; nothing is loaded into a model.
        """
        for rank, problem in enumerate(gather_objects(files_problem(path))):
            if problem:
                return f"checkpoint {path}: {problem}{f' (seen by rank {rank})' if rank else ''}"
        return None

    def step_of(self, path: Path) -> int:
        """The step a checkpoint holds, from its marker (``problem`` found nothing wrong with it)."""
        return int(read_marker(path)["step"])

    def settings_of(self, path: Path) -> dict[str, Any] | None:
        """The settings recorded with a checkpoint (None: saved before they were recorded)."""
        settings = read_marker(path).get("settings")
        return settings if isinstance(settings, dict) else None

    def run_id_of(self, path: Path) -> str | None:
        """The id of the run that wrote a checkpoint (None: saved before ids were recorded)."""
        run_id = read_marker(path).get("run_id")
        return run_id if isinstance(run_id, str) else None

    def world_size_of(self, path: Path) -> int:
        """The number of ranks that saved a checkpoint (its marker's ``world_size``; 1 if not recorded)."""
        world = read_marker(path).get("world_size")
        return world if isinstance(world, int) and world > 0 else 1

    def size_of(self, path: Path) -> int:
        """Bytes of the files of checkpoint ``path``."""
        return sum(p.stat().st_size for p in path.iterdir() if p.is_file())

    def check_space(self, needed: int, what: str) -> None:
        """DiskFull when the disk of the checkpoints has less than ``needed`` bytes (and 5%) free for ``what``;
        rank 0 looks (one shared file system), every rank gets the verdict."""
        problem = None
        if get_rank() == 0:
            free = free_bytes(self.root)
            if free < needed * 1.05:
                problem = disk_line(self.root, f"has {gb(free)} free, {what} needs about {gb(needed)}")
        if problem := broadcast_object(problem):
            raise DiskFull(problem)

    def save(
        self,
        step: int,
        *,
        model: nn.Module,
        optimizer: Optimizer | None,
        extra: dict[str, Any],
        settings: dict[str, Any] | None = None,
        run_id: str | None = None,
        check_owner: Callable[[], None] | None = None,
    ) -> Path:
        """Write a checkpoint of step ``step`` on every rank (a collective); return its folder.

        ``settings``: what the weights mean and ``run_id``: the run that writes it (both recorded in the marker,
        checked on resume). ``check_owner`` (a collective) raises before the checkpoint replaces or prunes anything
        when the folder is no longer this run's. A disk that is full or cannot be written raises SaveFailed
        (DiskFull) on every rank, the unfinished save deleted."""
        final = self.path_for(step)
        tmp = final.with_name(final.name + ".tmp")
        self._write(tmp, step, model=model, optimizer=optimizer, extra=extra)
        files = checksums(tmp)
        if check_owner is not None:
            check_owner()
        failed = None
        if get_rank() == 0:
            marker = {"step": step, "world_size": get_world_size(), "settings": settings, "run_id": run_id}
            try:
                self._commit(tmp, final, {**marker, "files": files})
            except OSError as err:
                failed = _write_failure(err, self.root, step)
        self._agree(tmp, step, broadcast_object(failed))
        return final

    def _write(
        self, tmp: Path, step: int, *, model: nn.Module, optimizer: Optimizer | None, extra: dict[str, Any]
    ) -> None:
        """Every rank's files of a save into ``tmp`` (a collective): the shards and its own state; a write that
        fails on any rank raises on every rank, the unfinished save deleted."""
        rng = rng_state()
        if get_rank() == 0:  # the folder, without the leftovers of interrupted saves
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("step_*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
        barrier()
        sharded_extra, local_extra = split_extra(extra)
        state = train_state(model, optimizer)
        if sharded_extra:
            state["extra"] = sharded_extra
        local = {
            "step": step,
            "world_size": get_world_size(),
            "extra": local_extra,
            "rng": rng,
            "sharded_extra_keys": sorted(flat_keys(sharded_extra)),
        }
        failed = None
        try:
            with _single_process_ok():
                dcp.save(state, checkpoint_id=tmp, no_dist=not is_distributed())
            torch.save(local, tmp / f"rank{get_rank()}.pt")
        except (OSError, RuntimeError, CheckpointException) as err:
            failed = _write_failure(err, self.root, step)
        self._agree(tmp, step, next((f for f in gather_objects(failed) if f), None))

    def _commit(self, tmp: Path, final: Path, marker: dict[str, Any]) -> None:
        """Rank 0's end of a save: the marker, the finished folder in place of ``final``, the oldest pruned."""
        (tmp / MARKER).write_text(json.dumps(marker))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in self.complete()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def _agree(self, tmp: Path, step: int, failed: tuple[bool, str] | None) -> None:
        """Every rank raises the failure of a save that any rank saw (``failed``: disk full?, its one line)."""
        if failed is None:
            return
        if get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # the previous checkpoints stay the latest
        full, line = failed
        raise DiskFull(line) if full else SaveFailed(line)

    def load(
        self,
        path: str | Path,
        *,
        model: nn.Module,
        optimizer: Optimizer | None,
        extra_template: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Restore model, optimizer and this rank's RNG states in place; return ``extra``.

        Sharded (DTensor) entries of ``extra`` are loaded into the matching DTensors of
        ``extra_template`` (e.g. ``{"ema": ema.state_dict()}``, which restores the EMA in place);
        the rest comes from this rank's file. With a different world size than at save time,
        model and optimizer reshard, ``extra`` comes from rank 0's file and RNG states are not
        restored (a warning says so).
        """
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(deleted(path), damaged=True)
        if not is_complete(path):
            raise CheckpointError(f"{path} is not a complete checkpoint (no {MARKER} file)", damaged=True)
        local = self._read_rank_file(path)
        sharded_template, _ = split_extra(extra_template or {})
        missing = set(local["sharded_extra_keys"]) - flat_keys(sharded_template)
        if missing:
            raise ValueError(
                f"checkpoint {path} holds sharded extra entries {sorted(missing)}: pass "
                "extra_template with DTensors of the same shape, e.g. {'ema': ema.state_dict()}"
            )
        state = train_state(model, optimizer)
        if local["sharded_extra_keys"]:
            state["extra"] = sharded_template
        try:
            with _single_process_ok():
                dcp.load(state, checkpoint_id=path, no_dist=not is_distributed())
        except CheckpointException as err:  # raised on every rank, with every rank's failure
            raise _load_error(path, err) from None
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return merge_trees(local["extra"], state.get("extra", {}))

    def _read_rank_file(self, path: Path) -> dict[str, Any]:
        saved_world = read_marker(path)["world_size"]
        # weights_only=False: the file is written by save() above and holds numpy RNG state.
        local = torch.load(path / rank_file(saved_world), weights_only=False)
        if saved_world != get_world_size():
            warnings.warn(
                f"checkpoint {path} was saved with world size {saved_world}, now {get_world_size()}: "
                "RNG states are not restored",
                RuntimeWarning,
                stacklevel=3,
            )
        else:
            set_rng_state(local["rng"])
        return local


def deleted(path: Path) -> str:
    """The line for checkpoint ``path``, found a moment ago and gone now: a run still training in its folder keeps
    only its latest ``checkpoint.keep_last`` checkpoints."""
    latest = CheckpointManager(path.parent.parent).latest()
    pick = f"pick its latest, {latest}" if latest is not None else "pick another"
    return (
        f"checkpoint {path} was deleted after this command found it (a run still training in {path.parent.parent} "
        f"keeps only its latest checkpoint.keep_last checkpoints and prunes the older ones): {pick}, or pass the run "
        "folder"
    )


def _write_failure(err: BaseException, root: Path, step: int) -> tuple[bool, str]:
    """(disk full?, the one line) of a save that the disk of ``root`` refused (an OSError, torch.save's RuntimeError
    on a full disk, DCP's CheckpointException holding either: ``write_failure``'s words, a file past the file-size
    limit included); anything else is a bug and raises."""
    causes = [f[0] for f in err.failures.values()] if isinstance(err, CheckpointException) else [err]
    for cause in causes:
        if (failed := write_failure(cause, root, f"the checkpoint of step {step}")) is not None:
            return isinstance(failed, DiskFull), str(failed)
    if isinstance(err, CheckpointException):  # not an Exception: the handlers of a failing step would miss it
        raise RuntimeError(f"the checkpoint save of step {step} failed: {causes[0]!r}") from err
    raise err


def _load_error(path: Path, err: CheckpointException) -> CheckpointError:
    """A CheckpointError for a failed DCP load: the checkpoint does not fit the model, a shard is damaged, or the
    checkpoint was deleted while it loaded."""
    if not path.is_dir():
        return CheckpointError(deleted(path), damaged=True)
    failures = [failure[0] for failure in err.failures.values()]
    for failure in failures:
        text = str(failure)
        if "Size mismatch" in text:
            return CheckpointError(
                f"checkpoint {path} was saved from a model of another size ({text}); resume with the model "
                "settings it was saved with (model.*), or start a new run folder",
                damaged=False,
            )
        if "Missing key" in text:
            return CheckpointError(
                f"checkpoint {path} does not hold this model's weights ({text.rstrip('.')}): it was saved with "
                "other model settings (model.name, model.path, model.lora.*); resume with those, or start a new "
                "run folder",
                damaged=False,
            )
    # torch.load's own message for a zeroed shard advises weights_only=False, which would not help.
    kinds = sorted({type(failure).__name__ for failure in failures})
    return CheckpointError(
        f"checkpoint {path} is damaged: its .distcp shards do not read back as saved tensors ({', '.join(kinds)}; "
        "a zeroed, overwritten or cut file)",
        damaged=True,
    )
