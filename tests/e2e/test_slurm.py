"""scripts/launch/slurm.sbatch without Slurm: its DRY_RUN lines (the job's SLURM_* variables set by hand, a
stand-in scontrol reading the node list), and its batch shell's answer to SIGTERM, with stand-ins for srun,
scancel, scontrol and torchrun that record what they were asked to do (and for the settings check's python)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "scripts/launch/slurm.sbatch"
# not set on the machine that runs the tests either: the paths of common.sh, a node rank, Slurm's own
UNSET = ("_PATH", "_CKPT", "_PROMPTS", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "RUN_DIR", "NNODES")


def tool(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


def job_env(folder: Path, **env: str) -> dict[str, str]:
    """The environment of a job of 2 nodes, gpu07 and gpu08, with the stand-ins of ``folder`` first on PATH."""
    clean = {k: v for k, v in os.environ.items() if not k.endswith(UNSET) and not k.startswith("SLURM_")}
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "flux2n", "SLURM_JOB_NUM_NODES": "2",
             "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_CPUS_ON_NODE": "96"}  # fmt: skip
    return {**clean, **slurm, "PATH": f"{folder}:{os.environ['PATH']}", **env}


@pytest.fixture
def fakes(tmp_path) -> Path:
    """scontrol that expands the node list gpu[07-08], and records every other call."""
    tool(tmp_path, "scontrol", 'if [[ "$*" == "show hostnames gpu[07-08]" ]]; then printf "gpu07\\ngpu08\\n"; '
         'else echo "scontrol $*" >> "$FAKES/events"; fi\n')  # fmt: skip
    return tmp_path


def dry_run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, env={**env, "DRY_RUN": "1"},
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done


def test_dry_run_prints_one_torchrun_per_node_meeting_on_the_first_node(fakes):
    done = dry_run(job_env(fakes), "flux_dance", "update=exact")
    lines = done.stdout.splitlines()
    assert len(lines) == 2  # one torchrun per node
    for rank, line in enumerate(lines):
        words = line.split()
        assert words[0] == "torchrun" and words[words.index("--node_rank") + 1] == str(rank)
        assert words[words.index("--nnodes") + 1] == "2" and words[words.index("--rdzv_backend") + 1] == "c10d"
        assert words[words.index("--rdzv_endpoint") + 1] == "gpu07:24242"  # the first node; port 20000 + id % 20000
        assert words[words.index("--nproc_per_node") + 1] == "8"
        # the run folder: one per job name, so a requeued job continues it
        assert {"hydra.run.dir=runs/slurm/flux2n", "resume=auto", "update=exact"} <= set(words)
    (srun,) = done.stderr.splitlines()  # how the batch shell starts them: one task per node
    assert srun.split() == ["srun", "--nodes", "2", "--ntasks-per-node", "1", "--cpus-per-task", "96",
                            "--kill-on-bad-exit=1", "bash", f"{ROOT}/{SCRIPT}", "--node", "flux_dance",
                            "runs/slurm/flux2n", "update=exact"]  # fmt: skip


def test_dry_run_of_one_node_and_the_settings_it_takes(fakes):
    env = job_env(fakes, SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="gpu07", RUN_DIR="/shared/runs/demo")
    (line,) = dry_run({**env, "MAX_RESTARTS": "0", "NPROC_PER_NODE": "2"}, "demo", "resume=null").stdout.splitlines()
    words = line.split()
    assert words[:6] == ["torchrun", "--standalone", "--max-restarts", "0", "--nproc_per_node", "2"]
    assert "hydra.run.dir=/shared/runs/demo" in words and [w for w in words if "resume=" in w] == ["resume=null"]
    # outside a job, the values Slurm would give print as placeholders
    no_slurm = {k: v for k, v in env.items() if not k.startswith("SLURM_") and k != "RUN_DIR"}
    (line,) = dry_run(no_slurm, "demo").stdout.splitlines()
    assert "'hydra.run.dir=runs/slurm/<SLURM_JOB_NAME>'" in line.split()


def test_the_grace_is_the_same_for_slurm_and_torchrun():
    """--signal's seconds are GRACE_S, which torchrun is given as its shutdown timeout (the checkpoint's time)."""
    text = (ROOT / SCRIPT).read_text()
    directives = re.findall(r"^#SBATCH (\S+)", text, re.M)
    assert "--requeue" in directives and "--ntasks-per-node=1" in directives
    (grace,) = [d.removeprefix("--signal=B:TERM@") for d in directives if d.startswith("--signal=")]
    assert f'GRACE_S="${{GRACE_S:-{grace}}}"' in text
    assert 'TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-$GRACE_S}"' in text


def start_job(fakes: Path, torchrun: str, **env: str) -> subprocess.Popen:
    """The batch shell with stand-ins: srun runs the node's command itself (node 0); torchrun is ``torchrun``
    (its pid in torchrun.pid); scancel records its call and signals torchrun and the shell around it
    (``signal_step``), as Slurm signals every process of a step."""
    tool(fakes, "srun", 'while [[ "$1" != bash ]]; do shift; done\nSLURM_NODEID=0 exec "$@"\n')
    # the settings check before torchrun passes (tests/e2e/test_faults_mistakes.py); the filter of the node's
    # stderr is the real interpreter's
    tool(fakes, "python", f'[[ "$1 $2" == "-m train.cli.check" ]] && exit 0\nexec {sys.executable} "$@"\n')
    tool(fakes, "torchrun", 'echo $$ > "$FAKES/torchrun.pid"\n' + torchrun)
    tool(fakes, "signal_step", 'pid=$(cat "$FAKES/torchrun.pid")\n'
         'kill -TERM "$pid" "$(cut -d" " -f4 /proc/$pid/stat)"\n')  # fmt: skip
    tool(fakes, "scancel", 'echo "scancel $*" >> "$FAKES/events"\nsignal_step\n')
    tool(fakes, "squeue", '[[ "$*" == "--noheader --jobs 4242 --format %T" ]] && echo "$JOB_STATE"\n')
    full = job_env(fakes, SLURM_JOB_NUM_NODES="1", FAKES=str(fakes), TORCHRUN=str(fakes / "torchrun"),
                   **{"JOB_STATE": "RUNNING", **env})  # fmt: skip
    return subprocess.Popen(["bash", SCRIPT, "demo"], cwd=ROOT, env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def events(fakes: Path) -> list[str]:
    path = fakes / "events"
    return path.read_text().splitlines() if path.exists() else []


# torchrun's last words on SIGTERM, and those of a crash (torch 2.14's traceback, its middle left out)
TRACEBACK = 'Traceback (most recent call last):\n  File "/venv/bin/torchrun", line 8, in <module>\n    main()\n'
SIGNALLED = "torch.distributed.elastic.multiprocessing.api.SignalException: Process 7 got signal: 15"
CRASHED = "ValueError: a bug"
# torchrun as it answers SIGTERM: its workers write a checkpoint (here: 1 s) and end the progress bar's line
# (its steps end in a carriage return), then it ends in its traceback, status 1
STOPS = ("trap 'sleep 1; echo \"checkpoint written\" >> \"$FAKES/events\"; "
         "printf \"\\n%s\" \"$LAST_WORDS\" >&2; exit 1' TERM\n"
         "while true; do printf '\\rtrain: step' >&2; sleep 0.1; done\n")  # fmt: skip


@pytest.mark.parametrize(
    "state, restarts, requeued, why",
    [
        ("RUNNING", "0", True, "requeueing job 4242"),  # --signal's notice before the time limit, a preemption
        ("RUNNING", "20", False, "not requeued: job 4242 ran 20 times (MAX_REQUEUES)"),
        ("COMPLETING", "0", False, "not requeued: job 4242 was COMPLETING (cancelled)"),  # scancel
    ],
)
def test_sigterm_reaches_torchrun_once_and_the_stopped_job_is_requeued(fakes, state, restarts, requeued, why):
    job = start_job(fakes, STOPS, SLURM_RESTART_COUNT=restarts, JOB_STATE=state,
                    LAST_WORDS=f"{TRACEBACK}{SIGNALLED}\n")  # fmt: skip
    deadline = time.monotonic() + 60
    while not (fakes / "torchrun.pid").exists():
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.1)
    if state != "RUNNING":  # scancel: Slurm signals every step itself, and the batch shell
        subprocess.run(["bash", str(fakes / "signal_step")], env={**os.environ, "FAKES": str(fakes)}, check=True)
    job.send_signal(signal.SIGTERM)  # Slurm's --signal=B:TERM@<grace>: the batch shell only
    time.sleep(0.3)
    job.send_signal(signal.SIGTERM)  # a second notice (a preemption) is not forwarded again
    _, err = job.communicate(timeout=60)
    # the shell around torchrun waited for it: the job's status is torchrun's, after the checkpoint
    assert job.returncode == 1, err
    forward = ["scancel --signal=TERM 4242"] if state == "RUNNING" else []  # a cancelled job is no longer there
    requeue = ["scontrol requeue 4242"] if requeued else []
    assert events(fakes) == [*forward, "checkpoint written", *requeue]
    assert why in err
    # torchrun's answer to SIGTERM is one line, not its traceback; the progress bar came through
    assert "torchrun stopped on SIGTERM after its workers" in err and "Traceback" not in err
    assert "train: step" in err


def test_a_job_that_ends_by_itself_is_not_requeued_and_its_traceback_is_kept(fakes):
    job = start_job(fakes, f"printf %s '{TRACEBACK}{CRASHED}' >&2\nexit 3\n")  # a bug: a requeue would repeat it
    _, err = job.communicate(timeout=60)
    assert job.returncode == 3 and events(fakes) == []
    assert f"{TRACEBACK}{CRASHED}" in err
