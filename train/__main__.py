"""``python -m train [overrides]`` (one process) or ``torchrun --nproc_per_node N -m train [overrides]``.

The configuration tree is ``configs/train.yaml``; every field is documented in ``train/config.py``.
A mistake in the settings, a path or a checkpoint prints one line and exits with status 2 (train/cli.py).
"""

import hydra
from omegaconf import DictConfig

from train.cli import reported, run_hydra
from train.config import register_schema

PROG = "python -m train"
register_schema()


@hydra.main(config_path="pkg://configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    with reported(PROG):
        from train.trainer import run  # imported here so --help and config errors stay fast

        run(cfg)


if __name__ == "__main__":
    run_hydra(main, prog=PROG)
