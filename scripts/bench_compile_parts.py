"""The default job's VAE decode and reward compiled against eager (CPU): per-call time ratios and compile cost.

    OMP_NUM_THREADS=1 python scripts/bench_compile_parts.py [--rows 64] [--reps 5]

What ``python -m train`` runs after each rollout, on its own model (``testbed/pipeline``) and reward
(``shape_alignment``): the decode of ``--rows`` latents in one call (the job's micro-batch: the whole
rollout) and the scorer on the decoded images of the testbed's own scenes (testbed/data.py: encoded by
the VAE, so the scorer sees images with shapes in them, as after training). Each part runs eager and
under ``torch.compile`` (inductor, torch's automatic dynamic shapes, as ``model.compile`` compiles
the blocks); the first compiled call, which compiles, is reported apart with the graphs it compiled.
Per call: the median of ``--reps`` after that first call, by the wall clock and by the process's CPU
time, and the compiled output's largest difference from eager's (relative to eager's largest element).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from models.diffusers_backbone import pack_latents
from models.registry import load_backbone
from rewards.base import build_scorer
from testbed.data import make_dataset
from train.distributed.parallelize import compile_stats

ROOT = Path(__file__).resolve().parents[1]


def timed(call: Callable[[], torch.Tensor], reps: int) -> tuple[torch.Tensor, float, float]:
    """The last output, and the median wall and CPU seconds of ``reps`` calls."""
    walls, cpus = [], []
    for _ in range(reps):
        wall, cpu = time.perf_counter(), time.process_time()
        out = call()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return out, statistics.median(walls), statistics.median(cpus)


def compare(name: str, eager: Callable[[], torch.Tensor], compiled: Callable[[], torch.Tensor], reps: int) -> None:
    before, start = compile_stats(), time.perf_counter()
    compiled()
    first, stats = time.perf_counter() - start, compile_stats()
    eager()  # warm-up
    ref, wall_e, cpu_e = timed(eager, reps)
    out, wall_c, cpu_c = timed(compiled, reps)
    error = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
    print(
        f"{name:<16}{first:>10.1f}{stats.graphs - before.graphs:>8}{wall_e:>10.4f}{wall_c:>10.4f}"
        f"{wall_c / wall_e:>8.3f}{cpu_e:>10.4f}{cpu_c:>10.4f}{cpu_c / cpu_e:>8.3f}{error:>12.2e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="latents per decode call (the default job's rollout)")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per part (median reported)")
    args = parser.parse_args()
    backbone = load_backbone("flux", ROOT / "testbed" / "pipeline", dtype="float32", device="cpu")
    images, captions = make_dataset(args.rows, seed=0)
    with torch.no_grad():
        latents = backbone.vae.encode(images * 2 - 1).latent_dist.mode()
        config = backbone.configs["vae"]
        z = pack_latents((latents - config.get("shift_factor", 0.0)) * config["scaling_factor"])
        decoded = backbone.decode(z)
        scorer = build_scorer("shape_alignment")
        print(f"{'part':<16}{'first s':>10}{'graphs':>8}{'eager s':>10}{'comp. s':>10}{'ratio':>8}", end="")
        print(f"{'eager cpu':>10}{'comp. cpu':>10}{'ratio':>8}{'rel. error':>12}")
        compiled_decode = torch.compile(backbone.decode)
        compare("vae decode", lambda: backbone.decode(z), lambda: compiled_decode(z), args.reps)
        compiled_score = torch.compile(scorer.score)
        compare(
            "shape_alignment",
            lambda: scorer.score(decoded, captions),
            lambda: compiled_score(decoded, captions),
            args.reps,
        )
    print(f"rows {args.rows}; median of {args.reps} calls; wall and process CPU seconds per call")


if __name__ == "__main__":
    main()
