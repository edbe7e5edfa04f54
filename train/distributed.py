"""Process groups, cross-rank helpers, FSDP2 sharding, global gradient clipping and seeds.

This is the only module (with the rest of ``train/``) that touches ``torch.distributed``.

* Launch: ``torchrun`` sets RANK / WORLD_SIZE / LOCAL_RANK; without them (``python -m train``) the
  run is one process and no process group is created. Every helper below is then the identity,
  so the trainer calls them unconditionally.
* Sharding (``parallelize``): activation checkpointing per block, then FSDP2 ``fully_shard`` on
  every block, then on the root, in that fixed order (the torchtitan recipe). Parameters are
  all-gathered in ``param_dtype`` for compute and gradients are reduce-scattered in
  ``reduce_dtype`` (float32 by default, so bf16 training still averages gradients exactly enough).
  The root gets the same ``reshard_after_forward`` as the blocks, so a forward plus a backward
  all-gathers each of the ``num_blocks + 1`` FSDP modules exactly once in each direction.
* Gradient clipping (``clip_grad_norm_``): the norm is the GLOBAL one,
  ``sqrt(sum over ranks of sum over local shards of g^2)``. A per-shard norm (each rank clipping
  by the norm of its own shard) differs on every rank and is a known bug of a reference trainer.
* A hung rank: every collective of the process group times out after ``dist.timeout_s``; gloo
  then raises in the waiting rank, which train/cli.py reports naming the collective and what the
  rank was doing (``activity``); NCCL's watchdog aborts the process with a message naming the op.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._python_dispatch import TorchDispatchMode


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
    dist.all_gather_into_tensor(out, local)
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


def _wrap_blocks(model: nn.Module, block_classes: tuple[type, ...], checkpointing: bool) -> list[nn.Module]:
    """The sharding units: every block, wrapped in place for activation checkpointing if asked.

    Non-reentrant checkpointing keeps kwargs (diffusers blocks take keyword arguments) and lets
    FSDP2's pre-backward all-gather run before the recomputation.
    """
    units = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, block_classes):
                unit = checkpoint_wrapper(child) if checkpointing else child
                parent.register_module(name, unit)
                units.append(unit)
    return units


_world_mesh: tuple[Any, DeviceMesh] | None = None  # (the default process group, its mesh)


def world_mesh(device_type: str | None = None) -> DeviceMesh:
    """The 1-D mesh over every rank of the default process group, built once per group.

    ``device_type``: None = the one already built, else cuda when available, else cpu. Building a
    mesh runs collectives on real tensors, so it fails under a fake-tensor mode: ``python -m
    train.plan`` builds a cpu mesh before entering one, and every later ``parallelize`` (the policy
    and the KL reference alike) shards over that same mesh.
    """
    global _world_mesh
    group = dist.group.WORLD
    if _world_mesh is not None and _world_mesh[0] is group and device_type in (None, _world_mesh[1].device_type):
        return _world_mesh[1]
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    _world_mesh = (group, init_device_mesh(device_type, (get_world_size(),)))
    return _world_mesh[1]


def parallelize(
    model: nn.Module,
    *,
    block_classes: Iterable[type],
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
    mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Apply activation checkpointing per block, then FSDP2 per block, then FSDP2 on the root.

    In one process (no process group) only checkpointing is applied: FSDP needs a process group,
    and a single CPU process trains in the model's own dtype, so ``param_dtype``/``reduce_dtype``
    are not used there. Returns the same module object (modified in place).
    """
    classes = tuple(block_classes)
    if not classes:
        raise ValueError(
            "parallelize: block_classes is empty; pass the transformer block classes "
            "(diffusers lists them in model._no_split_modules)"
        )
    units = _wrap_blocks(model, classes, activation_checkpointing)
    if not units:
        names = ", ".join(c.__name__ for c in classes)
        raise ValueError(f"parallelize: no submodule of {type(model).__name__} is an instance of {names}")
    if not is_distributed():
        return model
    if mesh is None:
        mesh = world_mesh()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # The root is set explicitly (not FSDP2's automatic "keep the root unsharded"), so the number
    # of all-gathers per forward and per backward both equal the number of FSDP modules.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's shard of a DTensor, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _replication(tensor: DTensor) -> int:
    """How many ranks hold the same local shard of ``tensor`` (product of its Replicate mesh dims)."""
    count = 1
    for dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Replicate):
            count *= tensor.device_mesh.size(dim)
    return count


def sum_over_shards(terms: Iterable[tuple[Tensor, Tensor]], *, zero: Tensor) -> Tensor:
    """The sum over all ranks of per-tensor ``terms``: pairs (tensor, value computed on its local part).

    A DTensor's value counts once per distinct shard: every rank adds its local shard's value divided
    by the number of ranks holding that same shard; a plain tensor is the same on every rank and its
    value counts once. ``zero`` fixes the shape, dtype and device of the accumulators. Every rank
    must call it (one all-reduce).
    """
    sharded, plain = zero.clone(), zero.clone()
    for tensor, value in terms:
        if isinstance(tensor, DTensor):
            sharded += value / _replication(tensor)
        else:
            plain += value
    return all_reduce_sum(sharded) + plain


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float) -> Tensor:
    """Scale gradients in place so their global L2 norm is at most ``max_norm``; return that norm.

    The squares of every gradient's local shard, summed over all ranks by ``sum_over_shards``
    (float32 accumulation).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    zero = torch.zeros((), device=local_tensor(grads[0]).device, dtype=torch.float32)
    total = sum_over_shards(((g, local_tensor(g).float().pow(2).sum()) for g in grads), zero=zero).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        local_tensor(g).mul_(coef.to(g.dtype))
    return total


@dataclass
class CollectiveCounts:
    """Collectives issued inside ``count_collectives()``; filled as they run."""

    num_all_gathers: int = 0
    num_reduce_scatters: int = 0
    num_all_reduces: int = 0
    by_op: dict[str, int] = field(default_factory=dict)

    def add(self, name: str) -> None:
        self.by_op[name] = self.by_op.get(name, 0) + 1
        if "allgather" in name or "all_gather" in name:
            self.num_all_gathers += 1
        elif "reduce_scatter" in name:
            self.num_reduce_scatters += 1
        elif "allreduce" in name or "all_reduce" in name:
            self.num_all_reduces += 1


class _CollectiveCounter(TorchDispatchMode):
    """Records every op of the c10d namespaces (what FSDP2 and the helpers above issue).

    Not ``CommDebugMode``: its module tracker raises a KeyError when activation checkpointing
    recomputes a block inside a backward that is counted apart from its forward.
    """

    def __init__(self, counts: CollectiveCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor lower itself to plain ops (and collectives) first
        if getattr(func, "namespace", None) in ("c10d", "_c10d_functional"):
            self.counts.add(func.name())
        return func(*args, **(kwargs or {}))


@contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """Count c10d collectives (all-gathers, reduce-scatters, all-reduces) issued in a block.

    A dispatch mode of the calling thread: on CPU the backward runs in that thread too, so
    backward collectives are counted (the CUDA autograd threads are not).
    """
    counts = CollectiveCounts()
    with _CollectiveCounter(counts):
        yield counts
