"""Whole training steps per update path (CPU): update-stage and step time as ratios to exact, and each
run's peak memory.

    OMP_NUM_THREADS=1 python scripts/bench_train.py [--job small|demo] [--rounds 3] [--steps 4]
        [--kl-beta 0.05] [--runs exact jagg jagg-recompute ablate] [--compile off on]
        [--share-group-start on|off ...] [--exact-batched on|off ...] [--post-window euler dpmpp_2m]
        [--post-window-ratio 0.4]

``--job small``: the small Flux config (64 px, 8 trainable transitions = 2 segments of W = 4, G = 4,
micro-batch 1, one optimizer step per training step, jagg_frac 1.0 so every segment takes the run's
path). ``--job demo``: the default job (``python -m train``, the CPU testbed: 64 samples per step in
one micro-batch, one optimizer step per training step, one segment of W = 4) without its evaluations
and checkpoints.
Both with the KL penalty of ``--kl-beta`` (full fine-tuning: a frozen copy is the reference; 0 = off).
``--compile off on``: every run eager and with ``model.compile=true`` (``<run>+compile``); the compiled
runs' first step, which compiles, is reported apart: its ``time/compile`` in the first process (a cold
inductor cache, when nothing compiled these graphs before on this machine) and the median of the
others (a warm cache), with the graphs compiled per process.

``--share-group-start`` (``update.share_group_start``, default on) and ``--exact-batched``
(``update.exact_batched``, default off) take one value or both: every run then runs with each, named
``<run> share <on|off>`` and ``batched <on|off>``; ``--exact-batched on`` only changes the ``exact`` run
(both jobs route every segment of the other runs to their path, jagg_frac 1.0), so the others run it off.
``--post-window`` (``sampler.post_window.solver``, default euler) likewise: ``euler`` is the sampling
schedule's Euler steps after the SDE window (ratio 1, today's rollout), ``dpmpp_2m`` MixGRPO-Flash's solver on
``--post-window-ratio`` of them (default 0.4: the default job's 5 steps after its window become 2), named
``<run> post <solver>``. The first run with the first values is the baseline of the ratios.

Runs: ``jagg`` reuses the rollout's velocities (``update.reuse_velocities=fresh``, the default),
``jagg-recompute`` recomputes them (``off``), ``jagg-stale`` reuses them after optimizer steps too.
Each (round, run) is one process that builds the run as ``python -m train`` does and trains
``--steps`` steps, the first a warm-up that is dropped; runs alternate within a round so drift in the
machine hits all of them alike, and a run reports the median over its other steps of all rounds.
Phases are timed twice: by the wall clock (what the trainer logs) and by the process's CPU time,
which other processes on a busy machine do not stretch (with OMP_NUM_THREADS=1 it is the work done).
Peak memory is the process's maximum resident set size (``os.wait4``), which includes the model, the
rollout and the reward, not just the update; "kept v" is the rollout's velocities per sample.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JOBS = {
    "small": [
        "experiment=tiny", "model.path=.cache/small_flux", "model.build_tiny=small", "model.height=64",
        "model.width=64", "sampler.num_steps=9", "update.segment_length=4", "update.jagg_frac=1.0", "grpo.group_size=4",
        "batch.prompts_per_rank=1", "batch.micro_batch=1", "batch.gradient_accumulation_steps=4",
        "checkpoint.every=0", "checkpoint.export=false", "logging.progress_bar=false", "logging.sample_every=0",
    ],
    "demo": [
        "eval.every=0", "logging.sample_every=0", "checkpoint.every=0", "checkpoint.export=false",
        "logging.progress_bar=false",
    ],
}  # fmt: skip
RUNS = {
    "exact": ["update=exact"],
    "jagg": ["update=jagg"],
    "jagg-recompute": ["update=jagg", "update.reuse_velocities=off"],
    "jagg-stale": ["update=jagg", "update.reuse_velocities=stale"],
    "jagg_sequential": ["update=jagg_sequential"],
    "ablate": ["update=ablate"],
}
PHASES = ("step", "rollout", "update")
SWITCHES = {"on": "true", "off": "false"}
SOLVERS = ("euler", "dpmpp_2m")


def post_window(solver: str, ratio: float) -> list[str]:
    """The overrides of one ``--post-window`` value: euler on every step after the window, or dpmpp_2m on ``ratio``."""
    return [f"sampler.post_window.solver={solver}", f"sampler.post_window.ratio={1.0 if solver == 'euler' else ratio}"]


def variants(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each run with each ``--share-group-start``, ``--exact-batched``, ``--compile`` and ``--post-window``
    value: name -> overrides."""
    share, batched, compile_, solvers = args.share_group_start, args.exact_batched, args.compile, args.post_window
    out = {}
    for name in args.runs:
        for b in batched if name == "exact" else batched[:1]:
            for on in share:
                for c in compile_:
                    for solver in solvers:
                        label = (
                            name
                            + (f" share {on}" if len(share) > 1 else "")
                            + (f" batched {b}" if len(batched) > 1 else "")
                            + (f" post {solver}" if len(solvers) > 1 else "")
                            + ("+compile" if c == "on" else "")
                        )
                        out[label] = [
                            *RUNS[name],
                            f"update.share_group_start={SWITCHES[on]}",
                            f"update.exact_batched={SWITCHES[b]}",
                            f"model.compile={SWITCHES[c]}",
                            *post_window(solver, args.post_window_ratio),
                        ]
    return out


def child(out: Path, steps: int, overrides: list[str]) -> None:
    """Train ``steps`` steps of the composed config in this process; write every step's metrics, with its
    phases timed by the wall clock (``time/*``, as the trainer logs them) and by this process's CPU
    time (``cpu/*``)."""
    from hydra import compose, initialize_config_module

    import train.loop.step
    from train.parts.config.schema import register_schema
    from train.parts.observe.perf import PhaseTimer
    from train.run.build import open_run
    from train.run.start import load_config, process_group

    class TwoClockTimer(PhaseTimer):
        """The trainer's phase timer that also sums the process's CPU time per phase."""

        def __init__(self, device: Any = "cpu", flops: Any = None) -> None:
            super().__init__(device, flops)
            self._cpu: dict[str, float] = defaultdict(float)

        @contextmanager
        def phase(self, name: str) -> Iterator[None]:
            start = time.process_time()
            try:
                with super().phase(name):
                    yield
            finally:
                self._cpu[name] += time.process_time() - start

        def pop(self) -> dict[str, float]:
            out = super().pop() | {f"cpu/{name}": seconds for name, seconds in self._cpu.items()}
            self._cpu.clear()
            return out

    train.loop.step.PhaseTimer = TwoClockTimer  # type: ignore[misc]  # train_step builds its timer from this name
    register_schema()
    with initialize_config_module(config_module="configs", version_base=None):
        config = load_config(compose(config_name="train", overrides=[*overrides, f"run_dir={out.parent}"]))
    with process_group() as dist, open_run(config, dist) as run:
        records = [train.loop.step.train_step(run, step) for step in range(steps)]
    out.write_text(json.dumps(records))


def run_once(overrides: list[str], steps: int, folder: Path) -> tuple[list[dict], float]:
    """Metrics of every step of one training process, and its peak RSS in MiB."""
    folder.mkdir(parents=True)
    out = folder / "steps.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, __file__, "--child", str(out), "--steps", str(steps), *overrides]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        assert proc.stderr is not None
        raise RuntimeError(f"{' '.join(overrides)} failed:\n{proc.stderr.read()[-3000:]}")
    return json.loads(out.read_text()), usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", choices=list(JOBS), default="small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps per process, the first one dropped")
    parser.add_argument("--kl-beta", type=float, default=0.05, help="grpo.kl_beta (0 = no KL reference)")
    parser.add_argument("--runs", nargs="+", default=["exact", "jagg", "jagg-recompute", "ablate"], choices=list(RUNS))
    parser.add_argument("--compile", nargs="+", default=["off"], choices=["off", "on"], help="model.compile per run")
    parser.add_argument("--share-group-start", nargs="+", default=["on"], choices=list(SWITCHES))
    parser.add_argument("--exact-batched", nargs="+", default=["off"], choices=list(SWITCHES))
    parser.add_argument(
        "--post-window", nargs="+", default=["euler"], choices=SOLVERS, help="sampler.post_window.solver"
    )
    parser.add_argument("--post-window-ratio", type=float, default=0.4, help="sampler.post_window.ratio of dpmpp_2m")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args()
    if args.child is not None:
        child(args.child, args.steps, overrides)
        return
    keys = [f"{clock}/{p}" for clock in ("time", "cpu") for p in PHASES]
    runs = variants(args)
    results: dict[str, dict[str, list[float]]] = {name: {k: [] for k in [*keys, "rss"]} for name in runs}
    kept: dict[str, float] = {}
    first_steps: dict[str, list[dict]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for i, (name, run_overrides) in enumerate(runs.items()):
                overrides_ = [*JOBS[args.job], *run_overrides, f"grpo.kl_beta={args.kl_beta}"]
                metrics, rss = run_once(overrides_, args.steps, Path(tmp) / f"{i}_{r}")
                first_steps[name].append(metrics[0])
                for key in keys:
                    results[name][key] += [m[key] for m in metrics[1:]]
                results[name]["rss"].append(rss)
                kept[name] = metrics[1].get("memory/velocity_bytes_per_sample", 0) / 1024
    report(args, results, kept)
    report_compile(first_steps)


def report(args: argparse.Namespace, results: dict[str, dict[str, list[float]]], kept: dict[str, float]) -> None:
    """Median rollout, update and step per run, as ratios to the first run, and the spread of its steps' CPU time."""
    med = {name: {k: statistics.median(v) for k, v in res.items()} for name, res in results.items()}
    base = next(iter(med.values()))
    timed = args.rounds * (args.steps - 1)
    print(f"job {args.job}, grpo.kl_beta={args.kl_beta}; median of {timed} steps per run ({args.rounds} processes)")
    width = max(16, *(len(name) + 2 for name in med))
    print(f"{'':<{width}}{'CPU time':>64}{'wall clock':>62}")
    header = f"{'rollout s':>10}{'update s':>10}{'step s':>8}{'rollout/base':>14}{'update/base':>13}{'step/base':>11}"
    print(f"{'run':<{width}}{header}{header}{'peak RSS MiB':>14}{'kept v KiB/sample':>19}{'CPU step min-max s':>20}")
    for name, m in med.items():
        row = ""
        for clock in ("cpu", "time"):
            times = [m[f"{clock}/{p}"] for p in ("rollout", "update", "step")]
            ratios = "".join(
                f"{t / base[f'{clock}/{p}']:>{w}.3f}"
                for t, p, w in zip(times, ("rollout", "update", "step"), (14, 13, 11))
            )
            row += f"{times[0]:>10.2f}{times[1]:>10.2f}{times[2]:>8.2f}{ratios}"
        spread = f"{min(results[name]['cpu/step']):.2f}-{max(results[name]['cpu/step']):.2f}"
        print(f"{name:<{width}}{row}{max(results[name]['rss']):>14.0f}{kept[name]:>19.1f}{spread:>20}")
    print(f"base: {next(iter(med))}")


def report_compile(first_steps: dict[str, list[dict]]) -> None:
    """The compiled runs' first step: compile time of the first process and of the later ones."""
    for name, steps in first_steps.items():
        if "time/compile" not in steps[0]:
            continue
        later = [m["time/compile"] for m in steps[1:]]
        warm = f", later processes (median) {statistics.median(later):.1f}s" if later else ""
        graphs = int(steps[0]["count/compilations"])
        print(f"{name}: time/compile of the first step: first process {steps[0]['time/compile']:.1f}s{warm}; "
              f"{graphs} graphs per process")  # fmt: skip


if __name__ == "__main__":
    main()
