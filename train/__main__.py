"""``python -m train [overrides]`` (one process) or ``torchrun --nproc_per_node N -m train [overrides]``;
installed as the console script ``jagg-train``.

The configuration tree is ``configs/train.yaml``; every field is documented in ``train/parts/config/schema.py``
(``--help`` lists them). A mistake in the settings, a path or a checkpoint prints one line and exits
with status 2 (train/cli/reporting.py).
"""

import logging

import hydra
from omegaconf import DictConfig

from train.cli.compose import setup
from train.cli.reporting import reported, run_hydra

PROG = "python -m train"
setup()


@hydra.main(config_path="pkg://configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    with reported(PROG):
        from train.loop.trainer import run  # imported here so --help and config errors stay fast

        logging.captureWarnings(True)  # warnings reach the console handler and the run's log file
        run(cfg)


def command() -> None:
    """``python -m train`` and the console script ``jagg-train``: one line for a user's mistake."""
    run_hydra(main, prog=PROG)


if __name__ == "__main__":
    command()
