"""One run per folder and the run folder's lock (train/run/folder.py), with a clock of the test's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from train.run.errors import ConfigError
from train.run.folder import FolderInUse, RunLock, check_one_run, clear_run, held_run
from train.run.layout import RunLayout


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def dead_pid():
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_lock(folder, *, host: str, pid: int, renewed: float) -> None:
    RunLayout(folder).lock.write_text(json.dumps({"host": host, "pid": pid, "renewed": renewed}))


def test_a_live_holder_on_this_host_is_named(tmp_path):
    clock = Clock()
    RunLock(tmp_path, clock=clock, host="here", pid=os.getppid()).acquire()  # a live process that is not us
    with pytest.raises(FolderInUse, match=rf"in use by pid {os.getppid()} on host here \(its lock .*LOCK was renewed"):
        RunLock(tmp_path, clock=clock, host="here").acquire()


def test_a_dead_holder_on_this_host_is_taken_over(tmp_path, dead_pid):
    clock = Clock()
    write_lock(tmp_path, host="here", pid=dead_pid, renewed=clock.now)  # renewed just now, but its process is gone
    lock = RunLock(tmp_path, clock=clock, host="here")
    lock.acquire()
    assert lock.holder() is not None and lock.holder().pid == os.getpid()


def test_a_holder_on_another_host_holds_until_its_lease_runs_out(tmp_path):
    clock = Clock()
    write_lock(tmp_path, host="elsewhere", pid=1, renewed=clock.now)
    lock = RunLock(tmp_path, clock=clock, host="here", lease_s=60)
    clock.now += 59
    with pytest.raises(FolderInUse, match=r"pid 1 on host elsewhere .* renewed 59 s ago"):
        lock.acquire()
    clock.now += 2  # 61 s without a renewal: the holder (its node) is taken for dead
    lock.acquire()
    assert lock.holder().host == "here"


def test_renewal_keeps_the_lease_and_release_removes_the_lock(tmp_path):
    clock = Clock()
    lock = RunLock(tmp_path, clock=clock, host="here", lease_s=60)
    lock.acquire()
    other = RunLock(tmp_path, clock=clock, host="elsewhere", lease_s=60)
    clock.now += 50
    assert lock.renew()
    clock.now += 50  # 100 s after the first write, 50 s after the renewal: still held
    assert other.busy() is not None
    lock.release()
    assert not RunLayout(tmp_path).lock.exists() and other.busy() is None


def test_a_lock_taken_over_is_not_renewed_nor_removed(tmp_path):
    clock = Clock()
    mine = RunLock(tmp_path, clock=clock, host="a", lease_s=60)
    mine.acquire()
    clock.now += 100
    RunLock(tmp_path, clock=clock, host="b", lease_s=60).acquire()
    assert not mine.renew()
    mine.release()
    assert mine.holder().host == "b"


def test_the_renewing_thread_renews_and_stops(tmp_path):
    lock = RunLock(tmp_path, lease_s=0.3)  # renews every 0.1 s
    lock.acquire()
    first = lock.holder().renewed
    lock.start_renewing()
    for _ in range(200):  # generous: the thread may be slow to run on a loaded machine
        if lock.holder().renewed > first:
            break
        lock._stop.wait(0.05)
    assert lock.holder().renewed > first
    lock.release()
    assert not RunLayout(tmp_path).lock.exists()


def test_a_folder_with_a_run_is_refused_unless_resumed_or_overwritten(tmp_path):
    assert held_run(tmp_path) is None
    (tmp_path / ".hydra").mkdir()
    (tmp_path / "__main__.log").write_text("a refused launch\n")
    check_one_run(tmp_path, resume=None, overwrite=False)  # Hydra's files alone are no run
    (tmp_path / "checkpoints" / "step_00000003").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    assert held_run(tmp_path) == "1 checkpoint (the latest step_00000003), 2 rows of metrics.jsonl"
    with pytest.raises(ConfigError, match=r"already holds a run .*resume=auto.*checkpoint\.overwrite=true"):
        check_one_run(tmp_path, resume=None, overwrite=False)
    check_one_run(tmp_path, resume="auto", overwrite=False)
    check_one_run(tmp_path, resume=None, overwrite=True)
    clear_run(tmp_path)
    assert held_run(tmp_path) is None and (tmp_path / ".hydra").is_dir() and (tmp_path / "__main__.log").is_file()
