"""The files of a checkpoint folder: the ``COMPLETE`` marker, the rank files, what is wrong with a folder's
files as each rank sees them, the checksums the ranks share the work of (rank r hashes every R-th file of
the sorted listing), and the disk space a checkpoint needs (train/parts/checkpoint/manager.py uses them)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.optim import Optimizer

from train.distributed.collectives import broadcast_object, gather_objects, get_rank, get_world_size
from train.distributed.parallelize import local_tensor
from train.parts.optim.ema import EMA

MARKER = "COMPLETE"
STEP_DIR = re.compile(r"^step_(\d{8})$")  # a complete checkpoint's folder; a save writes <name>.tmp first
RANK_FILE_KEYS = {"step", "world_size", "extra", "rng", "sharded_extra_keys"}
CHUNK = 8 << 20  # bytes per read while hashing


def is_complete(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint whose save finished (it holds the COMPLETE marker)."""
    return (Path(path) / MARKER).is_file()


def complete_in(folder: Path) -> dict[Path, int]:
    """The complete checkpoints of ``folder`` and the step of each (from the folder's name), oldest first."""
    if not folder.is_dir():
        return {}
    steps = {path: int(match.group(1)) for path in folder.iterdir() if (match := STEP_DIR.match(path.name))}
    return {path: steps[path] for path in sorted(steps, key=steps.__getitem__) if is_complete(path)}


def read_marker(path: Path) -> dict[str, Any]:
    """``{"step", "world_size"}`` from the marker of a checkpoint that passed ``problem``."""
    return json.loads((path / MARKER).read_text())


def rank_file(saved_world: int) -> str:
    """This rank's file of a checkpoint saved by ``saved_world`` ranks: its own, or rank 0's when resharded."""
    return f"rank{get_rank()}.pt" if saved_world == get_world_size() else "rank0.pt"


def files_problem(path: Path) -> str | None:
    """What this rank finds wrong with the files of checkpoint ``path``, or None: its marker, rank 0 the shared
    files (the metadata and the shards' lengths), every rank its own ``rank<r>.pt``, and the checksums."""
    if not path.is_dir():
        return "it is not a folder"
    marker = path / MARKER
    if not marker.is_file():
        return f"it has no {MARKER} marker (an interrupted save, or not a checkpoint folder)"
    text = marker.read_bytes()[: 1 << 20]  # a few kB as written; a huge file is not a marker
    try:
        info = json.loads(text)
        step, world = info["step"], info["world_size"]
    except (ValueError, KeyError, TypeError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return f"its {MARKER} marker is not the JSON the trainer writes ({text[:40]!r})"
    if not isinstance(step, int) or not isinstance(world, int) or world < 1:
        return f"its {MARKER} marker holds step={step!r}, world_size={world!r}; expected integers"
    match = STEP_DIR.match(path.name)
    if match and int(match.group(1)) != step:
        return f"its {MARKER} marker says step {step}, its folder name step {int(match.group(1))}"
    if get_rank() == 0 and (problem := _shard_problem(path)):
        return problem
    name = rank_file(world)
    try:  # memory-mapped: the check reads the pickled structure, not every tensor of the file
        local = torch.load(path / name, weights_only=False, mmap=True)
    except FileNotFoundError:
        return f"{name} is missing"
    # Whatever torch.load raises on a cut or overwritten file (zip, pickle, OS errors), the file is damaged.
    except Exception as err:
        return f"{name} cannot be read ({type(err).__name__}: {str(err).splitlines()[0][:80]})"
    if not isinstance(local, dict) or not RANK_FILE_KEYS <= set(local) or local["step"] != step:
        return f"{name} is not the rank file of step {step}"
    files = info.get("files")
    return checksum_problem(path, files) if isinstance(files, dict) else None


def _shard_problem(path: Path) -> str | None:
    """The metadata must read and every shard must be as long as the byte ranges it lists."""
    if not (path / ".metadata").is_file():
        return "it has no .metadata file (the index of its .distcp shards)"
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # any failure to unpickle the index means the file is damaged
        return f".metadata cannot be read ({type(err).__name__}: {str(err).splitlines()[0][:80]})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            return f"{name} is missing"
        if shard.stat().st_size < size:
            return f"{name} is truncated ({shard.stat().st_size} of {size} bytes)"
    return None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def my_share(names: list[str]) -> list[str]:
    """The files of a sorted listing this rank hashes: every world-size-th, from its rank on."""
    return names[get_rank() :: get_world_size()]


def file_info(path: Path) -> dict[str, Any]:
    """What a checkpoint or an export records of one of its files: ``{"size", "sha256"}``."""
    return {"size": path.stat().st_size, "sha256": sha256(path)}


def checksums(folder: Path) -> dict[str, dict[str, Any]]:
    """name -> {"size", "sha256"} of every file in ``folder``, the ranks sharing the work (a collective)."""
    names = broadcast_object(sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MARKER))
    mine = {name: file_info(folder / name) for name in my_share(names)}
    return {name: info for part in gather_objects(mine) for name, info in part.items()}


def checksum_problem(path: Path, files: dict[str, dict[str, Any]], kind: str = "checkpoint") -> str | None:
    """The first of this rank's share of ``files`` (of a ``kind``: a checkpoint, an export) that is missing or
    differs from what was recorded."""
    for name in my_share(sorted(files)):
        file, recorded = path / name, files[name]
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != recorded["size"]:
            return f"{name} has {file.stat().st_size} bytes, {recorded['size']} when it was saved"
        if sha256(file) != recorded["sha256"]:
            return (
                f"{name} does not match the checksum recorded when it was saved (a file of another {kind}, "
                "or changed since)"
            )
    return None


def state_bytes(model: nn.Module, optimizer: Optimizer | None, ema: EMA | None = None) -> int:
    """About the bytes of a checkpoint of ``model``, ``optimizer`` and ``ema``, all ranks together (a collective).

    An optimizer that has not stepped yet holds no state: AdamW's two moments per trainable weight are counted.
    """

    def local(t: Tensor) -> int:
        return local_tensor(t).numel() * t.element_size()

    total = sum(local(t) for t in model.state_dict().values() if isinstance(t, Tensor))
    if optimizer is not None:
        moments = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, Tensor)]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        total += sum(local(t) for t in moments) if moments else 2 * sum(local(p) for p in params)
    if ema is not None:
        total += sum(local(t) for t in ema.shadow)
    return int(sum(gather_objects(total)))
