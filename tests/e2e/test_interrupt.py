"""Ctrl+C: the first one finishes the step, writes a checkpoint and stops (as SIGTERM does); a second one
stops at once, saying what was not saved; copies of one Ctrl+C (the terminal's and torchrun's) count
once; before training it is one line, not a traceback; under torchrun the same; a signal during a served reward's
request stops it at once, inside torchrun's grace."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import small_run
from run_folders import ROOT, metrics
from two_ranks import env, torchrun

import train.loop.trainer as trainer
from train.distributed import preemption
from train.parts.policy import builder

FAST = [*small_run.FAST, "checkpoint.export=false"]


pytestmark = pytest.mark.usefixtures("repo_root")  # the tiny experiment's prompt file is relative to the repository


def train(capsys, run_dir: Path, *overrides: str) -> tuple[int, str]:
    """``python -m train`` in this process: (exit status, stderr and then stdout)."""
    status, stderr, stdout = small_run.command(capsys, run_dir, [*FAST, *overrides], stdout=True)
    return status, stderr + stdout


def ctrl_c_in(monkeypatch, steps: dict[int, int]) -> None:
    """During training step k, ``steps[k]`` SIGINTs to this process, as a terminal sends Ctrl+C."""
    real = trainer.train_step

    def step_then_signal(run, k, *stop):
        out = real(run, k, *stop)
        for _ in range(steps.get(k, 0)):
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(trainer, "train_step", step_then_signal)


def test_first_ctrl_c_checkpoints_and_two_at_once_count_once(tiny_flux_dir, tmp_path, capsys, monkeypatch):
    """Ctrl+C printed a KeyboardInterrupt traceback and wrote nothing; two SIGINTs within REPEAT_S (the
    terminal's and torchrun's copies of one Ctrl+C) are one request."""
    ctrl_c_in(monkeypatch, {1: 2})
    status, stderr = train(capsys, tmp_path / "run", f"model.path={tiny_flux_dir}", "num_steps=4")
    line = small_run.the_error(stderr, kind="stopped")
    assert status == 130 and "Ctrl+C (SIGINT): wrote checkpoint" in line and "after step 2" in line, stderr
    assert "resume=auto" in line and "Ctrl+C again stops at once" in stderr
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_00000002"]


def test_second_ctrl_c_stops_at_once_naming_the_unsaved_steps(tiny_flux_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(preemption, "REPEAT_S", 0.0)  # the second SIGINT below is the user's second Ctrl+C
    ctrl_c_in(monkeypatch, {0: 1, 1: 1})
    # nobody asks the loop to stop: training goes on after the first Ctrl+C, until the second
    monkeypatch.setattr(preemption.Preemption, "requested", lambda self, device, folder_lost=False: (0, folder_lost))
    overrides = [f"model.path={tiny_flux_dir}", "num_steps=4", "checkpoint.every=1"]
    status, stderr = train(capsys, tmp_path / "run", *overrides)
    line = small_run.the_error(stderr, kind="stopped")
    assert status == 130 and "a second Ctrl+C stopped training step 1 at once" in line, line
    assert "step 1 was not saved" in line and "step_00000001 (after step 1)" in line, line


def test_ctrl_c_before_training_is_one_line(tiny_flux_dir, tmp_path, capsys, monkeypatch):
    real = builder.build_backbone

    def load_then_ctrl_c(*args):
        backbone = real(*args)
        os.kill(os.getpid(), signal.SIGINT)
        return backbone

    monkeypatch.setattr(builder, "build_backbone", load_then_ctrl_c)
    status, stderr = train(capsys, tmp_path / "run", f"model.path={tiny_flux_dir}", "num_steps=2")
    line = small_run.the_error(stderr, kind="stopped")
    assert status == 130 and "Ctrl+C during start-up: the command ended there" in line


@pytest.mark.slow
def test_ctrl_c_under_torchrun_checkpoints_on_both_ranks(tiny_flux_dir, tmp_path):
    """torchrun's agent gets SIGINT and forwards it to its 2 workers, which finish the step, write one
    checkpoint and exit (the agent then reports the workers' failure)."""
    run_dir = tmp_path / "run"
    args = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=200", f"hydra.run.dir={run_dir}"]
    agent = subprocess.Popen(
        torchrun("-m", "train", *args), cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 240
    while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text().strip():
        assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()[1][-3000:]
        time.sleep(0.5)
    agent.send_signal(signal.SIGINT)
    _, stderr = agent.communicate(timeout=120)
    checkpoints = [p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.endswith(".tmp")]
    assert len(checkpoints) == 1, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("python -m train: stopped: Ctrl+C (SIGINT)")]
    assert len(lines) == 1 and checkpoints[0] in lines[0], stderr[-3000:]
    assert "Traceback" not in stderr.split("python -m train: stopped:")[0], stderr[-3000:]


@pytest.mark.slow
def test_ctrl_c_while_a_served_reward_is_mid_request_leaves_no_thread_and_resumes_exactly(
    tiny_flux_dir, tmp_path, capsys
):
    """The rollout in chunks of one group, a served reward (a slow stand-in server) scoring each chunk in the
    background; Ctrl+C arrives while step 1's first request is in flight: the step's requests stop (its second
    chunk is never asked), the step ends untrained, the checkpoint of step 0 is written, no worker thread is left,
    and resume=auto runs step 1 again and ends where the uninterrupted run ends, bit for bit."""
    pytest.importorskip("fastapi")
    from reward_servers import FAKE, fake_server, serve

    def good(count):
        return {"scores": [0.25 * i for i in range(count)], **FAKE}

    def ctrl_c_then_good(count):
        os.kill(os.getpid(), signal.SIGINT)
        return good(count)

    chunked = ["batch.prompts_per_rank=2", "reward.chunk_groups=1", f"model.path={tiny_flux_dir}", "num_steps=3"]
    with serve(fake_server(good, delay_s=0.2)) as url:
        served = [*chunked, f"+reward.components.remote={{url: '{url}', timeout_s: 10, retries: 0}}"]
        assert train(capsys, tmp_path / "straight", *served)[0] == 0
    # requests 0 and 1 score step 0's two chunks; request 2, step 1's first, brings the Ctrl+C
    with serve(fake_server(good, good, ctrl_c_then_good, good, delay_s=0.2), port=int(url.rsplit(":", 1)[1])):
        status, stderr = train(capsys, tmp_path / "stopped", *served)
        line = small_run.the_error(stderr, kind="stopped")
        assert status == 130 and "of step 1, which is not trained" in line and "after step 1" in line, stderr
        assert [t.name for t in threading.enumerate() if t.name.startswith("reward-")] == []
        assert train(capsys, tmp_path / "stopped", *served, "resume=auto")[0] == 0
    straight, resumed = metrics(tmp_path / "straight"), metrics(tmp_path / "stopped")
    assert [row["step"] for row in resumed] == [0, 1, 2]
    for a, b in zip(straight, resumed):
        for key in ("train/loss", "reward/total", "reward/remote", "adv/std", "train/grad_norm"):
            assert a[key] == b[key], (a["step"], key)


@pytest.mark.slow
def test_sigterm_under_torchrun_while_a_served_reward_hangs_ends_within_torchruns_grace(tiny_flux_dir, tmp_path):
    """torchrun with 2 workers, the reward server answering /health and never /score (a request's deadline 120 s):
    once both ranks' requests of step 0 are in flight, SIGTERM to torchrun's agent, which forwards it and kills
    its workers 30 s later (its --shutdown-timeout): both stop their requests at once, end step 0 untrained
    together and exit with their own "stopped" line well inside the 30 s. Before, each worker waited for its
    request's deadline (120 s), and the agent killed them first without a line."""
    from reward_servers import FAKE, hung_server

    run_dir = tmp_path / "run"
    with hung_server(FAKE) as (url, posted):
        remote = f"+reward.components.remote={{url: '{url}', timeout_s: 120, retries: 0}}"
        args = [*FAST, f"model.path={tiny_flux_dir}", remote, f"hydra.run.dir={run_dir}"]
        agent = subprocess.Popen(
            torchrun("-m", "train", *args), cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 240
        while len(posted) < 2:  # each rank's first request of step 0
            assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()[1][-3000:]
            time.sleep(0.2)
        agent.send_signal(signal.SIGTERM)
        start = time.monotonic()
        _, stderr = agent.communicate(timeout=120)
        elapsed = time.monotonic() - start
    grace_s = 30  # torchrun's default --shutdown-timeout
    stopped = "python -m train: stopped: SIGTERM during the served rewards of step 0, which is not trained: "
    assert stderr.count(stopped + "no step was trained yet") == 1 and elapsed < grace_s / 2, (elapsed, stderr[-3000:])
    assert len(posted) == 2
