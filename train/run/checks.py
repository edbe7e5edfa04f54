"""The rules across the trainer's configuration groups (train/parts/config/schema.py), checked before any model loads.

Each group checks its own ranges in ``__post_init__``; ``validate`` runs those again and then applies the few
rules across groups: every float finite, a segment that divides the trainable steps, the batch that divides
the samples, no solver after a window the job does not have, files that exist and read as UTF-8, the size of
an evaluation. It raises ConfigError or PathError (train/ground/errors.py), which the commands print as one line.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import fields
from functools import partial
from pathlib import Path
from typing import Any

from samplers.sampler_config import PostWindowConfig, SamplerConfig
from samplers.sde import SDEKind
from train.algorithm.segments import split_segments
from train.algorithm.update_config import Routing
from train.ground.errors import ConfigError, PathError, every_missing, prefixed
from train.parts.checkpoint.settings import not_allowable, recorded_settings
from train.parts.config.keys import check_finite, check_known_keys, checked
from train.parts.config.schema import TrainConfig
from train.parts.data.prompts import read_prompts
from train.parts.scoring.scorers import check_scorer_inputs, check_served_bounds


def trainable_transitions(sampler: SamplerConfig, window_start: int | None = None) -> list[int]:
    """Trainable transitions of a rollout: the SDE steps, without the last (ignored) transition."""
    last = sampler.num_steps - 1
    if sampler.sde is SDEKind.ode:
        return []
    if sampler.sde_window_size <= 0:
        return list(range(last))
    start = sampler.sde_window_range[0] if window_start is None else window_start
    return [k for k in range(start, start + sampler.sde_window_size) if k < last]


def _validate_training(cfg: TrainConfig, known_backbones: tuple[str, ...]) -> None:
    """What training needs beyond each group's own checks: a backbone the registry knows, a reward, a sampler
    with transitions to train."""
    _choice(cfg.model.name, known_backbones, "model.name")
    if not cfg.reward.components:
        raise ConfigError("reward.components is empty: name at least one scorer, e.g. reward=jpeg")
    if cfg.sampler.sde is SDEKind.ode:
        raise ConfigError("sampler.sde=ode samples no transition to train: pick dance, flow or cps")


def _choice(value: Any, accepted: Collection[Any], name: str) -> None:
    if value not in accepted:
        raise ConfigError(f"{name}={value!r} is not valid; accepted values: {', '.join(map(str, accepted))}")


def _check_across(cfg: TrainConfig) -> None:
    """The rules that span groups (each group checks its own fields in ``__post_init__``)."""
    samples = cfg.grpo.group_size * cfg.batch.prompts_per_rank
    per_step = f"per rank per step (grpo.group_size * batch.prompts_per_rank = {samples})"
    if samples % cfg.batch.gradient_accumulation_steps:
        steps = cfg.batch.gradient_accumulation_steps
        raise ConfigError(f"batch.gradient_accumulation_steps={steps} must divide the samples {per_step}")
    if cfg.update.routing is Routing.auto and cfg.update.auto_rollouts > samples:
        raise ConfigError(f"update.auto_rollouts={cfg.update.auto_rollouts} exceeds the samples {per_step}")
    if cfg.grpo.ratio_norm and cfg.sampler.sde is SDEKind.cps:
        raise ConfigError(
            "grpo.ratio_norm=true normalises a Gaussian log-prob, which sampler.sde=cps does not have: "
            "use sampler.sde=flow or dance, or grpo.ratio_norm=false"
        )
    recorded = recorded_settings(cfg, prompts="")  # its keys: the prompts' digest is the resume's to compare
    for key in cfg.checkpoint.allow_changed:
        if problem := not_allowable(key, recorded):
            raise ConfigError(f"checkpoint.allow_changed: {problem}")
    if cfg.checkpoint.keep_best and not cfg.eval.every:
        raise ConfigError(
            "checkpoint.keep_best=true keeps the checkpoint of the best evaluation, and eval.every=0 runs none: set "
            "eval.every > 0 (with eval.scorers), or checkpoint.keep_best=false"
        )
    if cfg.checkpoint.overwrite and cfg.resume:
        raise ConfigError(
            f"checkpoint.overwrite=true starts the run in run_dir again, resume={cfg.resume} continues one: pick one"
        )
    try:
        split_segments(trainable_transitions(cfg.sampler), cfg.update.segment_length)
    except ValueError as err:  # the trainable transitions follow the sampler's steps and window
        message = prefixed("update", str(err), ["segment_length"])
        raise ConfigError(f"{message} (sampler.num_steps, the SDE window)") from None


def _check_post_window(sampler: SamplerConfig) -> None:
    """``sampler.post_window`` changes only the steps after an SDE window, and the trainer draws one only with
    ``sde_window_size`` > 0 (samplers/window.py). The sampler's rollout also takes a window its caller gives, so
    this rule is the trainer's, not the sampler's own."""
    default = PostWindowConfig()
    changed = [
        f"sampler.post_window.{f.name}={getattr(sampler.post_window, f.name)}"
        for f in fields(PostWindowConfig)
        if getattr(sampler.post_window, f.name) != getattr(default, f.name)
    ]
    if sampler.sde_window_size == 0 and changed:
        raise ConfigError(
            f"{', '.join(changed)} sets the steps after the SDE window, and sampler.sde_window_size=0 has none (SDE "
            "on every step): leave sampler.post_window at its defaults, or set sampler.sde_window_size > 0 (and "
            "sampler.sde_window_range), e.g. sampler=flow_fast"
        )


def _folder(path: str, message: str) -> None:
    if not Path(path).is_dir():
        raise PathError(message)


def _validate_files(cfg: TrainConfig, *, rewards: bool) -> None:
    """Every file and folder the command reads before its model loads (``rewards``: the scorers' too); those
    missing named together."""
    m = cfg.model
    checks: list[Callable[[], object]] = [
        partial(read_prompts, cfg.data.train_prompts, field_name="data.train_prompts")
    ]
    if rewards:
        checks.append(partial(check_scorer_inputs, cfg.reward, cfg.eval.scorers if cfg.eval.every else None))
    if m.build_tiny is None:
        fix = "point it at a local diffusers pipeline folder"
        checks.append(partial(_folder, m.path, f"model.path={m.path!r} is not a folder; {fix}"))
    # eval.transformer: python -m train.eval checks it (train.cli.find_weights), naming what it accepts
    if m.embedding_cache is not None:
        checks.append(
            partial(_folder, m.embedding_cache, f"model.embedding_cache={m.embedding_cache!r} is not a folder")
        )
    if cfg.resume not in (None, "auto"):
        message = f"resume={cfg.resume!r}: no such checkpoint folder (use resume=auto or a path)"
        checks.append(partial(_folder, str(cfg.resume), message))
    for key, path in (("eval.prompts", cfg.eval.prompts), ("eval.heldout_prompts", cfg.eval.heldout_prompts)):
        if path is not None:
            checks.append(partial(read_prompts, path, field_name=key))
    every_missing(checks)


def _check_eval_size(cfg: TrainConfig) -> None:
    """One evaluation samples at most eval.max_images images (the trainer's run before training and every
    eval.every steps; python -m train.eval's once or twice)."""
    d, e = cfg.data, cfg.eval
    if not e.scorers:
        return  # no evaluation is configured
    prompts = len(read_prompts(e.prompts or d.train_prompts))
    if e.num_prompts:
        prompts = min(prompts, e.num_prompts)
    heldout = len(read_prompts(e.heldout_prompts)) if e.heldout_prompts else 0
    images = (prompts + heldout) * e.samples_per_prompt
    if images > e.max_images:
        source = f"eval.prompts={e.prompts}" if e.prompts else f"data.train_prompts={d.train_prompts}"
        raise ConfigError(
            f"an evaluation would sample {images} images ({prompts} prompts of {source}"
            + (f" and {heldout} held-out" if heldout else "")
            + f", x eval.samples_per_prompt={e.samples_per_prompt}), more than eval.max_images={e.max_images}: "
            "set eval.num_prompts=<n> (or eval.prompts=<a smaller file>), or raise eval.max_images"
        )


def validate(
    cfg: TrainConfig,
    *,
    known_scorers: tuple[str, ...],
    known_backbones: tuple[str, ...],
    check_files: bool = True,
    rewards: bool = True,
) -> None:
    """Reject impossible settings, naming the field and the accepted values. Loads no model.

    Raises ConfigError (a ValueError) for a setting, PathError (a FileNotFoundError) for a missing file.
    Each group's own checks (its ``__post_init__``) run again, so a config changed after it was built is
    checked too. ``check_files=False`` skips the checks of model, prompt and checkpoint paths, for a command
    that reads none of them; ``rewards=False`` skips the files of the rewards and evaluation scorers, for a command
    that checks its own (``python -m train.eval``).
    """
    check_known_keys(cfg, "")
    check_finite(cfg, "")
    checked(cfg)
    _validate_training(cfg, known_backbones)
    _check_post_window(cfg.sampler)
    for name in cfg.eval.scorers:
        _choice(name, known_scorers, "eval.scorers (scorer name)")
    _check_across(cfg)
    if check_files:
        _validate_files(cfg, rewards=rewards)
        if rewards:  # once their arguments are known to be good
            check_served_bounds(cfg.reward, cfg.eval.scorers if cfg.eval.every else None, cfg.dist.timeout_s)
        _check_eval_size(cfg)
