"""A comparison's plots: per evaluation metric its reward against step, training time and wall-clock time; the
training curves of metrics.jsonl (with grpo.inner_epochs > 1 each update pass's PPO ratio and clip fraction); the
median time per phase."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from train.parts.eval.tags import PHASES
from train.tools.compare.arms import Arm, Comparison

# The training curves plotted from metrics.jsonl (training_curves.png), with their axis labels.
TRAINING_CURVES = {
    "reward/total": "training reward (rollouts)",
    "adv/std": "advantage spread (std)",
    "train/approx_kl": "approximate KL to the rollout policy",
    "train/clip_frac": "clipped fraction",
    "train/grad_norm": "gradient norm (before clipping)",
    "time/step": "seconds per step",
}
# The per-pass curves of runs with grpo.inner_epochs > 1 (train/pass<k>/<name>, k from 1): one panel each, a line
# per arm and pass, so that the later passes' distance from the rollout's policy shows beside the first's.
PASS_CURVES = {
    "train/pass{k}/ratio_mean": "mean PPO ratio per update pass",
    "train/pass{k}/clip_frac": "clipped fraction per update pass",
}
# x axes of the reward plots: the step, the training time (the sum of step times: what a method's speed
# changes) and the wall-clock time (evaluations, checkpoints and stalls included)
PLOT_AXES = {
    "step": "training step",
    "training_time": "training time: sum of step times [min]",
    "wall": "wall-clock time, evaluations and stalls included [min]",
}


def plot(c: Comparison, out: Path) -> list[Path]:
    """Per metric: reward against step, training time and wall-clock time (mean line, min-max band over
    seeds); the training curves of metrics.jsonl; and the median time per phase as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for metric in c.metrics:
        for axis, xlabel in PLOT_AXES.items():
            fig, ax = plt.subplots(figsize=(6.5, 4))
            for arm in c.arms:
                r = c.rewards[metric][arm.label]
                if r is None:
                    continue
                steps = sorted(r.curve)
                x = steps if axis == "step" else [getattr(r, axis)[s] / 60 for s in steps]
                key = f"eval/{metric}"
                per_seed = [[run.steps[s][key] for s in steps] for run in arm.runs]
                ax.plot(x, [r.curve[s].mean for s in steps], marker="o", label=f"{arm.label} (n={len(arm.runs)})")
                ax.fill_between(x, [min(v) for v in zip(*per_seed)], [max(v) for v in zip(*per_seed)], alpha=0.2)
            ax.set(xlabel=xlabel, ylabel=f"eval/{metric}", title=f"eval/{metric}: mean, band = min..max over seeds")
            ax.grid(alpha=0.3)
            ax.legend()
            written.append(_save(fig, out / f"eval_{metric.replace('/', '_')}_vs_{axis}.png", plt))
    return [*written, _plot_training_curves(c, out, plt), _plot_phases(c, out, plt)]


PASS_STYLES = ("-", "--", ":", "-.")  # the line style of pass k, k from 1, cycled; an arm keeps its colour


def training_panels(c: Comparison) -> dict[str, list[tuple[Arm, str, str, int]]]:
    """The panels of ``training_curves.png``, by metric (a key of TRAINING_CURVES or PASS_CURVES): the (arm, key,
    line label, pass: 0 for none) of each line, for the metrics some run logged; a pass curve has a line per arm and
    pass it logged."""
    panels: dict[str, list[tuple[Arm, str, str, int]]] = {}
    for key in TRAINING_CURVES:
        lines = [(arm, key, f"{arm.label} (n={len(arm.runs)})", 0) for arm in c.arms if _logged(arm, key)]
        if lines:
            panels[key] = lines
    for pattern in PASS_CURVES:
        lines = []
        for arm in c.arms:
            k = 1
            while _logged(arm, pattern.format(k=k)):
                lines.append((arm, pattern.format(k=k), f"{arm.label}, pass {k} (n={len(arm.runs)})", k))
                k += 1
        if lines:
            panels[pattern] = lines
    return panels


def _logged(arm: Arm, key: str) -> bool:
    return any(r.series(key) for r in arm.runs)


def _plot_training_curves(c: Comparison, out: Path, plt: Any) -> Path:
    """``training_curves.png``: each logged one of TRAINING_CURVES and PASS_CURVES against the step, per line the
    mean over the arm's seeds with a min-max band."""
    panels = training_panels(c)
    columns = 3
    rows = max(1, math.ceil(len(panels) / columns))
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.4 * rows), squeeze=False)
    for ax, (metric, lines) in zip(axes.flat, panels.items()):
        for arm, key, label, number in lines:
            series = [r.series(key) for r in arm.runs]
            steps = sorted(set.intersection(*(set(s) for s in series)))
            values = [[s[k] for s in series] for k in steps]
            style = {"color": f"C{c.arms.index(arm) % 10}", "ls": PASS_STYLES[(max(number, 1) - 1) % len(PASS_STYLES)]}
            ax.plot(steps, [sum(v) / len(v) for v in values], label=label, lw=1, **style)
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], alpha=0.2, color=style["color"])
        title = TRAINING_CURVES.get(metric) or PASS_CURVES[metric]
        ax.set(xlabel="training step", ylabel=metric.replace("{k}", "<k>"), title=title)
        ax.grid(alpha=0.3)
        if metric in PASS_CURVES:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    if panels:
        axes.flat[0].legend()
    fig.tight_layout()
    return _save(fig, out / "training_curves.png", plt)


def _plot_phases(c: Comparison, out: Path, plt: Any) -> Path:
    phases = [p for p in PHASES[1:] if any(not math.isnan(t[p]) for t in c.timing.values())]
    width = 0.8 / max(len(c.arms), 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, arm in enumerate(c.arms):
        heights = [0.0 if math.isnan(c.timing[arm.label][p]) else c.timing[arm.label][p] for p in phases]
        ax.bar([k + i * width for k in range(len(phases))], heights, width=width, label=arm.label)
    ax.set_xticks([k + width * (len(c.arms) - 1) / 2 for k in range(len(phases))], phases)
    ax.set(ylabel="seconds per step (median)", title="time per phase")
    ax.legend()
    return _save(fig, out / "time_per_phase.png", plt)


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
