"""scripts/launch/slurm.sbatch on a real one-node Slurm cluster (slurm_cluster.py), as docs/clusters.md tells a
user to submit its check of the setup (the demo, CPU, one process), a few steps, with sbatch. A job preempted by the
recipe's own signal path writes its checkpoint, is requeued, resumes and ends bit for bit where an uninterrupted
run of the same settings ends; a job cancelled with scancel writes its checkpoint and stays cancelled; a job refused
for a bad setting fails once, not requeued. make test-slurm runs them (as root; it installs slurm-wlm and munge)."""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path

import pytest
from run_folders import assert_same_run, metrics
from slurm_cluster import ROOT, Cluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

NUM_STEPS = 5
# a few steps of the demo, a checkpoint after each, no evaluation (the settings docs/clusters.md's job takes)
SHORT = [f"num_steps={NUM_STEPS}", "checkpoint.every=1", "eval.every=0"]
CLOCKS = ("wall_time", "time/", "perf/")  # what a replay cannot repeat: the clocks and the rates taken from them


def documented_check() -> list[str]:
    """The command docs/clusters.md gives for a check of the setup (CPU, one process)."""
    (line,) = [ln for ln in (ROOT / "docs/clusters.md").read_text().splitlines() if "a check of the setup" in ln]
    return shlex.split(line, comments=True)


def submit(cluster: Cluster, name: str, *overrides: str) -> tuple[str, Path]:
    """The documented command, named ``name``, its run folder and log in the cluster's folder: the job id and run."""
    command = documented_check()
    script = command.index("scripts/launch/slurm.sbatch")
    run_dir = cluster.folder / "runs" / name
    ours = ["-J", name, f"--output={cluster.folder}/logs/%x-%j.out", f"--export=ALL,RUN_DIR={run_dir}"]
    out = cluster.run(*command[:script], *ours, *command[script:], *overrides)
    (job_id,) = re.findall(r"^Submitted batch job (\d+)$", out, re.M)
    return job_id, run_dir


def ended(cluster: Cluster, job_id: str) -> dict[str, str]:
    """The job's fields once it has ended and every process of it with it (the node idle again)."""
    cluster.until("end of the job", lambda: cluster.job(job_id)["JobState"] not in ("PENDING", "RUNNING")
                  and cluster.idle(), job_id)  # fmt: skip
    return cluster.job(job_id)


def after_first_step(cluster: Cluster, job_id: str, run_dir: Path) -> None:
    """Wait for the job to log its first training step (its model loaded, the loop under way)."""
    rows = run_dir / "metrics.jsonl"
    cluster.until("first training step", lambda: rows.exists() and rows.read_text().count("\n") >= 1, job_id)


def show(cluster: Cluster, job_id: str, what: str) -> None:
    """The job's fields and log, without its progress bar (make test-slurm prints them: pytest -rP)."""
    fields = cluster.job(job_id)
    print(f"job {job_id} {fields['JobName']}: {what}: JobState={fields['JobState']} Reason={fields['Reason']} "
          f"Restarts={fields['Restarts']} ExitCode={fields['ExitCode']}")  # fmt: skip
    lines = cluster.log(job_id).replace("\r", "\n").splitlines()
    print("\n".join(f"  | {line}" for line in lines if line and not line.startswith("train:")))


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").iterdir())


def assert_stopped_on_sigterm(log: str, run_dir: Path) -> int:
    """The log of a job stopped by SIGTERM: a checkpoint after the step in flight, and no traceback. Its step."""
    (step,) = re.findall(rf"stopped: SIGTERM: wrote checkpoint {run_dir}/checkpoints/step_(\d+) after step", log)
    assert "torchrun stopped on SIGTERM after its workers" in log and "Traceback" not in log, log
    assert 0 < int(step) < NUM_STEPS, log  # stopped during training, before its last step
    return int(step)


@pytest.fixture(scope="module")
def straight(cluster: Cluster) -> Path:
    """The uninterrupted run of the settings the stopped jobs run."""
    job_id, run_dir = submit(cluster, "straight", *SHORT)
    fields = ended(cluster, job_id)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "0"), cluster.log(
        job_id
    )
    show(cluster, job_id, "uninterrupted")
    return run_dir


def test_a_preempted_job_checkpoints_is_requeued_and_resumes_bit_for_bit(cluster, straight):
    job_id, run_dir = submit(cluster, "preempted", *SHORT)
    after_first_step(cluster, job_id, run_dir)
    # what --signal=B:TERM@<grace> does before the time limit: SIGTERM to the batch shell only
    cluster.run("scancel", "--batch", "--signal=TERM", job_id)
    cluster.until("requeue", lambda: cluster.job(job_id)["Restarts"] == "1", job_id)
    cluster.until("pending requeued job", lambda: cluster.job(job_id)["JobState"] == "PENDING", job_id)
    log = cluster.log(job_id)
    step = assert_stopped_on_sigterm(log, run_dir)
    assert f"requeueing job {job_id}" in log and checkpoint_steps(run_dir)[-1] == step
    assert [row["step"] for row in metrics(run_dir)] == list(range(step))
    show(cluster, job_id, f"SIGTERM to the batch shell, checkpoint after step {step}, requeued")
    # a requeued job may start only some two minutes later (Reason=BeginTime): once every process of its first
    # start has ended, moved to now instead of waiting
    cluster.until("end of the first start", cluster.idle, job_id)
    # slurmd refuses a job whose credential is as old as its last revocation, in whole seconds ("Job credential
    # revoked": the requeue revokes it): started in the second of its requeue, the job would fail at once
    time.sleep(1.1 - time.time() % 1)
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    fields = ended(cluster, job_id)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "1"), cluster.log(
        job_id
    )
    assert f"resumed from {run_dir}/checkpoints/step_{step:08d} at step {step}" in cluster.log(job_id)
    assert_same_run(straight, run_dir, NUM_STEPS)  # its loss, reward and gradient norm, and its export
    for a, b in zip(metrics(straight), metrics(run_dir), strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(CLOCKS)} == {
            k: v for k, v in b.items() if not k.startswith(CLOCKS)
        }
    show(cluster, job_id, f"resumed, its {NUM_STEPS} rows and export those of the uninterrupted run")


def test_a_cancelled_job_checkpoints_and_stays_cancelled(cluster):
    job_id, run_dir = submit(cluster, "cancelled", *SHORT)
    after_first_step(cluster, job_id, run_dir)
    cluster.run("scancel", job_id)
    fields = ended(cluster, job_id)
    log = cluster.log(job_id)
    step = assert_stopped_on_sigterm(log, run_dir)
    assert checkpoint_steps(run_dir)[-1] == step and len(metrics(run_dir)) == step
    # the batch shell decides on a requeue before it ends: the ended job's state is final
    assert (fields["JobState"], fields["Restarts"]) == ("CANCELLED", "0"), fields
    assert f"not requeued: job {job_id} was" in log and "scancel: error" not in log, log  # nothing signalled again
    show(cluster, job_id, f"scancel, checkpoint after step {step}, not requeued")


def test_a_job_refused_for_a_bad_setting_fails_once_and_is_not_requeued(cluster):
    job_id, run_dir = submit(cluster, "refused", "num_steps=0")
    fields = ended(cluster, job_id)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("FAILED", "2:0", "0"), fields
    log = cluster.log(job_id)
    assert "python -m train: error: num_steps must be > 0, got 0" in log, log
    assert "torchrun" not in log and not run_dir.exists()  # refused before torchrun, nothing written
    show(cluster, job_id, "refused")
