"""One run per folder and the run folder's lock (train/run/folder.py), with a clock of the test's own; the take-back
of a refused launch (train/cli/launch.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading

import pytest

import train.cli.launch as launch_module
from train.cli.launch import Launch
from train.ground.errors import ConfigError
from train.ground.layout import RunLayout
from train.run.folder import FolderInUse, RunLock, check_one_run, clear_run, held_run


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


def test_the_holders_own_lease_decides_when_it_is_taken_for_dead(tmp_path):
    """A holder with a 2 s lease on another host is taken over 2 s after its last renewal, whatever the taker's
    own lease."""
    clock = Clock()
    RunLock(tmp_path, clock=clock, host="elsewhere", pid=1, lease_s=2).acquire()
    taker = RunLock(tmp_path, clock=clock, host="here", lease_s=60)
    clock.now += 1
    with pytest.raises(FolderInUse, match=r"or 2 s after its last renewal"):
        taker.acquire()
    clock.now += 2
    taker.acquire()
    assert taker.holder().host == "here"


def test_a_holder_whose_lock_was_taken_over_finds_it_lost(tmp_path):
    """Suspended past its lease: another host takes the folder; the holder's renewal leaves the new lock alone,
    and ``lost`` names the new holder, then (once that one released it) says the lock is gone."""
    clock = Clock()
    mine = RunLock(tmp_path, clock=clock, host="a", pid=1, lease_s=2)
    mine.acquire()
    assert mine.lost() is None
    clock.now += 3
    other = RunLock(tmp_path, clock=clock, host="b", pid=2, lease_s=2)
    other.acquire()
    assert not mine.renew() and other.holder().host == "b"
    assert re.search(r"is no longer this run's: .*pid 2 on host b holds it now; stopped before writing", mine.lost())
    other.release()
    assert "it was removed" in mine.lost()


def test_of_starters_that_meet_exactly_one_owns_the_folder(tmp_path):
    """Eight starters of eight hosts at once (threads past one barrier): the lock is created atomically, so one
    acquires it and the seven others are refused naming it."""
    starters = [RunLock(tmp_path, host=f"host{i}", pid=i + 1) for i in range(8)]
    barrier, won, refused = threading.Barrier(len(starters)), [], []

    def start(lock: RunLock) -> None:
        barrier.wait()
        try:
            lock.acquire()
            won.append(lock.me)
        except FolderInUse:
            refused.append(lock.me)

    threads = [threading.Thread(target=start, args=(lock,)) for lock in starters]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    holder = starters[0].holder()
    assert len(won) == 1 and len(refused) == 7 and won[0] == (holder.host, holder.pid)


def test_a_stale_lock_is_taken_over_once(tmp_path, dead_pid):
    write_lock(tmp_path, host="here", pid=dead_pid, renewed=0.0)
    winner = RunLock(tmp_path, host="here", pid=os.getppid())  # alive, not this process
    winner.acquire()
    with pytest.raises(FolderInUse, match=rf"in use by pid {os.getppid()}"):
        RunLock(tmp_path, host="here").acquire()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LOCK"]  # no file of the takeover left behind


def test_a_launch_refused_in_a_race_leaves_the_folder_it_made_to_the_winner(tmp_path, monkeypatch):
    """This launch made the run folder; the winner took its lock and wrote there before this launch asked for
    it: the refusal takes back nothing (the folder, the winner's files and its LOCK stay)."""
    folder = tmp_path / "runs" / "new"

    class WinnerFirst(RunLock):
        def acquire(self) -> None:
            RunLock(self.path.parent, pid=os.getppid()).acquire()  # the winner: alive, on this host
            (self.path.parent / "config.yaml").write_text("the winner's\n")
            super().acquire()

    monkeypatch.setattr(launch_module, "RunLock", WinnerFirst)
    with pytest.raises(FolderInUse, match=rf"in use by pid {os.getppid()}"):
        Launch.claimed(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["LOCK", "config.yaml"]
    assert RunLock(folder).holder().pid == os.getppid()


def test_a_refused_launch_takes_back_its_folder_and_lets_the_lock_go_last(tmp_path):
    """The launch made runs/new and took its lock; the trainer (another lock of this process) took and released
    it too: the LOCK stays until the take-back, which removes what the launch wrote, then the folders it made."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "other").mkdir()  # another run beside it: runs/ stays
    folder = tmp_path / "runs" / "new"
    launch = Launch.claimed(folder)
    assert launch.made == [folder]
    (folder / ".hydra").mkdir()
    (folder / ".hydra" / "config.yaml").write_text("{}\n")
    (folder / "config.yaml").write_text("{}\n")
    trainer = RunLock(folder)
    trainer.acquire()
    trainer.release()
    assert RunLock(folder).holder() is not None  # still the launch's
    launch.undo()
    assert not folder.exists() and sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["other"]


def test_files_that_go_while_a_launch_is_taken_back_are_no_error(tmp_path):
    """Files another process removes between the record and the take-back (rank 0's LOCK and config.yaml, on
    another rank) are no error, and not put back."""
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "config.yaml").write_text("{}\n")
    write_lock(tmp_path, host="elsewhere", pid=1, renewed=0.0)
    launch = Launch.before(tmp_path)
    (tmp_path / "LOCK").unlink()
    (tmp_path / "config.yaml").unlink()
    assert not launch.did_work()
    launch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_folder_another_rank_made_first_is_taken_back_as_the_launchs(tmp_path, monkeypatch):
    """Rank 1's Hydra came first and wrote its .hydra/ in runs/a/new (both new): rank 0 counts both folders as its
    launch's, so a refused launch removes them instead of restoring rank 1's files; a mark of another launch (its
    rendezvous) is not taken, and such a folder is restored as it was."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    (tmp_path / "runs").mkdir()
    folder = tmp_path / "runs" / "a" / "new"
    launch_module.made_for_rank_zero(folder)
    (folder / ".hydra").mkdir()
    (folder / ".hydra" / "config.yaml").write_text("{}\n")
    launch = Launch.claimed(folder)
    assert launch.made == [tmp_path / "runs" / "a", folder]
    assert not (folder / launch_module.PEER_MARK).exists()
    launch.undo()
    assert list((tmp_path / "runs").iterdir()) == []

    launch_module.made_for_rank_zero(folder)
    monkeypatch.setenv("MASTER_PORT", "29501")  # rank 0 of the next launch finds the mark of an earlier one
    launch = Launch.claimed(folder)
    assert launch.made == []
    launch.undo()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["a"] and list(folder.iterdir()) == []


@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_zero_writes_the_run_folders_log(rank, tmp_path, monkeypatch, capsys):
    """The trainer's job logging (configs/hydra/job_logging/console.yaml) as RunFolder leaves it to Hydra: rank 0
    logs to its console and to <run>/__main__.log; a rank other than 0 to its console alone, its lines tagged
    (docs/logging.md), so that rank 0 is the log's one writer and the take-back of a refused launch restores it
    exactly. Before, every rank appended its lines there, untagged."""
    import logging.config

    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf, open_dict

    from train.cli.reporting import progress
    from train.cli.run_folder import RunFolder
    from train.parts.config.schema import register_schema

    register_schema()
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setattr(progress, "launch", None)  # what on_run_start records on rank 0
    folder = tmp_path / "run"
    with initialize_config_module(config_module="configs", version_base=None):
        config = compose("train", overrides=[f"hydra.run.dir={folder}"], return_hydra_config=True)
    with open_dict(config):  # what Hydra sets before it configures the job's logging
        config.hydra.runtime.output_dir, config.hydra.job.name = str(folder), "__main__"
    RunFolder().on_run_start(config)
    folder.mkdir(exist_ok=True)  # Hydra creates it next, on every rank
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        logging.config.dictConfig(OmegaConf.to_container(config.hydra.job_logging, resolve=True))
        logging.getLogger("train").warning("a line of rank %d", rank)
    finally:
        for handler in root.handlers:
            handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
        if progress.launch is not None and progress.launch.lock is not None:
            progress.launch.lock.release()
    assert capsys.readouterr().out == f"{'[rank 1] ' if rank else ''}WARNING: a line of rank {rank}\n"
    logs = {path.name: path.read_text() for path in folder.glob("*.log")}
    assert list(logs) == (["__main__.log"] if rank == 0 else []), logs
    assert rank > 0 or logs["__main__.log"].endswith("[WARNING] a line of rank 0\n"), logs
