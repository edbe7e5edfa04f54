"""``python -m train.cli.check [overrides]``: the settings of a launch, checked once before torchrun starts it.

torchrun's elastic agent restarts a failed worker group up to ``--max-restarts`` times whatever the workers'
exit status, so a launch refused for a setting would print its one line, and load everything before it,
once per start, then end in torchrun's traceback. The launchers of scripts/launch run this first, in one
process: the settings composed as ``python -m train`` composes them and validated as it validates them
(train/run/start.py's ``load_config``: each group's ranges, the rules across groups, the files the settings
name). Nothing is loaded and nothing is written. A refusal is the trainer's own line and exit status 2, and
torchrun never starts; what only the started run can check (its checkpoints, the world size) it checks itself.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from train.cli.compose import setup
from train.cli.reporting import hydra_message, report_error, reported
from train.ground.errors import ConfigError

PROG = "python -m train"  # the refusal reads as the trainer's own


def _composed(overrides: Sequence[str]) -> DictConfig:
    """The job's settings, its run folder set from ``hydra.run.dir`` as ``python -m train`` sets it (compose()
    runs no job, so Hydra's folder is read from its own settings)."""
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
    run_dir = OmegaConf.select(cfg, "hydra.run.dir", throw_on_resolution_failure=False)
    with open_dict(cfg):
        del cfg["hydra"]
        if not cfg.run_dir and run_dir:
            cfg.run_dir = str(run_dir)
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    """0 when ``python -m train`` would accept the settings; else its one line on stderr and status 2."""
    setup()
    overrides = sys.argv[1:] if argv is None else argv
    try:
        cfg = _composed(overrides)
    except (HydraException, OmegaConfBaseException) as err:
        return report_error(ConfigError(hydra_message(err)), PROG)
    from train.run.start import load_config  # torch and the models: after the settings compose

    with reported(PROG):
        load_config(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
