"""A full or refusing disk (docs/reliability.md, A full disk, Disks and exports): one line naming the disk,
status 2, before a save or at it; every checkpoint written before survives."""

from __future__ import annotations

import re

import pytest
from run_folders import copy_run, files_of, metrics, metrics_refused_after_one_row, refused_line

pytestmark = pytest.mark.usefixtures("repo_root")  # the tiny experiment's prompt file is relative to the repository


@pytest.mark.parametrize("when", ["at-start", "at-a-save", "while-writing"])
def test_a_full_disk_is_one_line_and_keeps_the_checkpoints(when, trained, launch, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from train.parts.checkpoint import manager as checkpoint

    run_dir = copy_run(trained, tmp_path)
    before = files_of(run_dir / "checkpoints")
    saves = []
    if when == "at-start":
        monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 1000)
    elif when == "at-a-save":  # room at start-up (one check), then full at the save after step 3
        monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 10**12 if len(saves) < 2 else 1000)
        real = checkpoint.CheckpointManager.check_space
        monkeypatch.setattr(checkpoint.CheckpointManager, "check_space", lambda *a: saves.append(1) or real(*a))
    else:

        def full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(dcp, "save", full)
    line = refused_line(launch, run_dir, "num_steps=4", "checkpoint.every=1", "resume=auto")
    assert re.search(r"the disk of .*checkpoints \(the file system mounted at /.*\) ", line), line
    if when == "at-start":
        assert "has 0.0 MB free, a checkpoint of this run needs about" in line
        assert files_of(run_dir / "checkpoints") == before
    else:
        names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        assert names[:2] == ["step_00000001", "step_00000002"] and not [n for n in names if n.endswith(".tmp")]
        assert {k: v for k, v in files_of(run_dir / "checkpoints").items() if k in before} == before


def test_a_checkpoint_save_the_file_system_refuses_is_one_line(trained, launch, tmp_path, monkeypatch):
    """A read-only mount under the save (DCP's CheckpointException, not an Exception): one line naming the
    checkpoints' disk and the OS's words, status 2; the checkpoints written before stay as they were."""
    import traceback

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    def read_only(*args, **kwargs):
        cause = OSError(30, "Read-only file system")
        raise CheckpointException("save failed", {0: (cause, traceback.StackSummary())})

    run_dir = copy_run(trained, tmp_path)
    before = files_of(run_dir / "checkpoints")
    monkeypatch.setattr(dcp, "save", read_only)
    line = refused_line(launch, run_dir, "num_steps=3", "resume=auto")
    assert re.search(r"checkpoints .*Read-only file system", line), line
    assert {k: v for k, v in files_of(run_dir / "checkpoints").items() if k in before} == before
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp")]


def test_a_disk_that_fills_while_a_metrics_row_is_written_is_one_line(launch, tmp_path, monkeypatch):
    """ENOSPC from the metrics file's write after step 1: one line naming the file's disk, no chained tracebacks;
    the steps before it are checkpointed."""
    metrics_refused_after_one_row(monkeypatch, 28, "No space left on device")
    line = refused_line(launch, tmp_path / "run", "num_steps=3", "checkpoint.every=0")
    assert re.search(r"the disk of .*metrics\.jsonl .*filled up", line), line
    assert [m["step"] for m in metrics(tmp_path / "run")] == [0]


def test_a_new_run_is_refused_naming_the_size_of_its_checkpoint(trained, launch, tmp_path, monkeypatch):
    """A new run on a disk with little room: the line names what a checkpoint of this run needs, estimated from
    the model and optimizer before any is written (within a factor of 2 of the size a checkpoint has)."""
    from train.parts.checkpoint import manager as checkpoint

    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 1000)
    line = refused_line(launch, tmp_path / "run", "num_steps=2")
    match = re.search(r"a checkpoint of this run \(.*\) needs about ([0-9.]+) MB", line)
    assert match, line
    written = sum(p.stat().st_size for p in (trained / "checkpoints" / "step_00000002").iterdir()) / 1e6
    assert written / 2 <= float(match.group(1)) <= written * 2, (match.group(1), written)


@pytest.mark.slow
def test_a_checkpoint_past_the_file_size_limit_is_one_line_naming_the_limit(tiny_flux_dir, tmp_path):
    """python -m train under a file-size limit (``ulimit -f``, 512 KiB) that the run's logs and metrics fit and its
    first checkpoint's shard does not: one line naming the limit and its fix, status 2, no half-written checkpoint
    left. It said "cannot be written (File too large) ...: make it writable", of a disk that is writable."""
    import resource
    import subprocess
    import sys

    from run_folders import ROOT
    from small_run import FAST, the_error
    from two_ranks import env

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (512 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    run_dir = tmp_path / "run"
    args = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=2", "checkpoint.every=1", f"hydra.run.dir={run_dir}"]
    done = subprocess.run([sys.executable, "-m", "train", *args], cwd=ROOT, env=env(), preexec_fn=limited,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    line = the_error(done.stderr)
    assert done.returncode == 2 and line.startswith(
        f"python -m train: error: the disk of {run_dir / 'checkpoints'} "
    ), line
    assert line.endswith(
        "refused a file past this process's file-size limit while the checkpoint of step 1 was written: raise or "
        "remove the limit (ulimit -f unlimited) and launch again; the checkpoints already written are intact, and "
        "resume=auto continues"
    ), line
    assert list((run_dir / "checkpoints").iterdir()) == []
