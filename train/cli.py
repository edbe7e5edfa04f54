"""What the command-line tools share: the schema and resolvers they compose with, the help text, the console.

* ``setup()``, called at import by every Hydra entry point (``python -m train``, ``train.eval``,
  ``train.grad_quality``, and their console scripts ``jagg-train``, ``jagg-eval``, ``jagg-probe``),
  registers the typed schema and the resolvers below.
* ``${jagg_fields:}`` (in ``hydra.help.template``, configs/train.yaml): every field of the schema with its
  current value and the comment that documents it in train/config.py, so ``--help`` needs no second copy.
* ``${jagg_eval_dir:...}`` (configs/eval.yaml): Hydra's folder of ``python -m train.eval``, inside the
  evaluated run, so its config and log sit beside its results.
* ``ConsoleFormatter`` (configs/hydra/job_logging/console.yaml): INFO lines as they are, other levels
  prefixed; the run folder's ``<job name>.log`` gets the same lines with a time stamp.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import logging
import tokenize
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from train import config as schema
from train.config import TrainConfig, register_schema


class ConsoleFormatter(logging.Formatter):
    """``message`` for INFO, ``LEVEL: message`` otherwise (a warning must not read like progress)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.levelno == logging.INFO else f"{record.levelname}: {text}"


def _comments(source: str) -> dict[int, str]:
    """Line number -> the text of the comment on that line."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = token.string.lstrip("#").strip()
    return found


def field_docs() -> dict[str, str]:
    """Dotted key of every schema field -> its documenting comment in train/config.py.

    A field's comment is the one at the end of its line, else the comment lines right above it.
    """
    source = inspect.getsource(schema)
    comments = _comments(source)
    lines = source.splitlines()
    per_class: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs = per_class.setdefault(node.name, {})
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            text = comments.get(item.lineno, "")
            if not text:
                above: list[str] = []
                number = item.lineno - 1
                while number in comments and lines[number - 1].lstrip().startswith("#"):
                    above.insert(0, comments[number])
                    number -= 1
                text = " ".join(above)
            docs[item.target.id] = text
    out: dict[str, str] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = hints[f.name]
            if dataclasses.is_dataclass(kind):
                walk(typing.cast(type, kind), f"{prefix}{f.name}.")
            else:
                out[f"{prefix}{f.name}"] = per_class.get(cls.__name__, {}).get(f.name, "")

    walk(TrainConfig, "")
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
    rows = []
    for key, doc in field_docs().items():
        node: Any = values
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        rows.append((f"{key} = {show_value(node)}", doc))
    width = min(48, max(len(left) for left, _ in rows))
    text = "\n".join(f"{left:<{width}}  {doc}".rstrip() for left, doc in rows)
    return text.replace("$", "$$")  # Hydra fills the template with string.Template: a literal $ is $$


@dataclass(frozen=True)
class Weights:
    """Trained weights that ``python -m train.eval`` can load, found from a path on its command line."""

    kind: str  # "checkpoint" (a step_XXXXXXXX folder), "export" (save_pretrained) or "lora_export"
    path: Path
    run_dir: Path | None  # the run folder that wrote them (holds metrics.jsonl or .hydra/), when recognisable
    tag: str  # names the evaluation's files: "step_00000060" or "export"


def _run_folder(path: Path) -> Path | None:
    return path if (path / "metrics.jsonl").is_file() or (path / ".hydra").is_dir() else None


def find_weights(value: str, field: str) -> Weights:
    """What ``value`` (``eval.transformer`` or ``resume``) points at: an export, a checkpoint, or a run folder
    (its export, else its latest complete checkpoint). Raises FileNotFoundError naming ``field`` and the fix."""
    # imported here: diffusers loads only when weights are asked for, not for --help
    from diffusers.loaders.lora_base import LORA_WEIGHT_NAME_SAFE

    from train.checkpoint import CheckpointManager, is_complete

    path = Path(value)
    accepted = "an export folder (<run>/export), a checkpoint folder (<run>/checkpoints/step_XXXXXXXX) or a run folder"
    if not path.exists():
        raise FileNotFoundError(f"{field}={value!r} does not exist; pass {accepted}")
    if is_complete(path):
        run = _run_folder(path.parent.parent) if path.parent.name == "checkpoints" else None
        return Weights("checkpoint", path, run, path.name)
    if (path / "config.json").is_file() or (path / LORA_WEIGHT_NAME_SAFE).is_file():
        kind = "export" if (path / "config.json").is_file() else "lora_export"
        return Weights(kind, path, _run_folder(path.parent), "export")
    if path.parent.name == "checkpoints" or path.name.endswith(".tmp"):
        raise FileNotFoundError(
            f"{field}={value!r} is not a complete checkpoint (no COMPLETE marker: its save was interrupted); "
            f"pick another folder of {path.parent}"
        )
    if (path / "export").is_dir():
        return find_weights(str(path / "export"), field)
    latest = CheckpointManager(path).latest()
    if latest is not None:
        return find_weights(str(latest), field)
    raise FileNotFoundError(f"{field}={value!r} holds no trained weights; pass {accepted}")


def eval_output_dir(transformer: str | None, resume: str | None, default: str) -> str:
    """Hydra's folder for ``python -m train.eval``: ``<evaluated run>/eval``, else ``default``.

    A path that names no weights also gives ``default``: train/eval.py then says what is wrong with it.
    """
    value = transformer or (resume if resume != "auto" else None)
    if not value:
        return default
    try:
        run = find_weights(value, "eval.transformer").run_dir
    except FileNotFoundError:
        return default
    return str(run / "eval") if run is not None else default


def setup() -> None:
    """The schema and the resolvers of configs/*.yaml (idempotent: every entry point calls it at import)."""
    register_schema()
    OmegaConf.register_new_resolver("jagg_fields", lambda *, _root_: fields_help(_root_), replace=True)
    OmegaConf.register_new_resolver("jagg_eval_dir", eval_output_dir, replace=True)
