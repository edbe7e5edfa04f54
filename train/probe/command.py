"""``python -m train.probe`` (``jagg-probe``): the gradient quality of a JAGG path per group (the
paper's Table 5) and the jagg_frac it gives, on the configured backbone, sampler and reward (train/probe/session.py).

    python -m train.probe probe.num_rollouts=8                  # the CPU testbed
    torchrun --nproc_per_node 8 -m train.probe experiment=flux_dance model.path=... \\
        data.train_prompts=... reward.components.hpsv2.checkpoint=... reward.components.clipscore.model_path=...

Each probe writes into its own folder, ``runs/<experiment>/probe/<time>`` (configs/probe.yaml).
"""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from train.cli.compose import setup
from train.cli.reporting import reported, run_hydra
from train.probe.probe_config import register
from train.probe.session import run_probe

PROG = "python -m train.probe"
setup()
register()


@hydra.main(config_path="pkg://configs", config_name="probe", version_base=None)
def main(cfg: DictConfig) -> None:
    with reported(PROG):
        logging.captureWarnings(True)  # warnings reach the console handler and the log file too
        run_probe(cfg)


def command() -> None:
    """``python -m train.probe`` and the console script ``jagg-probe``: one line for a user's mistake."""
    run_hydra(main, prog=PROG)


if __name__ == "__main__":
    command()
