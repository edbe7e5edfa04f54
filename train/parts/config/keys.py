"""The keys of the configuration tree: a key no group declares (one line with the closest name), a float that is
not finite, and where a group's error is.

``typed`` turns the composed tree into the schema's dataclasses as ``OmegaConf.to_object`` does (bottom-up, each
dataclass's ``__post_init__`` checking its own fields), but knows each dataclass's path: the plain ValueError of a
group ("num_steps must be >= 2 ...", which names the field relative to its group) becomes
ConfigError("sampler.num_steps must be >= 2 ..."). ``checked`` runs the same checks again on a built tree.
(OmegaConf 2.3's ``to_object`` runs ``__post_init__`` but lets its ValueError through with no key.)
"""

from __future__ import annotations

import difflib
import math
from dataclasses import fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from train.ground.errors import ConfigError, config_key


def unknown_setting(prefix: str, key: str, schema: type) -> str:
    """The error for ``<prefix><key>``, which the dataclass ``schema`` does not declare, with the closest name."""
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
        if key not in init:  # added with + although the schema does not declare it (a typo)
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
