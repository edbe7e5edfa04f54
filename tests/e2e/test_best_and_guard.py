"""``checkpoint.keep_best`` and ``eval.guard`` through ``python -m train`` on the tiny run (train/loop/watching.py):
the best evaluation's checkpoint kept past the rotation and exported, the guard's warnings where the watch raises
them, its stop after a checkpoint with one line and exit status 2, and a resume that keeps the best so far."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from run_folders import metrics
from safetensors.torch import load_file

from train.parts.eval.watch import Watch, logged_order
from train.parts.observe.metrics import evaluation_only

pytestmark = pytest.mark.usefixtures("repo_root")  # the tiny experiment's prompt file is relative to the repository
KEY = "eval/jpeg_compressibility/held-out"
EVAL = ["eval.every=1", "+eval.scorers.jpeg_compressibility={}", "eval.num_steps=2", "eval.num_prompts=2"]
WATCH = ["checkpoint.keep_best=true", "eval.guard.patience=1"]


@pytest.fixture
def heldout(tmp_path) -> str:
    path = tmp_path / "heldout.txt"
    path.write_text("a red apple\na blue cup\na green leaf\n")
    return f"eval.heldout_prompts={path}"


def best_of(run_dir: Path) -> int:
    """The step of the highest held-out value after a training step (the earlier on a tie), from metrics.jsonl."""
    series = [(row[KEY], row["step"]) for row in metrics(run_dir) if KEY in row and row["step"] > 0]
    return min(series, key=lambda value_step: (-value_step[0], value_step[1]))[1]


def alarms(run_dir: Path) -> list[str]:
    """The guard's lines for the run's rows (train/parts/eval/watch.py, tested against its slow reference)."""
    watch, lines = Watch(KEY, patience=1), []
    for row in logged_order(metrics(run_dir)):
        if evaluation_only(row):
            lines += [alarm] if (alarm := watch.evaluated(row["step"], row).alarm) else []
        else:
            watch.trained(row)
    return lines


def clockless(row: dict) -> dict:
    """A row without what the clocks give (time/*, perf/*, wall_time): what a replay reproduces."""
    return {k: v for k, v in row.items() if not k.startswith(("time/", "perf/")) and k != "wall_time"}


def note_step(folder: Path) -> int:
    return json.loads((folder / "weights.json").read_text())["step"]


def best_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("best evaluation: "))


def test_keep_best_and_the_guard_warning(launch, tmp_path, heldout):
    """Six evaluations, one checkpoint kept: checkpoints/best/ is the best held-out evaluation's, whole after the
    rotation deleted its step, exported to export_best/ beside export/; a warning per alarm; then the same run with
    eval.guard.action=stop ends after the first alarm's evaluation, checkpointed and exported, in one line."""
    run_dir, overrides = tmp_path / "warn", ["num_steps=6", "checkpoint.keep_last=1", *EVAL, heldout, *WATCH]
    status, stderr, stdout = launch(run_dir, *overrides, "eval.guard.action=warn", stdout=True)
    assert status == 0, stderr
    best, layout = best_of(run_dir), {p.name for p in (run_dir / "checkpoints").iterdir()}
    assert best < 6 and layout == {"best", "step_00000006"}  # the rows put the best before the last step
    assert json.loads((run_dir / "checkpoints" / "best" / "COMPLETE").read_text())["step"] == best
    assert (note_step(run_dir / "export_best"), note_step(run_dir / "export")) == (best, 6)
    weights = [load_file(run_dir / name / "diffusion_pytorch_model.safetensors") for name in ("export_best", "export")]
    assert any(not a.equal(b) for a, b in zip(weights[0].values(), weights[1].values()))
    assert best_line(stdout).startswith(f"best evaluation: {KEY} ") and f"after step {best}, +" in best_line(stdout)
    assert "checkpoints/best/ the checkpoint of the best evaluation" in stdout and "export_best/" in stdout
    expected = alarms(run_dir)
    assert expected and [line for line in expected if line in stdout] == expected
    assert stdout.count("eval.guard: ") == len(expected)
    stopped = int(re.search(r"now \S+ after step (\d+)", expected[0]).group(1))

    run_dir = tmp_path / "stop"
    status, stderr, stdout = launch(run_dir, *overrides, "eval.guard.action=stop", stdout=True)
    assert status == 2
    line = next(line for line in stderr.splitlines() if line.startswith("python -m train: error: "))
    checkpoint = run_dir / "checkpoints" / f"step_{stopped:08d}"
    assert line == (
        f"python -m train: error: {expected[0]}; stopped (eval.guard.action=stop): wrote checkpoint {checkpoint}; "
        "resume=auto continues, e.g. with eval.guard.action=warn"
    )
    assert "Traceback" not in stderr and checkpoint.is_dir()
    assert max(row["step"] for row in metrics(run_dir)) == stopped  # its evaluation's row, after step stopped - 1
    assert note_step(run_dir / "export") == stopped and f"stopped: {expected[0]}" in stdout
    assert f"steps 0-{stopped - 1} in " in stdout and "jpeg_compressibility: step 0 " in stdout
    assert f" -> step {stopped} " in stdout  # step 0's evaluation against the last one, paired


@pytest.mark.slow
def test_a_resume_keeps_the_best_so_far(launch, tmp_path, heldout):
    """Two steps, then a resume to four, against four in one go: the same rows, the same best step (one of the
    first session's) and export_best/ bit for bit, the same summary line and the same guard warnings after the
    resume's step."""
    overrides = ["seed=1", "checkpoint.every=2", *EVAL, heldout, *WATCH, "eval.guard.action=warn", "eval.num_prompts=3"]
    status, stderr, straight = launch(tmp_path / "straight", "num_steps=4", *overrides, stdout=True)
    assert status == 0, stderr
    status, stderr = launch(tmp_path / "resumed", "num_steps=2", *overrides)
    assert status == 0, stderr
    status, stderr, resumed = launch(tmp_path / "resumed", "num_steps=4", "resume=auto", *overrides, stdout=True)
    assert status == 0, stderr
    assert best_of(tmp_path / "straight") <= 2  # the best is the first session's: the resume must keep it
    rows = [[clockless(row) for row in logged_order(metrics(tmp_path / run))] for run in ("straight", "resumed")]
    assert rows[0] == rows[1] and len(rows[0]) == 9  # 4 steps, 5 evaluations
    assert best_line(straight) == best_line(resumed)
    a, b = (
        load_file(tmp_path / run / "export_best" / "diffusion_pytorch_model.safetensors")
        for run in ("straight", "resumed")
    )
    assert a.keys() == b.keys() and all(a[name].equal(b[name]) for name in a)
    late = [line for line in alarms(tmp_path / "straight") if int(re.search(r"after step (\d+),", line).group(1)) > 2]
    assert all(line in resumed for line in late) and resumed.count("eval.guard: ") == len(late)


@pytest.mark.slow
def test_a_branch_retires_a_later_best_and_links_its_own(launch, tmp_path, heldout):
    """A resume from step 2 of a run whose best is later: that checkpoints/best/ retires with the later checkpoints,
    the branch links its own best (of steps 1-2) again, and trained to the end again it keeps the same best."""
    run_dir = tmp_path / "run"
    overrides = ["seed=2", "checkpoint.keep_last=4", *EVAL, heldout, *WATCH, "eval.num_prompts=3", "num_steps=4"]
    status, stderr = launch(run_dir, *overrides)
    assert status == 0, stderr
    best = best_of(run_dir)
    assert best > 2  # the settings put the best after the branch's step
    first = load_file(run_dir / "export_best" / "diffusion_pytorch_model.safetensors")
    early = max(
        ((row[KEY], -row["step"]) for row in metrics(run_dir) if KEY in row and 0 < row["step"] <= 2),
    )
    status, stderr, stdout = launch(
        run_dir, *overrides, f"resume={run_dir / 'checkpoints' / 'step_00000002'}", "num_steps=2", stdout=True
    )
    assert status == 0, stderr
    (retired,) = (run_dir / "checkpoints" / "retired").iterdir()
    assert json.loads((retired / "best" / "COMPLETE").read_text())["step"] == best
    assert json.loads((run_dir / "checkpoints" / "best" / "COMPLETE").read_text())["step"] == -early[1]
    assert "no longer kept" not in stdout
    status, stderr = launch(run_dir, *overrides, "resume=auto")
    assert status == 0, stderr
    assert best_of(run_dir) == best and note_step(run_dir / "export_best") == best
    again = load_file(run_dir / "export_best" / "diffusion_pytorch_model.safetensors")
    assert all(first[name].equal(again[name]) for name in first)
