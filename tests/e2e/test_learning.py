"""GRPO learns: a short run on the CPU testbed raises its evaluation reward over the frozen model.

The testbed pipeline (testbed/pipeline, pretrained) is trained for a few steps with the JPEG
compressibility reward, whose gradient points one way for every caption and noise (smaller files:
flatter colours, cleaner edges), so a handful of optimizer steps move it well beyond the spread of
the evaluation (the shape reward of the default job needs ~100 steps: docs/testbed.md). The
evaluation is the ODE with fixed noise, so its step-0 value is the frozen model and the difference
is paired. The shape-alignment reward rides along at a small weight with ``reward.combine=advantage``,
so every step takes per-reward group advantages of a discrete reward as well; every group is centred,
so ``adv/mean`` is zero to float rounding (the exact-zero advantage of tied groups, which are rare
here, is pinned by tests/unit/test_grpo.py).

Measured (4 steps): gain +0.42 (exact) and +0.32 (jagg) kB against a margin of 0.15; with the
advantages' sign flipped -0.37 and -0.36. The test fails if the sign flips (the reward falls), if
the optimizer steps on zero gradients or the gradients never reach it (the reward stays where it
was), and if a group's advantages stop being centred.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from train.loop.trainer import run
from train.parts.config.schema import register_schema

ROOT = Path(__file__).resolve().parents[2]
register_schema()
NUM_STEPS = 4
FAST = [
    f"num_steps={NUM_STEPS}",
    "reward=jpeg",
    "reward.combine=advantage",
    "+reward.components.shape_alignment.weight=0.25",
    "grpo.group_size=8",
    "batch.prompts_per_rank=2",
    "batch.micro_batch=8",
    "batch.gradient_accumulation_steps=16",
    "optimizer.lr=1e-3",
    "grpo.kl_beta=0",
    "ema.decay=0",
    "data.train_prompts=testbed/prompts/train.txt",
    "eval.prompts=testbed/prompts/captions.txt",
    "eval.num_prompts=16",
    "eval.samples_per_prompt=1",
    "+eval.scorers.jpeg_compressibility={}",
    f"eval.every={NUM_STEPS}",
    "logging.sample_every=0",
    "logging.progress_bar=false",
    "checkpoint.every=0",
    "checkpoint.export=false",
]
MARGIN = 0.15  # kB of JPEG per image; the paired evaluation's own spread is ~0 (fixed noise)


def train(run_dir: Path, overrides: list[str]) -> list[dict]:
    with initialize_config_module(config_module="configs", version_base=None):
        run(compose(config_name="train", overrides=[f"run_dir={run_dir}", *FAST, *overrides]))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exact", "jagg"])
def test_short_run_raises_the_evaluation_reward(mode, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the prompt files named above are relative to the repository root
    rows = train(tmp_path / mode, [f"update={mode}"])
    evals = {r["step"]: r["eval/jpeg_compressibility"] for r in rows if "eval/jpeg_compressibility" in r}
    assert sorted(evals) == [0, NUM_STEPS]
    assert all(
        "eval/jpeg_compressibility/held-out" in r
        for r in rows
        if r["step"] in evals and "eval/jpeg_compressibility" in r
    )
    gain = evals[NUM_STEPS] - evals[0]
    assert gain > MARGIN, f"{mode}: evaluation reward {evals[0]:.4f} -> {evals[NUM_STEPS]:.4f}"
    steps = [r for r in rows if "adv/mean" in r]
    assert len(steps) == NUM_STEPS and all(r["train/skipped_optimizer_steps"] == 0 for r in steps)
    # every group centred (tied shape groups included): the mean advantage is zero to float rounding
    assert max(abs(r["adv/mean"]) for r in steps) < 1e-6
