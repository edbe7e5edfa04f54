"""Rollout throughput (images per second) on the tiny and small offline backbones.

For each backbone and size: build the pipeline folder (cached), load it, encode the prompts once,
then time ``samplers.rollout.rollout`` (DanceGRPO SDE at every step, no decode) with and without
kept velocities, next to the same number of batched ``predict`` calls alone (the rollout's floor);
best of ``--reps`` runs after one warm-up. Not a test.

    python scripts/bench_rollout.py --steps 10 --prompts 2 --group-size 4
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from models import backbone_names, load_backbone
from models.tiny import IMAGE_SIZE, SIZES, build_tiny
from samplers.rollout import KeptVelocities, group_noise, rollout
from samplers.sampler_config import SamplerConfig
from samplers.sde import SDEKind

PROMPTS = ["a photo of a cat", "a red dog on the grass", "a bowl of fruit", "a mountain lake at sunset"]


def _best_seconds(run: Callable[[int], None], reps: int) -> float:
    """Best of ``reps`` timed calls after one warm-up: the least-disturbed run on a shared machine."""
    seconds = []
    for rep in range(reps + 1):
        start = time.perf_counter()
        run(rep)
        seconds.append(time.perf_counter() - start)
    return min(seconds[1:])


def bench(name: str, size: str, folder: Path, args: argparse.Namespace) -> list[str]:
    backbone = load_backbone(name, build_tiny(name, folder / f"{name}_{size}", size=size), dtype="float32")
    pixels = IMAGE_SIZE[size]
    prompts = (PROMPTS * args.prompts)[: args.prompts]
    cond = backbone.encode(prompts).repeat(args.group_size)
    noise = group_noise(
        backbone.initial_noise, range(len(prompts)), group_size=args.group_size, height=pixels, width=pixels
    )
    sigmas = backbone.sigmas(args.steps, height=pixels, width=pixels, shift=3.0)
    t = torch.full((noise.shape[0],), 0.5)

    def predict_only(seed: int) -> None:  # the transformer calls alone: the floor of a rollout
        with torch.no_grad():
            for _ in range(args.steps):
                backbone.predict(noise, t, cond)

    def sample(seed: int, keep: bool) -> None:
        rollout(
            backbone.predict,
            cond,
            noise,
            SamplerConfig(sde=SDEKind.dance, eta=0.3),
            sigmas=sigmas,
            generator=torch.Generator().manual_seed(seed),
            velocities=KeptVelocities() if keep else None,
        )

    rows = []
    for label, run in (
        ("predict only ", predict_only),
        ("rollout      ", lambda seed: sample(seed, False)),
        ("rollout, keep v", lambda seed: sample(seed, True)),
    ):
        best = _best_seconds(run, args.reps)
        rows.append(
            f"{name:10s} {size:6s} {pixels:3d}px {noise.shape[0]:3d} imgs {args.steps:3d} steps  {label:16s}"
            f"{best:7.3f} s {noise.shape[0] / best:8.2f} img/s"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="denoising steps per rollout")
    parser.add_argument("--prompts", type=int, default=2, help="prompts (groups) per rollout")
    parser.add_argument("--group-size", type=int, default=4, help="images per prompt")
    parser.add_argument("--reps", type=int, default=3, help="timed runs after one warm-up")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=SIZES)
    parser.add_argument("--folder", default=None, help="where to build the pipelines (default: a temp dir)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, CPU")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.folder or tmp)
        for size in args.sizes:
            for name in backbone_names():
                for row in bench(name, size, folder, args):
                    print(row)


if __name__ == "__main__":
    main()
