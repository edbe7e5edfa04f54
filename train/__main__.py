"""``python -m train [overrides]`` (one process) or ``torchrun --nproc_per_node N -m train [overrides]``;
installed as the console script ``jagg-train``.

The configuration tree is ``configs/train.yaml``; every field is documented in ``train/config.py``
(``--help`` lists them).
"""

import logging

import hydra
from omegaconf import DictConfig

from train.cli import setup

setup()


@hydra.main(config_path="pkg://configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    from train.trainer import run  # imported here so --help and config errors stay fast

    logging.captureWarnings(True)  # warnings reach the console handler and the run's log file
    run(cfg)


if __name__ == "__main__":
    main()
