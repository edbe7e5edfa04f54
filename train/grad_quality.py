"""``python -m train.grad_quality``: the gradient quality of a JAGG path per group (the paper's Table 5)
and the jagg_frac it gives, on the configured backbone, sampler and reward (train/probe.py).

    python -m train.grad_quality probe.num_rollouts=8                  # tiny Flux on CPU
    torchrun --nproc_per_node 8 -m train.grad_quality experiment=flux_dance model.path=... \\
        data.train_prompts=... reward.components.hpsv2.checkpoint=... reward.components.clipscore.model_path=...
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from train.cli import reported, run_hydra
from train.config import register_schema
from train.probe import run_probe

PROG = "python -m train.grad_quality"


@hydra.main(config_path="pkg://configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    with reported(PROG):
        run_probe(cfg)


if __name__ == "__main__":
    register_schema()
    run_hydra(main, prog=PROG)
