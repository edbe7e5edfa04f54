"""python -m train.compare: the reward table, the efficiency summary and the plots, from metrics.jsonl."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from PIL import Image

from models.registry import backbone_names
from rewards.base import SCORER_NAMES
from train.compare import main
from train.config import register_schema, validate

ROOT = Path(__file__).resolve().parents[1]
register_schema()
TINY_RUN = [
    "experiment=tiny",
    "num_steps=2",
    "sampler.num_steps=5",
    "update.window=2",
    "grpo.group_size=2",
    "grpo.prompts_per_rank=1",
    "grpo.micro_batch=2",
    "grpo.gradient_accumulation_steps=2",
    "logging.progress_bar=false",
    "logging.sample_every=0",
    "checkpoint.export=false",
    "logging.eval_every=1",
    "+eval.scorers.jpeg_compressibility={}",
    "eval.num_steps=3",
    "eval.batch_size=2",
    "data.num_eval_prompts=2",
]


@pytest.fixture(scope="module")
def tiny_runs(tiny_flux_dir, tmp_path_factory) -> list[Path]:
    """Two 2-step runs of the tiny Flux, exact and jagg, each evaluated after every step."""
    from train.trainer import run

    root = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)  # the demo's prompt file is relative to the repository root
        for mode in ("exact", "jagg"):
            overrides = [f"run_dir={root / mode}", f"model.path={tiny_flux_dir}", f"update={mode}", *TINY_RUN]
            with initialize_config_module(config_module="configs", version_base=None):
                run(compose(config_name="train", overrides=overrides))
    return [root / "exact", root / "jagg"]


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_two_tiny_runs_give_table_summary_and_plots(tiny_runs, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main([*map(str, tiny_runs), "--out", str(out), "--warmup", "0"]) == 0
    printed = capsys.readouterr().out
    # Table 3: one row per evaluation step, the runs' eval values side by side.
    key = "eval/jpeg_compressibility"
    evals = {run.name: {r["step"]: r[key] for r in records(run) if key in r} for run in tiny_runs}
    assert sorted(evals["exact"]) == [0, 1, 2]  # before training, after step 1 and after step 2
    for step in (0, 1, 2):
        line = next(row for row in printed.splitlines() if row.split()[:1] == [str(step)])
        for run in ("exact", "jagg"):
            assert f"{evals[run][step]:.4f}" in line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["baseline"] == "exact"
    # --warmup 0: the mean over both steps
    mean_step = {run.name: sum(r["time/step"] for r in records(run) if "time/step" in r) / 2 for run in tiny_runs}
    expected = (mean_step["exact"] - mean_step["jagg"]) / mean_step["exact"] * 100
    assert summary["efficiency"]["jagg"]["speedup_step_pct"] == pytest.approx(expected)
    assert f"{expected:.1f}%" in printed
    for name in ("eval_jpeg_compressibility", "reward_jpeg_compressibility", "reward_total", "time_per_phase"):
        with Image.open(out / f"{name}.png") as image:
            assert image.format == "PNG" and min(image.size) > 100
    assert "| step |" in (out / "table.md").read_text()


def write_run(folder: Path, lines: list[dict | str]) -> Path:
    folder.mkdir(parents=True)
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    (folder / "metrics.jsonl").write_text(text + "\n")
    return folder


def step(i: int, reward: float, t_step: float, t_update: float) -> dict:
    return {"step": i, "reward/hpsv2": reward, "time/step": t_step, "time/update": t_update, "time/rollout": 1.0}


def test_training_rewards_and_speedups_by_hand(tmp_path, capsys):
    # No eval records: the table falls back to the training rewards. After one warm-up step the mean
    # step times are (4 + 6) / 2 = 5 s and (4 + 3) / 2 = 3.5 s: a 30% speed-up; update 2 -> 1.5 s: 25%.
    base = write_run(tmp_path / "base", [step(0, 0.20, 10, 9), step(1, 0.25, 4, 2), step(2, 0.30, 6, 2)])
    fast = write_run(tmp_path / "fast", [step(0, 0.20, 10, 9), step(1, 0.26, 4, 1), step(2, 0.27, 3, 2)])
    out = tmp_path / "cmp"
    assert main([str(base), str(fast), "--labels", "exact,jagg", "--out", str(out), "--every", "2"]) == 0
    printed = capsys.readouterr().out
    assert "training rewards" in printed
    rows = [line.split() for line in printed.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"])]
    assert [r[0] for r in rows] == ["0", "2"]  # every 2nd step
    assert rows[1][1:] == ["0.3000*", "0.2700"]
    eff = json.loads((out / "summary.json").read_text())["efficiency"]
    assert eff["jagg"]["speedup_step_pct"] == pytest.approx(30.0)
    assert eff["jagg"]["speedup_update_pct"] == pytest.approx(25.0)
    assert eff["exact"]["step"] == pytest.approx(5.0)


def test_replayed_steps_keep_the_later_values(tmp_path, capsys):
    run = write_run(tmp_path / "run", [step(0, 0.1, 1, 1), step(1, 0.2, 1, 1), step(1, 0.9, 1, 1)])
    assert main([str(run), "--out", str(tmp_path / "cmp")]) == 0
    assert "0.9000" in capsys.readouterr().out


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda p: p / "nowhere", "does not exist"),
        (lambda p: (p / "empty_dir").mkdir() or p / "empty_dir", "has no metrics.jsonl"),
        (lambda p: write_run(p / "bad", [step(0, 0.1, 1, 1), "{not json"]), "metrics.jsonl:2 is not valid JSON"),
        (lambda p: write_run(p / "nostep", [{"reward/hpsv2": 0.1}]), 'integer "step"'),
        (lambda p: write_run(p / "blank", [""]), "no logged step"),
    ],
)
def test_bad_run_folder_is_named_with_the_reason(make, reason, tmp_path, capsys):
    good = write_run(tmp_path / "good", [step(0, 0.1, 1, 1)])
    bad = make(tmp_path)
    assert main([str(good), str(bad), "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err
    assert str(bad.name) in err and reason in err


def test_labels_must_be_distinct_and_complete(tmp_path, capsys):
    a = write_run(tmp_path / "a" / "run", [step(0, 0.1, 1, 1)])
    b = write_run(tmp_path / "b" / "run", [step(0, 0.1, 1, 1)])
    assert main([str(a), str(b), "--out", str(tmp_path / "cmp")]) == 2
    assert "--labels" in capsys.readouterr().err
    assert main([str(a), str(b), "--labels", "x", "--out", str(tmp_path / "cmp")]) == 2
    assert main([str(a), str(b), "--labels", "x,y", "--baseline", "z", "--out", str(tmp_path / "cmp")]) == 2
    assert "--baseline 'z'" in capsys.readouterr().err


def dry_run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """A launcher of scripts/launch with DRY_RUN=1: it prints its commands instead of running them."""
    full_env = {"PATH": os.environ["PATH"], "DRY_RUN": "1", **env}
    return subprocess.run([ROOT / "scripts" / "launch" / script, *args], env=full_env, capture_output=True, text=True)


@pytest.mark.parametrize("experiment", ["flux_dance", "qwenimage_dance", "flux_flow_fast", "qwenimage_flow_fast"])
def test_experiment_launchers_compose_and_validate(experiment, tmp_path, monkeypatch):
    assert dry_run(f"{experiment}.sh").returncode == 2  # no paths exported: refused, naming the variable
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    model = str(tmp_path)
    paths = dict(FLUX_PATH=model, QWENIMAGE_PATH=model, TRAIN_PROMPTS=str(prompts), HPS_CKPT="/ckpt/hps.pt")
    paths |= dict(CLIP_PATH=model, PICKSCORE_PATH=model, PICKSCORE_PROCESSOR=model)
    result = dry_run(f"{experiment}.sh", "update=ablate", **paths)
    assert result.returncode == 0, result.stderr
    cmd = shlex.split(result.stdout)
    assert cmd[:4] == ["torchrun", "--standalone", "--nproc_per_node", "8"] and cmd[4:6] == ["-m", "train"]
    overrides = [arg for arg in cmd[6:] if not arg.startswith("hydra.")]
    assert f"experiment={experiment}" in overrides and f"model.path={model}" in overrides
    monkeypatch.chdir(ROOT)
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = OmegaConf.to_object(compose(config_name="train", overrides=[f"run_dir={tmp_path}", *overrides]))
    validate(cfg, known_scorers=SCORER_NAMES, known_backbones=tuple(backbone_names()))
    assert cfg.update.mode == "ablate" and cfg.reward.components["hpsv2"]["checkpoint"] == "/ckpt/hps.pt"


def test_compare_modes_runs_three_modes_in_one_group_then_compares():
    result = dry_run("compare_modes.sh", "demo", "num_steps=2", NPROC_PER_NODE="1", GROUP="g", OUT_DIR="out")
    assert result.returncode == 0, result.stderr
    *launches, compare = [shlex.split(line) for line in result.stdout.splitlines()]
    for mode, cmd in zip(("exact", "jagg", "ablate"), launches, strict=True):
        assert cmd[0] == "torchrun" and "--nproc_per_node" in cmd and cmd[cmd.index("--nproc_per_node") + 1] == "1"
        assert {f"update={mode}", "logging.group=g", f"hydra.run.dir=out/{mode}", "num_steps=2"} <= set(cmd)
    assert compare[1:] == [
        "-m", "train.compare", "out/exact", "out/jagg", "out/ablate", "--labels", "exact,jagg,ablate",
        "--out", "out/compare",
    ]  # fmt: skip


def test_testbed_compare_sweeps_the_three_modes_then_compares(tmp_path):
    """python -m train -m experiment=testbed_compare: one job per update mode with the same seed,
    then the Hydra callback writes the comparison of the three folders."""
    sweep = tmp_path / "sweep"
    short = ["num_steps=1", "grpo.prompts_per_rank=1", "grpo.group_size=2", "grpo.micro_batch=2"]
    short += ["grpo.gradient_accumulation_steps=2", "data.num_eval_prompts=2", "eval.batch_size=2"]
    short += ["logging.eval_every=1", "logging.sample_every=0", "checkpoint.export=false"]
    cmd = [sys.executable, "-m", "train", "-m", "experiment=testbed_compare", *short, f"hydra.sweep.dir={sweep}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["ablate", "compare", "exact", "jagg"]
    summary = json.loads((sweep / "compare" / "summary.json").read_text())
    assert summary["baseline"] == "exact" and set(summary["runs"]) == {"exact", "jagg", "ablate"}
    firsts = {run: values["shape_alignment"]["0"] for run, values in summary["eval"].items()}
    assert len(set(firsts.values())) == 1  # the same seeds: the same model evaluated before training
    assert "speed-up over exact" in done.stdout
