"""The scorers of a run: the rewards and the evaluation's metrics, their arguments and files checked at
start-up (before any of them, or the model, loads), then built on the run's device."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rewards.base import Scorer, build_scorer, scorer_class
from rewards.combine import RewardCombiner
from rewards.reward_config import RewardConfig, optional_terms
from rewards.served import request_bound_s
from train.ground.errors import ConfigError, PathError, config_key, every_missing


def check_scorer(field_name: str, name: str, kwargs: dict[str, Any]) -> None:
    """The settings under ``field_name`` are arguments scorer ``name`` takes, its own checks of them pass (a served
    scorer's address, tries and key: ``Scorer.check_arguments``, which reaches no server), and the files and
    folders among them (the constructor's parameters typed ``Path``) exist, every missing one named; nothing is
    built."""
    cls = scorer_class(name)
    signature = inspect.signature(cls)
    try:
        arguments = scorer_arguments(name, kwargs)
    except TypeError as err:
        raise ConfigError(f"{field_name}: {err} (the scorer's arguments are in docs/rewards.md)") from None
    with config_key(field_name, signature.parameters):
        cls.check_arguments(arguments)
    paths = {key for key, parameter in signature.parameters.items() if "Path" in str(parameter.annotation)}
    every_missing(partial(_exists, field_name, key, value) for key, value in kwargs.items()
                  if key in paths and value is not None)  # fmt: skip


def scorer_arguments(name: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Every argument of scorer ``name``'s constructor given ``kwargs``, its defaults filled in; TypeError when
    ``kwargs`` do not fit it."""
    bound = inspect.signature(scorer_class(name)).bind(**kwargs)
    bound.apply_defaults()
    return bound.arguments


def _exists(field_name: str, key: str, value: Any) -> None:
    if not Path(str(value)).expanduser().exists():
        raise PathError(
            f"{field_name}.{key}={str(value)!r} does not exist: point it at the scorer's file or folder "
            "(docs/rewards.md lists them)"
        )


def _reward_arguments(component: dict[str, Any]) -> dict[str, Any]:
    """A component's scorer arguments: its settings but the combiner's (weight, required)."""
    return {key: value for key, value in component.items() if key not in ("weight", "required")}


def check_scorer_inputs(reward: RewardConfig, eval_scorers: Mapping[str, Any] | None) -> None:
    """What the scorers read, checked at start-up (``validate``) before any of them (or the model) loads, rather
    than when each one builds: the rewards' arguments and files, and with an evaluation those of ``eval_scorers``
    (eval.scorers; None without one); every missing file named at once."""
    checks = [
        partial(check_scorer, f"reward.components.{name}", name, _reward_arguments(dict(component)))
        for name, component in reward.components.items()
    ]
    every_missing(checks if eval_scorers is None else [*checks, partial(check_eval_scorers, eval_scorers)])


def check_served_bounds(
    reward: RewardConfig | None, eval_scorers: Mapping[str, Any] | None, dist_timeout_s: float
) -> None:
    """Each served scorer's request to a server that does not answer ends before ``dist_timeout_s``
    (dist.timeout_s): the reward's terms (``reward``; None for a command that trains nothing) and, with an
    evaluation, those of ``eval_scorers`` (eval.scorers; None without one). The other ranks wait for this rank's
    scores in a collective (the step's all-reduce, the evaluation's next forward or gather), which would end the run
    instead of the step or the scorer's part in the evaluation."""
    for key, name, kwargs in _served(reward, eval_scorers):
        arguments = scorer_arguments(name, kwargs)
        timeout_s, retries = arguments["timeout_s"], arguments["retries"]
        if (longest := request_bound_s(timeout_s, retries)) >= dist_timeout_s:
            raise ConfigError(
                f"{key}: a request its server does not answer takes up to {longest:g} s ((2 x retries + 1) x "
                f"timeout_s with retries={retries}, timeout_s={timeout_s:g}), not below dist.timeout_s="
                f"{dist_timeout_s:g}, so the other ranks' wait for this rank's scores would end the run: lower "
                f"{key}.timeout_s or {key}.retries, or raise dist.timeout_s"
            )


def _served(reward: RewardConfig | None, eval_scorers: Mapping[str, Any] | None) -> list[tuple[str, str, dict]]:
    """(the field, the scorer's name, its arguments) of each served scorer among ``reward``'s terms and
    ``eval_scorers``."""
    served = []
    if reward is not None:
        for name in reward.served_terms():
            served.append((f"reward.components.{name}", name, _reward_arguments(dict(reward.components[name]))))
    for name, kwargs in (eval_scorers or {}).items():
        if scorer_class(name).runs_remotely:
            served.append((f"eval.scorers.{name}", name, dict(kwargs)))
    return served


def check_eval_scorers(scorers: Mapping[str, Any]) -> None:
    """``check_scorer`` on each of eval.scorers (``scorers``: name -> constructor arguments)."""
    every_missing(partial(check_scorer, f"eval.scorers.{name}", name, dict(kwargs))
                  for name, kwargs in scorers.items())  # fmt: skip


def _scorer(field_name: str, name: str, kwargs: dict[str, Any], device: torch.device) -> Scorer:
    """Scorer ``name`` built from the settings under ``field_name`` (``check_scorer_inputs`` checked them)."""
    with config_key(field_name, inspect.signature(scorer_class(name)).parameters):
        return build_scorer(name, **kwargs).to(device)


def build_rewards(reward: RewardConfig, device: torch.device) -> RewardCombiner:
    """Every reward model is replicated on every rank: scoring is data-parallel and frozen."""
    components = {
        name: (
            _scorer(f"reward.components.{name}", name, _reward_arguments(comp), device),
            float(comp.get("weight", 1.0)),
        )
        for name, comp in reward.components.items()
    }
    return RewardCombiner(components, mode=reward.combine, optional=optional_terms(reward.components))


def build_eval_scorers(scorers: Mapping[str, Any], device: torch.device) -> dict[str, Scorer]:
    """The evaluation metrics of eval.scorers (``scorers``: name -> constructor arguments)."""
    return {name: _scorer(f"eval.scorers.{name}", name, dict(kwargs), device) for name, kwargs in scorers.items()}
