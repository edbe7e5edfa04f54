"""Scorer throughput on tiny random models: images per second, batched against one image per call.

    python scripts/bench_rewards.py [--batch 16] [--size 64] [--reps 5] [--device cpu]

Builds the tiny HPSv2 / CLIPScore / PickScore / ImageReward models of ``rewards.tiny`` in a temporary folder,
then times ``scorer(images, prompts)`` on one batch of ``--batch`` images (a GRPO group: one
prompt repeated) against ``--batch`` calls of one image each. Median of ``--reps`` after a warm-up,
under ``torch.no_grad`` as the trainer calls scorers.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rewards.base import Scorer, build_scorer
from rewards.tiny import save_tiny_clip, save_tiny_hps, save_tiny_imagereward, tiny_clip_processor


def build_tiny_scorers(directory: Path, device: str) -> dict[str, Scorer]:
    checkpoint, config = save_tiny_hps(directory / "hps")
    clip_dir = save_tiny_clip(directory / "clip")
    pick_dir = save_tiny_clip(directory / "pickscore", seed=1, with_processor=False)
    tiny_clip_processor().save_pretrained(directory / "clip_h")
    return {
        "hpsv2": build_scorer("hpsv2", checkpoint=checkpoint, arch=str(config), device=device),
        "clipscore": build_scorer("clipscore", model_path=clip_dir, device=device),
        "pickscore": build_scorer("pickscore", model_path=pick_dir, processor_path=directory / "clip_h", device=device),
        "imagereward": build_scorer("imagereward", **save_tiny_imagereward(directory / "imagereward"), device=device),
        "jpeg_compressibility": build_scorer("jpeg_compressibility"),
    }


def median_seconds(run: Callable[[], object], reps: int) -> float:
    run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="images per batch (one GRPO group)")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    images = torch.rand(args.batch, 3, args.size, args.size, device=args.device)
    prompts = ["a photo of a cat sitting on a wooden table"] * args.batch
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        scorers = build_tiny_scorers(Path(tmp), args.device)
        print(f"{args.batch} images {args.size}x{args.size}, device {args.device}, {torch.get_num_threads()} threads")
        print(f"{'scorer':<22} {'batched img/s':>14} {'one-by-one img/s':>17} {'speedup':>8}")
        for name, scorer in scorers.items():
            batched = median_seconds(lambda scorer=scorer: scorer(images, prompts), args.reps)
            single = median_seconds(
                lambda scorer=scorer: [scorer(images[i : i + 1], prompts[i : i + 1]) for i in range(args.batch)],
                args.reps,
            )
            print(f"{name:<22} {args.batch / batched:>14.1f} {args.batch / single:>17.1f} {single / batched:>7.1f}x")


if __name__ == "__main__":
    main()
