"""A run's record has no hole and no silent change; a fault of the disk or the folder is one line, exit 2.

Each test runs the command through its own entry (``train.cli.reporting.run_hydra``) in this process:

* an evaluation lost to a crash is done again on resume when the checkpoint is at its step, else named missing
  (the console, the summary and ``eval/curve.png``); the health counters go on across a resume;
* a metrics.jsonl emptied or cut short since the checkpoint is named; an older run's folder (checkpoints that
  recorded no settings, or fewer) resumed with another KL or other prompts is refused, as its config.yaml records;
* every checkpoint without its marker: ``resume=auto`` refuses instead of starting again over the run;
* the disk filling during the export or an evaluation, a folder turning read-only, an export cut short or a damaged
  recorded config under ``train.eval``, a file named ``export``: one line, exit 2, nothing lost;
* ``resume=auto`` without a folder resumes the latest interrupted run of the experiment, or says there is none;
* the run folder is named first, and the run's evaluations are drawn in ``eval/curve.png``, named in the summary
  (with the evaluation lost before an earlier checkpoint);
* an optional reward term left out of some of the run's steps is named in the summary, with how many.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
from pathlib import Path

import pytest
from run_folders import copy_run, metrics, metrics_refused_after_one_row, nan_rewards, refused_line, sigterm_at

import train.tools.eval.command as eval_command
from train.parts.eval import evaluator

pytestmark = pytest.mark.usefixtures("repo_root")  # the tiny experiment's prompt file is relative to the repository
EVAL = ["eval.every=1", "+eval.scorers.jpeg_compressibility={}", "eval.num_steps=2", "eval.num_prompts=2"]


def evaluated(run_dir: Path) -> list[int]:
    return [row["step"] for row in metrics(run_dir) if "eval/jpeg_compressibility" in row]


def test_an_evaluation_lost_to_a_crash_is_done_again_on_resume(launch, tmp_path, monkeypatch):
    """The process dies while it evaluates after step 1 (the checkpoint of step 1 is written): the resumed run
    evaluates step 1 again with that checkpoint's weights, says so, and the curve has no hole."""
    real, run_dir = evaluator.evaluate, tmp_path / "run"

    def killed_at_step_1(*args, **kwargs):
        if kwargs["tag"] == "step_00000001":
            raise KeyboardInterrupt  # kill -9: nothing after this point runs
        return real(*args, **kwargs)

    overrides = ["num_steps=2", "checkpoint.every=1", *EVAL]
    monkeypatch.setattr(evaluator, "evaluate", killed_at_step_1)
    with pytest.raises(KeyboardInterrupt):
        launch(run_dir, *overrides)
    monkeypatch.setattr(evaluator, "evaluate", real)
    status, stderr, stdout = launch(run_dir, *overrides, "resume=auto", stdout=True)
    assert status == 0, stderr
    assert "the evaluation after step 1 was lost (no row in metrics.jsonl): evaluating it again" in stdout
    assert evaluated(run_dir) == [0, 1, 2]
    assert (run_dir / "eval" / "curve.png").is_file() and "evaluations missing" not in stdout


def test_an_evaluation_lost_before_an_earlier_checkpoint_is_named_missing(launch, tmp_path):
    """The run folder is named first, and the run's evaluations drawn in ``eval/curve.png``, named in the summary.
    Then the evaluation after step 1 has no row, and the checkpoint resumed holds step 2: its weights are gone, so
    the console, the summary and the curve say it is missing."""
    run_dir = tmp_path / "run"
    overrides = ["num_steps=2", "checkpoint.every=1", *EVAL]
    status, stderr, stdout = launch(run_dir, *overrides, stdout=True)
    assert status == 0, stderr
    assert stdout.splitlines()[0].endswith(f"run folder: {run_dir}")
    assert (run_dir / "eval" / "curve.png").stat().st_size > 0
    assert re.search(r"eval/curve\.png +the evaluations against the step\n", stdout)
    rows = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    kept = [r for r in rows if not (json.loads(r)["step"] == 1 and "eval/jpeg_compressibility" in json.loads(r))]
    (run_dir / "metrics.jsonl").write_text("".join(kept))
    status, stderr, stdout = launch(run_dir, *overrides, "num_steps=3", "resume=auto", stdout=True)
    assert status == 0, stderr
    assert re.search(r"the evaluations after step 1 were lost .* the curve \(.*curve\.png\) and the summary", stdout)
    assert "evaluations missing (lost before a resume, their weights gone): after step 1" in stdout
    assert re.search(r"eval/curve\.png +the evaluations against the step \(missing: after step 1\)", stdout)
    assert evaluated(run_dir) == [0, 2, 3]


def test_a_cadence_changed_on_resume_loses_no_evaluation(launch, tmp_path):
    """Trained with eval.every=2 (evaluations after steps 0 and 2), resumed with eval.every=1: the evaluation
    after step 1 was never due, so nothing is named lost or missing; the change itself is named."""
    run_dir = tmp_path / "run"
    overrides = ["num_steps=2", "checkpoint.every=1", *EVAL, "eval.every=2"]
    assert launch(run_dir, *overrides)[0] == 0
    status, stderr, stdout = launch(run_dir, *overrides, "num_steps=3", "eval.every=1", "resume=auto", stdout=True)
    assert status == 0, stderr
    assert "eval.every 2 -> 1" in stdout and "lost" not in stdout and "missing" not in stdout
    assert evaluated(run_dir) == [0, 2, 3]


def test_the_health_counters_go_on_across_a_resume(launch, tmp_path, monkeypatch):
    """Every reward NaN, health.max_bad_steps=3, SIGTERM after step 1: the resumed run stops after its first step
    (the third bad one in a row), as the uninterrupted run would, not three steps later."""
    nan_rewards(monkeypatch)
    sigterm_at(1, monkeypatch)
    run_dir = tmp_path / "run"
    overrides = ["num_steps=6", "checkpoint.every=0", "health.max_bad_steps=3"]
    assert launch(run_dir, *overrides)[0] == 128 + signal.SIGTERM
    monkeypatch.undo()
    nan_rewards(monkeypatch)
    line = refused_line(launch, run_dir, *overrides, "resume=auto")
    assert re.search(r"health\.max_bad_steps=3: steps 0 to 2 could not change the weights", line), line


@pytest.mark.parametrize("cut", ["emptied", "shortened"])
def test_a_metrics_file_that_lost_rows_is_named_on_resume(cut, trained, launch, tmp_path):
    """metrics.jsonl emptied, or cut to its first row, after checkpoint 2: the run goes on from step 2 and says
    which rows are lost."""
    run_dir = copy_run(trained, tmp_path)
    path = run_dir / "metrics.jsonl"
    path.write_text("" if cut == "emptied" else path.read_text().splitlines(keepends=True)[0])
    status, stderr, stdout = launch(run_dir, "num_steps=3", "resume=auto", stdout=True)
    assert status == 0, stderr
    lost = "0-1" if cut == "emptied" else "1"
    assert re.search(rf"metrics\.jsonl holds no row of steps {lost}, which checkpoint .*step_00000002 trained", stdout)
    assert [m["step"] for m in metrics(run_dir)][-1] == 2


def drop_settings(run_dir: Path, key: str | None) -> None:
    """Each checkpoint's marker as an older trainer wrote it: no settings (``key`` None), or all but ``key``."""
    for marker in (run_dir / "checkpoints").glob("step_*/COMPLETE"):
        info = json.loads(marker.read_text())
        info["settings"] = None if key is None else {k: v for k, v in info["settings"].items() if k != key}
        marker.write_text(json.dumps(info))


@pytest.mark.parametrize(
    "case",
    ["kl-none-recorded", "kl-not-recorded", "prompts-none-recorded", "kl-hydra-only", "same-settings"],
)
def test_an_older_run_resumed_with_other_settings_is_refused(case, trained, launch, tmp_path):
    """Checkpoints that recorded no settings (or not grpo.kl_beta): the run folder's config.yaml (or, in a folder
    without one, Hydra's copy when this launch did not rewrite it: run_dir= given, Hydra's output elsewhere)
    stands in for them; another KL or other prompts are refused in one line, nothing changed; the same settings
    resume."""
    run_dir = copy_run(trained, tmp_path)
    drop_settings(run_dir, "grpo.kl_beta" if case == "kl-not-recorded" else None)
    folder = run_dir
    if case == "kl-hydra-only":
        (run_dir / "config.yaml").unlink()
        folder = tmp_path / "launch"  # Hydra writes its own files there; the trainer resumes run_dir
    other = tmp_path / "other.txt"
    other.write_text("a red cube\n")
    change = {"kl": ["grpo.kl_beta=0.1"], "prompts": [f"data.train_prompts={other}"], "same": []}[case.split("-")[0]]
    change += [f"run_dir={run_dir}"] if folder != run_dir else []
    if case == "same-settings":
        assert launch(folder, "num_steps=3", "resume=auto", *change)[0] == 0
        return
    line = refused_line(launch, folder, "num_steps=3", "resume=auto", *change, kept=run_dir)
    changed = r"grpo\.kl_beta 0\.0 -> 0\.1" if case.startswith("kl") else r"data\.train_prompts '.*' -> '1 prompts"
    assert re.search(rf"as its run folder's .*config\.yaml records .*{changed}", line), line
    if case == "kl-hydra-only":
        assert ".hydra/config.yaml" in line


def test_an_older_run_with_no_recorded_configuration_is_named(trained, launch, tmp_path):
    """Neither the checkpoint nor the folder records the settings (Hydra's copy rewritten by this launch): the
    resume goes on, saying in one line that they cannot be compared."""
    run_dir = copy_run(trained, tmp_path)
    drop_settings(run_dir, None)
    (run_dir / "config.yaml").unlink()
    status, stderr, stdout = launch(run_dir, "num_steps=3", "resume=auto", stdout=True)
    assert status == 0, stderr
    assert re.search(r"checkpoint .*step_00000002 records no settings and its run folder no configuration", stdout)


def test_resume_auto_with_every_checkpoint_unfinished_is_refused(trained, launch, tmp_path):
    """Every save cut before its COMPLETE marker: resume=auto refuses in one line naming the folder and the two
    ways on, instead of starting again from step 0 over the old run; nothing changed."""
    run_dir = copy_run(trained, tmp_path)
    (run_dir / "checkpoints" / "step_00000002" / "COMPLETE").unlink()  # a marker lost
    step_1 = run_dir / "checkpoints" / "step_00000001"
    (step_1 / "COMPLETE").unlink()
    step_1.rename(step_1.with_name("step_00000001.tmp"))  # a save cut before its marker and rename
    line = refused_line(launch, run_dir, "num_steps=3", "resume=auto", kept=run_dir)
    assert re.search(
        r"resume=auto: no checkpoint under .*checkpoints is complete \(step_00000001\.tmp, step_00000002: .*\).*"
        r"checkpoint\.overwrite=true, or train in a new folder",
        line,
    ), line


def test_a_disk_that_fills_during_the_export_is_one_line_and_resume_exports(launch, tmp_path, monkeypatch):
    """ENOSPC while the export is written: one line naming the export's disk, no export cut short left behind,
    the checkpoint of the last step kept; resume=auto (with room again) writes the export."""
    import safetensors.torch

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    run_dir = tmp_path / "run"
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    line = refused_line(launch, run_dir, "num_steps=1")
    assert re.search(r"the disk of .*export \(the file system .*\) filled up while the export", line), line
    assert not (run_dir / "export").exists() and (run_dir / "checkpoints" / "step_00000001" / "COMPLETE").is_file()
    monkeypatch.undo()
    assert launch(run_dir, "num_steps=1", "resume=auto")[0] == 0
    assert (run_dir / "export" / "weights.json").is_file()


def test_a_disk_that_fills_during_an_evaluation_is_one_line_and_resume_evaluates(launch, tmp_path, monkeypatch):
    """ENOSPC while the evaluation after step 1 writes its means: one line, exit 2; the resumed run evaluates
    step 1 again from its checkpoint."""
    real, run_dir = pathlib.Path.write_text, tmp_path / "run"

    def full_at_step_1(self, *args, **kwargs):
        if self.name == "step_00000001.json":
            raise OSError(28, "No space left on device")
        return real(self, *args, **kwargs)

    overrides = ["num_steps=2", "checkpoint.every=1", *EVAL]
    monkeypatch.setattr(pathlib.Path, "write_text", full_at_step_1)
    line = refused_line(launch, run_dir, *overrides)
    assert re.search(r"the disk of .*eval .* filled up while the evaluation after step 1", line), line
    monkeypatch.undo()
    assert launch(run_dir, *overrides, "resume=auto")[0] == 0
    assert evaluated(run_dir) == [0, 1, 2]


def test_a_disk_that_fills_during_a_sample_grid_is_one_line(launch, tmp_path, monkeypatch):
    """A neighbour of the evaluation's: the sample grid of step 0 (logging.sample_every=1) that the disk refuses is
    one line naming the samples' disk, not a traceback."""
    from PIL import Image

    real = Image.Image.save

    def full(self, target, *args, **kwargs):
        if isinstance(target, str | Path):  # a file; the JPEG reward's in-memory saves go on
            raise OSError(28, "No space left on device")
        return real(self, target, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", full)
    run_dir = tmp_path / "run"
    line = refused_line(launch, run_dir, "num_steps=2", "logging.sample_every=1")
    assert re.search(r"the disk of .*samples .* filled up while the sample grid of step", line), line


def test_eval_on_a_full_disk_is_one_line(trained, launch, tmp_path, monkeypatch):
    real = pathlib.Path.write_text

    def full(self, *args, **kwargs):
        if self.name.startswith("eval_"):
            raise OSError(28, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    overrides = [f"eval.transformer={trained / 'export'}", "+eval.scorers.jpeg_compressibility={}"]
    line = refused_line(launch, tmp_path / "eval", *overrides, module=eval_command)
    assert re.search(r"filled up while the evaluation eval_export was written: .*untouched", line), line


def test_a_run_folder_that_turns_read_only_is_one_line(launch, tmp_path, monkeypatch):
    """The folder turns read-only after step 0: the metrics row of step 1 is refused, and so is the removal of the
    lock; the refused row is the one line, exit 2 (not a traceback of the lock's release)."""
    real_unlink = pathlib.Path.unlink

    def unlink(self, *args, **kwargs):
        if self.name == "LOCK":
            raise OSError(30, "Read-only file system")
        return real_unlink(self, *args, **kwargs)

    metrics_refused_after_one_row(monkeypatch, 30, "Read-only file system")
    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    line = refused_line(launch, tmp_path / "run", "num_steps=3", "checkpoint.every=0")
    assert re.search(r"metrics\.jsonl .*cannot be written \(Read-only file system\)", line), line


@pytest.mark.parametrize("cut", ["weights-missing", "truncated-without-note", "shard-missing"])
def test_eval_names_an_export_cut_short(cut, trained, launch, tmp_path):
    run_dir = copy_run(trained, tmp_path)
    export = run_dir / "export"
    weights = export / "diffusion_pytorch_model.safetensors"
    (export / "weights.json").unlink()  # the trainer writes it last
    if cut == "weights-missing":
        weights.unlink()
    elif cut == "truncated-without-note":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:  # a sharded export whose index names a shard that was never written
        index = {"metadata": {}, "weight_map": {"x": "diffusion_pytorch_model-00002-of-00002.safetensors"}}
        weights.rename(export / "diffusion_pytorch_model-00001-of-00002.safetensors")
        (export / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    overrides = [f"eval.transformer={export}", "+eval.scorers.jpeg_compressibility={}"]
    line = refused_line(launch, tmp_path / "eval", *overrides, module=eval_command, kept=run_dir)
    assert re.search(r"eval\.transformer=.*export'.*(an export cut short|cannot be read)", line), line


def test_eval_names_a_damaged_recorded_config(trained, launch, tmp_path):
    run_dir = copy_run(trained, tmp_path)
    (run_dir / ".hydra" / "config.yaml").write_text("model: [name: flux\n")  # cut short mid-write
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    overrides = [f"eval.transformer={checkpoint}", "+eval.scorers.jpeg_compressibility={}"]
    line = refused_line(launch, tmp_path / "eval", *overrides, module=eval_command)
    assert re.search(r"recorded configuration .*\.hydra/config\.yaml is damaged", line), line


def test_a_file_named_export_in_the_run_folder_is_one_line_before_training(launch, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "export").write_text("notes\n")
    line = refused_line(launch, run_dir, "num_steps=1")
    assert re.search(r"export is a file, where the export at the end of training writes a folder", line), line
    assert (run_dir / "export").read_text() == "notes\n" and not (run_dir / "checkpoints").exists()


def test_resume_auto_without_a_folder_resumes_the_latest_interrupted_run(trained, launch, tmp_path, monkeypatch):
    """runs/tiny/ holds two runs stopped after step 2 of 3: resume=auto alone continues the later one and names
    it and the other; with none, one line says so and how to start."""
    monkeypatch.chdir(tmp_path)
    line = refused_line(launch, None, "num_steps=3", "resume=auto")  # no hydra.run.dir: runs/<experiment>/ here
    assert re.search(r"runs/tiny holds no interrupted run of experiment tiny .*without resume=auto", line), line
    older, newer = (Path(shutil.copytree(trained, tmp_path / "runs" / "tiny" / name)) for name in ("a", "b"))
    marker = newer / "checkpoints" / "step_00000002" / "COMPLETE"
    os.utime(marker, (marker.stat().st_atime, marker.stat().st_mtime + 60))
    status, stderr, stdout = launch(None, "num_steps=3", "resume=auto", stdout=True)
    assert status == 0, stderr
    assert re.search(r"resume=auto: continuing .*runs/tiny/b, the latest interrupted run .*; the others: a", stdout)
    assert [m["step"] for m in metrics(newer)][-1] == 2 and [m["step"] for m in metrics(older)][-1] == 1
    assert sorted(p.name for p in (tmp_path / "runs" / "tiny").iterdir()) == ["a", "b"]


def test_the_summary_names_an_optional_term_left_out_and_on_how_many_of_the_runs_steps(launch, tmp_path):
    """An optional served term (required: false) whose server answers step 1 with a 500: that step's reward/total is
    over the JPEG reward alone. After the resumed session's step 2 the summary says, from metrics.jsonl, that the
    term was left out of 1 of the run's 3 steps, the first session's included."""
    pytest.importorskip("fastapi")
    from fastapi.responses import JSONResponse
    from reward_servers import FAKE, fake_server, serve

    def good(count: int) -> dict:
        return {"scores": [0.5] * count, **FAKE}

    refused = JSONResponse({"detail": "overloaded"}, status_code=500)
    run_dir = tmp_path / "run"
    with serve(fake_server(good, refused, good)) as url:
        remote = f"+reward.components.remote={{url: '{url}', timeout_s: 10, retries: 0, required: false}}"
        overrides = ["checkpoint.every=1", "eval.every=0", "checkpoint.export=false", remote]
        status, stderr, first = launch(run_dir, "num_steps=2", *overrides, stdout=True)
        assert status == 0, stderr
        status, stderr, second = launch(run_dir, "num_steps=3", "resume=auto", *overrides, stdout=True)
        assert status == 0, stderr
    assert [row["reward/remote/missing"] for row in metrics(run_dir)] == [0.0, 1.0, 0.0]
    said = "optional reward terms left out: remote on {} of {} steps; reward/total on those steps is over the other "
    assert said.format(1, 2) in first and said.format(1, 3) in second
    assert "renormalised (reward/<name>/missing in metrics.jsonl marks them)" in second
