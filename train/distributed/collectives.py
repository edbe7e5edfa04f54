"""Process groups and the cross-rank helpers every layer of the trainer calls, with their settings (the ``dist``
group) and the start-up checks the ranks agree on (``agreed``, ``main_decides``), as a write (``agree_on_write``): a
check or a write that fails on one rank stops every rank together, in one line, rather than leaving the others
waiting in the next collective.

* Launch: ``torchrun`` sets RANK / WORLD_SIZE / LOCAL_RANK; without them (``python -m train``) the
  run is one process and no process group is created. Every helper below is then the identity,
  so the trainer calls them unconditionally.
* A hung rank: every collective of the process group times out after ``dist.timeout_s``; gloo
  then raises in the waiting rank, which train/cli/reporting.py reports naming the collective and what the
  rank was doing (``activity``); NCCL's watchdog aborts the process with a message naming the op.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from settings import positive
from train.ground.disk import KEPT, write_failure
from train.ground.errors import DiskFull, SaveFailed, StartRefused, UserError


@dataclass
class DistConfig:
    """The process group and the device mesh (train/distributed/)."""

    timeout_s: float = 1800.0
    """Seconds a collective may wait for the other ranks before this rank fails with a message naming it (a hung,
    stopped or dead rank). Longer than any legitimate wait: a slow checkpoint save or evaluation.
    """
    replicate_degree: int = 1
    """HSDP: R > 1 replicates the model over R groups of world / R ranks, each group sharding it (one group per
    node: all-gathers stay inside a node, gradients are all-reduced across nodes); R must divide the world size.
    1 = FSDP over every rank. Checkpoints load across a change of R or of the world size.
    """

    def __post_init__(self) -> None:
        positive(self.timeout_s, "timeout_s")
        positive(self.replicate_degree, "replicate_degree", " (1 = shard over every rank)")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, number of processes, rank on its node, its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    is_main: bool


def is_distributed() -> bool:
    """True when a process group with more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(f"WORLD_SIZE is set but {name} is not: launch with torchrun, which sets both")
    return int(value)


@dataclass
class _Context:
    activity: str = "start-up"  # what this rank is doing, for the message of a collective that timed out
    timeout_s: float | None = None  # the process group's collective timeout


_context = _Context()


@contextmanager
def activity(label: str) -> Iterator[None]:
    """Name what the block does ("training step 3"), so a collective that times out in it says so.

    An exception leaves the label in place: the command reports it after the blocks have unwound.
    """
    outer, _context.activity = _context.activity, label
    yield
    _context.activity = outer


def collective_context() -> tuple[str, float | None]:
    """(what this rank is doing, the collective timeout in seconds or None)."""
    return _context.activity, _context.timeout_s


def init_distributed(backend: str | None = None, *, timeout_s: float | None = None) -> DistInfo:
    """Read torchrun's environment and create the process group (none for a single process).

    backend: None picks nccl when CUDA is available, else gloo. The device is cuda:LOCAL_RANK or cpu.
    timeout_s: how long any collective waits for the other ranks (None: torch's default, 10 min for
    NCCL and 30 min for gloo).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = _env_int("RANK") if world_size > 1 else 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available()
    if backend is None:
        backend = "nccl" if use_cuda else "gloo"
    if backend == "nccl" and not use_cuda:
        raise ValueError("backend='nccl' needs CUDA, which is not available here: use backend='gloo' or None")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    _context.activity = "start-up"
    if world_size > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
        dist.init_process_group(backend=backend, device_id=device if use_cuda else None, timeout=timeout)
        _context.timeout_s = timeout_s
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, is_main=rank == 0)


def shutdown() -> None:
    """Destroy the process group if one exists (safe to call in a single process)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """Sum of ``tensor`` over ranks, as a new tensor (the input is left unchanged)."""
    out = tensor.detach().clone()
    if is_distributed():
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_reduce_max(tensor: Tensor) -> Tensor:
    """Elementwise maximum of ``tensor`` over ranks, as a new tensor (for a minimum, negate)."""
    out = tensor.detach().clone()
    if is_distributed():
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


def all_gather_tensor(tensor: Tensor) -> Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 in rank order (all ranks pass equal shapes)."""
    if not is_distributed():
        return tensor.detach().clone()
    local = tensor.detach().contiguous()
    out = local.new_empty((get_world_size() * local.shape[0], *local.shape[1:]))
    # all_gather_single is all_gather_into_tensor's new name (torch 2.14 deprecates the old one, with a warning)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank."""
    if not is_distributed():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, on every rank."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if is_distributed():
        dist.barrier()


T = TypeVar("T")


def failed_ranks_line(lines: list[str | None]) -> str:
    """Each rank's failure (``lines[rank]``, None where it passed) in one line: the line alone when every rank
    failed alike, else ``rank 1: <line>; rank 0,2: <line>``."""
    ranks: dict[str, list[int]] = {}
    for rank, line in enumerate(lines):
        if line is not None:
            ranks.setdefault(line, []).append(rank)
    if len(ranks) == 1 and len(next(iter(ranks.values()))) == len(lines):
        return next(iter(ranks))
    return "; ".join(f"rank {','.join(map(str, who))}: {line}" for line, who in ranks.items())


def agreed(fn: Callable[[], T]) -> T:
    """``fn()``, a rank's own checks (files read where this rank reads them, its device, the servers it reaches), then
    one gather: where it raised a UserError on any rank, every rank raises StartRefused. A failing rank prints its own
    line (rank 0 alone when every rank failed alike); a rank that passed, if it is the first of its node (LOCAL_RANK
    0), prints the line naming each failing rank's (``failed_ranks_line``), so that every node's output says why it
    stopped. A rank that failed alone would otherwise skip the next collective, and the others wait in it for
    dist.timeout_s."""
    refusal: UserError | None = None
    try:
        result = fn()
    except UserError as err:
        refusal = err
    lines = gather_objects(None if refusal is None else str(refusal))
    if refusal is not None and len(lines) == 1:  # one process: its own error as it was raised
        raise refusal
    if len(set(lines)) == 1 and lines[0] is not None:  # every rank alike: rank 0 says it
        raise StartRefused(lines[0]) from refusal
    if refusal is not None:
        raise StartRefused(str(refusal), printed=True) from refusal
    if any(line is not None for line in lines):
        raise StartRefused(failed_ranks_line(lines), printed=int(os.environ.get("LOCAL_RANK", "0")) == 0)
    return result


def main_decides(dist: DistInfo, fn: Callable[[], T]) -> T | None:
    """``fn()`` on rank 0 alone, the other ranks waiting for it (a collective every rank reaches, whatever rank 0
    found): a UserError it raises is raised on every rank, in rank 0's words (rank 0 prints it). Rank 0's result,
    None elsewhere."""
    result, refusal = None, None
    if dist.is_main:
        try:
            result = fn()
        except UserError as err:
            refusal = err
    message = broadcast_object(None if refusal is None else str(refusal))
    if refusal is not None:
        raise refusal
    if message is not None:
        raise StartRefused(message)
    return result


def agree_on_write(write: Callable[[], None], path: Path, what: str, kept: str = KEPT) -> None:
    """Run ``write`` on every rank (rank 0 writes the files; collectives may run inside it); a file the disk of
    ``path`` refuses ends it on every rank with rank 0's one line (SaveFailed, DiskFull), instead of a traceback on
    rank 0 and a hang elsewhere. A collective."""
    failed = None
    try:
        write()
    except SaveFailed as err:  # a row of metrics.jsonl (train/parts/observe/metrics.py) said it already
        failed = str(err), isinstance(err, DiskFull)
    except Exception as err:  # the writers' own errors too: torch.save and safetensors say a full disk their way
        if (failure := write_failure(err, path, what, kept)) is None:
            raise
        failed = str(failure), isinstance(failure, DiskFull)
    failed = broadcast_object(failed)
    if failed is not None:
        line, full = failed
        raise DiskFull(line) if full else SaveFailed(line)
