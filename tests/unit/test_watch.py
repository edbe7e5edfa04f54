"""The watch over the evaluations (train/parts/eval/watch.py) against a slow reference, its replay of the rows a
resume keeps, and checkpoints/best/ (train/parts/checkpoint/best.py)."""

from __future__ import annotations

import json
import logging
import math
import random
import shutil

import pytest
import torch

from train.parts.checkpoint.best import best_folder, best_step, keep_best, restore_best
from train.parts.checkpoint.manager import CheckpointManager
from train.parts.eval.eval_config import EvalConfig, GuardConfig
from train.parts.eval.watch import REWARD, Watch, logged_order, watched_key

KEY = "eval/shape_alignment/held-out"


def history(seed: int, steps: int) -> list[dict]:
    """The rows a run logs, in order: evaluations every 1 to 3 steps (some without the metric: its scorer left out),
    training rows whose reward is sometimes NaN or absent; values from a small set, so ties and equal means occur,
    and in half the runs a reward that rises while the metric falls (a gamed one)."""
    rng = random.Random(seed)
    gamed = rng.random() < 0.5
    logged = [{"step": 0, KEY: rng.choice([0.1, 0.2, 0.3])}]
    for step in range(steps):
        reward = rng.choice([0.0, 0.5, 1.0, math.nan, None])
        reward = reward + step if gamed and reward is not None else reward
        logged.append({"step": step} | ({REWARD: reward} if reward is not None else {"train/loss": 0.0}))
        if rng.random() < 0.5 or step == steps - 1:
            value = rng.choice([0.1, 0.2, 0.3, 0.4, None])
            value = value - 0.25 * step if gamed and value is not None else value
            logged.append({"step": step + 1, **({KEY: value} if value is not None else {"eval/other": 1.0})})
    return logged


def reference(logged: list[dict], patience: int) -> list[tuple[int, int | None, bool]]:
    """Per evaluation with the metric: (step, the best step so far, alarm), from the whole list at once."""
    evals = [(i, row["step"], row[KEY]) for i, row in enumerate(logged) if KEY in row]
    out, flags = [], []
    for n, (i, step, value) in enumerate(evals):
        rewards = []  # the finite training rewards logged between the previous evaluation and this one
        if n:
            rewards = [r[REWARD] for r in logged[evals[n - 1][0] + 1 : i] if not math.isnan(r.get(REWARD, math.nan))]
        before = []
        if n > 1:
            span = logged[evals[n - 2][0] + 1 : evals[n - 1][0]]
            before = [r[REWARD] for r in span if not math.isnan(r.get(REWARD, math.nan))]
        rose = bool(rewards) and bool(before) and sum(rewards) / len(rewards) > sum(before) / len(before)
        flags.append(n > 0 and value < evals[n - 1][2] and rose)
        streak = 0
        while streak < len(flags) and flags[len(flags) - 1 - streak]:
            streak += 1
        trained = [(v, s) for _, s, v in evals[: n + 1] if s > 0]
        best = min(trained, key=lambda vs: (-vs[0], vs[1]))[1] if trained else None
        out.append((step, best, patience > 0 and streak >= patience))
    return out


def live(logged: list[dict], patience: int) -> tuple[Watch, list[tuple[int, int | None, bool]]]:
    watch, out = Watch(KEY, patience), []
    for row in logged:
        if any(key.startswith("eval/") for key in row):
            verdict = watch.evaluated(row["step"], row)
            if KEY in row:
                out.append((row["step"], watch.best.step if watch.best else None, verdict.alarm is not None))
                assert verdict.best == (watch.best is not None and watch.best.step == row["step"])
            else:
                assert verdict.alarm is None and not verdict.best
        else:
            watch.trained(row)
    return watch, out


@pytest.mark.parametrize("patience", [0, 1, 2, 3])
def test_the_watch_matches_the_slow_reference(patience):
    alarms = 0
    for seed in range(300):
        logged = history(seed, 12)
        _, verdicts = live(logged, patience)
        assert verdicts == reference(logged, patience), seed
        alarms += sum(alarm for *_, alarm in verdicts)
    assert (alarms > 0) == (patience > 0)  # the histories do raise the alarm


def test_a_replay_of_the_rows_a_resume_keeps_is_the_live_watch():
    """At every step k a resume could start from: the rows a rewind keeps (training rows of steps < k, evaluations
    after <= k steps), in any order (a branch brings rows back at the end), replay to the live watch's state."""
    for seed in range(60):
        logged = history(seed, 10)
        for k in range(1, 11):
            kept = [r for r in logged if r["step"] < k or (r["step"] == k and "eval/" in "".join(r))]
            straight, _ = live(kept, 2)
            shuffled = random.Random(k).sample(kept, len(kept))
            replayed = Watch(KEY, 2)
            replayed.replay(shuffled)
            assert replayed == straight, (seed, k)
            assert logged_order(shuffled) == kept


def test_a_tensor_reward_counts_as_its_logged_float():
    watch, logged = Watch(KEY, 1), Watch(KEY, 1)
    watch.trained({REWARD: torch.tensor(0.1, dtype=torch.float32)})
    logged.trained(json.loads(json.dumps({REWARD: float(torch.tensor(0.1).item())})))
    assert watch == logged and watch.window == [float(torch.tensor(0.1))]


def test_the_alarm_line_and_the_margin():
    watch = Watch(KEY, 1)
    for step, value, reward in [(0, 0.5, None), (2, 0.6, 0.1), (4, 0.55, 0.2)]:
        if reward is not None:
            watch.trained({REWARD: reward})
        verdict = watch.evaluated(step, {KEY: value})
    assert verdict.alarm is not None and verdict.alarm.startswith(f"eval.guard: {KEY} fell for 1 evaluation in a row")
    assert "after step 4" in verdict.alarm and "the best was 0.6000 after step 2" in verdict.alarm
    assert (
        watch.margin_line()
        == f"best evaluation: {KEY} 0.6000 after step 2, +0.0500 over the last (after step 4: 0.5500)"
    )


def test_the_watched_key_and_the_guard_settings():
    scorers = {"clipscore": {}, "shape_alignment": {}}
    assert watched_key(EvalConfig(scorers=scorers)) == "eval/clipscore"
    assert watched_key(EvalConfig()) is None and Watch(None).evaluated(1, {"eval/clipscore": 1.0}).best is False
    assert watched_key(EvalConfig(scorers=scorers, heldout_prompts="h.txt", metric="shape_alignment")) == KEY
    assert Watch.of(EvalConfig(every=1, scorers=scorers)).patience == 0  # guard off
    assert Watch.of(EvalConfig(every=1, scorers=scorers, guard=GuardConfig(action="warn", patience=2))).patience == 2
    with pytest.raises(ValueError, match="metric='hpsv2' is not one of eval.scorers"):
        EvalConfig(scorers=scorers, metric="hpsv2")
    with pytest.raises(ValueError, match="patience must be > 0"):
        GuardConfig(patience=0)


def fake_checkpoint(manager: CheckpointManager, step: int) -> None:
    path = manager.path_for(step)
    path.mkdir(parents=True)
    (path / "rank0.pt").write_bytes(bytes([step]) * 10)
    (path / "COMPLETE").write_text(json.dumps({"step": step, "world_size": 1}))


def test_keep_best_links_the_checkpoint_and_outlives_its_pruning(tmp_path):
    manager = CheckpointManager(tmp_path / "run")
    for step in (2, 4):
        fake_checkpoint(manager, step)
    keep_best(manager, 2)
    best = best_folder(manager)
    assert best_step(best) == 2 and best.name == "best" and manager.complete() == [manager.path_for(s) for s in (2, 4)]
    assert (best / "rank0.pt").stat().st_ino == (manager.path_for(2) / "rank0.pt").stat().st_ino  # a hard link
    keep_best(manager, 4)
    assert best_step(best) == 4 and (best / "rank0.pt").read_bytes() == bytes([4]) * 10
    keep_best(manager, 2)
    for step in (2, 4):  # the rotation deletes the step's folder; best/ stays whole
        shutil.rmtree(manager.path_for(step))
    assert best_step(best) == 2 and (best / "rank0.pt").read_bytes() == bytes([2]) * 10


def test_restore_best_after_a_resume(tmp_path, caplog):
    manager = CheckpointManager(tmp_path / "run")
    fake_checkpoint(manager, 3)
    restore_best(manager, None)
    assert best_step(best_folder(manager)) is None
    restore_best(manager, 3)  # a crash between the evaluation's row and the link
    assert best_step(best_folder(manager)) == 3
    fake_checkpoint(manager, 5)
    keep_best(manager, 5)
    restore_best(manager, 3)  # a branch back to a timeline whose best is step 3
    assert best_step(best_folder(manager)) == 3
    keep_best(manager, 5)
    shutil.rmtree(manager.path_for(3))
    with caplog.at_level(logging.WARNING):
        restore_best(manager, 3)
    assert not best_folder(manager).exists()
    assert "the checkpoint of the best evaluation (after step 3) is no longer kept" in caplog.text
