"""``--help`` from the schema itself: ``${jagg_fields:}`` (in ``hydra.help.template``, configs/train.yaml) lists
every field of the schema with its current value and its attribute docstring, read from the module of its
dataclass, so ``--help`` needs no second copy."""

from __future__ import annotations

import ast
import functools
import inspect
import json
import sys
import typing
from dataclasses import fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from train.parts.config.schema import TrainConfig


@functools.cache  # a module's source is read and parsed once per process
def _class_docs(module_name: str) -> dict[str, dict[str, str]]:
    """Class name -> field name -> its attribute docstring (the string literal right below the field), on one line,
    for the classes of a module's source."""
    per_class: dict[str, dict[str, str]] = {}
    for node in ast.parse(inspect.getsource(sys.modules[module_name])).body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs = per_class.setdefault(node.name, {})
        for item, after in zip(node.body, [*node.body[1:], None]):
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            literal = after.value if isinstance(after, ast.Expr) else None
            text = literal.value if isinstance(literal, ast.Constant) and isinstance(literal.value, str) else ""
            docs[item.target.id] = " ".join(inspect.cleandoc(text).split())
    return per_class


def field_docs(schema: type = TrainConfig) -> dict[str, str]:
    """Dotted key of every field of ``schema`` (the trainer's, or a command's that extends it) -> its attribute
    docstring, read from the module that declares its dataclass (train/parts/config/schema.py, samplers/, ...)."""
    out: dict[str, str] = {}

    def doc(cls: type, name: str) -> str:
        for owner in cls.__mro__:  # the class that declares the field, for an inherited one
            docs = _class_docs(owner.__module__).get(owner.__name__, {}) if is_dataclass(owner) else {}
            if name in docs:
                return docs[name]
        return ""

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            kind = hints[f.name]
            if is_dataclass(kind):
                walk(typing.cast(type, kind), f"{prefix}{f.name}.")
            else:
                out[f"{prefix}{f.name}"] = doc(cls, f.name)

    walk(schema, "")
    return out


def show_value(value: Any) -> str:
    """A value as it is written on the command line (null, true, JSON for lists and dicts)."""
    if value is None:
        return "null"
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def fields_help(root: DictConfig) -> str:
    """``key = value   meaning`` for every schema field, values as composed (interpolations unresolved)."""
    values = OmegaConf.to_container(root, resolve=False, throw_on_missing=False)
    assert isinstance(values, dict)
    schema = OmegaConf.get_type(root)
    rows = []
    for key, doc in field_docs(schema if isinstance(schema, type) and is_dataclass(schema) else TrainConfig).items():
        node: Any = values
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        rows.append((f"{key} = {show_value(node)}", doc))
    width = min(48, max(len(left) for left, _ in rows))
    text = "\n".join(f"{left:<{width}}  {doc}".rstrip() for left, doc in rows)
    return text.replace("$", "$$")  # Hydra fills the template with string.Template: a literal $ is $$
