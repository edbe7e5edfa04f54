"""Compare training runs (baseline / JAGG / ablate over seeds): ``python -m train.compare PATH...``.

    python -m train.compare runs/testbed_compare/sweep_<date>            # a whole sweep folder
    python -m train.compare runs/a runs/b runs/c --out cmp               # run folders
    python -m train.compare runs/a/wandb runs/b/wandb                    # offline wandb runs
    python -m train.compare wandb:<entity>/<project>/group:<name>        # a wandb group (network, login)
    python -m train.compare wandb:<entity>/<project>/<run id> ...        # wandb runs by id
    python -m train.compare runs/sweep --reward-threshold 0.06            # with the training time to +0.06

Runs are grouped into arms by the settings that differ between them (seeds pooled); train/tools/compare/arms.py
documents the statistics. Printed and written to ``--out`` (default ``<sweep>/compare`` for one
sweep folder, else ``comparison``): ``table.md``, ``summary.json``, ``eval_<metric>_vs_step.png``,
``eval_<metric>_vs_training_time.png`` (against the sum of step times), ``eval_<metric>_vs_wall.png`` (evaluations
and stalls included), ``training_curves.png`` (metrics.jsonl's reward, advantage spread, KL, clip fraction,
gradient norm and step time) and ``time_per_phase.png``. Exit status 2, with one line naming the
run and the reason, when a run is missing or its metrics are malformed. A run counts once: its retired
timelines are left out, and a run whose recorded configuration cannot be read whole is named in one line and
left out, the others compared (train/tools/compare/runs.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from train.cli.reporting import report_error
from train.ground.errors import UserError
from train.ground.layout import RunLayout
from train.tools.compare.arms import build_comparison
from train.tools.compare.plots import plot
from train.tools.compare.tables import comparison_tables, summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m train.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "runs",
        nargs="+",
        help="run folders, sweep folders, offline wandb run folders, wandb:<entity>/<project>/<run id or group:name>",
    )
    parser.add_argument("--labels", help="comma-separated arm label of each run (default: from their configs)")
    parser.add_argument("--baseline", help="arm label of the baseline (default: the arm with update.mode=exact)")
    parser.add_argument(
        "--metrics",
        nargs="+",
        help="eval metric names to compare (default: every logged overall mean, held-out ones included)",
    )
    parser.add_argument(
        "--reward-threshold",
        type=float,
        help="also report each arm's training time to first evaluate this much over step 0 (e.g. 0.06), over seeds",
    )
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the timings (default 1)")
    parser.add_argument("--out", help="output folder (default: <sweep>/compare for one sweep folder, else comparison)")
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.out is None:
        only = Path(args.runs[0])
        one_sweep = len(args.runs) == 1 and only.is_dir() and not RunLayout(only).metrics.exists()
        args.out = str(only / "compare") if one_sweep else "comparison"
    return args


def compare(args: argparse.Namespace) -> str:
    """Everything ``main`` does; returns the printed report."""
    c = build_comparison(
        args.runs,
        labels=args.labels.split(",") if args.labels else None,
        baseline=args.baseline,
        metrics=args.metrics,
        warmup=args.warmup,
        threshold=args.reward_threshold,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(comparison_tables(c, markdown=True), encoding="utf-8")
    (out / "summary.json").write_text(json.dumps(summary(c), indent=2) + "\n", encoding="utf-8")
    images = plot(c, out)
    return comparison_tables(c) + f"\nwritten to {out}: table.md, summary.json, {', '.join(p.name for p in images)}\n"


class CompareSweep(Callback):
    """Hydra callback: after a ``-m`` sweep, compare its runs into ``<sweep dir>/compare``."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(config.hydra.sweep.dir)
        main([str(sweep), "--out", str(sweep / "compare")])  # prints the tables, or the error on stderr


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        print(compare(args), end="")
    except (FileNotFoundError, ValueError) as err:  # raised by this module's checks, naming the run and the fix
        return report_error(UserError(str(err)), "train.tools.compare.command")
    return 0
