"""A two-node rehearsal on one machine: two torchrun agents (``--nnodes 2``, c10d rendezvous on
127.0.0.1) of 2 gloo processes each, started by scripts/launch/multinode.sh as on a cluster, train
the tiny experiment as one process does; then a cluster's faults:

- a node lost (its agent and workers killed), no restarts: the other node fails within
  ``dist.timeout_s`` naming the collective, the checkpoints stay, and relaunching both nodes (the
  launcher's ``resume=auto``) ends where the uninterrupted run ends, bit for bit;
- a worker killed, with ``--max-restarts``: both agents restart their workers, which resume from the
  last checkpoint, and the run ends as the uninterrupted one does.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_folders import assert_same_run, metrics
from small_run import SMALL_RUN
from two_ranks import ROOT, env, free_port

pytestmark = [pytest.mark.slow, pytest.mark.long]  # four processes per run, several runs: make test-long

STEPS = 3  # a checkpoint per step; the faults come after the first, with steps left to run
TIMEOUT_S = 90  # dist.timeout_s: bounds the surviving node's wait for a lost one, and a loaded start-up's too
TINY = [
    *SMALL_RUN,
    "eval.every=0",
    f"num_steps={STEPS}",
    "checkpoint.every=1",
    f"dist.timeout_s={TIMEOUT_S}",
]


def overrides(tiny_flux_dir: Path, tiny_clip_dir: Path) -> list[str]:
    """The runs' settings: a CLIP reward, continuous in the images, so layouts agree to rounding."""
    reward = ["~reward.components.jpeg_compressibility", f"+reward.components.clipscore.model_path={tiny_clip_dir}"]
    return [f"model.path={tiny_flux_dir}", *TINY, *reward]


def start_nodes(run_dir: Path, args: list[str], *, restarts: int) -> list[subprocess.Popen]:
    """Both nodes' ``scripts/launch/multinode.sh tiny args``, each in its own session (a node to kill). Node 1
    starts once node 0's agent listens at the rendezvous endpoint: on one machine either agent can host the
    store (on a cluster only the first node, whose address it is), and the launchers' settings checks take
    unequal times; the node these tests kill must not be the store's host."""
    port = free_port()
    common = {
        **env(),
        "NNODES": "2",
        "NPROC_PER_NODE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RUN_DIR": str(run_dir),
        "MAX_RESTARTS": str(restarts),
        "TORCHRUN": str(Path(sys.executable).parent / "torchrun"),
        "PYTHON": sys.executable,  # the launcher's settings check before torchrun
    }

    def start(node: int) -> subprocess.Popen:
        return subprocess.Popen(
            ["bash", "scripts/launch/multinode.sh", "tiny", *args],
            cwd=ROOT,
            env={**common, "NODE_RANK": str(node)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    first = start(0)
    wait_for_listener(port, first)
    return [first, start(1)]


def wait_for_listener(port: int, node: subprocess.Popen, timeout: float = 180) -> None:
    """Until something accepts connections on 127.0.0.1:``port`` (node's torchrun agent, the store's host)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert node.poll() is None and time.monotonic() < deadline, node.communicate()[1][-3000:]
            time.sleep(0.2)


def finish(nodes: list[subprocess.Popen], timeout: float = 600) -> list[tuple[int, str]]:
    """(exit status, stderr) of each node; kills what is left on the way out."""
    out = []
    try:
        for node in nodes:
            _, stderr = node.communicate(timeout=timeout)
            out.append((node.returncode, stderr))
    finally:
        for node in nodes:
            kill_session(node)
    return out


def kill_session(node: subprocess.Popen) -> None:
    """Kill a node: the launcher's session and torchrun's workers, which torchrun starts in sessions of
    their own."""
    for pid in [*workers_of(agent_of(node)), node.pid] if node.poll() is None else []:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    node.wait()


def wait_for_checkpoint(run_dir: Path, step: int, nodes: list[subprocess.Popen], timeout: float = 400) -> None:
    marker = run_dir / "checkpoints" / f"step_{step:08d}"
    deadline = time.monotonic() + timeout
    while not marker.is_dir():
        assert all(node.poll() is None for node in nodes), [node.communicate()[1][-3000:] for node in nodes]
        assert time.monotonic() < deadline, f"no checkpoint of step {step} after {timeout} s"
        time.sleep(0.2)


def workers_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun's workers of an agent)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def agent_of(node: subprocess.Popen) -> int:
    """The torchrun agent the launcher's bash started (its child after the settings check)."""
    deadline = time.monotonic() + 120
    while not (agents := [pid for pid in workers_of(node.pid) if "torchrun" in _cmdline(pid)]):
        assert time.monotonic() < deadline and node.poll() is None, "the launcher started no torchrun"
        time.sleep(0.1)
    return agents[0]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # it ended meanwhile
        return ""


@pytest.fixture(scope="module")
def straight(tiny_flux_dir, tiny_clip_dir, tmp_path_factory) -> Path:
    """The uninterrupted two-node run."""
    run_dir = tmp_path_factory.mktemp("nodes") / "straight"
    results = finish(start_nodes(run_dir, overrides(tiny_flux_dir, tiny_clip_dir), restarts=0))
    for status, stderr in results:
        assert status == 0, stderr[-4000:]
    return run_dir


def test_two_nodes_train_as_one_process(straight, tiny_flux_dir, tiny_clip_dir, tmp_path, monkeypatch):
    from hydra import compose, initialize_config_module

    from train.loop.trainer import run
    from train.parts.config.schema import register_schema

    register_schema()
    one = tmp_path / "one"
    args = [*overrides(tiny_flux_dir, tiny_clip_dir), "batch.prompts_per_rank=4", "batch.gradient_accumulation_steps=8"]
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="train", overrides=["experiment=tiny", *args, f"run_dir={one}"])
    monkeypatch.chdir(ROOT)  # the tiny experiment's prompt file is relative to the repository root
    run(cfg)
    for a, b in zip(metrics(one), metrics(straight), strict=True):
        for key in ("train/loss", "reward/total", "train/grad_norm", "train/approx_kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)


def test_a_lost_node_fails_the_other_and_a_relaunch_resumes(straight, tiny_flux_dir, tiny_clip_dir, tmp_path):
    run_dir, args = tmp_path / "lost", overrides(tiny_flux_dir, tiny_clip_dir)
    nodes = start_nodes(run_dir, args, restarts=0)
    wait_for_checkpoint(run_dir, 1, nodes)
    lost_at = time.monotonic()
    kill_session(nodes[1])
    (status, stderr), _ = finish(nodes)
    waited = time.monotonic() - lost_at
    assert status != 0 and waited < TIMEOUT_S + 120, (status, waited)
    # each rank of node 0 prints its own line (rank N > 0 prefixed "[rank N] " by train/cli/reporting.py); torchrun's
    # agent stops the node's other workers 0.1 s after the first one exits, so under load only one rank may print
    lines = [line for line in stderr.splitlines() if re.match(r"(\[rank \d+\] )?python -m train: error: ", line)]
    assert lines and re.search(r"the collective \w+", lines[0]), stderr[-4000:]
    assert (run_dir / "checkpoints" / "step_00000001").is_dir()
    for status, stderr in finish(start_nodes(run_dir, args, restarts=0)):
        assert status == 0, stderr[-4000:]
    assert_same_run(straight, run_dir, steps=STEPS)


def test_a_killed_worker_restarts_both_nodes_and_the_run_ends_whole(straight, tiny_flux_dir, tiny_clip_dir, tmp_path):
    """With ``--max-restarts``, a worker killed on one node: both agents re-rendezvous and restart their
    workers, which resume from the last checkpoint (the launcher's ``resume=auto``); the run ends with one
    metrics row per step, equal to the uninterrupted run's."""
    run_dir, args = tmp_path / "restarted", overrides(tiny_flux_dir, tiny_clip_dir)
    nodes = start_nodes(run_dir, args, restarts=1)
    wait_for_checkpoint(run_dir, 1, nodes)
    worker = workers_of(agent_of(nodes[1]))[0]
    os.kill(worker, signal.SIGKILL)
    for status, stderr in finish(nodes):
        assert status == 0, stderr[-4000:]
    assert_same_run(straight, run_dir, steps=STEPS)
