"""Whole training steps per update mode on the small Flux config (CPU): step and update-stage time
as ratios to exact, and each run's peak memory.

    python scripts/bench_train.py [--rounds 2] [--steps 3] [--modes exact jagg ablate]

Each (round, mode) is one ``python -m train`` process on the same model, prompts, seeds and
settings (W = 4, jagg_frac = 1.0, so every group takes the mode's path); modes alternate within a
round so drift in the machine hits all of them alike. The first step of every run is a warm-up and
is dropped; the others are averaged. Peak memory is the process's maximum resident set size
(``os.wait4``), which includes the model, the rollout and the reward, not just the update.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [
    "experiment=tiny", "model.path=.cache/small_flux", "model.build_tiny=small", "model.height=64", "model.width=64",
    "sampler.num_steps=9", "update.window=4", "update.jagg_frac=1.0", "grpo.group_size=4", "grpo.prompts_per_rank=1",
    "grpo.micro_batch=1", "grpo.gradient_accumulation_steps=4", "checkpoint.every=0", "checkpoint.export=false",
    "logging.progress_bar=false", "logging.sample_every=0",
]  # fmt: skip


def run_once(mode: str, steps: int, run_dir: Path) -> tuple[list[dict], float]:
    """Metrics of steps 1.. of one training process, and its peak RSS in MiB."""
    cmd = [sys.executable, "-m", "train", *SETTINGS, f"update={mode}", f"num_steps={steps}",
           f"run_dir={run_dir}", f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{mode} run failed:\n{proc.stderr.read()[-3000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return metrics[1:], usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="steps per run, the first one dropped")
    parser.add_argument("--modes", nargs="+", default=["exact", "jagg", "ablate"])
    args = parser.parse_args()
    results = {mode: {"step": [], "update": [], "rss": []} for mode in args.modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in args.modes:
                metrics, rss = run_once(mode, args.steps, Path(tmp) / f"{mode}_{r}")
                results[mode]["step"] += [m["time/step"] for m in metrics]
                results[mode]["update"] += [m["time/update"] for m in metrics]
                results[mode]["rss"].append(rss)
    mean = {mode: {k: statistics.mean(v) for k, v in res.items()} for mode, res in results.items()}
    base = mean[args.modes[0]]
    print(f"small Flux (4+4 blocks, head_dim 64, 256 image tokens), 8 trainable transitions = 2 groups of W=4, "
          f"G=4, micro_batch 1; {args.rounds} rounds x {args.steps - 1} timed steps per mode")  # fmt: skip
    print(f"{'mode':<8}{'step s':>8}{'update s':>10}{'update share':>14}{'step/exact':>12}{'update/exact':>14}"
          f"{'peak RSS MiB':>14}")  # fmt: skip
    for mode, m in mean.items():
        ratios = f"{m['step'] / base['step']:>12.3f}{m['update'] / base['update']:>14.3f}"
        print(f"{mode:<8}{m['step']:>8.2f}{m['update']:>10.2f}{m['update'] / m['step']:>14.2f}{ratios}"
              f"{max(results[mode]['rss']):>14.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
