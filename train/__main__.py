"""``python -m train [overrides]`` (one process) or ``torchrun --nproc_per_node N -m train [overrides]``.

The configuration tree is ``configs/train.yaml``; every field is documented in ``train/config.py``.
"""

import hydra
from omegaconf import DictConfig

from train.config import register_schema

register_schema()


@hydra.main(config_path="pkg://configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    from train.trainer import run  # imported here so --help and config errors stay fast

    run(cfg)


if __name__ == "__main__":
    main()
