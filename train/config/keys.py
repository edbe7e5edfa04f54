"""The keys of the configuration tree: where a group's error is, which keys moved, which settings a run records.

* ``typed`` turns the composed tree into the schema's dataclasses as ``OmegaConf.to_object`` does (bottom-up,
  each dataclass's ``__post_init__`` checking its own fields), but knows each dataclass's path: the plain
  ValueError of a group ("num_steps must be >= 2 ...", which names the field relative to its group) becomes
  ConfigError("sampler.num_steps must be >= 2 ..."). ``checked`` runs the same checks again on a built tree.
  (OmegaConf 2.3's ``to_object`` runs ``__post_init__`` but lets its ValueError through with no key.)
* ``MOVED``: settings that moved to another group. A moved key given on the command line or in a YAML file
  is refused in one line naming its new place ("grpo.lr is now optimizer.lr"); what an older run recorded
  (a checkpoint's settings, its config.yaml) is read under the new names (``moved_settings``, ``moved_tree``).
* ``RESUME_SETTINGS``: what a checkpoint records, and the comparison that refuses to resume with other values.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import asdict, fields, is_dataclass
from enum import Enum
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from train.run.errors import ConfigError, config_key

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
# Settings that change what a checkpoint's weights or the run's history mean: a resumed run keeps them unless
# checkpoint.allow_changed names them (a key or a group of keys). The world size and the replicate degree
# are not among them: a checkpoint reshards.
RESUME_SETTINGS = ("model.name", "model.path", "model.lora", "seed", "update.mode", "sampler")
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


def resume_settings(cfg: Any) -> dict[str, Any]:
    """The ``RESUME_SETTINGS`` of ``cfg`` (a TrainConfig), dotted key -> value (what a checkpoint records)."""
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif covered(f"{prefix}{key}", RESUME_SETTINGS):
                flat[f"{prefix}{key}"] = value.value if isinstance(value, Enum) else value  # as JSON records it

    walk(asdict(cfg), "")
    return flat


def _change(key: str, saved: Any, now: Any) -> str:
    """``key saved -> now``; lists of module names by what differs (hundreds of names on a real model)."""
    if key != LORA_MODULES or not isinstance(saved, list) or not isinstance(now, list):
        return f"{key} {saved!r} -> {now!r}"
    gone, new = [n for n in saved if n not in now], [n for n in now if n not in saved]

    def some(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "") if names else "none"

    return f"{key} {len(saved)} -> {len(now)} modules wrapped (no longer: {some(gone)}; new: {some(new)})"


def changed_settings(saved: dict[str, Any], now: dict[str, Any], allowed: Sequence[str]) -> list[str]:
    """``key saved -> now`` for each key whose recorded value differs, unless ``allowed`` (checkpoint.allow_changed)
    names it or a group of keys it belongs to."""
    return [
        _change(key, saved.get(key), now.get(key))
        for key in sorted(saved.keys() | now.keys())
        if saved.get(key) != now.get(key) and not covered(key, allowed)
    ]


def changed_refusal(resume: str | None, path: Any, changed: list[str]) -> ConfigError:
    """The one line that refuses to resume checkpoint ``path`` with the ``changed`` settings."""
    keys = ",".join(change.split(" ")[0] for change in changed)
    return ConfigError(
        f"resume={resume}: checkpoint {path} was saved with other settings that change what it means "
        f"({'; '.join(changed)}): resume with its settings, start a new run folder, or allow them with "
        f"checkpoint.allow_changed=[{keys}]"
    )
