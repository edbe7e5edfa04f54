"""What every command does first: the typed, validated configuration of a composed Hydra tree, and
torchrun's process group for the duration of the command."""

from __future__ import annotations

import atexit
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from models.registry import backbone_names
from rewards.base import SCORER_NAMES
from train.distributed.collectives import DistInfo, init_distributed, shutdown
from train.ground.errors import ConfigError
from train.parts.config.keys import typed
from train.parts.config.schema import TrainConfig
from train.run.checks import validate


def _missing(tree: Any, name: str = "") -> list[str]:
    """Keys whose value is ``???`` (read without resolving interpolations, which would stop at the first)."""
    if isinstance(tree, dict):
        children = [(f"{name}.{key}" if name else str(key), value) for key, value in tree.items()]
    elif isinstance(tree, list):
        children = [(f"{name}[{i}]", value) for i, value in enumerate(tree)]
    else:
        return [name] if tree == "???" else []
    return [key for child, value in children for key in _missing(value, child)]


def typed_config(cfg: DictConfig) -> TrainConfig:
    """The composed tree as the typed schema; ConfigError naming a ``???`` or unresolvable setting, or the
    first field a group's own checks refuse (its dotted key prefixed: train/parts/config/keys.py)."""
    missing = _missing(OmegaConf.to_container(cfg, resolve=False))
    if missing:  # the experiment leaves them ??? (local paths the user must give)
        raise ConfigError(f"required settings have no value: {', '.join(missing)}; pass each as <key>=<value>")
    try:
        return cast(TrainConfig, typed(cfg))
    except OmegaConfBaseException as err:  # e.g. an interpolation that does not resolve
        key = getattr(err, "full_key", None)
        raise ConfigError(f"{key}: {str(err).splitlines()[0]}" if key else str(err).splitlines()[0]) from None


def load_config(cfg: DictConfig, *, rewards: bool = True) -> TrainConfig:
    """The typed config of a composed Hydra tree, validated (no model is loaded).

    An empty ``run_dir`` becomes Hydra's output folder of the job (``hydra.run.dir``, or the sweep job's folder).
    ``rewards=False``: the rewards' and evaluation scorers' files are not checked (a command that checks its own).
    """
    config = typed_config(cfg)
    if not config.run_dir:
        if not HydraConfig.initialized():
            raise ConfigError("run_dir is not set and no Hydra command is running: pass run_dir=<folder>")
        config.run_dir = HydraConfig.get().runtime.output_dir
    validate(config, known_scorers=SCORER_NAMES, known_backbones=tuple(backbone_names()), rewards=rewards)
    return config


@contextmanager
def process_group(timeout_s: float | None = None) -> Iterator[DistInfo]:
    """torchrun's process group (none for one process) for the duration of a command.

    timeout_s: ``dist.timeout_s``, how long a collective waits for the other ranks.
    """
    dist = init_distributed(timeout_s=timeout_s)
    if dist.world_size > 1:
        from train.distributed.parallelize import release_world_mesh  # FSDP's imports: with a process group only

        # after the command's frames and its exception are gone, before Python shuts down
        atexit.register(release_world_mesh)
    try:
        yield dist
    finally:
        shutdown()
