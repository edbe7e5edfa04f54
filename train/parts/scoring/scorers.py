"""The scorers of a run: the rewards and the evaluation's metrics, their arguments and files checked at
start-up (before any of them, or the model, loads), then built on the run's device."""

from __future__ import annotations

import inspect
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rewards.base import Scorer, build_scorer, scorer_class
from rewards.combine import RewardCombiner
from rewards.reward_config import optional_terms
from train.ground.errors import ConfigError, PathError, config_key, every_missing
from train.parts.config.schema import TrainConfig


def check_scorer(field_name: str, name: str, kwargs: dict[str, Any]) -> None:
    """The settings under ``field_name`` are arguments scorer ``name`` takes, and the files and folders among
    them (the constructor's parameters typed ``Path``) exist, every missing one named; nothing is built."""
    signature = inspect.signature(scorer_class(name))
    try:
        signature.bind(**kwargs)
    except TypeError as err:
        raise ConfigError(f"{field_name}: {err} (the scorer's arguments are in docs/rewards.md)") from None
    paths = {key for key, parameter in signature.parameters.items() if "Path" in str(parameter.annotation)}
    every_missing(partial(_exists, field_name, key, value) for key, value in kwargs.items()
                  if key in paths and value is not None)  # fmt: skip


def _exists(field_name: str, key: str, value: Any) -> None:
    if not Path(str(value)).expanduser().exists():
        raise PathError(
            f"{field_name}.{key}={str(value)!r} does not exist: point it at the scorer's file or folder "
            "(docs/rewards.md lists them)"
        )


def _reward_arguments(component: dict[str, Any]) -> dict[str, Any]:
    """A component's scorer arguments: its settings but the combiner's (weight, required)."""
    return {key: value for key, value in component.items() if key not in ("weight", "required")}


def check_scorer_inputs(cfg: TrainConfig) -> None:
    """What the scorers read, checked at start-up (``validate``) before any of them (or the model) loads, rather
    than when each one builds: the rewards' arguments and files, and with an evaluation (eval.every) those of
    eval.scorers; every missing file named at once."""
    checks = [
        partial(check_scorer, f"reward.components.{name}", name, _reward_arguments(dict(component)))
        for name, component in cfg.reward.components.items()
    ]
    every_missing([*checks, partial(check_eval_scorers, cfg)] if cfg.eval.every else checks)


def check_eval_scorers(cfg: TrainConfig) -> None:
    """``check_scorer`` on each of eval.scorers."""
    every_missing(partial(check_scorer, f"eval.scorers.{name}", name, dict(kwargs))
                  for name, kwargs in cfg.eval.scorers.items())  # fmt: skip


def _scorer(field_name: str, name: str, kwargs: dict[str, Any], device: torch.device) -> Scorer:
    """Scorer ``name`` built from the settings under ``field_name`` (``check_scorer_inputs`` checked them)."""
    with config_key(field_name, inspect.signature(scorer_class(name)).parameters):
        return build_scorer(name, **kwargs).to(device)


def build_rewards(cfg: TrainConfig, device: torch.device) -> RewardCombiner:
    """Every reward model is replicated on every rank: scoring is data-parallel and frozen."""
    components = {
        name: (
            _scorer(f"reward.components.{name}", name, _reward_arguments(comp), device),
            float(comp.get("weight", 1.0)),
        )
        for name, comp in cfg.reward.components.items()
    }
    return RewardCombiner(components, mode=cfg.reward.combine, optional=optional_terms(cfg.reward.components))


def build_eval_scorers(cfg: TrainConfig, device: torch.device) -> dict[str, Scorer]:
    """The evaluation metrics of ``eval.scorers`` (name -> constructor arguments)."""
    return {
        name: _scorer(f"eval.scorers.{name}", name, dict(kwargs), device) for name, kwargs in cfg.eval.scorers.items()
    }
