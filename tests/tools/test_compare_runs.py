"""python -m train.compare: the reward table, the efficiency summary and the plots, from metrics.jsonl
and from wandb runs (offline run folders, online runs through a stand-in for wandb's API)."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from PIL import Image
from run_folders import metrics
from small_run import FAST

from models.registry import backbone_names
from rewards.base import SCORER_NAMES
from train.parts.config.schema import register_schema
from train.run.checks import validate
from train.tools.compare.arms import arm_rewards, build_comparison, group_arms
from train.tools.compare.command import main
from train.tools.compare.plots import training_panels
from train.tools.compare.runs import load_run
from train.tools.compare.tables import reach_cell

ROOT = Path(__file__).resolve().parents[2]
register_schema()
TINY_RUN = [
    *FAST,
    "num_steps=2",
    "update.segment_length=2",
    "checkpoint.export=false",
    "eval.every=1",
    "+eval.scorers.jpeg_compressibility={}",
    "eval.num_steps=3",
    "eval.batch_size=2",
    "eval.num_prompts=2",
    "logging.wandb_mode=offline",
]


@pytest.fixture(scope="module")
def tiny_runs(tiny_flux_dir, tmp_path_factory) -> list[Path]:
    """Two 2-step runs of the tiny Flux, exact and jagg, each evaluated after every step."""
    from train.loop.trainer import run

    root = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)  # the demo's prompt file is relative to the repository root
        for mode in ("exact", "jagg"):
            overrides = [f"run_dir={root / mode}", f"model.path={tiny_flux_dir}", f"update={mode}", *TINY_RUN]
            with initialize_config_module(config_module="configs", version_base=None):
                run(compose(config_name="train", overrides=overrides))
    return [root / "exact", root / "jagg"]


def test_two_tiny_runs_give_tables_and_plots(tiny_runs, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main([*map(str, tiny_runs), "--out", str(out), "--warmup", "0"]) == 0
    printed = capsys.readouterr().out
    # arms are labelled from the runs' own configurations: update.mode is the setting that differs
    assert "- exact: seeds [42]" in printed and "- jagg: seeds [42]" in printed
    assert "baseline: exact; its update.mode is exact" in printed
    key = "eval/jpeg_compressibility"
    evals = {run.name: {r["step"]: r[key] for r in metrics(run) if key in r} for run in tiny_runs}
    assert sorted(evals["exact"]) == [0, 1, 2]  # before training, after step 1 and after step 2
    for step in (0, 1, 2):
        line = next(row for row in printed.splitlines() if row.split()[:1] == [str(step)])
        for run in ("exact", "jagg"):
            assert f"{evals[run][step]:.4f} (n=1)" in line  # one seed: no interval
    summary = json.loads((out / "summary.json").read_text())
    assert summary["baseline"] == "exact"
    # --warmup 0: the median of the two steps' times (two values: their mean)
    med = {run.name: sum(r["time/step"] for r in metrics(run) if "time/step" in r) / 2 for run in tiny_runs}
    assert summary["arms"]["jagg"]["time_median_s"]["step"] == pytest.approx(med["jagg"])
    expected = (med["exact"] - med["jagg"]) / med["exact"] * 100
    assert f"{expected:.1f}%" in printed
    names = ["eval_jpeg_compressibility_vs_step", "eval_jpeg_compressibility_vs_training_time"]
    for name in (*names, "eval_jpeg_compressibility_vs_wall", "training_curves", "time_per_phase"):
        with Image.open(out / f"{name}.png") as image:
            assert image.format == "PNG" and min(image.size) > 100
    assert "| step |" in (out / "table.md").read_text()


def test_offline_wandb_runs_of_a_tiny_job_compare_as_their_metrics_files(tiny_runs, tmp_path, capsys):
    """The same two runs read from their wandb/offline-run-* folders give the same comparison."""
    by_file, by_wandb = tmp_path / "file", tmp_path / "wandb"
    assert main([*map(str, tiny_runs), "--out", str(by_file), "--warmup", "0"]) == 0
    offline = [next((run / "wandb").glob("offline-run-*")) for run in tiny_runs]
    assert main([*map(str, offline), "--out", str(by_wandb), "--warmup", "0"]) == 0
    printed = capsys.readouterr().out
    assert "- exact: seeds [42]" in printed and "baseline: exact; its update.mode is exact" in printed
    a, b = (json.loads((out / "summary.json").read_text()) for out in (by_file, by_wandb))
    for arm in ("exact", "jagg"):
        assert a["arms"][arm].pop("runs") != b["arms"][arm].pop("runs")  # read from different places
    assert a == b  # every reward, every step time, the baseline: equal
    # a folder holding the wandb folders (a sweep copied from a cluster) is read as a sweep
    assert main([str(tiny_runs[0] / "wandb"), "--out", str(tmp_path / "dir"), "--warmup", "0"]) == 0


def offline_session(root: Path, run_id: str, values: dict[int, float], config: dict) -> None:
    import wandb

    os.environ["WANDB_SILENT"] = "true"
    run = wandb.init(mode="offline", dir=str(root), id=run_id, resume="allow", project="p", config=config)
    for s, v in values.items():
        run.log({"eval/hps": v, "wall_time": float(s)}, step=s)
    run.finish()
    wait_for_offline_records(root / "wandb")


def wait_for_offline_records(folder: Path, timeout_s: float = 60.0) -> None:
    """wandb's service process writes an offline run's .wandb file on its own schedule, and on a busy
    machine it can still be short of its run record when ``finish()`` returns: wait (bounded) until
    every offline folder's file reads as a started run, as train.compare will read it."""
    from train.tools.compare.wandb_runs import read_offline_file

    deadline = time.monotonic() + timeout_s
    for file in sorted(folder.glob("offline-run-*/*.wandb")):
        while True:
            try:
                read_offline_file(file)
                break
            except ValueError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def test_offline_sessions_of_a_resumed_run_merge_and_damage_is_named(tmp_path, capsys):
    """A resumed run writes a second offline folder with the same id: merged, the replayed step keeps
    its later value (as metrics.jsonl does). A damaged .wandb file is named, exit status 2."""
    from train.tools.compare.wandb_runs import read_offline

    cfg = {"seed": 0, "update": {"mode": "jagg"}}
    offline_session(tmp_path, "abcd1234", {0: 0.1, 1: 0.2, 2: 0.3}, cfg)
    offline_session(tmp_path, "abcd1234", {2: 0.7, 3: 0.8}, cfg)  # resumed at step 2
    folders = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(folders) == 2
    (run,) = read_offline(folders)
    assert run.run_id == "abcd1234" and run.config == cfg
    assert {s: v["eval/hps"] for s, v in run.steps.items()} == {0: 0.1, 1: 0.2, 2: 0.7, 3: 0.8}
    assert main([str(tmp_path / "wandb"), "--out", str(tmp_path / "cmp")]) == 0
    assert "0.8000" in capsys.readouterr().out
    (file,) = folders[0].glob("*.wandb")
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))
    assert main([str(folders[0]), "--out", str(tmp_path / "cmp")]) == 2
    assert f"{file} is damaged" in capsys.readouterr().err


def test_offline_reader_crosses_blocks_and_stops_at_a_cut(tmp_path):
    """Records span wandb's 32 KiB blocks (a 70 kB configuration is cut into first/middle/last chunks;
    500 rows cross several block ends); a file cut inside a record (a killed writer) reads up to it."""
    from train.tools.compare.wandb_runs import BLOCK, read_offline, read_offline_file

    big = {"seed": 1, "note": "x" * 70_000}
    offline_session(tmp_path, "big00001", {s: s / 7 for s in range(500)}, big)
    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    (file,) = folder.glob("*.wandb")
    assert file.stat().st_size > 4 * BLOCK
    (run,) = read_offline([folder])
    assert run.config == big
    assert {s: v["eval/hps"] for s, v in run.steps.items()} == {s: s / 7 for s in range(500)}
    cut = tmp_path / "cut.wandb"
    cut.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    steps = sorted(read_offline_file(cut).steps)
    assert 0 < len(steps) < 500 and steps == list(range(len(steps)))


class FakeApiRun:
    def __init__(self, run_id: str, group: str, mode: str, seed: int, values: dict[int, float]) -> None:
        self.id, self.name, self.group = run_id, f"{mode}-s{seed}", group
        self.config = {"seed": seed, "update": {"mode": mode}, "_wandb": {}}
        self.rows = [{"_step": s, "_runtime": 1.0, "eval/hps": v, "wall_time": 10.0 * s} for s, v in values.items()]

    def scan_history(self):
        return iter(self.rows)


class FakeApi:
    """wandb.Api's two calls train.tools.compare.command makes, over four runs of two groups."""

    RUNS = [
        FakeApiRun("r1", "sweep", "exact", 0, {0: 0.4, 10: 0.5}),
        FakeApiRun("r2", "sweep", "jagg", 0, {0: 0.4, 10: 0.6}),
        FakeApiRun("r3", "sweep", "jagg", 1, {0: 0.4, 10: 0.7}),
        FakeApiRun("r4", "other", "exact", 1, {0: 0.4, 10: 0.9}),
    ]

    def runs(self, path: str, filters: dict):
        assert path == "team/proj"
        return [r for r in self.RUNS if r.group == filters["group"]]

    def run(self, path: str):
        return next(r for r in self.RUNS if f"team/proj/{r.id}" == path)


def test_online_runs_by_group_and_by_id(tmp_path, capsys, monkeypatch):
    import wandb

    monkeypatch.setattr(wandb, "Api", FakeApi)
    assert main(["wandb:team/proj/group:sweep", "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    assert "- exact: seeds [0]" in printed and "- jagg: seeds [0, 1]" in printed
    summary = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert summary["arms"]["jagg"]["runs"] == {"0": "wandb:team/proj/r2", "1": "wandb:team/proj/r3"}
    assert summary["arms"]["jagg"]["eval/hps"]["final"] == {"0": 0.6, "1": 0.7}
    assert main(["wandb:team/proj/r1", "wandb:team/proj/r4", "--out", str(tmp_path / "cmp2")]) == 0
    assert "seeds [0, 1]" in capsys.readouterr().out  # one arm: both exact
    assert main(["wandb:team/proj/group:none", "--out", str(tmp_path / "cmp3")]) == 2
    assert "no run in group 'none'" in capsys.readouterr().err
    assert main(["wandb:team/proj", "--out", str(tmp_path / "cmp3")]) == 2
    assert "group:<name>" in capsys.readouterr().err


def write_run(folder: Path, lines: list[dict | str], config: str | None = None) -> Path:
    folder.mkdir(parents=True)
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    (folder / "metrics.jsonl").write_text(text + "\n")
    if config is not None:
        (folder / ".hydra").mkdir()
        (folder / ".hydra" / "config.yaml").write_text(config)
    return folder


def step(i: int, reward: float, t_step: float, t_update: float) -> dict:
    return {"step": i, "reward/hpsv2": reward, "time/step": t_step, "time/update": t_update, "time/rollout": 1.0}


def config(mode: str, seed: int, lr: float = 1e-4) -> str:
    return f"seed: {seed}\nrun_dir: /r/{mode}{seed}\nupdate:\n  mode: {mode}\noptimizer:\n  lr: {lr}\n"


def evals(values: dict[int, float]) -> list[dict]:
    return [{"step": s, "wall_time": 10.0 * s, "eval/hps": v} for s, v in values.items()]


def test_sweep_over_seeds_by_hand(tmp_path, capsys):
    # Three seeds per arm. exact: final (step 20) 0.50, 0.52, 0.54; jagg: 0.53, 0.56, 0.56 (same seeds).
    # jagg - exact per seed: +0.03, +0.04, +0.02 -> mean +0.03, std 0.01, t(2) = 4.303 -> +-0.0248:
    # distinguishable. Means over training (trapezoids over steps 0, 10, 20) likewise by hand.
    sweep = tmp_path / "sweep"
    exact = {0: [0.40, 0.45, 0.50], 1: [0.40, 0.47, 0.52], 2: [0.40, 0.46, 0.54]}
    jagg = {0: [0.40, 0.47, 0.53], 1: [0.40, 0.49, 0.56], 2: [0.40, 0.46, 0.56]}
    for mode, table in (("exact", exact), ("jagg", jagg)):
        for seed, (a, b, c) in table.items():
            timing = [step(i, 0.1, 2.0 if mode == "exact" else 1.2, 1.0) for i in range(3)]
            write_run(sweep / mode / f"s{seed}", timing + evals({0: a, 10: b, 20: c}), config(mode, seed))
    write_run(sweep / "probe", [])  # an empty metrics file: skipped, named
    (sweep / "compare").mkdir()  # no metrics file: not a run
    assert main([str(sweep)]) == 0
    printed = capsys.readouterr().out
    assert f"skipped {sweep / 'probe'}" in printed
    assert (sweep / "compare" / "table.md").is_file()  # the default output of one sweep folder
    paired_line = next(line for line in printed.splitlines() if "final: " in line and line.strip().startswith("jagg"))
    assert "+0.0300 ± 0.0248" in paired_line and "final: yes, higher" in paired_line
    summary = json.loads((sweep / "compare" / "summary.json").read_text())
    assert summary["arms"]["jagg"]["eval/hps"]["final"] == {"0": 0.53, "1": 0.56, "2": 0.56}
    auc = (10 * (0.40 + 0.45) / 2 + 10 * (0.45 + 0.50) / 2) / 20  # exact, seed 0
    assert summary["arms"]["exact"]["eval/hps"]["auc"]["0"] == pytest.approx(auc)
    assert "40.0%" in printed  # median step time 1.2 s against 2.0 s
    assert "*" not in printed  # no "best" marks


def test_a_sweep_counts_runs_not_timelines_and_names_configs_it_could_not_read(tmp_path, capsys):
    """A resumed run's retired timeline (checkpoints/retired/<time>_after_step_N/ with its rows) is not an arm;
    a run whose config is damaged or cut short (mid-line, or at a line's end) is named once and left out, and
    the others compare with their seeds together."""
    sweep = tmp_path / "sweep"
    for mode in ("exact", "jagg"):
        for seed in (0, 1):
            write_run(sweep / f"{mode}_s{seed}", evals({0: 0.40, 10: 0.50 + 0.01 * seed}), config(mode, seed))
    retired = sweep / "exact_s0" / "checkpoints" / "retired" / "2026-12-05T01-00-00_after_step_00000005"
    write_run(retired, evals({10: 0.9}))
    whole = config("jagg", 2)
    cut = {"mid_line": whole[: whole.index("jagg") + 2], "line_end": whole[: whole.index("update:")]}
    cut["damaged"] = "seed: 2\nupdate: [\n"
    for name, text in cut.items():
        write_run(sweep / f"jagg_{name}", evals({0: 0.40, 10: 0.7}), text)
    assert main([str(sweep)]) == 0
    printed = capsys.readouterr().out
    assert "- exact: seeds [0, 1]" in printed and "- jagg: seeds [0, 1]" in printed
    summary = json.loads((sweep / "compare" / "summary.json").read_text())
    assert list(summary["arms"]) == ["exact", "jagg"]
    assert summary["arms"]["exact"]["eval/hps"]["final"] == {"0": 0.5, "1": 0.51}  # not the retired 0.9
    assert f"left out 1 retired timeline(s) of {sweep / 'exact_s0'}" in printed
    for name in cut:
        assert sum(f"not read: {sweep / f'jagg_{name}'}" in line for line in printed.splitlines()) == 1
    assert "stops before update.mode, which the other runs record (cut short?)" in printed
    assert "ends mid-line (cut short)" in printed and "does not read as the YAML" in printed
    # a run folder named on its own whose config is damaged: named, the others compared
    assert main([str(sweep / "exact_s0"), str(sweep / "jagg_damaged"), "--out", str(tmp_path / "cmp")]) == 0
    assert "not read:" in capsys.readouterr().out
    # --labels counts the runs given: one left out is named in the refusal
    labels = ["--labels", "a,b", "--out", str(tmp_path / "cmp")]
    assert main([str(sweep / "exact_s0"), str(sweep / "jagg_damaged"), *labels]) == 2
    assert "--labels names 2 runs but 1 runs are given; not read: " in capsys.readouterr().err
    # nothing readable: one line, exit status 2
    assert main([str(sweep / "jagg_damaged"), "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no run to compare" in err and "jagg_damaged" in err


def test_training_time_to_a_reward_threshold_over_seeds(tmp_path, capsys):
    """--reward-threshold 0.06: per seed, the sum of the step times before its first evaluation 0.06 over step 0
    (exact 2 s a step, jagg 1 s); the mean and 95% interval over the seeds that reach it, the others counted."""
    exact = {0: [0.40, 0.48, 0.50], 1: [0.40, 0.44, 0.49], 2: [0.40, 0.48, 0.52]}  # reached at steps 10, 20, 10
    jagg = {0: [0.40, 0.50, 0.55], 1: [0.40, 0.42, 0.43], 2: [0.40, 0.47, 0.48]}  # 10, never, 10
    for mode, table in (("exact", exact), ("jagg", jagg)):
        for seed, (a, b, c) in table.items():
            timing = [step(i, 0.1, 2.0 if mode == "exact" else 1.0, 0.5) for i in range(20)]
            write_run(tmp_path / "sweep" / f"{mode}_s{seed}", timing + evals({0: a, 10: b, 20: c}), config(mode, seed))
    assert main([str(tmp_path / "sweep"), "--reward-threshold", "0.06"]) == 0
    printed = capsys.readouterr().out
    half = 4.303 * (400 / 3) ** 0.5 / 3**0.5  # exact: 20, 40, 20 s -> mean 26.7, sample std sqrt(400 / 3)
    exact_line = next(line for line in printed.splitlines() if line.strip().startswith("exact "))
    assert "training time to +0.06 [s]" in printed and f"26.7 ± {half:.1f}" in exact_line
    assert "10.0 ± 0.0 (2 of 3 seeds; the others never)" in printed
    # paired on the seeds: jagg's time over exact's, where both reached it (seeds 0 and 2: 10 / 20 s)
    assert "time to +0.06 / exact's" in printed
    assert "0.500 ± 0.000 (2 of 3 seeds reached it in both)" in printed
    summary = json.loads((tmp_path / "sweep" / "compare" / "summary.json").read_text())
    assert summary["arms"]["exact"]["eval/hps"]["time_to_threshold"] == {"0": 20.0, "1": 40.0, "2": 20.0}
    assert summary["arms"]["jagg"]["eval/hps"]["time_to_threshold"] == {"0": 10.0, "1": None, "2": 10.0}
    assert reach_cell({0: math.inf, 1: math.inf}) == "never (0 of 2 seeds)"
    assert main([str(tmp_path / "sweep")]) == 0 and "training time to" not in capsys.readouterr().out


def test_held_out_metrics_are_compared_and_rewards_plot_against_training_time(tmp_path, capsys):
    """eval/<metric>/held-out was left out although --help says every logged metric is compared; the
    reward-vs-wall plot counted evaluation time and stalls, so the x of the training-time view is the
    sum of the step times before each evaluation."""
    rows = [step(i, 0.1, 2.0, 1.0) for i in range(4)]  # steps 0-3, 2 s each
    rows += [{**e, "eval/hps/held-out": e["eval/hps"] - 0.1, "eval/hps/photo": 0.3} for e in evals({0: 0.4, 4: 0.6})]
    run = write_run(tmp_path / "run", rows, config("jagg", 0))
    assert main([str(run), "--out", str(tmp_path / "cmp"), "--warmup", "0"]) == 0
    printed = capsys.readouterr().out
    assert "eval/hps/held-out: mean" in printed and "eval/hps/photo" not in printed  # categories: on request
    summary = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert summary["arms"]["jagg"]["eval/hps/held-out"]["final"] == {"0": pytest.approx(0.5)}
    curves = arm_rewards(group_arms([load_run(run)])[0], "hps")
    assert curves.training_time == {0: 0.0, 4: 8.0} and curves.wall == {0: 0.0, 4: 40.0}
    for name in ("eval_hps_held-out_vs_training_time", "eval_hps_vs_wall", "training_curves"):
        assert (tmp_path / "cmp" / f"{name}.png").is_file()


def test_the_best_evaluation_of_each_seed_and_how_much_it_beat_the_last(tmp_path, capsys):
    """As checkpoint.keep_best picks it: the highest evaluation after a training step (step 0's higher one does not
    count), the earlier on a tie; its margin over the seed's last evaluation, over seeds, with the steps."""
    sweep = tmp_path / "sweep"
    for seed, values in ((0, {0: 0.9, 10: 0.5, 20: 0.7, 30: 0.6}), (1, {0: 0.4, 10: 0.6, 20: 0.6, 30: 0.6})):
        write_run(sweep / f"s{seed}", [step(i, 0.1, 1.0, 1.0) for i in range(30)] + evals(values), config("jagg", seed))
    assert main([str(sweep), "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    assert "best - last (best step)" in printed and "+0.0500 ± " in printed and "(steps 20, 10)" in printed
    best = json.loads((tmp_path / "cmp" / "summary.json").read_text())["arms"]["jagg"]["eval/hps"]["best"]
    assert best == {"0": {"step": 20, "over_last": pytest.approx(0.1)}, "1": {"step": 10, "over_last": 0.0}}


def test_arms_come_in_one_order_whatever_the_folder_names(tmp_path, capsys):
    """A sweep folder's runs are read in name order (ablate, exact, jagg); the reports show exact, jagg, ablate."""
    for mode in ("ablate", "exact", "jagg"):
        write_run(tmp_path / "sweep" / f"{mode}_s0", evals({0: 0.4, 5: 0.5}), config(mode, 0))
    assert main([str(tmp_path / "sweep")]) == 0
    summary = json.loads((tmp_path / "sweep" / "compare" / "summary.json").read_text())
    assert list(summary["arms"]) == ["exact", "jagg", "ablate"]


def test_arms_are_labelled_by_the_settings_that_differ(tmp_path, capsys):
    a = write_run(tmp_path / "1", evals({0: 0.4, 5: 0.5}), config("jagg", 0, lr=1e-4))
    b = write_run(tmp_path / "2", evals({0: 0.4, 5: 0.6}), config("jagg", 0, lr=3e-4))
    assert main([str(a), str(b), "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out
    assert "- optimizer.lr=0.0001: seeds [0]" in printed and "- optimizer.lr=0.0003: seeds [0]" in printed
    assert "the first arm given" in printed  # no exact arm: the first is the baseline, and it says why


def test_runs_of_other_inner_epochs_are_arms_and_their_passes_plot(tmp_path, capsys):
    """grpo.inner_epochs is a knob like any other: one pass and two passes, two seeds each, are two arms named by it;
    the two-pass runs' per-pass ratio and clip fraction (train/pass<k>/*) leave the tables whole and plot as a line
    per pass, the one-pass runs' clip fraction as its own panel."""
    for passes in (1, 2):
        for seed in (0, 1):
            rows = [step(i, 0.1, 1.0 + passes, 0.5 * passes) for i in range(3)]
            for row in rows:
                row["train/clip_frac"] = 0.1 * passes
                if passes > 1:
                    row |= {"train/pass1/ratio_mean": 1.0, "train/pass1/clip_frac": 0.0}
                    row |= {"train/pass2/ratio_mean": 1.1, "train/pass2/clip_frac": 0.2}
            inner = f"grpo:\n  inner_epochs: {passes}\n"
            write_run(
                tmp_path / "sweep" / f"k{passes}_s{seed}", rows + evals({0: 0.4, 2: 0.5}), config("jagg", seed) + inner
            )
    assert main([str(tmp_path / "sweep")]) == 0
    printed = capsys.readouterr().out
    assert "- grpo.inner_epochs=1: seeds [0, 1]" in printed and "- grpo.inner_epochs=2: seeds [0, 1]" in printed
    summary = json.loads((tmp_path / "sweep" / "compare" / "summary.json").read_text())
    assert summary["arms"]["grpo.inner_epochs=2"]["time_median_s"]["update"] == 1.0
    assert (tmp_path / "sweep" / "compare" / "training_curves.png").is_file()
    panels = training_panels(build_comparison([str(tmp_path / "sweep")]))
    lines = {metric: [(arm.label, key) for arm, key, _, _ in drawn] for metric, drawn in panels.items()}
    assert lines["train/clip_frac"] == [
        ("grpo.inner_epochs=1", "train/clip_frac"),
        ("grpo.inner_epochs=2", "train/clip_frac"),
    ]
    two = "grpo.inner_epochs=2"
    for name in ("ratio_mean", "clip_frac"):
        assert lines[f"train/pass{{k}}/{name}"] == [(two, f"train/pass1/{name}"), (two, f"train/pass2/{name}")]


def test_median_time_ignores_a_stalled_step(tmp_path, capsys):
    # Step times 1, 1, 30 (a stall), 1, 1 after the warm-up: the median is 1 s, a mean would be 6.8 s.
    times = [10, 1, 1, 30, 1, 1]
    run = write_run(tmp_path / "run", [step(i, 0.1, t, 0.5) for i, t in enumerate(times)])
    assert main([str(run), "--out", str(tmp_path / "cmp")]) == 0
    summary = json.loads((tmp_path / "cmp" / "summary.json").read_text())
    assert summary["arms"]["run"]["time_median_s"]["step"] == 1.0


def test_replayed_steps_keep_the_later_values(tmp_path, capsys):
    run = write_run(tmp_path / "run", [*evals({0: 0.1, 1: 0.2}), *evals({1: 0.9})])
    assert main([str(run), "--out", str(tmp_path / "cmp")]) == 0
    assert "0.9000" in capsys.readouterr().out


def test_a_run_that_left_an_optional_term_out_is_named_under_the_tables(tmp_path, capsys):
    """jagg's judge (optional) was left out of steps 1 and 3 of its 4 (step 2's first row too, replayed after a
    resume with the judge back): the note under the tables names the run, the term and 2 of 4 steps; exact, whose
    judge answered every step, is not named."""

    def row(i: int, missing: float) -> dict:
        return {**step(i, 0.1, 1.0, 0.5), "reward/total": 0.2, "reward/judge/missing": missing}

    exact = write_run(tmp_path / "exact", [row(i, 0.0) for i in range(4)], config("exact", 0))
    left = [row(0, 0.0), row(1, 1.0), row(2, 1.0), row(2, 0.0), row(3, 1.0)]
    jagg = write_run(tmp_path / "jagg", left, config("jagg", 0))
    out = tmp_path / "cmp"
    assert main([str(exact), str(jagg), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    expected = (
        f"note: {jagg}: optional reward terms left out: judge on 2 of 4 steps; reward/total on those steps is over "
        "the other terms, renormalised (reward/<name>/missing in metrics.jsonl marks them)"
    )
    tables, _, notes = printed.partition("median seconds per step of each phase")
    assert expected in notes.splitlines() and str(exact) not in notes and "note: " not in tables
    assert expected in (out / "table.md").read_text().splitlines()


def latin1_row(run: Path) -> Path:
    """A second row with a byte of another encoding."""
    with open(run / "metrics.jsonl", "ab") as file:
        file.write('{"step": 1, "note": "caf\xe9"}\n'.encode("latin-1"))
    return run


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda p: p / "nowhere", "does not exist"),
        (lambda p: (p / "empty_dir").mkdir() or p / "empty_dir", "holds no metrics.jsonl"),
        (lambda p: write_run(p / "bad", [step(0, 0.1, 1, 1), "{not json"]), "metrics.jsonl:2 is not valid JSON"),
        (lambda p: latin1_row(write_run(p / "latin1", [step(0, 0.1, 1, 1)])), "metrics.jsonl:2 is not UTF-8"),
        (lambda p: write_run(p / "nostep", [{"reward/hpsv2": 0.1}]), 'integer "step"'),
        (lambda p: write_run(p / "blank", [""]), "no logged step"),
        (lambda p: (p / "file.txt").write_text("x") and p / "file.txt", "is a file"),
    ],
)
def test_bad_run_folder_is_named_with_the_reason(make, reason, tmp_path, capsys):
    good = write_run(tmp_path / "good", [step(0, 0.1, 1, 1)])
    bad = make(tmp_path)
    assert main([str(good), str(bad), "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err
    assert str(bad.name) in err and reason in err


def test_labels_and_baseline_errors(tmp_path, capsys):
    a = write_run(tmp_path / "a", [step(0, 0.1, 1, 1)], config("jagg", 0))
    b = write_run(tmp_path / "b", [step(0, 0.1, 1, 1)], config("jagg", 0))
    assert main([str(a), str(b), "--out", str(tmp_path / "cmp")]) == 2
    assert "two runs of one seed" in capsys.readouterr().err  # same arm, same seed: ambiguous
    assert main([str(a), str(b), "--labels", "x", "--out", str(tmp_path / "cmp")]) == 2
    assert "--labels names 1 runs but 2" in capsys.readouterr().err
    assert main([str(a), str(b), "--labels", "x,y", "--baseline", "z", "--out", str(tmp_path / "cmp")]) == 2
    assert "--baseline 'z'" in capsys.readouterr().err


def dry_run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """A launcher of scripts/launch with DRY_RUN=1: it prints its commands instead of running them."""
    full_env = {"PATH": os.environ["PATH"], "DRY_RUN": "1", **env}
    return subprocess.run([ROOT / "scripts" / "launch" / script, *args], env=full_env, capture_output=True, text=True)


@pytest.mark.parametrize("experiment", ["flux_dance", "qwenimage_dance", "flux_flow_fast", "qwenimage_flow_fast"])
def test_experiment_launchers_compose_and_validate(experiment, tmp_path, monkeypatch):
    # no paths exported: refused, naming the variable (DRY_RUN=1 prints <NAME> for them instead)
    script = ROOT / "scripts" / "launch" / f"{experiment}.sh"
    refused = subprocess.run([script], env={"PATH": os.environ["PATH"]}, capture_output=True, text=True)
    assert refused.returncode == 2 and "set " in refused.stderr, refused.stderr
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    model = str(tmp_path)
    paths = dict(FLUX_PATH=model, QWENIMAGE_PATH=model, TRAIN_PROMPTS=str(prompts), EVAL_PROMPTS=str(prompts))
    hps = tmp_path / "hps.pt"  # the settings check looks for every scorer's files
    hps.write_bytes(b"")
    paths |= dict(HPS_CKPT=str(hps))
    paths |= dict(CLIP_PATH=model, PICKSCORE_PATH=model, PICKSCORE_PROCESSOR=model)
    result = dry_run(f"{experiment}.sh", "update=ablate", **paths)
    assert result.returncode == 0, result.stderr
    cmd = shlex.split(result.stdout)
    assert cmd[:6] == ["torchrun", "--standalone", "--max-restarts", "3", "--nproc_per_node", "8"]
    assert cmd[6:8] == ["-m", "train"] and "resume=auto" in cmd
    overrides = [arg for arg in cmd[8:] if not arg.startswith("hydra.")]
    assert f"experiment={experiment}" in overrides and f"model.path={model}" in overrides
    monkeypatch.chdir(ROOT)
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = OmegaConf.to_object(compose(config_name="train", overrides=[f"run_dir={tmp_path}", *overrides]))
    validate(cfg, known_scorers=SCORER_NAMES, known_backbones=tuple(backbone_names()))
    assert cfg.update.mode == "ablate" and cfg.reward.components["hpsv2"]["checkpoint"] == str(hps)


def test_compare_modes_runs_three_modes_in_one_group_then_compares():
    result = dry_run("compare_modes.sh", "demo", "num_steps=2", NPROC_PER_NODE="1", GROUP="g", OUT_DIR="out")
    assert result.returncode == 0, result.stderr
    *launches, compare = [shlex.split(line) for line in result.stdout.splitlines()]
    for mode, cmd in zip(("exact", "jagg", "ablate"), launches, strict=True):
        assert cmd[0] == "torchrun" and "--nproc_per_node" in cmd and cmd[cmd.index("--nproc_per_node") + 1] == "1"
        assert {f"update={mode}", "logging.group=g", f"hydra.run.dir=out/{mode}", "num_steps=2"} <= set(cmd)
    # train.tools.compare.command labels each run from its own config.yaml
    assert compare[1:] == ["-m", "train.compare", "out/exact", "out/jagg", "out/ablate", "--out", "out/compare"]


@pytest.mark.slow
def test_testbed_compare_sweeps_modes_and_seeds_then_compares(tmp_path):
    """python -m train -m experiment=testbed_compare: one job per update mode and seed, then the
    Hydra callback writes the comparison over seeds."""
    sweep = tmp_path / "sweep"
    short = ["update=exact,jagg", "seed=0,1", "num_steps=1", "batch.prompts_per_rank=1", "grpo.group_size=2"]
    short += ["health.max_bad_steps=0"]  # a group of 2 can tie on its one step: exported all the same
    short += ["batch.micro_batch=2"]
    short += ["batch.gradient_accumulation_steps=2", "eval.num_prompts=2", "eval.batch_size=2"]
    short += ["eval.samples_per_prompt=1", "eval.heldout_prompts=null"]
    short += ["eval.every=1", "logging.sample_every=0", "checkpoint.export=false"]
    cmd = [sys.executable, "-m", "train", "-m", "experiment=testbed_compare", *short, f"hydra.sweep.dir={sweep}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == [
        "compare",
        "exact_s0",
        "exact_s1",
        "jagg_s0",
        "jagg_s1",
    ]
    summary = json.loads((sweep / "compare" / "summary.json").read_text())
    assert summary["baseline"] == "exact" and set(summary["arms"]) == {"exact", "jagg"}
    firsts = {arm: entry["eval/shape_alignment"]["curve"]["0"] for arm, entry in summary["arms"].items()}
    assert len({(f["mean"], f["std"]) for f in firsts.values()}) == 1  # the same model before training
    assert firsts["jagg"]["std"] == 0.0  # and the same evaluation noise on every seed
    assert "paired difference to exact" in done.stdout and "- jagg: seeds [0, 1]" in done.stdout


def test_runs_of_several_experiments_are_flagged_and_labelled_shortly():
    from train.tools.compare.arms import MAX_LABEL_SETTINGS, arm_labels, experiments_note
    from train.tools.compare.runs import RunMetrics

    def run(experiment: str, **settings) -> RunMetrics:
        return RunMetrics(experiment, {}, {"experiment": experiment, "update.mode": "jagg", "seed": 0, **settings})

    # two experiments that differ in many settings: the label names the experiment first and counts the rest
    runs = [run("a", **{f"grpo.x{i}": 0 for i in range(9)}), run("b", **{f"grpo.x{i}": 1 for i in range(9)})]
    labels = arm_labels(runs)
    assert labels[0].startswith("experiment=a, ") and labels[0].endswith(f"(+{10 - MAX_LABEL_SETTINGS} more settings)")
    assert len(set(labels)) == 2 and all(len(label) < 80 for label in labels)
    assert "belong to 2 experiments (a, b)" in experiments_note(runs)[0]
    assert experiments_note([run("a"), run("a", seed=1)]) == []
    # short labels that would merge two arms: the full ones
    close = [run("a", **{f"grpo.x{i}": int(i == 3 and k == 1 or k == 2) for i in range(4)}) for k in (0, 1, 2)]
    assert len(set(arm_labels(close))) == 3
