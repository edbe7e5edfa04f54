"""The files of a checkpoint folder: the ``COMPLETE`` marker, the checksums the ranks share the work of
(rank r hashes every R-th file of the sorted listing), and the disk space a checkpoint needs
(train/checkpoint/manager.py uses them)."""

from __future__ import annotations

import errno
import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from train.distributed.collectives import broadcast_object, gather_objects, get_rank, get_world_size

MARKER = "COMPLETE"
CHUNK = 8 << 20  # bytes per read while hashing


def is_complete(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint whose save finished (it holds the COMPLETE marker)."""
    return (Path(path) / MARKER).is_file()


def read_marker(path: Path) -> dict[str, Any]:
    """``{"step", "world_size"}`` from the marker of a checkpoint that passed ``problem``."""
    return json.loads((path / MARKER).read_text())


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def my_share(names: list[str]) -> list[str]:
    """The files of a sorted listing this rank hashes: every world-size-th, from its rank on."""
    return names[get_rank() :: get_world_size()]


def checksums(folder: Path) -> dict[str, dict[str, Any]]:
    """name -> {"size", "sha256"} of every file in ``folder``, the ranks sharing the work (a collective)."""
    names = broadcast_object(sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MARKER))
    mine = {name: {"size": (folder / name).stat().st_size, "sha256": sha256(folder / name)} for name in my_share(names)}
    return {name: info for part in gather_objects(mine) for name, info in part.items()}


def checksum_problem(path: Path, files: dict[str, dict[str, Any]]) -> str | None:
    """The first of this rank's share of ``files`` that is missing or differs from what was recorded."""
    for name in my_share(sorted(files)):
        file, recorded = path / name, files[name]
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != recorded["size"]:
            return f"{name} has {file.stat().st_size} bytes, {recorded['size']} when it was saved"
        if sha256(file) != recorded["sha256"]:
            return (
                f"{name} does not match the checksum recorded when it was saved (a file of another checkpoint, "
                "or changed since)"
            )
    return None


def mount_point(path: Path) -> Path:
    """The mount point of the file system that holds ``path`` (an existing folder)."""
    device = path.stat().st_dev
    while path.parent != path and path.parent.stat().st_dev == device:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Free bytes of the file system of ``path`` (or of its nearest existing parent)."""
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


NO_SPACE = re.compile(r"No space left|unexpected pos|Errno 28|disk quota", re.IGNORECASE)


def is_no_space(err: BaseException) -> bool:
    return (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)) or bool(NO_SPACE.search(str(err)))


def state_bytes(model: nn.Module, optimizer: Optimizer | None) -> int:
    """About the bytes of a checkpoint of ``model`` and ``optimizer``, all ranks together (a collective).

    An optimizer that has not stepped yet holds no state: AdamW's two moments per trainable weight are counted.
    """

    def local(t: Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    total = sum(local(t) for t in model.state_dict().values() if isinstance(t, Tensor))
    if optimizer is not None:
        moments = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, Tensor)]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        total += sum(local(t) for t in moments) if moments else 2 * sum(local(p) for p in params)
    return int(sum(gather_objects(total)))
