"""Local gloo ranks (two unless told) for the multi-process tests: a free port and torchrun's command line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HELPERS = Path(__file__).resolve().parent  # the worker scripts and their modules


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(*args: str, nproc: int = 2) -> list[str]:
    """``python -m torch.distributed.run`` with ``nproc`` processes on a free port, then ``args``."""
    port = str(free_port())
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", port, *args]


def env() -> dict[str, str]:
    """One thread per rank (2 ranks share 2 cores), no model hub, the repository importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{HELPERS}"}


def run_torchrun(*args: str, timeout: float, nproc: int = 2) -> subprocess.CompletedProcess:
    """Run ``torchrun(*args, nproc=nproc)`` from the repository root and capture its output."""
    cmd = torchrun(*args, nproc=nproc)
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)


def start_ranks(*args: str, nproc: int = 2) -> list[subprocess.Popen]:
    """``python args`` as ``nproc`` ranks of one world, each started by hand (torchrun would stop the others once one
    fails), their output piped."""
    port = str(free_port())
    return [
        subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env={
                **env(),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(nproc)
    ]


def run_ranks(*args: str, timeout: float, nproc: int = 2) -> list[subprocess.CompletedProcess]:
    """``start_ranks(*args)``: each rank's exit status and output, once all have ended (killed after ``timeout``
    seconds)."""
    procs = start_ranks(*args, nproc=nproc)
    try:
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return [
        subprocess.CompletedProcess(proc.args, proc.returncode, out, err) for proc, (out, err) in zip(procs, outputs)
    ]
