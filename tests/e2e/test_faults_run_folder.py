"""One run per folder (docs/reliability.md): a folder that holds a run or that cannot be written is refused
in one line and a refused launch takes back what it wrote; a live owner is named, a dead one taken over, a holder
whose folder was taken over writes nothing more; a sweep checks every job's folder first and runs its valid jobs."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from run_folders import ROOT, contents, copy_run, metrics, refused_line
from small_run import FAST, the_error
from torch import Tensor
from two_ranks import HELPERS

import train.__main__ as train_command
import train.loop.trainer as trainer
from rewards.base import Scorer
from train.cli.reporting import run_hydra
from train.parts.eval.protocol import EvalParts

pytestmark = pytest.mark.usefixtures("repo_root")  # the tiny experiment's prompt file is relative to the repository


def as_host(host: str, lease_s: float, overrides: list[str]) -> subprocess.Popen:
    """``python -m train overrides`` as a process of ``host`` with a lock lease of ``lease_s`` (its output piped)."""
    argv = [sys.executable, str(HELPERS / "other_host.py"), host, str(lease_s), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kept(folder: Path) -> dict[str, str]:
    """``contents`` without the log files (a process that stops says why there)."""
    return {name: sha for name, sha in contents(folder).items() if not name.endswith(".log")}


@pytest.mark.parametrize("where", ["under-a-file", "checkpoints-is-a-file", "read-only"])
def test_an_unwritable_run_folder_is_one_line_before_training(where, launch, tmp_path):
    if where == "read-only" and os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    run_dir = tmp_path / "run"
    if where == "under-a-file":
        (tmp_path / "file").write_text("")
        run_dir = tmp_path / "file" / "run"
    elif where == "checkpoints-is-a-file":
        run_dir.mkdir()
        (run_dir / "checkpoints").write_text("")
    else:
        run_dir.mkdir()
        run_dir.chmod(0o555)
    line = refused_line(launch, run_dir, "num_steps=1")
    assert re.search(r"(run folder|run_dir).*(Not a directory|File exists|Permission denied)", line), line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_read_only_run_folder_is_one_line_before_hydra_writes(trained, launch, tmp_path, monkeypatch):
    """resume=auto in an existing folder this user cannot write (os.access says so: the tests may run as root)."""
    import train.cli.run_folder as run_folder

    run_dir = copy_run(trained, tmp_path)
    real = os.access
    monkeypatch.setattr(run_folder.os, "access", lambda path, mode: Path(path) != run_dir and real(path, mode))
    line = refused_line(launch, run_dir, "num_steps=3", "resume=auto", kept=run_dir)
    assert re.search(r"cannot write the run folder \(Permission denied: .*run\)", line), line


def test_a_folder_that_holds_a_run_is_refused_before_anything_is_written(trained, launch, tmp_path):
    """A second launch into a finished run's folder (another seed, no resume=) changes nothing in it."""
    run_dir = copy_run(trained, tmp_path)
    line = refused_line(launch, run_dir, "num_steps=2", "seed=7", kept=run_dir)
    assert re.search(r"run_dir=.* already holds a run \(2 checkpoints .*resume=auto.*overwrite", line), line


def test_overwrite_replaces_the_run(trained, launch, tmp_path):
    """Nothing of the old run stays for train.eval to score into the new one: its export_raw/ (of a run that
    kept an EMA) and its probe.json go with its checkpoints and metrics."""
    run_dir = copy_run(trained, tmp_path)
    shutil.copytree(run_dir / "export", run_dir / "export_raw")
    (run_dir / "probe.json").write_text("{}")
    assert launch(run_dir, "num_steps=1", "checkpoint.overwrite=true")[0] == 0
    assert [m["step"] for m in metrics(run_dir)] == [0]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000001"]
    assert not (run_dir / "export_raw").exists() and not (run_dir / "probe.json").exists()
    assert json.loads((run_dir / "export" / "weights.json").read_text())["step"] == 1


def test_a_refused_launch_leaves_no_folder(launch, tmp_path):
    run_dir = tmp_path / "runs" / "new"
    assert "optimizer.lr" in refused_line(launch, run_dir, "optimizer.lr=nan")
    assert not (tmp_path / "runs").exists()  # nor the parent Hydra created for it


def test_rank_1_of_a_refused_launch_leaves_the_take_back_to_rank_0(trained, launch, tmp_path, monkeypatch):
    """Rank 1 of a launch refused for a setting, while rank 0 takes the launch back (its LOCK and config.yaml go):
    status 2, no line (rank 0 prints it), no traceback, and rank 1 puts nothing back nor removes anything."""
    run_dir = copy_run(trained, tmp_path)
    (run_dir / "LOCK").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "renewed": 0.0}))
    real = trainer.load_config

    def rank_0_takes_back(cfg):
        (run_dir / "LOCK").unlink()
        (run_dir / "config.yaml").unlink()
        return real(cfg)

    monkeypatch.setattr(trainer, "load_config", rank_0_takes_back)
    monkeypatch.setenv("RANK", "1")
    saved = kept(run_dir)
    status, stderr = launch(run_dir, "num_steps=3", "resume=auto", "optimizer.lr=nan")
    assert status == 2 and stderr.strip() == "", stderr
    del saved["LOCK"], saved["config.yaml"]
    assert {k: v for k, v in kept(run_dir).items() if not k.startswith(".hydra")} == {
        k: v
        for k, v in saved.items()
        if not k.startswith(".hydra")  # rank 1's Hydra writes what rank 0's did
    }


@pytest.mark.parametrize("holder", ["live", "dead"])
def test_a_live_owner_of_the_folder_is_named_and_a_dead_one_taken_over(holder, launch, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    pid = os.getppid()  # alive, and not this process
    if holder == "dead":
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()
        pid = proc.pid
    (run_dir / "LOCK").write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "renewed": time.time()}))
    status, stderr, stdout = launch(run_dir, "num_steps=1", stdout=True)
    if holder == "live":
        assert status == 2 and re.search(rf"is in use by pid {pid} on host {socket.gethostname()}", the_error(stderr))
        assert sorted(p.name for p in run_dir.iterdir()) == ["LOCK"]
    else:
        assert status == 0 and "taking over the lock" in stderr + stdout
        assert not (run_dir / "LOCK").exists()  # released at the end


@pytest.mark.slow
def test_two_launches_into_one_new_folder_one_trains_the_other_takes_back_nothing(tiny_flux_dir, tmp_path):
    """Two launches at once into one new folder: exactly one owns it and trains; the other is refused in one line
    and leaves the winner's files alone (its LOCK while it runs, .hydra/, log, config.yaml)."""
    run_dir = tmp_path / "runs" / "new"
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=1", f"hydra.run.dir={run_dir}"]
    launches = [as_host(socket.gethostname(), 60.0, overrides) for _ in range(2)]
    deadline = time.monotonic() + 300
    while all(launch.poll() is None for launch in launches):
        assert time.monotonic() < deadline, "neither launch ended"
        time.sleep(0.1)
    still = [launch for launch in launches if launch.poll() is None]
    holder = json.loads((run_dir / "LOCK").read_text()) if (run_dir / "LOCK").is_file() else None
    if still and still[0].poll() is None:  # the winner still runs: its lock is in place
        assert holder is not None and holder["pid"] == still[0].pid, holder
    stderrs = [launch.communicate(timeout=300)[1] for launch in launches]
    statuses = [launch.returncode for launch in launches]
    assert sorted(statuses) == [0, 2], stderrs
    winner = launches[statuses.index(0)]
    line = the_error(stderrs[statuses.index(2)])
    assert re.search(rf"is in use by pid {winner.pid} |already holds a run", line), line
    assert [m["step"] for m in metrics(run_dir)] == [0]
    for name in (".hydra/config.yaml", "__main__.log", "config.yaml", "run_id", "checkpoints/step_00000001", "export"):
        assert (run_dir / name).exists(), name
    assert not (run_dir / "LOCK").exists()


@pytest.mark.slow
def test_a_suspended_holder_whose_folder_was_taken_over_stops_before_writing(tiny_flux_dir, tmp_path):
    """Host a's run is stopped (SIGSTOP) past its 2 s lease; a launch from host b takes the folder over with
    resume=auto and finishes. Host a's run, continued, stops at its step's end in one line, before its metrics
    row: nothing in the folder changes."""
    run_dir = tmp_path / "run"
    common = [*FAST, f"model.path={tiny_flux_dir}", "checkpoint.every=0", f"hydra.run.dir={run_dir}"]
    holder = as_host("host-a", 2.0, [*common, "num_steps=500"])
    try:
        deadline = time.monotonic() + 300
        while not ((run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text()):
            assert time.monotonic() < deadline and holder.poll() is None, "step 0 never finished"
            time.sleep(0.2)
        holder.send_signal(signal.SIGSTOP)
        time.sleep(3)  # past the lease: host b takes host a for dead
        taker = as_host("host-b", 2.0, [*common, "num_steps=2", "resume=auto"])
        taker_stdout, taker_stderr = taker.communicate(timeout=300)
        assert taker.returncode == 0, taker_stderr
        assert "taking over the lock" in taker_stdout
        saved = kept(run_dir)
        holder.send_signal(signal.SIGCONT)
        _, stderr = holder.communicate(timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert holder.returncode == 1, stderr
    line = the_error(stderr)
    assert re.search(r"is no longer this run's: its lock .*LOCK was taken over .*pid \d+ on host host-a", line), line
    assert "stopped before writing anything more" in line
    assert kept(run_dir) == saved
    assert [m["step"] for m in metrics(run_dir)] == [0, 1] and not (run_dir / "LOCK").exists()


def test_a_holder_that_loses_its_folder_while_it_evaluates_writes_nothing(launch, tmp_path, monkeypatch):
    """The lock taken over once the evaluation after step 1 has scored its images (rewritten here as another host's,
    as a launch that took a suspended holder for dead leaves it): the run stops with status 1 in one line, and that
    evaluation writes no file and no metrics row."""
    from train.parts.eval import evaluator

    run_dir, real, saved = tmp_path / "run", evaluator.evaluate, {}

    def then_taken_over(scorer: Scorer) -> Callable[[Tensor, list[str]], Tensor]:
        def score(images: Tensor, prompts: list[str]) -> Tensor:
            scores = scorer(images, prompts)
            lock = {"host": "host-b", "pid": 1, "renewed": time.time(), "lease_s": 60.0}
            (run_dir / "LOCK").write_text(json.dumps(lock))
            saved.update(kept(run_dir))
            return scores

        score.runs_remotely = scorer.runs_remotely  # type: ignore[attr-defined]  # the evaluation reads it
        return score

    def taken_over_in_step_1(parts: EvalParts, *args, **kwargs):
        if kwargs["tag"] != "step_00000000":
            parts = replace(parts, scorers={name: then_taken_over(s) for name, s in parts.scorers.items()})
        return real(parts, *args, **kwargs)

    monkeypatch.setattr(evaluator, "evaluate", taken_over_in_step_1)
    overrides = ["num_steps=2", "checkpoint.every=0", "eval.every=1"]
    overrides += ["+eval.scorers.jpeg_compressibility={}", "eval.num_prompts=2"]
    status, stderr = launch(run_dir, *overrides)
    line = the_error(stderr)
    assert status == 1 and re.search(r"is no longer this run's: .*pid 1 on host host-b holds it now", line), line
    assert saved and kept(run_dir) == saved
    assert not list((run_dir / "eval").glob("step_00000001*"))


def sweep(folder: Path, tiny_flux_dir: Path, *overrides: str) -> int:
    """``python -m train -m overrides`` in this process, job n in ``folder/n``: its exit status."""
    argv = ["-m", *FAST, f"model.path={tiny_flux_dir}", *overrides, f"hydra.sweep.dir={folder}"]
    with pytest.raises(SystemExit) as stop:
        run_hydra(train_command.main, prog=train_command.PROG, argv=[*argv, "hydra.sweep.subdir=${hydra.job.num}"])
    return stop.value.code


def test_a_sweep_runs_its_valid_jobs_and_names_the_failed_one(tiny_flux_dir, tmp_path, capsys):
    status = sweep(
        tmp_path / "sweep", tiny_flux_dir, "num_steps=1", "checkpoint.export=false", "optimizer.lr=nan,0.001"
    )
    stderr = capsys.readouterr().err
    assert status == 2 and "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.startswith("python -m train: error: ")]
    assert re.search(r"sweep job #0 \(.*sweep/0\): optimizer\.lr must be a finite number", lines[0]), lines
    assert re.search(r"1 of the sweep's 2 jobs failed \(#0 \(.*sweep/0\); .*the others ran", lines[1]), lines
    assert [m["step"] for m in metrics(tmp_path / "sweep" / "1")] == [0]
    assert not (tmp_path / "sweep" / "0").exists()  # the failed job took back the folder it created


def test_a_sweep_with_a_folder_that_holds_a_run_starts_none_of_its_jobs(trained, tiny_flux_dir, tmp_path, capsys):
    """Job #1's folder holds a finished run: the sweep is refused before it writes anything, job #0's
    folder included, and the run in job #1's folder is unchanged."""
    folder = tmp_path / "sweep"
    held = copy_run(trained, folder).rename(folder / "1")
    saved = contents(held)
    status = sweep(folder, tiny_flux_dir, "num_steps=1", "seed=0,1")
    line = the_error(capsys.readouterr().err)
    assert status == 2, line
    assert re.search(r"the sweep starts none of its 2 jobs: job #1 \(.*sweep/1\): run_dir=.* already holds a run", line)
    assert sorted(p.name for p in folder.iterdir()) == ["1"]  # no multirun.yaml, no folder of job #0
    assert contents(folder / "1") == saved
