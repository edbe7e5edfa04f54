"""No step lost to a signal or a crash (docs/reliability.md, Signals and pipes; docs/distributed.md): SIGTERM
and SIGHUP write a checkpoint after the step and the resumed run equals an uninterrupted one, bit for bit (on one
of two ranks too); the steps trained before a failure are saved; a stopped rank makes the other fail after
``dist.timeout_s`` naming the collective."""

from __future__ import annotations

import json
import re
import signal
import sys
import time

import pytest
from run_folders import ROOT, assert_same_run, metrics, sigterm_at
from small_run import FAST, the_error
from two_ranks import HELPERS, run_torchrun, start_ranks

import train.__main__ as train_command
import train.loop.trainer as trainer
from train.cli.reporting import run_hydra
from train.ground.errors import Preempted

pytestmark = pytest.mark.usefixtures("repo_root")  # the tiny experiment's prompt file is relative to the repository


def test_sighup_checkpoints_like_sigterm(launch, tmp_path, monkeypatch):
    """A closed terminal (SIGHUP) during step 0: the step ends, its checkpoint is written, the one line says so
    (on stderr and in the run's log file), status 129, the lock is released."""
    sigterm_at(0, monkeypatch, signal.SIGHUP)
    run_dir = tmp_path / "run"
    ignored = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a suite started under nohup: the trainer would keep that
    try:
        status, stderr = launch(run_dir, "num_steps=3")
    finally:
        signal.signal(signal.SIGHUP, ignored)
    assert status == 128 + signal.SIGHUP
    line = the_error(stderr, kind="stopped")
    assert re.search(
        r"SIGHUP \(the terminal or ssh session closed\): wrote checkpoint .*step_00000001 after step 1; "
        r"rerun with resume=auto",
        line,
    ), line
    assert line in (run_dir / "__main__.log").read_text()
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000001"]
    assert not (run_dir / "LOCK").exists()


def test_help_into_a_reader_that_stops_early_ends_quietly(capsys, monkeypatch):
    """``python -m train --help | head``: the reader closed stdout; no line about the run folder, status 141
    (128 + SIGPIPE), as a process that SIGPIPE ended."""

    class Closed:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    with pytest.raises(SystemExit) as stop:
        run_hydra(train_command.main, prog=train_command.PROG, argv=["--help"])
    assert stop.value.code == 128 + signal.SIGPIPE
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_sigterm_checkpoints_and_resume_is_bit_identical(launch, tmp_path, monkeypatch):
    common = ["num_steps=4", "checkpoint.every=0"]
    assert launch(tmp_path / "straight", *common)[0] == 0
    sigterm_at(1, monkeypatch)
    status, stderr = launch(tmp_path / "stopped", *common)
    assert status == Preempted.exit_code == 143
    line = the_error(stderr, kind="stopped")
    assert "step_00000002 after step 2" in line and "resume=auto" in line, stderr
    assert [p.name for p in (tmp_path / "stopped" / "checkpoints").iterdir()] == ["step_00000002"]
    assert not (tmp_path / "stopped" / "export").exists()
    monkeypatch.undo()
    monkeypatch.chdir(ROOT)
    assert launch(tmp_path / "stopped", *common, "resume=auto")[0] == 0
    assert_same_run(tmp_path / "straight", tmp_path / "stopped", steps=4)


def test_a_resumed_run_logs_each_step_once(launch, tmp_path, monkeypatch):
    """A crash in step 3 after the checkpoint of step 2 left rows 0..2 (and the evaluation after step 2):
    the resumed run drops row 2 before replaying it, and keeps that evaluation (it does not rerun it)."""
    common = [
        "num_steps=4",
        "checkpoint.every=2",
        "eval.every=2",
        "+eval.scorers.jpeg_compressibility={}",
        "eval.num_steps=2",
        "eval.num_prompts=2",
    ]
    real = trainer.train_step

    def crash_in_step_3(run, k, *stop):
        if k == 3:
            raise KeyboardInterrupt  # the process dies; nothing after the checkpoint of step 2 survives
        return real(run, k, *stop)

    monkeypatch.setattr(trainer, "train_step", crash_in_step_3)
    with pytest.raises(KeyboardInterrupt):
        launch(tmp_path / "run", *common)
    monkeypatch.setattr(trainer, "train_step", real)
    assert launch(tmp_path / "run", *common, "resume=auto")[0] == 0
    rows = [(m["step"], "eval" if "eval/jpeg_compressibility" in m else "train") for m in metrics(tmp_path / "run")]
    assert rows == [(0, "eval"), (0, "train"), (1, "train"), (2, "eval"), (2, "train"), (3, "train"), (4, "eval")]


def test_the_steps_trained_before_a_failure_are_saved(launch, tmp_path, monkeypatch):
    """A failure in step 2 (here: a bug) after two unsaved steps: step 2's checkpoint is written first."""
    real = trainer.train_step

    def fail_in_step_2(run, k, *stop):
        if k == 2:
            raise RuntimeError("the reward server went away")
        return real(run, k, *stop)

    monkeypatch.setattr(trainer, "train_step", fail_in_step_2)
    with pytest.raises(RuntimeError, match="the reward server went away"):
        launch(tmp_path / "run", "num_steps=4", "checkpoint.every=0")
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_00000002"]


@pytest.mark.slow
def test_sigterm_on_one_of_two_ranks(tiny_flux_dir, tmp_path):
    """2 gloo ranks; SIGTERM reaches rank 1 only. Both stop after the same step, write one checkpoint
    and exit; resume=auto then ends where the uninterrupted 2-rank run ends, bit for bit."""
    common = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=3", "checkpoint.every=0"]
    cases = {
        "straight": {"overrides": [*common, f"run_dir={tmp_path / 'straight'}"]},
        "stopped": {"overrides": [*common, f"run_dir={tmp_path / 'stopped'}"], "sigterm": {"rank": 1, "step": 0}},
        "resumed": {"overrides": [*common, f"run_dir={tmp_path / 'stopped'}", "resume=auto"]},
    }
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    result = run_torchrun(str(HELPERS / "reliability_worker.py"), str(tmp_path / "cases.json"), timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    outcome = json.loads((tmp_path / "outcome.json").read_text())
    assert outcome["stopped"] == {"0": "Preempted", "1": "Preempted"}, (outcome, result.stderr[-4000:])
    assert_same_run(tmp_path / "straight", tmp_path / "stopped", steps=3)


@pytest.mark.slow
@pytest.mark.long  # two torchrun ranks over several steps: make test-long
def test_a_failure_on_one_of_two_ranks_saves_the_steps_before_it(tiny_flux_dir, tmp_path):
    """Rank 1's reward raises in step 2 (0-based) after two unsaved steps: both ranks stop at the reward phase's
    check and write step 2's checkpoint together, then fail: rank 1 with its own error, rank 0 naming rank 1."""
    common = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=3", "checkpoint.every=0", "checkpoint.export=false"]
    common += [f"run_dir={tmp_path / 'run'}"]
    cases = {"failed": {"overrides": common, "fail": {"rank": 1, "step": 2}}}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    result = run_torchrun(str(HELPERS / "reliability_worker.py"), str(tmp_path / "cases.json"), timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    outcome = json.loads((tmp_path / "outcome.json").read_text())
    assert outcome == {"failed": {"0": "RankFailed", "1": "RuntimeError"}}, outcome
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_00000002"]
    assert [m["step"] for m in metrics(tmp_path / "run")] == [0, 1]


@pytest.mark.slow
def test_a_stopped_rank_makes_the_other_fail_naming_the_collective(tiny_flux_dir, tmp_path):
    """Two ``python -m train`` processes (gloo); once step 0 is logged, rank 1 is stopped (SIGSTOP). Rank 0
    fails after dist.timeout_s with one line naming the collective and what it was doing."""
    run_dir = tmp_path / "run"
    args = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=50", "dist.timeout_s=10", f"hydra.run.dir={run_dir}"]
    procs = start_ranks("-m", "train", *args)
    try:
        deadline = time.monotonic() + 300
        while not ((run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text()):
            assert time.monotonic() < deadline and procs[0].poll() is None, "step 0 never finished"
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, stderr = procs[0].communicate(timeout=120)
        waited = time.monotonic() - stopped_at
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert procs[0].returncode == 1, stderr
    line = the_error(stderr)
    assert re.search(r"the collective \w*(all_reduce|all_gather|broadcast|barrier|reduce_scatter)\w*", line), line
    assert re.search(r"during training step \d+, timed out after 10 s \(dist\.timeout_s\)", line), line
    assert 9 < waited < 60, waited
