"""The export of the trained transformer, and finding trained weights from a path.

``export_model`` gathers the full (unsharded) state dict to rank 0's CPU and writes the
transformer as diffusers ``save_pretrained`` output (loadable with ``from_pretrained``), a LoRA
injected with diffusers' ``add_adapter`` as ``pytorch_lora_weights.safetensors`` (keys prefixed
with the pipeline component, loadable with ``pipe.load_lora_weights`` or
``transformer.load_lora_adapter``), or a ``peft.PeftModel`` as a PEFT adapter folder. A run exports
into ``export/`` (the weights its evaluations scored) and, with an EMA, ``export_raw/`` (train/ground/layout.py),
each with a ``weights.json`` saying which weights it holds and the size and SHA-256 of each of its files.

``find_weights`` says what a path on ``python -m train.eval``'s command line points at: an export, a
checkpoint, or a run folder.
"""

from __future__ import annotations

import json
import logging
import shutil
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import ModelMixin
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY, LORA_WEIGHT_NAME_SAFE
from diffusers.utils import SAFETENSORS_WEIGHTS_NAME
from peft import PeftModel
from peft.utils import get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule

from train.distributed.collectives import agree_on_write, get_rank
from train.ground.disk import write_failure
from train.ground.errors import PathError
from train.ground.layout import BEST_EXPORT, CHECKPOINTS, EXPORT, RAW_EXPORT, RunLayout
from train.parts.checkpoint.files import checksum_problem, file_info, is_complete
from train.parts.checkpoint.manager import CheckpointManager
from train.parts.optim.ema import EMA

log = logging.getLogger(__name__)


def export_model(
    model: nn.Module,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    adapter_name: str | None = None,
    lora_prefix: str = "transformer",
) -> Path:
    """Write the trained transformer, or only its LoRA adapter, to ``out_dir`` (a collective).

    dtype: cast the exported tensors (None keeps the training dtype). adapter_name: which LoRA
    adapter to write when the model holds several. lora_prefix: the pipeline component the LoRA
    keys are prefixed with (diffusers-injected adapters only).
    """
    if not isinstance(model, (ModelMixin, PeftModel)):
        raise ValueError(
            f"export_model: {type(model).__name__} is neither a diffusers ModelMixin nor a peft "
            "PeftModel; only those have a loadable on-disk format"
        )
    # Full tensors are gathered on every rank but kept only on rank 0 (cpu_offload), in CPU memory.
    full: dict[str, Any] = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = Path(out_dir)
    if dtype is not None and get_rank() == 0:
        full = {key: value.to(dtype) for key, value in full.items()}

    def write() -> None:
        if get_rank() != 0:
            return
        try:
            if isinstance(model, PeftModel):
                model.save_pretrained(str(out), state_dict=full)
            elif getattr(model, "peft_config", None):
                _export_diffusers_lora(model, full, out, adapter_name, lora_prefix)
            else:
                _export_full(model, full, out)
        except Exception:
            shutil.rmtree(out, ignore_errors=True)  # no export cut short is left for train.eval to find
            raise

    agree_on_write(write, out, "the export")  # every rank waits for rank 0's files and hears how they went
    return out


def _export_full(model: ModelMixin, state: dict[str, Tensor], out: Path) -> None:
    """save_pretrained of an unsharded copy built on the meta device from the model's config.

    FSDP2 swaps the model's class for a generated subclass; the copy uses the original class, so
    config.json names the real class.
    """
    cls: Any = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    with torch.device("meta"):
        copy = cls.from_config(model.config)  # type: ignore[attr-defined]  # ModelMixin's ConfigMixin
    copy.load_state_dict(state, strict=True, assign=True)
    copy.save_pretrained(out)


def _export_diffusers_lora(
    model: Any, state: dict[str, Tensor], out: Path, adapter_name: str | None, prefix: str
) -> None:
    """The file diffusers' ``save_lora_adapter`` writes, from the gathered state and with a prefix."""
    names = list(model.peft_config)
    if adapter_name is None:
        if len(names) != 1:
            raise ValueError(f"export_model: the model holds adapters {names}; pass adapter_name")
        adapter_name = names[0]
    if adapter_name not in names:
        raise ValueError(f"export_model: adapter_name={adapter_name!r} not in the model's adapters {names}")
    lora = get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter_name)
    config = model.peft_config[adapter_name].to_dict()
    config = {key: sorted(value) if isinstance(value, set) else value for key, value in config.items()}
    # Like a pipeline's save_lora_weights: tensor keys and adapter-config keys carry the component prefix.
    tag = f"{prefix}." if prefix else ""
    tensors = {f"{tag}{key}": value.contiguous() for key, value in lora.items()}
    packed = {f"{tag}{key}": value for key, value in config.items()}
    metadata = {"format": "pt", LORA_ADAPTER_METADATA_KEY: json.dumps(packed, indent=2, sort_keys=True)}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / LORA_WEIGHT_NAME_SAFE), metadata=metadata)


@dataclass(frozen=True)
class Weights:
    """Trained weights that ``python -m train.eval`` can load, found from a path on its command line."""

    kind: str  # "checkpoint" (a step_XXXXXXXX folder), "export" (save_pretrained) or "lora_export"
    path: Path
    run_dir: Path | None  # the run folder that wrote them (holds metrics.jsonl or .hydra/), when recognisable
    tag: str  # names the evaluation's files: "step_00000060", "export", "export_raw" or "export_best"


def _run_folder(path: Path) -> Path | None:
    layout = RunLayout(path)
    return path if layout.metrics.is_file() or layout.hydra.is_dir() else None


def _export_problem(folder: Path) -> str | None:
    """What is wrong with the files of an export, or None: each must have the size and checksum its ``weights.json``
    recorded; an export without them (written by ``export_model`` alone, or before they were recorded) has its
    safetensors headers read (a copy cut short, a damaged header)."""
    note = folder / EXPORT_NOTE
    if note.is_file():
        try:
            files = json.loads(note.read_bytes()).get("files")
        except (ValueError, AttributeError):  # not JSON, or not an object
            return f"{EXPORT_NOTE} is not the JSON the trainer writes"
        if isinstance(files, dict):
            return checksum_problem(folder, files, "export")
    if problem := _weights_missing(folder):
        return problem
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt") as weights:
                weights.keys()
        except Exception as err:  # safetensors raises its own error type for any unreadable header
            return f"{file.name} cannot be read ({str(err).splitlines()[0][:80]})"
    return None


def _weights_missing(folder: Path) -> str | None:
    """A full export (``config.json``) without its weights file, or without a shard its index lists: cut short."""
    if not (folder / "config.json").is_file():
        return None
    index = folder / f"{SAFETENSORS_WEIGHTS_NAME}.index.json"
    if not index.is_file():
        found = (folder / SAFETENSORS_WEIGHTS_NAME).is_file()
        return None if found else f"has no {SAFETENSORS_WEIGHTS_NAME} (an export cut short)"
    try:
        shards = set(json.loads(index.read_bytes())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{index.name} is not the index save_pretrained writes (an export cut short)"
    gone = sorted(name for name in shards if not (folder / name).is_file())
    return f"{gone[0]} is missing (an export cut short)" if gone else None


def find_weights(value: str, field: str) -> Weights:
    """What ``value`` (``eval.transformer`` or ``resume``) points at: an export, a checkpoint, or a run folder
    (its export, else its latest complete checkpoint). Raises PathError naming ``field`` and the fix."""
    path = Path(value)
    accepted = "an export folder (<run>/export), a checkpoint folder (<run>/checkpoints/step_XXXXXXXX) or a run folder"
    if not path.exists():
        latest = CheckpointManager(path.parent.parent).latest() if path.parent.name == CHECKPOINTS else None
        if latest is not None:  # an older checkpoint of a run that keeps only its latest ones
            raise PathError(
                f"{field}={value!r} does not exist: the run keeps only its latest checkpoint.keep_last checkpoints "
                f"and pruned it; pick its latest, {latest}, or pass the run folder {path.parent.parent}"
            )
        raise PathError(f"{field}={value!r} does not exist; pass {accepted}")
    if is_complete(path):
        run = _run_folder(path.parent.parent) if path.parent.name == CHECKPOINTS else None
        return Weights("checkpoint", path, run, path.name)
    if (path / "config.json").is_file() or (path / LORA_WEIGHT_NAME_SAFE).is_file():
        kind = "export" if (path / "config.json").is_file() else "lora_export"
        if problem := _export_problem(path):
            raise PathError(f"{field}={value!r}: the export {problem}; export again, or pass a checkpoint folder")
        tag = path.name if path.name in (RAW_EXPORT, BEST_EXPORT) else EXPORT
        return Weights(kind, path, _run_folder(path.parent), tag)
    if path.parent.name == CHECKPOINTS or path.name.endswith(".tmp"):
        raise PathError(
            f"{field}={value!r} is not a complete checkpoint (no COMPLETE marker: its save was interrupted); "
            f"pick another folder of {path.parent}"
        )
    latest = CheckpointManager(path).latest()
    export = RunLayout(path).export
    if export.is_dir():
        problem = _export_problem(export)
        if problem is None or latest is None:
            return find_weights(str(export), field)
        log.warning("%s=%s: its export %s; using its latest checkpoint %s", field, value, problem, latest.name)
    if latest is not None:
        return find_weights(str(latest), field)
    raise PathError(f"{field}={value!r} holds no trained weights; pass {accepted}")


EXPORT_NOTE = "weights.json"  # in an export folder: which weights it holds ({"weights": "ema" | "trained", ...})


def export_weights(
    model: nn.Module, out: Path, ema: EMA | None, *, weights: str, step: int, ema_decay: float, what: str
) -> None:
    """``out``: ``model``'s weights, the EMA's swapped in when ``weights`` is "ema", and rank 0's ``weights.json``
    (``write_export_note``); a collective. A note the disk refuses is one line naming ``what``."""
    with ema.swapped() if weights == "ema" and ema is not None else nullcontext():
        export_model(model, out)
    if get_rank() == 0:
        try:
            write_export_note(out, weights=weights, step=step, ema_decay=ema_decay)
        except OSError as err:
            raise write_failure(err, out / EXPORT_NOTE, what) or err from None


def write_export_note(out: Path, *, weights: str, step: int, ema_decay: float) -> None:
    """``<out>/weights.json``: which weights an export holds, and the size and SHA-256 of each of its files, which
    ``find_weights`` checks (the main rank writes it)."""
    files = {
        str(p.relative_to(out)): file_info(p) for p in sorted(out.rglob("*")) if p.is_file() and p != out / EXPORT_NOTE
    }
    note = {
        "weights": weights,
        "step": step,
        "ema_decay": ema_decay,
        "scored_by_the_trainer": out.name in (EXPORT, BEST_EXPORT),  # export_best/: the best evaluation's weights
        "files": files,
    }
    (out / EXPORT_NOTE).write_text(json.dumps(note, indent=2) + "\n")


def export_description(folder: Path) -> str | None:
    """What an export holds, from its ``weights.json`` (None when it has none)."""
    note = folder / EXPORT_NOTE
    if not note.is_file():
        return None
    meta = json.loads(note.read_text())  # find_weights read it
    step = f"the weights after step {meta['step']}"
    what = f"the EMA (ema.decay={meta['ema_decay']:g}) of {step}" if meta["weights"] == "ema" else step
    scored = "which the trainer's evaluations scored" if meta["scored_by_the_trainer"] else f"not the EMA of {EXPORT}/"
    return f"{what}, {scored}"
