"""Compare training runs (baseline / JAGG / ablate): the paper's Table 3, the efficiency summary, plots.

    python -m train.compare runs/flux_dance/cmp/exact runs/flux_dance/cmp/jagg runs/flux_dance/cmp/ablate \\
        --out runs/flux_dance/cmp/compare
    python -m train.compare wandb:<entity>/<project>/<run id> ... --labels exact,jagg

A run is a run folder holding the trainer's ``metrics.jsonl`` (offline, the record of truth) or, with
the ``wandb:`` prefix, a wandb run path (needs the network and a wandb login). Records of one step
are merged; a step logged twice (a resumed run replays from its checkpoint) keeps the later values.

Printed and written to ``--out``:
  * the reward table: each evaluation metric (``eval/<name>``, the overall means of
    ``train/eval.py``) at each evaluation step, per run; the best run of each row and metric is
    marked ``*``. Without evaluation records it falls back to the training rewards (``reward/<name>``)
    at every ``--every``-th step. Steps are as logged in metrics.jsonl;
  * the efficiency summary: per run the mean seconds per step of ``time/step`` and each phase
    (rollout, reward, update, optimizer, probe), after ``--warmup`` steps, and the speed-up over
    the baseline run in % = (T_baseline - T_run) / T_baseline * 100, for the whole step and the
    update stage (the paper's definition: 279 s -> 228 s is 18.2%);
  * ``table.md``, ``summary.json``, one PNG of curves per metric (``eval_<name>.png``,
    ``reward_<name>.png``, all runs overlaid) and ``time_per_phase.png`` (bars per phase and run).

Exit status 2, with a message naming the run and the reason, when a run is missing or malformed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from train.cli import report
from train.errors import UserError

PHASES = ("rollout", "reward", "update", "optimizer", "probe")
WANDB_PREFIX = "wandb:"


@dataclass
class RunMetrics:
    label: str
    source: str  # the folder or wandb path it was read from
    steps: dict[int, dict[str, float]]  # logged step -> every metric logged at that step

    def series(self, key: str) -> dict[int, float]:
        return {step: values[key] for step, values in sorted(self.steps.items()) if key in values}


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def read_metrics_file(path: Path) -> dict[int, dict[str, float]]:
    """Steps of one metrics.jsonl; a line that is not a JSON object with an integer "step" is an error."""
    steps: dict[int, dict[str, float]] = {}
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno} is not valid JSON ({err.msg}); the file is damaged") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f'{path}:{lineno} is not a metrics record (a JSON object with an integer "step")')
        steps.setdefault(record["step"], {}).update(_numbers(record))
    if not steps:
        raise ValueError(f"{path} holds no logged step (the file is empty): did the run log anything?")
    return steps


def _read_wandb(path: str) -> dict[int, dict[str, float]]:
    try:
        import wandb

        history = wandb.Api().run(path).scan_history()
        steps: dict[int, dict[str, float]] = {}
        for row in history:
            if isinstance(row.get("_step"), int):
                steps.setdefault(row["_step"], {}).update(_numbers({k: v for k, v in row.items() if k[0] != "_"}))
    except Exception as err:  # wandb raises its own error types (network, auth, missing run)
        raise ValueError(f"wandb run {path!r} could not be read: {err}") from None
    if not steps:
        raise ValueError(f"wandb run {path!r} has no logged step")
    return steps


def load_run(spec: str, label: str | None = None) -> RunMetrics:
    """A run folder (its metrics.jsonl) or ``wandb:<entity>/<project>/<run id>``."""
    if spec.startswith(WANDB_PREFIX):
        path = spec[len(WANDB_PREFIX) :]
        return RunMetrics(label or path.rsplit("/", 1)[-1], spec, _read_wandb(path))
    folder = Path(spec)
    if not folder.exists():
        raise FileNotFoundError(f"run folder {spec!r} does not exist (for a wandb run write wandb:<entity>/...)")
    if not folder.is_dir():
        raise ValueError(f"run {spec!r} is a file; pass the run folder that holds metrics.jsonl")
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"run folder {spec!r} has no metrics.jsonl: is it a run folder of python -m train?")
    return RunMetrics(label or folder.resolve().name, spec, read_metrics_file(metrics))


def load_runs(specs: list[str], labels: list[str] | None) -> list[RunMetrics]:
    if labels is not None and len(labels) != len(specs):
        raise ValueError(f"--labels names {len(labels)} runs but {len(specs)} runs are given")
    runs = [load_run(spec, None if labels is None else labels[i]) for i, spec in enumerate(specs)]
    names = [r.label for r in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"runs share a label ({', '.join(names)}); name them with --labels a,b,...")
    return runs


def table_metrics(runs: list[RunMetrics], wanted: list[str] | None) -> tuple[str, list[str]]:
    """("eval" or "reward", metric names): evaluation metrics when any run has them."""
    for prefix in ("eval", "reward"):
        names: list[str] = []
        for run in runs:
            for values in run.steps.values():
                names += [k.split("/", 1)[1] for k in values if k.startswith(f"{prefix}/") and k.count("/") == 1]
        names = list(dict.fromkeys(names))
        if names:
            if wanted:
                missing = [m for m in wanted if m not in names]
                if missing:
                    raise ValueError(f"--metrics {', '.join(missing)} not logged as {prefix}/<name>; found {names}")
                names = wanted
            return prefix, names
    raise ValueError("no run logged an eval/<metric> or reward/<metric>: nothing to compare")


def _fmt(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.4f}"


def reward_table(runs: list[RunMetrics], prefix: str, names: list[str], every: int) -> list[list[str]]:
    """Rows [step, run1 metric1, run1 metric2, ..., run2 metric1, ...]; the best of a row is starred."""
    steps = sorted({s for run in runs for s, v in run.steps.items() if any(f"{prefix}/{n}" in v for n in names)})
    if prefix == "reward":
        steps = steps[::every]
    header = ["step"] + [f"{run.label}:{name}" for run in runs for name in names]
    rows = [header]
    for step in steps:
        cells: dict[tuple[int, int], float | None] = {}
        for i, run in enumerate(runs):
            for j, name in enumerate(names):
                cells[i, j] = run.steps.get(step, {}).get(f"{prefix}/{name}")
        best = {
            j: max((v for (i, jj), v in cells.items() if jj == j and v is not None), default=None)
            for j in range(len(names))
        }
        row = [str(step)]
        for i in range(len(runs)):
            for j in range(len(names)):
                value = cells[i, j]
                star = "*" if value is not None and len(runs) > 1 and value == best[j] else ""
                row.append(_fmt(value) + star)
        rows.append(row)
    return rows


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def efficiency(runs: list[RunMetrics], baseline: str | None, warmup: int) -> tuple[str, dict[str, dict[str, float]]]:
    """(baseline label, per run: mean seconds per step and per phase, speed-ups in %)."""
    labels = [r.label for r in runs]
    if baseline is None:
        baseline = "exact" if "exact" in labels else labels[0]
    if baseline not in labels:
        raise ValueError(f"--baseline {baseline!r} is not a run label; labels: {', '.join(labels)}")
    out: dict[str, dict[str, float]] = {}
    for run in runs:
        timed = [v for _, v in sorted(run.steps.items()) if "time/step" in v]
        kept = timed[warmup:] if len(timed) > warmup else timed
        stats = {"num_steps": float(len(kept))}
        for name in ("step", *PHASES):
            stats[name] = _mean([v[f"time/{name}"] for v in kept if f"time/{name}" in v])
        out[run.label] = stats
    base = out[baseline]
    for stats in out.values():
        for name in ("step", "update"):
            stats[f"speedup_{name}_pct"] = (base[name] - stats[name]) / base[name] * 100 if base[name] > 0 else math.nan
    return baseline, out


def efficiency_rows(baseline: str, stats: dict[str, dict[str, float]]) -> list[list[str]]:
    header = ["run", "steps", "step [s]", *[f"{p} [s]" for p in PHASES], "speed-up step", "speed-up update"]
    rows = [header]
    for label, s in stats.items():
        speed = (
            ["(baseline)"] * 2
            if label == baseline
            else [f"{s['speedup_step_pct']:.1f}%", f"{s['speedup_update_pct']:.1f}%"]
        )
        rows.append([label, str(int(s["num_steps"])), *[_fmt(s[name]) for name in ("step", *PHASES)], *speed])
    return rows


def render(rows: list[list[str]], *, markdown: bool = False) -> str:
    if markdown:
        lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows[1:]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows)


def plot_curves(runs: list[RunMetrics], out: Path) -> list[Path]:
    """One PNG per eval/<name> and reward/<name> metric, every run overlaid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = dict.fromkeys(
        k
        for run in runs
        for v in run.steps.values()
        for k in v
        if k.startswith(("eval/", "reward/")) and k.count("/") == 1
    )
    written = []
    for key in keys:
        fig, ax = plt.subplots(figsize=(6, 4))
        for run in runs:
            series = run.series(key)
            if series:
                ax.plot(list(series), list(series.values()), marker="o" if len(series) < 30 else None, label=run.label)
        ax.set(xlabel="step", ylabel=key, title=key)
        ax.grid(alpha=0.3)
        ax.legend()
        path = out / f"{key.replace('/', '_')}.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def plot_phases(stats: dict[str, dict[str, float]], out: Path) -> Path:
    """Mean seconds per step of each phase, one bar per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [p for p in PHASES if any(not math.isnan(s[p]) for s in stats.values())]
    width = 0.8 / max(len(stats), 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, s) in enumerate(stats.items()):
        heights = [0.0 if math.isnan(s[p]) else s[p] for p in phases]
        ax.bar([k + i * width for k in range(len(phases))], heights, width=width, label=label)
    ax.set_xticks([k + width * (len(stats) - 1) / 2 for k in range(len(phases))], phases)
    ax.set(ylabel="seconds per step (mean)", title="time per phase")
    ax.legend()
    path = out / "time_per_phase.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def compare(args: argparse.Namespace) -> str:
    """Everything ``main`` does; returns the printed report."""
    runs = load_runs(args.runs, args.labels.split(",") if args.labels else None)
    prefix, names = table_metrics(runs, args.metrics)
    table = reward_table(runs, prefix, names, args.every)
    baseline, stats = efficiency(runs, args.baseline, args.warmup)
    eff = efficiency_rows(baseline, stats)
    what = "evaluation metrics" if prefix == "eval" else "training rewards (no eval/<metric> was logged)"
    report = f"{what} per step (* = best run of the row)\n{render(table)}\n\n"
    report += f"mean time per step after {args.warmup} warm-up step(s); speed-up over {baseline}\n{render(eff)}\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(
        f"## {what}\n\n{render(table, markdown=True)}\n\n## efficiency (baseline: {baseline})\n\n"
        f"{render(eff, markdown=True)}\n",
        encoding="utf-8",
    )
    values = {prefix: {run.label: {n: run.series(f"{prefix}/{n}") for n in names} for run in runs}}
    summary = {"runs": {r.label: r.source for r in runs}, "baseline": baseline, "efficiency": stats, **values}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    images = plot_curves(runs, out) + [plot_phases(stats, out)]
    return report + f"\nwritten to {out}: table.md, summary.json, {', '.join(p.name for p in images)}\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (with metrics.jsonl) or wandb:<entity>/<project>/<id>")
    parser.add_argument("--labels", help="comma-separated run labels (default: the folder names)")
    parser.add_argument("--baseline", help="label of the baseline run for speed-ups (default: exact, else the first)")
    parser.add_argument("--metrics", nargs="+", help="metric names for the table (default: every logged one)")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the time means (default 1)")
    parser.add_argument("--every", type=int, default=1, help="table row every N steps for training rewards")
    parser.add_argument("--out", default="comparison", help="folder for table.md, summary.json and the PNGs")
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.every < 1:
        parser.error("--warmup must be >= 0 and --every >= 1")
    return args


class CompareSweep(Callback):
    """Hydra callback: after a ``-m`` sweep, compare its jobs' run folders into ``<sweep dir>/compare``.

    ``experiment=testbed_compare`` installs it; every job folder of the sweep that holds a
    metrics.jsonl is a run, labelled by its folder name (the update mode there).
    """

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(config.hydra.sweep.dir)
        runs = sorted(str(p.parent) for p in sweep.glob("*/metrics.jsonl"))
        if not runs:
            print(f"train.compare: no job of the sweep in {sweep} wrote a metrics.jsonl; nothing to compare")
            return
        main([*runs, "--out", str(sweep / "compare")])  # prints the tables, or the error on stderr


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        print(compare(args), end="")
    except (FileNotFoundError, ValueError) as err:  # raised by this module's checks, naming the run and the fix
        return report(UserError(str(err)), "train.compare")
    return 0


if __name__ == "__main__":
    sys.exit(main())
