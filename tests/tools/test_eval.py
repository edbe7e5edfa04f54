"""The evaluation protocol and ``python -m train.eval``: fixed seeds, means per category, scores per prompt,
trained weights from a checkpoint, an export or a run folder, and the paired difference."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_module
from PIL import Image
from small_run import TWO_SEGMENTS

from train.ground.errors import ConfigError
from train.loop.epilogue import files_section
from train.loop.trainer import run
from train.parts.checkpoint.export import find_weights
from train.parts.eval import protocol as evaluation
from train.parts.eval.eval_config import SCORERS_HINT
from train.parts.eval.protocol import first_occurrences, paired_difference, read_scores
from train.parts.observe.stats import standard_error
from train.run.start import load_config
from train.tools.eval import command as eval_module
from train.tools.eval.command import check_scorers, eval_command, target

ROOT = Path(__file__).resolve().parents[2]
SCORER = "jpeg_compressibility"
# The tiny random Flux pipeline, 3 prompts, a 4-step ODE: seconds per evaluation.
EVAL = [
    "experiment=tiny",
    "model.build_tiny=null",
    f"+eval.scorers.{SCORER}={{}}",
    "eval.num_steps=4",
    "eval.batch_size=2",
    "eval.num_prompts=3",
]
TRAIN = ["num_steps=2", *TWO_SEGMENTS, "logging.sample_every=0", "checkpoint.every=2"]


pytestmark = pytest.mark.usefixtures("repo_root")  # the tiny experiment's prompt file is relative to the repository


def compose_config(name: str, overrides: list[str]):
    with initialize_config_module(config_module="configs", version_base=None):
        return compose(config_name=name, overrides=overrides)


def evaluate_cli(model: Path, out: Path, *overrides: str):
    """``python -m train.eval`` in this process, writing into ``out``."""
    return eval_command(compose_config("eval", [f"model.path={model}", *EVAL, f"run_dir={out}", *overrides]))


def train_run(model: Path, run_dir: Path, *overrides: str) -> Path:
    cfg = compose_config("train", [f"model.path={model}", *EVAL, *TRAIN, f"run_dir={run_dir}", *overrides])
    run(cfg)
    return run_dir


def scores(path: Path) -> list[float]:
    return [row[SCORER] for row in read_scores(path)]


def test_eval_writes_means_per_category_scores_per_prompt_and_a_grid(tiny_flux_dir, tmp_path):
    prompts = tmp_path / "bench.jsonl"
    rows = [("a cat", "photo"), ("a dog", "photo"), ("a castle", "paintings"), ("a robot", "anime")]
    rows.append(("a tree", "anime"))
    prompts.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for p, c in rows))
    extra = [f"eval.prompts={prompts}", "eval.num_prompts=0"]
    outputs = [evaluate_cli(tiny_flux_dir, tmp_path / name, *extra)["eval_pretrained"] for name in ("a", "b")]
    result = json.loads((tmp_path / "a" / "eval_pretrained.json").read_text())
    assert result == json.loads((tmp_path / "b" / "eval_pretrained.json").read_text())  # fixed seeds
    assert result["num_prompts"] == 5 and outputs[0].summary == outputs[1].summary
    categories = {k.split("/")[1] for k in result if "/" in k}
    assert categories == {"photo", "paintings", "anime"}
    # the overall mean is the mean over prompts, i.e. the count-weighted mean of the categories
    weighted = (2 * result[f"{SCORER}/photo"] + result[f"{SCORER}/paintings"] + 2 * result[f"{SCORER}/anime"]) / 5
    assert abs(result[SCORER] - weighted) < 1e-5
    # one line per prompt, in prompt order, with what pairs it with another model's evaluation
    per_prompt = read_scores(tmp_path / "a" / "eval_pretrained.scores.jsonl")
    assert [(r["index"], r["prompt"], r["category"], r["seed"]) for r in per_prompt] == [
        (i, p, c, 0) for i, (p, c) in enumerate(rows)
    ]
    values = [r[SCORER] for r in per_prompt]
    assert sum(values) / 5 == pytest.approx(result[SCORER], abs=1e-5)
    assert result[f"{SCORER}_se"] == pytest.approx(standard_error(values))
    grid = Image.open(tmp_path / "a" / "eval_pretrained.png")
    assert grid.size[0] >= 3 * 128  # 32 px samples upscaled, three per row, captions under them


def test_eval_of_a_checkpoint_an_export_and_a_run_folder(tiny_flux_dir, tmp_path):
    """The same protocol as the trainer's evaluation: the checkpoint at step 2 scores what the trainer
    measured after 2 steps, the pretrained model what it measured at step 0, prompt by prompt."""
    run_dir = train_run(tiny_flux_dir, tmp_path / "run", "eval.every=2")
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    results = evaluate_cli(
        tiny_flux_dir, run_dir / "eval", f"eval.transformer={checkpoint}", "eval.compare_pretrained=true"
    )
    assert set(results) == {"eval_pretrained", "eval_step_00000002"}
    out = run_dir / "eval"
    for trainer_tag, cli_tag in (("step_00000000", "eval_pretrained"), ("step_00000002", "eval_step_00000002")):
        expected = scores(out / f"{trainer_tag}.scores.jsonl")
        assert scores(out / f"{cli_tag}.scores.jsonl") == pytest.approx(expected, abs=1e-5)
    paired = json.loads((out / "eval_step_00000002_vs_pretrained.json").read_text())
    before, after = scores(out / "eval_pretrained.scores.jsonl"), scores(out / "eval_step_00000002.scores.jsonl")
    assert paired[0]["difference"] == pytest.approx(sum(b - a for a, b in zip(before, after)) / 3)
    assert Image.open(out / "eval_step_00000002_vs_pretrained.png").size[0] > 4 * 128  # pairs side by side
    # the export holds the same (final) weights; the run folder means its export; resume= means eval.transformer=
    evaluate_cli(tiny_flux_dir, tmp_path / "export", f"eval.transformer={run_dir}")
    assert scores(tmp_path / "export" / "eval_export.scores.jsonl") == pytest.approx(after, abs=1e-5)
    overrides = [f"model.path={tiny_flux_dir}", *EVAL, f"run_dir={tmp_path}", f"resume={checkpoint}"]
    config = load_config(compose_config("eval", overrides))
    assert target(config) == find_weights(str(checkpoint), "resume")


def test_the_export_is_the_ema_the_trainer_scored_and_the_raw_weights_sit_beside_it(tiny_flux_dir, tmp_path):
    """With an EMA the trainer evaluated the EMA, but export/ held the raw weights: train.eval of the
    export did not reproduce the run's final score. Now export/ is the EMA, export_raw/ the raw weights
    (as the checkpoint's model), and each export's weights.json says which."""
    run_dir = train_run(tiny_flux_dir, tmp_path / "run", "eval.every=2", "ema.decay=0.5")
    notes = {name: json.loads((run_dir / name / "weights.json").read_text()) for name in ("export", "export_raw")}
    assert notes["export"]["weights"] == "ema" and notes["export_raw"]["weights"] == "trained"
    summary = files_section(
        load_config(compose_config("train", [f"model.path={tiny_flux_dir}", *EVAL, f"run_dir={run_dir}"])), "disabled"
    )
    assert any("export/" in line and "EMA (ema.decay=0.5)" in line and "scored" in line for line in summary)
    assert any("export_raw/" in line and "not the EMA" in line for line in summary), summary
    trained = scores(run_dir / "eval" / "step_00000002.scores.jsonl")
    evaluate_cli(tiny_flux_dir, tmp_path / "ema", f"eval.transformer={run_dir}")  # a run folder: its export
    assert scores(tmp_path / "ema" / "eval_export.scores.jsonl") == pytest.approx(trained, abs=1e-5)
    evaluate_cli(tiny_flux_dir, tmp_path / "raw", f"eval.transformer={run_dir / 'export_raw'}")
    evaluate_cli(tiny_flux_dir, tmp_path / "raw", f"eval.transformer={run_dir / 'checkpoints' / 'step_00000002'}")
    raw = scores(tmp_path / "raw" / "eval_export_raw.scores.jsonl")
    assert raw == pytest.approx(scores(tmp_path / "raw" / "eval_step_00000002.scores.jsonl"), abs=1e-5)
    assert raw != pytest.approx(trained, abs=1e-5)  # the EMA of 2 steps is not the last weights


@pytest.mark.slow
def test_eval_command_line_writes_into_the_evaluated_run(tiny_flux_dir, tmp_path):
    """Hydra's own folder of the command (its .hydra/ and eval.log) is the evaluated run's eval/ folder."""
    run_dir = train_run(tiny_flux_dir, tmp_path / "run")
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    (run_dir / ".hydra").mkdir()  # what python -m train leaves in a run folder
    cmd = [sys.executable, "-m", "train.eval", f"model.path={tiny_flux_dir}", *EVAL, f"eval.transformer={checkpoint}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = run_dir / "eval"
    assert (out / "eval_step_00000002.scores.jsonl").is_file() and (out / ".hydra" / "config.yaml").is_file()
    assert "eval step_00000002: jpeg_compressibility" in done.stdout
    assert "eval step_00000002: jpeg_compressibility" in (out / "eval.log").read_text()


@pytest.mark.parametrize("name, extra", [("eval", []), ("train", ["eval.every=1"])])
def test_no_scorers_fails_before_loading_with_a_hint_that_works_when_typed(name, extra, tmp_path, monkeypatch):
    """experiment=tiny has no eval.scorers: train.eval sampled, then crashed writing the scores (IndexError);
    the trainer's hint eval.scorers={jpeg_compressibility: {}} failed when typed in a shell."""
    overrides = ["experiment=tiny", f"model.path={tmp_path / 'model'}", f"run_dir={tmp_path / 'run'}", *extra]
    monkeypatch.setattr(eval_module, "build_for_eval", lambda *args: pytest.fail("a model was loaded"))
    with pytest.raises(ConfigError, match="eval.scorers") as err:
        (eval_command if name == "eval" else load_config)(compose_config(name, overrides))
    hint = re.search(r"e\.g\. (\S+)", str(err.value)).group(1)
    assert hint == SCORERS_HINT
    check_scorers(load_config(compose_config(name, [*overrides, hint])))  # the hint as typed composes and validates


def test_an_evaluation_shows_its_progress(tiny_flux_dir, tmp_path, monkeypatch):
    """The demo was silent for 24 s before its first evaluation line; a real preset's would be for hours."""
    lines: list[str] = []
    monkeypatch.setattr(evaluation, "log", SimpleNamespace(info=lambda fmt, *args: lines.append(fmt % args)))
    monkeypatch.setattr(evaluation, "PROGRESS_S", 0.0)
    evaluate_cli(tiny_flux_dir, tmp_path / "out")  # 3 prompts, 2 per batch
    assert len(lines) == 1 and re.fullmatch(r"eval pretrained: 2/3 images, [\d.]+s, eta [\d.]+s", lines[0]), lines


def test_eval_checks_the_weights_before_loading(tiny_flux_dir, tmp_path):
    run_dir = train_run(tiny_flux_dir, tmp_path / "run")
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    base = [f"model.path={tiny_flux_dir}", *EVAL, f"run_dir={tmp_path / 'out'}"]
    (run_dir / "notes").mkdir()
    cases = [
        (["eval.transformer=/no/export"], FileNotFoundError, "eval.transformer='/no/export' does not exist"),
        ([f"eval.transformer={run_dir / 'notes'}"], FileNotFoundError, "holds no trained weights"),
        ([f"eval.transformer={run_dir / 'checkpoints' / 'step_00000001'}"], FileNotFoundError, "does not exist"),
        (["eval.compare_pretrained=true"], ValueError, "needs the trained weights"),
        (["resume=auto"], ValueError, "resume=auto names no run"),
        ([f"eval.transformer={checkpoint}", f"resume={run_dir}"], ValueError, "name different weights"),
    ]
    for overrides, error, message in cases:
        with pytest.raises(error, match=message):
            eval_command(compose_config("eval", [*base, *overrides]))
    (checkpoint.parent / "step_00000004.tmp").mkdir()  # an interrupted save
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        find_weights(str(checkpoint.parent / "step_00000004.tmp"), "eval.transformer")


def test_eval_of_lora_checkpoint_and_export(tiny_flux_dir, tmp_path):
    """A LoRA run's checkpoint loads into adapters of its model.lora settings and scores what its exported
    adapter file does; a command without those settings is told which to pass."""
    lora = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8", "optimizer.lr=0.1"]
    run_dir = train_run(tiny_flux_dir, tmp_path / "run", *lora)
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "config.yaml").write_text("model:\n  lora:\n    enabled: true\n    rank: 4\n    alpha: 8\n")
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    assert find_weights(str(run_dir), "eval.transformer").kind == "lora_export"
    evaluate_cli(tiny_flux_dir, tmp_path / "a", f"eval.transformer={checkpoint}", *lora)
    evaluate_cli(tiny_flux_dir, tmp_path / "b", f"eval.transformer={run_dir}/export", "eval.compare_pretrained=true")
    from_checkpoint = scores(tmp_path / "a" / "eval_step_00000002.scores.jsonl")
    assert from_checkpoint == pytest.approx(scores(tmp_path / "b" / "eval_export.scores.jsonl"), abs=1e-5)
    assert from_checkpoint != pytest.approx(scores(tmp_path / "b" / "eval_pretrained.scores.jsonl"), abs=1e-6)
    with pytest.raises(ValueError, match="model.lora.enabled=true"):
        evaluate_cli(tiny_flux_dir, tmp_path / "c", f"eval.transformer={checkpoint}")


def test_paired_difference_by_hand():
    before = [{"index": i, "prompt": p, "s": v} for i, (p, v) in enumerate([("a", 1.0), ("b", 2.0), ("c", 3.0)])]
    after = [{"index": i, "prompt": p, "s": v} for i, (p, v) in enumerate([("a", 1.5), ("b", 2.0), ("c", 4.0)])]
    paired = paired_difference(before, list(reversed(after)), "s")  # matched by prompt, not by position
    # differences 0.5, 0, 1: mean 0.5, sample std 0.5, standard error 0.5 / sqrt(3)
    assert (paired.num_prompts, paired.before, paired.after, paired.difference) == (3, 2.0, 2.5, 0.5)
    assert paired.difference_se == pytest.approx(0.5 / math.sqrt(3))
    assert paired.before_se == pytest.approx(1 / math.sqrt(3))
    assert "paired difference +0.5000 ± 0.2887" in paired.line()
    with pytest.raises(ValueError, match="same prompts"):
        paired_difference(before, after[:2], "s")
    assert math.isnan(standard_error([1.0]))


def test_padding_rows_are_dropped_after_gather():
    # 2 ranks, 5 prompts: rank 0 scored prompts 0, 2, 4; rank 1 scored 1, 3 and padded with 3.
    owners = torch.tensor([0, 2, 4, 1, 3, 3])
    keep = first_occurrences(owners)
    assert owners[keep].tolist() == [0, 2, 4, 1, 3]


def test_samples_per_prompt_repeats_the_prompt_set_with_new_noise(tmp_path):
    # Item j * n + i is sample j of prompt i: sample 0 of every prompt keeps the index (and so the
    # noise, drawn from (eval.seed, "eval_noise", index)) it has with one sample per prompt.
    from train.parts.config.schema import TrainConfig
    from train.parts.eval.evaluator import read_eval_prompts

    prompts = tmp_path / "p.txt"
    prompts.write_text("a\nb\nc\n")
    cfg = TrainConfig()
    cfg.data.train_prompts = str(prompts)
    cfg.eval.samples_per_prompt = 3
    records = [r.prompt for r in read_eval_prompts(cfg.eval, cfg.data.train_prompts)]
    assert records == ["a", "b", "c"] * 3
    cfg.eval.num_prompts = 2
    assert [r.prompt for r in read_eval_prompts(cfg.eval, cfg.data.train_prompts)] == ["a", "b"] * 3


def test_heldout_prompts_are_read_like_eval_prompts_and_logged_under_held_out(tmp_path):
    from train.parts.config.schema import TrainConfig
    from train.parts.eval.evaluator import logged_metrics, read_heldout_prompts

    cfg = TrainConfig()
    cfg.eval.samples_per_prompt = 2
    assert read_heldout_prompts(cfg.eval) == []
    held = tmp_path / "held.txt"
    held.write_text("x\ny\n")
    cfg.eval.heldout_prompts = str(held)
    assert [r.prompt for r in read_heldout_prompts(cfg.eval)] == ["x", "y", "x", "y"]
    summary = {"shape_alignment": 0.5, "shape_alignment/pairs": 0.25}
    assert logged_metrics(summary, "") == {"eval/shape_alignment": 0.5, "eval/shape_alignment/pairs": 0.25}
    assert logged_metrics(summary, "/held-out") == {
        "eval/shape_alignment/held-out": 0.5,
        "eval/shape_alignment/held-out/pairs": 0.25,
    }
