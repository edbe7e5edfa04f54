"""The pieces of a run's record: which evaluations were due and are missing, which rows were lost, the health
counters a checkpoint keeps, and the curve of the evaluations (tests/e2e/test_run_record.py runs them end to end)."""

from __future__ import annotations

import json
from pathlib import Path

from train.loop.epilogue import eval_series, write_curve
from train.parts.config.record import due_evaluations, lost_rows, missing_evaluations, steps_text
from train.parts.observe.health import HealthConfig


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"step": 9, "trai')  # and a row cut short
    return path


def test_steps_text_groups_consecutive_steps():
    assert steps_text([5, 0, 1, 2, 8, 9, 2]) == "0-2, 5, 8-9"
    assert steps_text([]) == ""


def test_the_evaluations_due_are_step_0_the_cadence_and_the_last_step():
    assert due_evaluations(every=2, num_steps=5, upto=5) == [0, 2, 4, 5]
    assert due_evaluations(every=2, num_steps=5, upto=3) == [0, 2]
    assert due_evaluations(every=0, num_steps=5, upto=5) == []


def test_missing_evaluations_and_lost_rows(tmp_path):
    """Rows of training steps 0, 2 (1 lost) and evaluations after steps 0 and 4 (2 missing)."""
    metrics = write_rows(
        tmp_path / "metrics.jsonl",
        [
            {"step": 0, "wall_time": 0.1, "eval/hps": 0.2},
            {"step": 0, "wall_time": 0.2, "train/loss": 1.0},
            {"step": 2, "wall_time": 0.3, "train/loss": 1.0},
            {"step": 4, "wall_time": 0.4, "eval/hps": 0.3},
        ],
    )
    assert missing_evaluations(metrics, due_evaluations(every=2, num_steps=4, upto=4)) == [2]
    assert lost_rows(metrics, 4) == [1, 3]
    assert lost_rows(tmp_path / "none.jsonl", 2) == [0, 1]


def test_the_health_counters_round_trip_and_name_the_streak_from_an_earlier_session():
    """2 bad steps counted before a resume, limit 3: the resumed session's first bad step stops the run, naming
    the streak from step 0; without the counters it would not."""
    nan = {"train/skipped_nan_reward": 1.0}
    before = HealthConfig(max_bad_steps=3).build(optimizer_steps=1, first=0, last=9, start_norm=1.0)
    assert before.observe(nan, 0) is None and before.observe(nan, 1) is None
    after = HealthConfig(max_bad_steps=3).build(optimizer_steps=1, first=2, last=9, start_norm=1.0)
    after.load_state_dict(json.loads(json.dumps(before.state_dict())))  # as a checkpoint's rank file keeps it
    verdict = after.observe(nan, 2)
    assert verdict is not None and "steps 0 to 2 could not change the weights" in verdict.line


def test_the_curve_draws_each_metric_and_its_held_out_prompts(tmp_path):
    metrics = write_rows(
        tmp_path / "metrics.jsonl",
        [
            {"step": 0, "eval/hps": 0.2, "eval/hps/held-out": 0.1, "eval/hps/animals": 0.5},
            {"step": 2, "eval/hps": 0.3, "eval/hps/held-out": 0.2},
            {"step": 2, "train/loss": 1.0},
        ],
    )
    assert eval_series(metrics) == {"eval/hps": {0: 0.2, 2: 0.3}, "eval/hps/held-out": {0: 0.1, 2: 0.2}}
    path = write_curve(metrics, tmp_path / "eval" / "curve.png", missing=[1])
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert write_curve(write_rows(tmp_path / "train.jsonl", [{"step": 0, "train/loss": 1.0}]), path, []) is None
