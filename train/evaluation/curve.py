"""``eval/curve.png``: the run's evaluations against the step, from its metrics.jsonl, written at the end of a run.

One panel per evaluation metric (``eval/<metric>``, and its held-out prompts' ``eval/<metric>/held-out`` on the
same panel); an evaluation the cadence asked for that has no row (lost to a crash before the weights that it
would have scored were checkpointed) is a dashed line marked "missing", so the curve has no silent hole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.config.record import after_steps, rows
from train.evaluation.summary import HELD_OUT


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
