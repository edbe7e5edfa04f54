"""A command's two entry points from its body: ``main``, the body under ``@hydra.main``, and ``command``, the
console script's (``python -m`` too), which runs ``main`` under ``run_hydra`` (train/cli/reporting.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import hydra
from omegaconf import DictConfig

from train.cli.reporting import reported, run_hydra


def hydra_command(
    config_name: str, prog: str, body: Callable[[DictConfig], Any]
) -> tuple[Callable[..., Any], Callable[[], None]]:
    """``main``: ``body`` on the tree Hydra composes from ``configs/<config_name>.yaml``, inside ``reported`` (a
    user's mistake is one line); ``command``: ``main`` under ``run_hydra``."""

    @hydra.main(config_path="pkg://configs", config_name=config_name, version_base=None)
    def main(cfg: DictConfig) -> None:
        with reported(prog):
            logging.captureWarnings(True)  # warnings reach the console handler and the log file too
            body(cfg)

    return main, partial(run_hydra, main, prog=prog)
