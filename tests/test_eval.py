"""The evaluation protocol: ODE sampling with fixed seeds, scores per category, JSON and grid."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from PIL import Image

from train.evaluation import _first_occurrences

ROOT = Path(__file__).resolve().parents[1]


def test_python_m_train_eval_writes_means_per_category_and_a_grid(tiny_flux_dir, tmp_path):
    prompts = tmp_path / "bench.jsonl"
    rows = [
        ("a cat", "photo"),
        ("a dog", "photo"),
        ("a castle", "paintings"),
        ("a robot", "anime"),
        ("a tree", "anime"),
    ]
    prompts.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for p, c in rows))
    args = ["experiment=tiny", f"model.path={tiny_flux_dir}", "model.build_tiny=null", f"data.eval_prompts={prompts}",
            "+eval.scorers.jpeg_compressibility={}", "eval.num_steps=4", "eval.batch_size=2"]  # fmt: skip
    outputs = []
    for name in ("a", "b"):
        run_dir = tmp_path / name
        cmd = [sys.executable, "-m", "train.eval", *args, f"run_dir={run_dir}", f"hydra.run.dir={run_dir}"]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(json.loads((run_dir / "eval" / "eval.json").read_text()))
    result = outputs[0]
    assert result == outputs[1]  # fixed seeds: the same numbers twice
    assert result["num_prompts"] == 5
    categories = {k.split("/")[1] for k in result if "/" in k}
    assert categories == {"photo", "paintings", "anime"}
    # the overall mean is the mean over prompts, i.e. the count-weighted mean of the categories
    weighted = (2 * result["jpeg_compressibility/photo"] + result["jpeg_compressibility/paintings"]
                + 2 * result["jpeg_compressibility/anime"]) / 5  # fmt: skip
    assert abs(result["jpeg_compressibility"] - weighted) < 1e-5
    grid = Image.open(tmp_path / "a" / "eval" / "eval.png")
    assert grid.size[0] > 32 and grid.size[1] > 32


def test_padding_rows_are_dropped_after_gather():
    # 2 ranks, 5 prompts: rank 0 scored prompts 0, 2, 4; rank 1 scored 1, 3 and padded with 3.
    owners = torch.tensor([0, 2, 4, 1, 3, 3])
    keep = _first_occurrences(owners)
    assert owners[keep].tolist() == [0, 2, 4, 1, 3]


def test_samples_per_prompt_repeats_the_prompt_set_with_new_noise(tmp_path):
    # Item j * n + i is sample j of prompt i: sample 0 of every prompt keeps the index (and so the
    # noise, drawn from (eval.seed, "eval_noise", index)) it has with one sample per prompt.
    from train.build import read_eval_prompts
    from train.config import TrainConfig

    prompts = tmp_path / "p.txt"
    prompts.write_text("a\nb\nc\n")
    cfg = TrainConfig()
    cfg.data.train_prompts = str(prompts)
    cfg.eval.samples_per_prompt = 3
    records = [r.prompt for r in read_eval_prompts(cfg)]
    assert records == ["a", "b", "c"] * 3
    cfg.data.num_eval_prompts = 2
    assert [r.prompt for r in read_eval_prompts(cfg)] == ["a", "b"] * 3


def test_heldout_prompts_are_read_like_eval_prompts_and_logged_under_held_out(tmp_path):
    from train.build import read_heldout_prompts
    from train.config import TrainConfig
    from train.trainer import _eval_keys

    cfg = TrainConfig()
    cfg.eval.samples_per_prompt = 2
    assert read_heldout_prompts(cfg) == []
    held = tmp_path / "held.txt"
    held.write_text("x\ny\n")
    cfg.data.heldout_prompts = str(held)
    assert [r.prompt for r in read_heldout_prompts(cfg)] == ["x", "y", "x", "y"]
    summary = {"shape_alignment": 0.5, "shape_alignment/pairs": 0.25}
    assert _eval_keys(summary, "") == {"eval/shape_alignment": 0.5, "eval/shape_alignment/pairs": 0.25}
    assert _eval_keys(summary, "/held-out") == {
        "eval/shape_alignment/held-out": 0.5,
        "eval/shape_alignment/held-out/pairs": 0.25,
    }
