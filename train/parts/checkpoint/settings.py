"""What a checkpoint records of the settings, and what a resume may change.

``recorded_settings`` is what a checkpoint records (dotted key -> value). ``RESUME_SETTINGS`` change what the next
steps compute and are refused unless ``checkpoint.allow_changed`` names them (``changed_refusal``); the per-rank batch
is compared as the global batch it makes with the world size (``global_batch_refusal``); ``NOTED_SETTINGS`` are
changed on purpose (a learning rate lowered by hand) or change nothing a step computes (a served reward's address)
and are named in one line. A mapping among them (the reward's components, the model's options) is compared entry by
entry (``compared``), so that ``checkpoint.allow_changed`` may name a key at any depth, or a group of keys.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import fields, is_dataclass
from difflib import get_close_matches
from enum import Enum
from typing import Any

from rewards.reward_config import SERVED_TRANSPORT
from train.ground.errors import ConfigError

# Settings that change what a checkpoint's weights mean or what the next steps compute: a resumed run keeps them
# unless checkpoint.allow_changed names them (a key or a group of keys). The prompt file counts by its prompts
# (train/parts/data/prompts.py's ``prompts_digest``: the same prompts at another path are the same run). The world size
# and the replicate degree are not among them (a checkpoint reshards), but the global batch they make is.
RESUME_SETTINGS = (
    "model.name",
    "model.path",
    "model.dtype",
    "model.height",
    "model.width",
    "model.options",
    "model.lora",
    "seed",
    "data.train_prompts",
    "sampler",
    "update",
    "grpo",
    "batch",
    "reward",
    "ema",
)
# Under those, what changes only how the same numbers are computed (memory, speed, float rounding): not recorded.
SAME_NUMBERS = (
    "update.offload_velocities",
    "update.share_group_start",
    "update.exact_batched",
    "batch.micro_batch",
    "reward.chunk_groups",  # the rollout's chunks: other batch shapes in its matmuls, the same samples
)
# Per-rank settings compared as the global batch they make with the world size (``global_batch_refusal``).
GLOBAL_BATCH = ("batch.prompts_per_rank", "batch.gradient_accumulation_steps")
# Recorded too, but changed on purpose (a learning rate lowered by hand, another evaluation set) or changing nothing
# a step computes (a served reward's address, key variable, deadline, tries, concurrency: rewards/reward_config.py's
# SERVED_TRANSPORT): a resumed run goes on with the new values and names them in one line.
NOTED_SETTINGS = (
    "optimizer",
    "health",
    "eval.every",  # the cadence the evaluations up to a checkpoint were due on (train/parts/config/record.py)
    "eval.prompts",
    "eval.num_prompts",
    "eval.heldout_prompts",
    "eval.num_steps",
    "eval.seed",
    "eval.samples_per_prompt",
    "eval.scorers",
    *(f"reward.components.{name}.{key}" for name, keys in SERVED_TRANSPORT.items() for key in keys),
)
# Recorded with a checkpoint beside the settings: the full names of the modules LoRA wrapped (known once
# the adapters are added; [] for full fine-tuning), so that other targets are refused as a changed setting.
LORA_MODULES = "model.lora.modules"


def covered(key: str, prefixes: Sequence[str]) -> bool:
    """``key`` is one of ``prefixes`` or a key under one."""
    return any(key == prefix or key.startswith(prefix + ".") for prefix in prefixes)


def recorded_settings(cfg: Any, *, prompts: str) -> dict[str, Any]:
    """What a checkpoint records of ``cfg`` (a TrainConfig): the ``RESUME_SETTINGS`` and ``NOTED_SETTINGS`` but the
    ``SAME_NUMBERS``, dotted key -> value as JSON holds it (a dict or a list is one value); ``data.train_prompts``
    as ``prompts`` (train/parts/data/prompts.py's ``prompts_digest``)."""
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for f in fields(node):
            key, value = f"{prefix}{f.name}", getattr(node, f.name)
            if covered(key, SAME_NUMBERS):
                continue
            if is_dataclass(value):
                walk(value, f"{key}.")
            elif covered(key, RESUME_SETTINGS + NOTED_SETTINGS):
                flat[key] = value.value if isinstance(value, Enum) else value  # as JSON records it

    walk(cfg, "")
    flat["data.train_prompts"] = prompts
    return flat


class _NotSet:
    """The value of a mapping's entry that one side of a comparison does not have."""

    def __repr__(self) -> str:
        return "(not set)"


NOT_SET = _NotSet()


def _opened(key: str, saved: Any, now: Any) -> dict[str, tuple[Any, Any]]:
    """``key``'s values (saved, now), two mappings opened entry by entry to any depth, an entry one lacks NOT_SET."""
    if not isinstance(saved, Mapping) or not isinstance(now, Mapping):
        return {key: (saved, now)}
    pairs: dict[str, tuple[Any, Any]] = {}
    for name in sorted(saved.keys() | now.keys(), key=str):
        pairs |= _opened(f"{key}.{name}", saved.get(name, NOT_SET), now.get(name, NOT_SET))
    return pairs


def compared(saved: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """What a resume compares: dotted key -> (saved, now) for the keys both record, a mapping among them (the
    reward's components, the model's options) opened into its entries' keys (``reward.components.judge.model``).
    A key only one side records is not compared: a checkpoint saved before it was recorded, or a setting gone
    since; an entry only one side's mapping has is (a scorer added, an argument left to its default)."""
    pairs: dict[str, tuple[Any, Any]] = {}
    for key in sorted(saved.keys() & now.keys()):
        pairs |= _opened(key, saved[key], now[key])
    return pairs


def unrecorded(key: str, keys: Collection[str]) -> str | None:
    """Why ``checkpoint.allow_changed`` may not name ``key``, which names none of ``keys`` (those a resume
    compares, ``compared``, and the LoRA modules beside them) nor a group of them, with the nearest; or None."""
    keys = [*keys, LORA_MODULES]
    if any(covered(known, (key,)) for known in keys):
        return None
    groups = {".".join(known.split(".")[:depth]) for known in keys for depth in range(1, known.count(".") + 2)}
    near = get_close_matches(key, sorted(g for g in groups if not covered(g, NOTED_SETTINGS)), n=3)
    hint = f"the nearest are {', '.join(near)}" if near else f"those are under {', '.join(RESUME_SETTINGS)}"
    return f"{key!r} names no setting a checkpoint records ({hint}): name one of them, or a group of them"


def _past_an_entry(key: str, settings: Mapping[str, Any]) -> bool:
    """``key`` names an entry that a mapping of ``settings`` does not have (a scorer of reward.components that
    a checkpoint may have had): only a resume, which has the checkpoint's, can tell whether it names one."""
    for name, value in settings.items():
        if isinstance(value, Mapping) and key.startswith(name + "."):
            return key[len(name) + 1 :].split(".")[0] not in value
    return False


def not_allowable(key: str, settings: Mapping[str, Any]) -> str | None:
    """Why ``checkpoint.allow_changed`` may not name ``key`` (given ``settings``, what this run records:
    ``recorded_settings``), or None: a key that may change without it, or one that names nothing they compare
    (an entry a mapping lacks is left to the resume, ``unrecorded`` with the checkpoint's settings)."""
    if covered(key, SAME_NUMBERS) or covered(key, NOTED_SETTINGS):
        return f"{key!r} may change on resume without it"
    return None if _past_an_entry(key, settings) else unrecorded(key, compared(settings, settings))


def change(key: str, saved: Any, now: Any) -> str:
    """``key saved -> now``; lists of module names by what differs (hundreds of names on a real model)."""
    if key != LORA_MODULES or not isinstance(saved, list) or not isinstance(now, list):
        return f"{key} {saved!r} -> {now!r}"
    gone, new = [n for n in saved if n not in now], [n for n in now if n not in saved]

    def some(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "") if names else "none"

    return f"{key} {len(saved)} -> {len(now)} modules wrapped (no longer: {some(gone)}; new: {some(new)})"


def changed_keys(saved: Mapping[str, Any], now: Mapping[str, Any], allowed: Sequence[str]) -> list[str]:
    """The keys a resume compares (``compared``) whose values differ, unless ``allowed`` (checkpoint.allow_changed)
    names them or a group of keys they belong to."""
    pairs = compared(saved, now)
    return [key for key, (before, after) in pairs.items() if before != after and not covered(key, allowed)]


def changed_refusal(resume: str | None, path: Any, changed: list[str]) -> ConfigError:
    """The one line that refuses to resume checkpoint ``path`` with the ``changed`` settings."""
    keys = ",".join(change.split(" ")[0] for change in changed)
    return ConfigError(
        f"resume={resume}: checkpoint {path} was saved with other settings that change what it means "
        f"({'; '.join(changed)}): resume with its settings, start a new run folder, or allow them with "
        f"checkpoint.allow_changed=[{keys}]"
    )


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n > 1 else ''}"


def global_batch_refusal(
    saved: dict[str, Any], saved_world: int, now: dict[str, Any], world: int, allowed: Sequence[str]
) -> str | None:
    """Why a resume on ``world`` ranks changes the global batch the checkpoint trained with (its prompts per step,
    its samples per optimizer step: the per-rank ``GLOBAL_BATCH`` settings times the world size), with the per-rank
    values that keep it; None when it is kept, allowed, or not recorded."""
    what = dict(zip(GLOBAL_BATCH, ("prompts per step", "samples per optimizer step"), strict=True))
    parts, keep, keys = [], [], []
    for key in GLOBAL_BATCH:
        if key not in saved or key not in now or covered(key, allowed):
            continue
        before, after = saved[key] * saved_world, now[key] * world
        if before == after:
            continue
        parts.append(
            f"{before} {what[key]} ({_ranks(saved_world)} x {key}={saved[key]}), now {after} "
            f"({_ranks(world)} x {key}={now[key]})"
        )
        keep.append(f"{key}={before // world}" if before % world == 0 else f"a world size that divides {before}")
        keys.append(key)
    if not parts:
        return None
    return (
        f"the global batch changes: {'; '.join(parts)}: keep it with {' '.join(keep)}, or allow the change with "
        f"checkpoint.allow_changed=[{','.join(keys)}]"
    )
