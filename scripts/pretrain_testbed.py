"""Pretrain the CPU testbed's tiny Flux-architecture pipeline on the procedural shape set.

    python scripts/pretrain_testbed.py --out testbed/pipeline

Trains the VAE, then the flow transformer (testbed/pretrain.py states the objectives), saves the
pipeline with save_pretrained (loadable by models.registry.load_backbone("flux", out)), then
samples held-out captions with a 9-step ODE (shift 3), writes the grid next to the pipeline and
prints the shape-alignment reward of the samples with its parts. Deterministic from --seed on a
given machine and thread count.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from rewards.shapes import ShapeAlignmentScorer
from testbed.data import make_dataset
from testbed.pretrain import PretrainConfig, load_testbed, pretrain, sample
from train.parts.observe.grid import image_grid


def main() -> None:
    defaults = PretrainConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("testbed/pipeline"), help="pipeline folder (must not exist)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--num-images", type=int, default=defaults.num_images)
    parser.add_argument("--vae-steps", type=int, default=defaults.vae_steps)
    parser.add_argument("--flow-steps", type=int, default=defaults.flow_steps)
    parser.add_argument("--num-samples", type=int, default=64, help="held-out captions sampled after training")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (results depend on it)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = PretrainConfig(
        seed=args.seed, num_images=args.num_images, vae_steps=args.vae_steps, flow_steps=args.flow_steps
    )
    start = time.perf_counter()
    images, captions = make_dataset(config.num_images, seed=config.seed)
    summary = pretrain(args.out, images, captions, config, log=lambda line: print(line, flush=True))
    summary["train_seconds"] = round(time.perf_counter() - start, 1)
    # held-out captions: a different seed of the generator
    _, prompts = make_dataset(args.num_samples, seed=config.seed + 1)
    samples = sample(load_testbed(args.out), prompts, seed=config.seed)
    parts = ShapeAlignmentScorer().score_parts(samples, prompts)
    summary["samples_reward"] = {k: round(v.nanmean().item(), 4) for k, v in parts.items()}
    image_grid(samples, nrow=math.ceil(math.sqrt(len(prompts)))).save(args.out / "samples.png")
    (args.out / "samples.txt").write_text("\n".join(prompts) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
