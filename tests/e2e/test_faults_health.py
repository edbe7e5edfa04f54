"""Runs that stop by themselves (docs/reliability.md, Runs that diverge or learn nothing): steps that cannot
change the weights, weights out of range, collapsed images, NaN weights in the model; a reward without spread is
named."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from run_folders import copy_run, files_of, nan_rewards, refused_line
from safetensors.torch import load_file
from small_run import the_error

from train.parts.config.schema import HealthConfig

pytestmark = pytest.mark.usefixtures("repo_root")  # the tiny experiment's prompt file is relative to the repository


@pytest.mark.parametrize("why", ["nan-reward", "cancelling-rewards"])
def test_a_run_that_cannot_learn_stops_after_max_bad_steps(why, launch, tmp_path, monkeypatch):
    """Every step skipped (NaN rewards) or with a zero gradient (weights that cancel): after 2 such steps the
    run writes its checkpoint and stops in one line, status 2."""
    overrides = ["num_steps=4", "checkpoint.every=0", "health.max_bad_steps=2"]
    if why == "nan-reward":
        nan_rewards(monkeypatch)
    else:
        overrides.append("+reward.components.jpeg_incompressibility.weight=1")  # minus the other: the sum is 0
    line = refused_line(launch, tmp_path / "run", *overrides)
    expected = "a reward was NaN" if why == "nan-reward" else "the gradient was 0"
    assert re.search(rf"health\.max_bad_steps=2: steps 0 to 1 .*{expected}.*step_00000002", line), line
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_00000002"]


def test_a_run_none_of_whose_steps_learned_is_not_exported(launch, tmp_path, monkeypatch):
    """Shorter than health.max_bad_steps, every reward NaN: a checkpoint, one line, status 2, and no export or summary
    that would call the loaded weights trained."""
    nan_rewards(monkeypatch)
    run_dir = tmp_path / "run"
    status, stderr, stdout = launch(run_dir, "num_steps=2", stdout=True)
    line = the_error(stderr)
    assert status == 2 and re.search(r"none of steps 0 to 1 could change the weights .*NaN.* nothing is exported", line)
    assert line.endswith("wrote checkpoint " + str(run_dir / "checkpoints" / "step_00000002")), line
    assert not (run_dir / "export").exists() and "finished" not in stdout + stderr


def test_a_reward_without_spread_is_named(monkeypatch):
    from train.parts.observe import health

    warnings = []
    monkeypatch.setattr(health.log, "warning", lambda message, *args: warnings.append(message % args))
    metrics_of = {"spread/jpeg_compressibility": 0.0, "spread/clipscore": 0.5, "train/grad_norm": 1.0}
    watch = health.Health(HealthConfig(), optimizer_steps=1, first=0, last=100, start_norm=1.0)
    for step in range(health.SPREAD_STEPS + 2):
        assert watch.observe(metrics_of, step) is None
    assert len(warnings) == 1 and warnings[0].startswith("reward.components.jpeg_compressibility: its scores tied")


# (health settings, metrics of step 5, the first step count whose weights diverged or None): the bounds' edges
HEALTH_BOUNDS = {
    "grown": ({}, {"health/weight_growth": 10.5}, 6),
    "shrunk": ({}, {"health/weight_growth": 0.09}, 6),
    "within": ({}, {"health/weight_growth": 9.5, "health/flat_images": 0.5}, None),
    "growth-off": ({"max_weight_growth": 0}, {"health/weight_growth": 1e9}, None),
    "all-flat": ({}, {"health/weight_growth": 1.0, "health/flat_images": 1.0}, 5),
    "flat-off": ({"flat_image_range": 0}, {"health/flat_images": 1.0}, None),
}


@pytest.mark.parametrize("case", list(HEALTH_BOUNDS))
def test_the_health_bounds(case):
    from train.parts.observe.health import Health

    settings, measured, bad_from = HEALTH_BOUNDS[case]
    watch = Health(HealthConfig(**settings), optimizer_steps=1, first=0, last=100, start_norm=1.0)
    verdict = watch.observe({"train/grad_norm": 1.0, **measured}, 5)
    assert (verdict and verdict.bad_from) == bad_from, verdict


def black_images(monkeypatch) -> None:
    """Every rollout decodes to black images, as a policy that collapsed samples them."""
    from train.loop import step

    monkeypatch.setattr(step, "decode_images", lambda backbone, latents, model: torch.zeros(len(latents), 3, 8, 8))


# How a resumed run diverges (steps 2 and 3 after the trained run's 2): the line's cause, and the checkpoint it
# names as the last before the weights that diverged (step_00000002 sampled the black images of step 2).
DIVERGED = {
    "weights": (
        ["optimizer.lr=0.9", "health.max_weight_growth=2"],
        r"health\.max_weight_growth=2: after step 2 the trainable weights' norm is [\d.]+ times its value at the start",
        r"is \S+/step_00000002: lower optimizer\.lr \(now 0\.9\), then resume=auto continues from it$",
    ),
    "flat-images": (
        [],
        r"health\.flat_image_range=0\.00392: every image sampled in step 2 is one flat colour: the weights after 2",
        r"is \S+/step_00000001 \(step_00000002 after it\): lower optimizer\.lr \(now 0\.003\), then resume=\S+01 ",
    ),
}


@pytest.mark.parametrize("case", list(DIVERGED))
def test_a_diverged_run_stops_before_saving_the_diverged_weights(case, trained, launch, tmp_path, monkeypatch):
    """Weights that grew past health.max_weight_growth, or images that are all one colour, in a run of finite
    numbers: one line naming the bound and the last checkpoint before, status 2; no checkpoint or export changed."""
    overrides, cause, left = DIVERGED[case]
    if case == "flat-images":
        black_images(monkeypatch)
    run_dir = copy_run(trained, tmp_path)
    saved = {name: files_of(run_dir / name) for name in ("checkpoints", "export")}
    line = refused_line(launch, run_dir, "num_steps=4", "checkpoint.every=1", "resume=auto", *overrides)
    assert re.search(cause, line) and re.search(left, line), line
    assert {name: files_of(run_dir / name) for name in saved} == saved


def nan_weights(tiny_flux_dir: Path, tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    folder = Path(shutil.copytree(tiny_flux_dir, tmp_path / "nan"))
    file = next((folder / "transformer").glob("*.safetensors"))
    tensors = load_file(file)
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, file)
    return folder


def test_nan_weights_in_the_model_are_one_line(tiny_flux_dir, launch, tmp_path):
    model = nan_weights(tiny_flux_dir, tmp_path)
    line = refused_line(launch, tmp_path / "run", f"model.path={model}", "model.build_tiny=null")
    assert re.search(r"model\.path=.*nan'.* weights hold 1 NaN or inf values \(the first in ", line), line
    assert not (tmp_path / "run").exists()
