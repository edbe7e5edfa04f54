"""The keys of the configuration tree: where a group's error is, which keys moved, which settings a run records.

* ``typed`` turns the composed tree into the schema's dataclasses as ``OmegaConf.to_object`` does (bottom-up,
  each dataclass's ``__post_init__`` checking its own fields), but knows each dataclass's path: the plain
  ValueError of a group ("num_steps must be >= 2 ...", which names the field relative to its group) becomes
  ConfigError("sampler.num_steps must be >= 2 ..."). ``checked`` runs the same checks again on a built tree.
  (OmegaConf 2.3's ``to_object`` runs ``__post_init__`` but lets its ValueError through with no key.)
* ``MOVED``: settings that moved to another group. A moved key given on the command line or in a YAML file
  is refused in one line naming its new place ("grpo.lr is now optimizer.lr"); what an older run recorded
  (a checkpoint's settings, its config.yaml) is read under the new names (``moved_settings``, ``moved_tree``).
* What a checkpoint records (``recorded_settings``) and what a resume may change: ``RESUME_SETTINGS`` change what the
  next steps compute and are refused unless ``checkpoint.allow_changed`` names them (``changed_refusal``); the
  per-rank batch is compared as the global batch it makes with the world size (``global_batch_refusal``);
  ``NOTED_SETTINGS`` are changed on purpose (a learning rate lowered by hand) and named in one line.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from train.ground.errors import ConfigError, config_key

# Old key -> new key, for every setting that moved (a key under an old key moves with it).
MOVED = {
    "grpo.prompts_per_rank": "batch.prompts_per_rank",
    "grpo.micro_batch": "batch.micro_batch",
    "grpo.gradient_accumulation_steps": "batch.gradient_accumulation_steps",
    "grpo.lr": "optimizer.lr",
    "grpo.weight_decay": "optimizer.weight_decay",
    "grpo.betas": "optimizer.betas",
    "grpo.max_grad_norm": "optimizer.max_grad_norm",
    "grpo.ema_decay": "ema.decay",
    "grpo.max_bad_steps": "health.max_bad_steps",
    "logging.eval_every": "eval.every",
    "data.eval_prompts": "eval.prompts",
    "data.num_eval_prompts": "eval.num_prompts",
    "data.heldout_prompts": "eval.heldout_prompts",
    "update.window": "update.segment_length",
}
# Settings that change what a checkpoint's weights mean or what the next steps compute: a resumed run keeps them
# unless checkpoint.allow_changed names them (a key or a group of keys). The prompt file counts by its prompts
# (train/data/prompts.py's ``prompts_digest``: the same prompts at another path are the same run). The world size
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
SAME_NUMBERS = ("update.offload_velocities", "update.share_group_start", "update.exact_batched", "batch.micro_batch")
# Per-rank settings compared as the global batch they make with the world size (``global_batch_refusal``).
GLOBAL_BATCH = ("batch.prompts_per_rank", "batch.gradient_accumulation_steps")
# Recorded too, but changed on purpose (a learning rate lowered by hand, another evaluation set): a resumed run
# goes on with the new values and names them in one line.
NOTED_SETTINGS = (
    "optimizer",
    "health",
    "eval.every",  # the cadence the evaluations up to a checkpoint were due on (train/config/record.py)
    "eval.prompts",
    "eval.num_prompts",
    "eval.heldout_prompts",
    "eval.num_steps",
    "eval.seed",
    "eval.samples_per_prompt",
    "eval.scorers",
)
# Recorded with a checkpoint beside the settings: the full names of the modules LoRA wrapped (known once
# the adapters are added; [] for full fine-tuning), so that other targets are refused as a changed setting.
LORA_MODULES = "model.lora.modules"


def moved_to(key: str) -> str | None:
    """The new name of ``key`` (or of a key under it: ``grpo.betas[0]``) if it moved, else None."""
    for old, new in MOVED.items():
        if key == old or key.startswith((f"{old}.", f"{old}[")):
            return new + key[len(old) :]
    return None


def moved_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Dotted key -> value as an older run recorded them, under today's names."""
    return {moved_to(key) or key: value for key, value in settings.items()}


def moved_tree(tree: Any) -> dict[str, Any]:
    """A nested configuration as an older run wrote it (its config.yaml), with each moved key at its new place."""
    assert isinstance(tree, dict), f"a configuration is a mapping, got {type(tree).__name__}"
    out = {key: dict(value) if isinstance(value, dict) else value for key, value in tree.items()}
    for old, new in MOVED.items():
        (group, key), (new_group, new_key) = old.split("."), new.split(".")
        if isinstance(out.get(group), dict) and key in out[group] and isinstance(out.setdefault(new_group, {}), dict):
            out[new_group].setdefault(new_key, out[group].pop(key))
    return out


def unknown_setting(prefix: str, key: str, schema: type) -> str:
    """The error for ``<prefix><key>``, which the dataclass ``schema`` does not declare: its new place if it
    moved, else the closest name."""
    if (new := moved_to(f"{prefix}{key}")) is not None:
        return f"{prefix}{key} is now {new}"
    close = difflib.get_close_matches(key, sorted(f.name for f in fields(schema)), n=1)
    hint = f"; did you mean {prefix}{close[0]}?" if close else ""
    where = schema.__module__.replace(".", "/") + ".py"  # the module that declares the schema
    return f"{prefix}{key} is not a setting of {schema.__name__}{hint} ({where})"


def check_known_keys(node: object, prefix: str) -> None:
    """A key added with ``+group.key=value`` that no dataclass declares would be silently ignored: reject it."""
    if not is_dataclass(node):
        return
    declared = {f.name for f in fields(node)}
    for key in vars(node):
        if key not in declared:
            raise ConfigError(unknown_setting(prefix, key, type(node)))
    for name in declared:
        check_known_keys(getattr(node, name), f"{prefix}{name}.")


def check_finite(node: object, prefix: str) -> None:
    """Every float anywhere in the settings (dataclass fields, lists, dicts such as model.options) is finite.

    The groups' own checks add the ranges; this walk keeps a new float field from slipping through with a
    NaN, which no comparison rejects.
    """
    if is_dataclass(node):
        items = [(f.name, getattr(node, f.name)) for f in fields(node)]
    elif isinstance(node, dict):
        items = [(str(key), value) for key, value in node.items()]
    elif isinstance(node, list | tuple):
        items = [(f"[{i}]", value) for i, value in enumerate(node)]
    else:
        return
    for key, value in items:
        name = f"{prefix}{key}" if key.startswith("[") or not prefix else f"{prefix}.{key}"
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value}")
        check_finite(value, name)


def typed(node: DictConfig, path: str = "") -> Any:
    """The structured node ``node`` (at dotted ``path``) as its dataclass, children first, as
    ``OmegaConf.to_object`` builds it; a ValueError of a dataclass's ``__post_init__`` names its full key."""
    kind = OmegaConf.get_type(node)
    assert kind is not None and is_dataclass(kind), f"{path or 'the root'} is not a structured config"
    init = {f.name for f in fields(kind) if f.init}
    values = {}
    for key in node:
        if key not in init:  # added with + although the schema does not declare it (moved, or a typo)
            raise ConfigError(unknown_setting(f"{path}." if path else "", str(key), kind))
        child = node[key]  # resolves an interpolation
        if isinstance(child, DictConfig) and is_dataclass(OmegaConf.get_type(child)):
            value = typed(child, f"{path}.{key}" if path else str(key))
        elif isinstance(child, DictConfig | ListConfig):
            value = OmegaConf.to_container(child, resolve=True)
        else:
            value = child
        values[str(key)] = value
    with config_key(path, [f.name for f in fields(kind)]):
        return kind(**values)


def checked(node: object, path: str = "") -> None:
    """Run every dataclass's ``__post_init__`` in the tree again (children first), naming the full key."""
    if not is_dataclass(node):
        return
    for f in fields(node):
        checked(getattr(node, f.name), f"{path}.{f.name}" if path else f.name)
    if (post_init := getattr(node, "__post_init__", None)) is not None:
        with config_key(path, [f.name for f in fields(node)]):
            post_init()


def covered(key: str, prefixes: Sequence[str]) -> bool:
    """``key`` is one of ``prefixes`` or a key under one."""
    return any(key == prefix or key.startswith(prefix + ".") for prefix in prefixes)


def recorded_settings(cfg: Any, *, prompts: str) -> dict[str, Any]:
    """What a checkpoint records of ``cfg`` (a TrainConfig): the ``RESUME_SETTINGS`` and ``NOTED_SETTINGS`` but the
    ``SAME_NUMBERS``, dotted key -> value as JSON holds it (a dict or a list is one value); ``data.train_prompts``
    as ``prompts`` (train/data/prompts.py's ``prompts_digest``)."""
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


def not_allowable(key: str) -> str | None:
    """Why ``checkpoint.allow_changed`` may not name ``key``, or None."""
    if covered(key, SAME_NUMBERS) or covered(key, NOTED_SETTINGS):
        return f"{key!r} may change on resume without it"
    if not any(covered(key, (prefix,)) or covered(prefix, (key,)) for prefix in RESUME_SETTINGS):
        return (
            f"{key!r} is not a setting a resumed run keeps; those are {', '.join(RESUME_SETTINGS)} (and the keys "
            "under them)"
        )
    return None


def change(key: str, saved: Any, now: Any) -> str:
    """``key saved -> now``; lists of module names by what differs (hundreds of names on a real model)."""
    if key != LORA_MODULES or not isinstance(saved, list) or not isinstance(now, list):
        return f"{key} {saved!r} -> {now!r}"
    gone, new = [n for n in saved if n not in now], [n for n in now if n not in saved]

    def some(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "") if names else "none"

    return f"{key} {len(saved)} -> {len(now)} modules wrapped (no longer: {some(gone)}; new: {some(new)})"


def changed_keys(saved: dict[str, Any], now: dict[str, Any], allowed: Sequence[str]) -> list[str]:
    """The keys both record whose values differ, unless ``allowed`` (checkpoint.allow_changed) names them or a group
    of keys they belong to. A key only one side has is not compared: a checkpoint saved before it was recorded,
    or a setting gone since."""
    return sorted(key for key in saved.keys() & now.keys() if saved[key] != now[key] and not covered(key, allowed))


def changed_settings(saved: dict[str, Any], now: dict[str, Any], allowed: Sequence[str]) -> list[str]:
    """``key saved -> now`` for each of ``changed_keys``."""
    return [change(key, saved[key], now[key]) for key in changed_keys(saved, now, allowed)]


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
