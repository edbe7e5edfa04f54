"""The end of a run: ``eval/curve.png``, the run's evaluations against the step (from its metrics.jsonl), and the
summary the console shows.

The curve has one panel per evaluation metric (``eval/<metric>``, and its held-out prompts' ``eval/<metric>/held-out``
on the same panel); an evaluation the cadence asked for that has no row (lost to a crash before the weights that it
would have scored were checkpointed) is a dashed line marked "missing", so the curve has no silent hole.

The summary gives the evaluation reward before -> after, of the held-out prompts too, with standard
errors over prompts and the paired difference (from the per-prompt score files, so it holds across a
resume), the optional reward terms that the run's steps left out and on how many of them (from its metrics.jsonl,
train/parts/scoring/left_out.py), the median time per step and per phase, the achieved TFLOP/s and MFU per phase
(train/parts/observe/perf.py), what compiling cost (model.compile), and where everything was written, with
what each export holds (its ``weights.json``: the EMA the evaluations scored in ``export/``, the trained
weights in ``export_raw/``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from train.ground.layout import RunLayout
from train.parts.checkpoint.best import best_step
from train.parts.checkpoint.export import export_description
from train.parts.config.record import after_steps, rows
from train.parts.config.schema import TrainConfig
from train.parts.eval.protocol import paired_difference, read_scores
from train.parts.eval.tags import HELD_OUT, PHASES, eval_tag, heldout_tag
from train.parts.observe.console import format_seconds
from train.parts.observe.perf import Peak
from train.parts.observe.stats import median
from train.parts.scoring.left_out import left_out_line


def eval_series(metrics: Path) -> dict[str, dict[int, float]]:
    """``eval/<metric>`` and ``eval/<metric>/held-out`` -> {step: value}, from the rows of ``metrics`` (the last
    row of a step wins, as a resumed run's replay does)."""
    series: dict[str, dict[int, float]] = {}
    for row in rows(metrics):
        for key, value in row.items():
            name = key.removeprefix("eval/")
            if key.startswith("eval/") and ("/" not in name or name.endswith(f"/{HELD_OUT}")):
                series.setdefault(key, {})[int(row["step"])] = float(value)
    return series


def write_curve(metrics: Path, path: Path, missing: list[int]) -> Path | None:
    """``path`` (``<run>/eval/curve.png``): the evaluations in ``metrics``, the ``missing`` steps marked; None
    when no evaluation was logged."""
    series = eval_series(metrics)
    panels = sorted({key.removesuffix(f"/{HELD_OUT}") for key in series})
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.6), squeeze=False)
    for ax, key in zip(axes.flat, panels):
        _panel(ax, key, series, missing)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _panel(ax: Any, key: str, series: dict[str, dict[int, float]], missing: list[int]) -> None:
    for name in (key, f"{key}/{HELD_OUT}"):
        if name in series:
            steps = sorted(series[name])
            label = HELD_OUT if name.endswith(HELD_OUT) else "evaluation prompts"
            ax.plot(steps, [series[name][s] for s in steps], marker="o", label=label)
    for n, step in enumerate(missing):
        ax.axvline(step, color="grey", linestyle="--", label="missing" if n == 0 else None)
    title = key + (f" (missing: {after_steps(missing)})" if missing else "")
    ax.set(xlabel="training step", ylabel=key, title=title)
    ax.grid(alpha=0.3)
    ax.legend()


def _logged(history: Sequence[Mapping[str, float]], key: str) -> list[float]:
    """The values of metric ``key`` in the steps that logged it."""
    return [m[key] for m in history if key in m]


def _timing(history: Sequence[Mapping[str, float]]) -> str:
    steps = _logged(history, "time/step")
    if not steps:
        return "time per step: no step ran in this session"
    # the step itself first, on its own
    phases = [f"{p} {median(values):.2f}s" for p in PHASES[1:] if (values := _logged(history, f"time/{p}"))]
    return f"time per step (median of {len(steps)}): {median(steps):.2f}s; per phase: " + ", ".join(phases)


def _perf(history: Sequence[Mapping[str, float]], peak: Peak) -> list[str]:
    """Median TFLOP/s (and MFU) per phase, and the compilation of the first step when compiled."""
    parts = []
    for phase in PHASES:
        if tflops := _logged(history, f"perf/tflops/{phase}"):
            mfu = _logged(history, f"perf/mfu/{phase}")
            parts.append(f"{phase} {median(tflops):.3g}" + (f" ({100 * median(mfu):.1f}%)" if mfu else ""))
    if not parts:
        return []
    known = f"{peak.tflops:.3g} TFLOP/s, {peak.source}" if peak.tflops else peak.source
    lines = [f"transformer TFLOP/s (MFU of the peak {known}): " + ", ".join(parts)]
    compiled = [m for m in history if "count/compilations" in m]
    if compiled:
        lines.append(
            f"compile: {compiled[0]['time/compile']:.1f}s in the first step of this session, "
            f"{int(compiled[-1]['count/compilations'])} graphs in all"
        )
    return lines


def _paired_lines(eval_dir: Path, tags: tuple[str, str], names: tuple[str, str], label: str) -> list[str]:
    """Per scorer, the paired difference between the evaluations ``tags`` (none when either is missing)."""
    before, after = (eval_dir / f"{tag}.scores.jsonl" for tag in tags)
    if not before.is_file() or not after.is_file():
        return []
    rows_before, rows_after = read_scores(before), read_scores(after)
    # a scorer left out of either evaluation (a served one that failed) has nothing to pair
    metrics = [k for k in rows_after[0] if k in rows_before[0] and k not in ("index", "prompt", "category", "seed")]
    return [label + paired_difference(rows_before, rows_after, name).line(*names) for name in metrics]


def _rewards(cfg: TrainConfig, history: Sequence[Mapping[str, float]], end: int) -> list[str]:
    """Step 0's evaluation against that after step ``end`` (the last step trained), else the training reward."""
    eval_dir = RunLayout(cfg.run_dir).eval
    names = ("step 0", f"step {end}")
    trained = _paired_lines(eval_dir, (eval_tag(0), eval_tag(end)), names, "")
    if cfg.eval.every and trained:
        tags = (heldout_tag(0), heldout_tag(end))
        return trained + _paired_lines(eval_dir, tags, names, f"{HELD_OUT} prompts, ")
    rewards = [m["reward/total"] for m in history if not math.isnan(m.get("reward/total", math.nan))]
    why = "eval.every=0" if not cfg.eval.every else f"no {eval_tag(0)}.scores.jsonl to pair with"
    if len(rewards) < 2:
        return [f"no reward to compare ({why})"]
    return [f"training reward/total: first step {rewards[0]:.4f} -> last step {rewards[-1]:.4f} ({why})"]


def _listing(folder: Path, pattern: str) -> list[str]:
    return sorted(p.name for p in folder.glob(pattern)) if folder.is_dir() else []


def files_section(cfg: TrainConfig, wandb_mode: str, missing: Sequence[int] = ()) -> list[str]:
    """The summary's lines of what the run folder holds (what each file is, how to use it); ``missing``: the
    evaluations due that metrics.jsonl holds no row of."""
    layout = RunLayout(cfg.run_dir)
    run = layout.root
    lines = [f"run folder: {run}", f"  {layout.metrics.name}   every logged step (python -m train.compare reads it)"]
    lines += [f"  {name:<15} these lines" for name in _listing(run, "*.log")]
    if wandb_mode != "disabled":
        lines.append(f"  wandb/          wandb {wandb_mode} run (its id in wandb_run_id)")
    offline = _listing(layout.wandb, "offline-run-*")
    if wandb_mode == "offline" and offline:
        lines.append(f"                  upload it later: wandb sync {layout.wandb / offline[-1]}")
    samples = _listing(layout.samples, "*.png")
    if samples:
        lines.append(f"  samples/        {len(samples)} captioned grids of rollouts, rewards under each image")
    evals = _listing(layout.eval, "step_*.json")
    if evals:
        sheets = _listing(layout.eval, "before_after_*.png")
        lines.append(
            f"  eval/           {len(evals)} evaluations ({evals[0]} ... {evals[-1]}): means (.json), scores per "
            f"prompt (.scores.jsonl), grids (.png)" + (f", before/after sheets ({sheets[-1]})" if sheets else "")
        )
    if layout.eval_curve.is_file():
        holes = f" (missing: {after_steps(list(missing))})" if missing else ""
        lines.append(f"  eval/{layout.eval_curve.name:<10} the evaluations against the step{holes}")
    checkpoints = _listing(layout.checkpoints, "step_????????")
    if checkpoints:
        lines.append(f"  checkpoints/    {', '.join(checkpoints)} (continue with resume=auto)")
    if (step := best_step(layout.best_checkpoint)) is not None:
        lines.append(f"  checkpoints/best/ the checkpoint of the best evaluation (after step {step})")
    for folder in (layout.export, layout.export_raw, layout.export_best):
        if folder.is_dir():
            what, name = export_description(folder) or "the trained transformer", folder.name
            lines.append(f"  {name + '/':<15} {what} (python -m train.eval eval.transformer=<run>/{name})")
    return lines


def run_summary(
    cfg: TrainConfig,
    *,
    start: int,
    history: Sequence[Mapping[str, float]],
    seconds: float,
    peak: Peak,
    missing: Sequence[int] = (),
    end: int | None = None,
    notes: Sequence[str] = (),
) -> str:
    """The end-of-run summary: rewards before -> after, timing, throughput, files; ``missing``: the evaluations
    due that metrics.jsonl holds no row of (named with the rewards and the curve); ``end``: the steps trained when
    the run ended (num_steps when None); ``notes``: lines after the rewards (the best evaluation, a guard's stop)."""
    end = cfg.num_steps if end is None else end
    done = f"steps {start}-{end - 1}" if start < end else "no step left to run"
    lines = [f"finished {cfg.experiment} ({cfg.update.mode}, seed {cfg.seed}): {done} in {format_seconds(seconds)}"]
    lines += _rewards(cfg, history, end)
    lines += notes
    metrics = RunLayout(cfg.run_dir).metrics  # the run's steps, those of earlier sessions too
    if left := left_out_line((int(row["step"]), row) for row in rows(metrics)):
        lines.append(left)
    if missing:
        lines.append(f"evaluations missing (lost before a resume, their weights gone): {after_steps(list(missing))}")
    lines.append(_timing(history))
    lines += _perf(history, peak)
    lines += files_section(cfg, cfg.logging.wandb_mode, missing)
    return "\n".join(lines)
