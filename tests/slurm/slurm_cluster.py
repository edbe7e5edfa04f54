"""A real one-node Slurm cluster for the recipe's tests (tests/slurm/test_recipe.py): Debian's slurm-wlm and munge,
started as root (``started``, conftest.py's ``cluster`` fixture) with a configuration written into a folder of its
own (its own munge key and socket, ports picked free, CPU only: ``proctrack/linuxproc``, ``task/none``,
``select/cons_tres``, one node and one partition), all on loopback; stopped at the end, also when a test fails, and
checked to leave nothing running. ``make test-slurm`` installs slurm-wlm and munge where they are missing."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
DAEMONS = ("slurmd", "slurmctld", "munged")  # stopped in this order
TIMEOUT_S = 300.0  # a bound on every wait, far above what a wait takes (seconds), so that a hang fails


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def slurm_conf(folder: Path, host: str) -> str:
    ctld, slurmd = free_port(), free_port()
    return f"""ClusterName=jaggtest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmctldPort={ctld}
SlurmdPort={slurmd}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder}/socket/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
KillWait=60
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=cpu Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """The cluster in ``folder``: its commands (``run``), a job's fields (``job``), waits (``until``)."""

    def __init__(self, folder: Path):
        self.folder = folder
        # the jobs' environment, as a user's: the virtual environment active, no Slurm of another job
        clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
        self.env = {**clean, "PATH": path, "SLURM_CONF": str(folder / "slurm.conf")}

    def run(self, *command: str, cwd: Path = ROOT) -> str:
        done = subprocess.run(command, cwd=cwd, env=self.env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{' '.join(command)}: {done.stderr}"
        return done.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields: JobState, Restarts, ExitCode, Reason, ..."""
        return dict(re.findall(r"(\w+)=(\S*)", self.run("scontrol", "--oneliner", "show", "job", job_id)))

    def until(self, what: str, done: Callable[[], bool], job_id: str | None = None) -> None:
        """Wait for ``done()``; past TIMEOUT_S fail naming ``what`` (and the job's fields and log)."""
        deadline = time.monotonic() + TIMEOUT_S
        while not done():
            if time.monotonic() > deadline:
                detail = f"\n{self.job(job_id)}\n{self.log(job_id)}" if job_id else ""
                pytest.fail(f"no {what} after {TIMEOUT_S:.0f} s{detail}")
            time.sleep(0.2)

    def log(self, job_id: str) -> str:
        """The job's log (``slurm-<name>-<id>.out`` in the cluster's folder), appended across requeues."""
        (path,) = self.folder.glob(f"logs/*-{job_id}.out")
        return path.read_text()

    def idle(self) -> bool:
        """The node is up and runs no job: every process of the last one has ended."""
        done = subprocess.run(["sinfo", "--noheader", "--format", "%t"], env=self.env, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        return done.stdout.strip() == "idle"


def leftovers(folder: Path) -> list[str]:
    """The processes that name the cluster's folder in their command line or environment (daemons, jobs)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            seen = (proc / "cmdline").read_bytes() + (proc / "environ").read_bytes()
        except OSError:  # ended meanwhile, or not a process
            continue
        if proc.name.isdigit() and int(proc.name) != os.getpid() and str(folder).encode() in seen:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{proc.name} {command.strip()}")
    return found


def start(cluster: Cluster) -> None:
    folder, env = cluster.folder, cluster.env
    for name, mode in (("munge", 0o700), ("socket", 0o755), ("state", 0o755), ("spool", 0o755), ("logs", 0o755)):
        (folder / name).mkdir(mode=mode)
    cluster.run("mungekey", "--create", f"--keyfile={folder}/munge/key")
    cluster.run("munged", f"--socket={folder}/socket/munge", f"--key-file={folder}/munge/key",
                f"--pid-file={folder}/munged.pid", f"--seed-file={folder}/munge/seed",
                f"--log-file={folder}/munge/log")  # fmt: skip
    (folder / "slurm.conf").write_text(slurm_conf(folder, socket.gethostname().split(".")[0]))
    for daemon in ("slurmctld", "slurmd"):
        subprocess.run([daemon, "-f", env["SLURM_CONF"]], env=env, check=True, timeout=60)
    cluster.until(f"idle node (see {folder}/slurmctld.log and slurmd.log)", cluster.idle)


def stop(cluster: Cluster) -> None:
    """Every job cancelled and ended, then the daemons; then nothing of the cluster may be left running."""
    folder = cluster.folder
    try:
        if (folder / "slurmctld.pid").exists():
            subprocess.run(["scancel", "--user", "root"], env=cluster.env, timeout=60)
            cluster.until("end of the cluster's jobs", cluster.idle)
    finally:
        for daemon in DAEMONS:
            pid_file = folder / f"{daemon}.pid"
            if pid_file.exists():
                pid = int(pid_file.read_text())
                with contextlib.suppress(ProcessLookupError):  # a daemon that died already
                    os.kill(pid, signal.SIGTERM)
                gone = Path(f"/proc/{pid}")
                cluster.until(f"end of {daemon} (pid {pid})", lambda: not gone.exists())  # noqa: B023 (waited here)
    left = leftovers(folder)
    for line in left:  # nothing stays behind, even so
        os.kill(int(line.split()[0]), signal.SIGKILL)
    assert not left, f"still running after the cluster stopped: {left}"


@contextlib.contextmanager
def started() -> Iterator[Cluster]:
    """A cluster for the duration of the block, in a folder of its own, stopped and removed after it."""
    if os.geteuid() != 0:
        pytest.fail("the Slurm tests start slurmctld, slurmd and munged as root: run make test-slurm as root")
    missing = [tool for tool in TOOLS if not shutil.which(tool)]
    if missing:
        pytest.fail(f"{', '.join(missing)} not found: make test-slurm installs slurm-wlm and munge (apt-get)")
    # not under pytest's 0700 folders: munged wants its socket's folder and those above it open to all
    folder = Path(tempfile.mkdtemp(prefix="jagg-slurm-"))
    folder.chmod(0o755)
    cluster = Cluster(folder)
    try:
        start(cluster)
        yield cluster
    finally:
        try:
            stop(cluster)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
