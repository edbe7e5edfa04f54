"""Resumable checkpoints (torch.distributed.checkpoint) and the export of the trained transformer.

Layout of ``run_dir/checkpoints/step_00000040/``:

* DCP files (``.metadata``, ``__<rank>_*.distcp``): ``{"model", "optim", "extra"}`` where model and
  optimizer states come from ``get_state_dict`` (FSDP2-aware, resharding-capable) and ``extra``
  holds the DTensor leaves of the caller's ``extra`` dict (e.g. an FSDP2 EMA, saved sharded).
* ``rank{r}.pt``, one per rank: the rest of ``extra`` (step, data position, plain tensors, any
  picklable object) and this rank's RNG states (torch CPU, CUDA if any, python, numpy). RNG
  states differ per rank, so they are per-rank files, not DCP entries (DCP would keep rank 0's).
* ``COMPLETE``: a JSON marker (step, world size).

Atomicity: every rank writes into ``step_XXXXXXXX.tmp/``; after a barrier, rank 0 writes
``COMPLETE`` there and renames the folder to ``step_XXXXXXXX/`` (an atomic rename on one file
system). A crash at any earlier point leaves only a ``.tmp`` folder, which ``latest()`` ignores and
the next save deletes, so the previous checkpoint stays the latest usable one.

In a single process there is no process group: DCP is called with ``no_dist=True`` (it would
otherwise guess the same; its warning is silenced) and ``get_state_dict`` works on the unsharded model.

``export_model`` gathers the full (unsharded) state dict to rank 0's CPU and writes the
transformer as diffusers ``save_pretrained`` output (loadable with ``from_pretrained``), a LoRA
injected with diffusers' ``add_adapter`` as ``pytorch_lora_weights.safetensors`` (keys prefixed
with the pipeline component, loadable with ``pipe.load_lora_weights`` or
``transformer.load_lora_adapter``), or a ``peft.PeftModel`` as a PEFT adapter folder.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from diffusers import ModelMixin
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY, LORA_WEIGHT_NAME_SAFE
from peft import PeftModel
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from train.distributed import barrier, broadcast_object, get_rank, get_world_size, is_distributed

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_MARKER = "COMPLETE"


def is_complete(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint whose save finished (it holds the COMPLETE marker)."""
    return (Path(path) / _MARKER).is_file()


def _split_extra(tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a nested dict into (DTensor leaves, everything else), both keeping the nesting."""
    sharded: dict[str, Any] = {}
    local: dict[str, Any] = {}
    for key, value in tree.items():
        if not isinstance(key, str):
            raise ValueError(f"checkpoint extra: keys must be strings, got {key!r}")
        if isinstance(value, dict):
            sub_sharded, sub_local = _split_extra(value)
            if sub_sharded:
                sharded[key] = sub_sharded
            if sub_local or not sub_sharded:
                local[key] = sub_local
        elif isinstance(value, DTensor):
            sharded[key] = value
        else:
            local[key] = value
    return sharded, local


def _merge(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _flat_keys(tree: dict[str, Any], prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for key, value in tree.items():
        path = f"{prefix}{key}"
        keys |= _flat_keys(value, path + ".") if isinstance(value, dict) else {path}
    return keys


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@contextmanager
def _single_process_ok() -> Iterator[None]:
    """Silence DCP's "assuming ... a single process" warning: that is our explicit no_dist choice."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _train_state(model: nn.Module, optimizer: Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


class CheckpointManager:
    """Save, find and load the checkpoints of one run (every rank constructs one, same run_dir)."""

    def __init__(self, run_dir: str | Path, *, keep_last: int = 3) -> None:
        if keep_last < 1:
            raise ValueError(f"checkpoint keep_last must be >= 1, got {keep_last}")
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first (folders ending in .tmp are ignored)."""
        if not self.root.is_dir():
            return []
        steps: dict[Path, int] = {}
        for path in self.root.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and (path / _MARKER).is_file():
                steps[path] = int(match.group(1))
        return sorted(steps, key=steps.__getitem__)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        found = self.complete()
        return found[-1] if found else None

    def resolve(self, resume: str | None) -> Path | None:
        """The checkpoint to resume from: None/"" -> none, "auto" -> latest (or none), else a path.

        A collective: rank 0 decides and every rank gets the same answer.
        """
        if resume in (None, ""):
            return None
        choice = self.latest() if resume == "auto" else Path(resume)
        if choice is not None and not (choice / _MARKER).is_file():
            raise FileNotFoundError(
                f"resume={resume}: {choice} is not a complete checkpoint (no {_MARKER} file); "
                "use resume=auto or a step_XXXXXXXX folder under <run_dir>/checkpoints"
            )
        return broadcast_object(choice)

    def save(self, step: int, *, model: nn.Module, optimizer: Optimizer | None, extra: dict[str, Any]) -> Path:
        """Write a checkpoint of step ``step`` on every rank (a collective); return its folder."""
        rng = _rng_state()
        final = self.path_for(step)
        tmp = final.with_name(final.name + ".tmp")
        if get_rank() == 0:
            self._prepare()
        barrier()
        sharded_extra, local_extra = _split_extra(extra)
        state = _train_state(model, optimizer)
        if sharded_extra:
            state["extra"] = sharded_extra
        with _single_process_ok():
            dcp.save(state, checkpoint_id=tmp, no_dist=not is_distributed())
        local = {
            "step": step,
            "world_size": get_world_size(),
            "extra": local_extra,
            "rng": rng,
            "sharded_extra_keys": sorted(_flat_keys(sharded_extra)),
        }
        torch.save(local, tmp / f"rank{get_rank()}.pt")
        barrier()
        if get_rank() == 0:
            (tmp / _MARKER).write_text(json.dumps({"step": step, "world_size": get_world_size()}))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            self._prune()
        barrier()
        return final

    def load(
        self,
        path: str | Path,
        *,
        model: nn.Module,
        optimizer: Optimizer | None,
        extra_template: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Restore model, optimizer and this rank's RNG states in place; return ``extra``.

        Sharded (DTensor) entries of ``extra`` are loaded into the matching DTensors of
        ``extra_template`` (e.g. ``{"ema": ema.state_dict()}``, which restores the EMA in place);
        the rest comes from this rank's file. With a different world size than at save time,
        model and optimizer reshard, ``extra`` comes from rank 0's file and RNG states are not
        restored (a warning says so).
        """
        path = Path(path)
        if not (path / _MARKER).is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no {_MARKER} file)")
        local = self._read_rank_file(path)
        sharded_template, _ = _split_extra(extra_template or {})
        missing = set(local["sharded_extra_keys"]) - _flat_keys(sharded_template)
        if missing:
            raise ValueError(
                f"checkpoint {path} holds sharded extra entries {sorted(missing)}: pass "
                "extra_template with DTensors of the same shape, e.g. {'ema': ema.state_dict()}"
            )
        state = _train_state(model, optimizer)
        if local["sharded_extra_keys"]:
            state["extra"] = sharded_template
        with _single_process_ok():
            dcp.load(state, checkpoint_id=path, no_dist=not is_distributed())
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return _merge(local["extra"], state.get("extra", {}))

    def _read_rank_file(self, path: Path) -> dict[str, Any]:
        own = path / f"rank{get_rank()}.pt"
        saved_world = json.loads((path / _MARKER).read_text())["world_size"]
        resharded = saved_world != get_world_size()
        # weights_only=False: the file is written by save() above and holds numpy RNG state.
        local = torch.load(path / "rank0.pt" if resharded else own, weights_only=False)
        if resharded:
            warnings.warn(
                f"checkpoint {path} was saved with world size {saved_world}, now {get_world_size()}: "
                "RNG states are not restored",
                RuntimeWarning,
                stacklevel=3,
            )
        else:
            _set_rng_state(local["rng"])
        return local

    def _prepare(self) -> None:
        """Create the folder and delete the leftovers of interrupted saves."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)

    def _prune(self) -> None:
        for old in self.complete()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)


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
    if get_rank() == 0:
        if dtype is not None:
            full = {key: value.to(dtype) for key, value in full.items()}
        if isinstance(model, PeftModel):
            model.save_pretrained(str(out), state_dict=full)
        elif getattr(model, "peft_config", None):
            _export_diffusers_lora(model, full, out, adapter_name, lora_prefix)
        else:
            _export_full(model, full, out)
    barrier()
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
