"""FSDP2 sharding and regional compilation of a transformer, and the global gradient norm.

* Sharding (``parallelize``): activation checkpointing per block, then ``torch.compile`` of each
  block on its own (regional compilation, when asked), then FSDP2 ``fully_shard`` on every block,
  then on the root, in that fixed order (the torchtitan recipe). Over a 1-D mesh every rank holds
  1 / world of each parameter; with ``replicate`` R > 1 the mesh is 2-D (replicate R, shard world /
  R): hybrid sharding (HSDP), each parameter sharded over the world / R ranks of a shard group (one
  node) and replicated over the R groups, so all-gathers stay inside a node and only the gradients'
  all-reduce crosses nodes. Parameters are
  all-gathered in ``param_dtype`` for compute and gradients are reduce-scattered in
  ``reduce_dtype`` (float32 by default, so bf16 training still averages gradients exactly enough).
  The root gets the same ``reshard_after_forward`` as the blocks, so a forward plus a backward
  all-gathers each of the ``num_blocks + 1`` FSDP modules exactly once in each direction.
* Compilation (``compile_blocks``): each block is compiled in place (``nn.Module.compile``: its
  parameter names, hence checkpoints and exports, stay those of the eager model) by inductor, with
  torch's automatic dynamic shapes: a block's first row count compiles a static graph, and the
  first call with another row count compiles one with the batch dimension symbolic, which then
  serves every row count a step feeds the blocks (rollout, micro-batches, JAGG's endpoint and middle
  rows, evaluation batches); a batch of one row is specialised by torch to a graph of its own. So a
  run compiles a bounded number of graphs per block class and variant (train or eval mode, with or
  without gradients, LoRA on or off), not one per step. ``dynamic=True`` (every dimension symbolic
  from the first call, the text and image token counts too) ran the testbed's forward slower than
  eager on CPU and still recompiled when a row count stopped equalling the token count (torch
  unifies equal sizes). Blocks of one class share their compiled code (torch guards on the class,
  not on the instance), so a model compiles once per block class and variant whatever its depth.
  ``compile_stats`` reads torch's counters.
* Gradient clipping (``clip_grad_norm_``): the norm is the GLOBAL one,
  ``sqrt(sum over ranks of sum over local shards of g^2)``. A per-shard norm (each rank clipping
  by the norm of its own shard) differs on every rank and is a known bug of a reference trainer.
"""

from __future__ import annotations

import functools
import gc
import importlib
import math
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate

from train.distributed.collectives import all_reduce_sum, broadcast_object, get_rank, get_world_size, is_distributed


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


def mesh_shape(world_size: int, replicate: int) -> tuple[int, ...]:
    """(world,) or, for HSDP, (replicate, world / replicate); ValueError when ``replicate`` does not
    divide the world."""
    if replicate < 1 or world_size % replicate:
        raise ValueError(f"dist.replicate_degree={replicate} must divide the world size {world_size}")
    return (world_size,) if replicate == 1 else (replicate, world_size // replicate)


def world_mesh(device_type: str | None = None, *, replicate: int = 1) -> DeviceMesh:
    """The mesh over every rank of the default process group (``mesh_shape``), built once per group.

    ``device_type``: None = the one already built, else cuda when available, else cpu. Building a
    mesh runs collectives on real tensors, so it fails under a fake-tensor mode: a caller tracing on
    fake tensors builds a cpu mesh before entering one, and every later ``parallelize`` (the policy
    and the KL reference alike) shards over that same mesh.
    """
    global _world_mesh
    group, shape = dist.group.WORLD, mesh_shape(get_world_size(), replicate)
    if _world_mesh is not None and _world_mesh[0] is group and tuple(_world_mesh[1].shape) == shape:
        if device_type in (None, _world_mesh[1].device_type):
            return _world_mesh[1]
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    _world_mesh = (group, init_device_mesh(device_type, shape, mesh_dim_names=names))
    return _world_mesh[1]


_MESH_CACHES = (  # torch's private caches that keep a mesh and its process group (as of torch 2.14)
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"),
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear"),
    ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),
)


def release_world_mesh() -> None:
    """Forget the mesh of ``world_mesh`` and the references torch's DTensor caches keep to it (redistribution plans,
    topology, sharding propagation), then collect the sharded modules' reference cycles: a process group that
    ``destroy_process_group`` let go is then freed here, its destructor joining gloo's threads. Held by these caches,
    a destroyed group's ``pt_gloo_runloop`` and ``gloo_tcp_loop`` threads were alive in every two-rank run until
    Python shut down, and the group was freed, if at all, while the interpreter was being torn down
    (docs/distributed.md, Hung ranks). For an exit handler: the command's own frames hold the run until then."""
    global _world_mesh
    _world_mesh = None
    for module, name in _MESH_CACHES:
        try:
            clear: Any = functools.reduce(getattr, name.split("."), importlib.import_module(module))
        except (ImportError, AttributeError):  # another torch than 2.14: not that cache
            continue
        clear()
    gc.collect()  # the sharded modules of the runs that ended, in reference cycles, hold it too


def compile_unavailable(device_type: str) -> str | None:
    """Why ``torch.compile`` (inductor) cannot run on ``device_type`` here, or None when it can.

    Inductor turns CPU graphs into C++ (a C++ compiler on PATH, ``$CXX`` or g++) and CUDA graphs
    into Triton kernels; torch's own check covers the Python version and the platform.
    """
    from torch._dynamo.eval_frame import is_dynamo_supported

    if not is_dynamo_supported():
        return "torch.compile does not support this Python or platform"
    if device_type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "inductor needs Triton for CUDA and it is not installed (pip install triton)"
        return None
    from torch._inductor import config as inductor_config

    names = inductor_config.cpp.cxx if isinstance(inductor_config.cpp.cxx, list | tuple) else (inductor_config.cpp.cxx,)
    if not any(name and shutil.which(name) for name in names):
        wanted = ", ".join(name for name in names if name) or "g++"
        return f"inductor compiles CPU code with a C++ compiler and none is on PATH ({wanted}; set CXX to another)"
    return None


def compile_blocks(units: Iterable[nn.Module]) -> None:
    """``torch.compile`` each unit in place: the sharding units, and the VAE decoder's (the module docstring
    says how and why)."""
    for unit in units:
        unit.compile()


@dataclass(frozen=True)
class CompileStats:
    """What torch.compile did so far in this process (torch's own counters)."""

    graphs: int  # graphs compiled (each with its backward when it is differentiated)
    seconds: float  # time spent compiling forward graphs and, lazily at their first backward, backward graphs


def compile_stats() -> CompileStats:
    from torch._dynamo.utils import counters, cumulative_time_spent_ns

    seconds = sum(cumulative_time_spent_ns.get(k, 0.0) for k in ("entire_frame_compile", "entire_backward_compile"))
    return CompileStats(graphs=int(counters["stats"]["unique_graphs"]), seconds=seconds / 1e9)


def parallelize(
    model: nn.Module,
    *,
    block_classes: Iterable[type],
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool = False,
    compile: bool = False,
    reshard_after_forward: bool = True,
    replicate: int = 1,
) -> nn.Module:
    """Apply activation checkpointing per block, then ``torch.compile`` per block (``compile``),
    then FSDP2 per block, then FSDP2 on the root, over ``world_mesh(replicate=replicate)`` (HSDP when
    ``replicate`` > 1).

    In one process (no process group) only checkpointing and compilation are applied: FSDP needs a
    process group, and a single CPU process trains in the model's own dtype, so
    ``param_dtype``/``reduce_dtype`` are not used there. Returns the same module object (modified
    in place).
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
    if compile:
        compile_blocks(units)
    if not is_distributed():
        return model
    mesh = world_mesh(replicate=replicate)
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
    return math.prod(
        tensor.device_mesh.size(dim) for dim, p in enumerate(tensor.placements) if isinstance(p, Replicate)
    )


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


@torch.no_grad()
def global_dots(a: Sequence[Tensor | None], b: Sequence[Tensor | None]) -> tuple[float, float, float]:
    """(<a, a>, <b, b>, <a, b>) of two gradients given per parameter (None = zero), over all ranks.

    Each parameter's three local products are summed over ranks by ``sum_over_shards`` (a DTensor
    counts once per distinct shard, a plain tensor once), in float64. Every rank must call it.
    """
    if len(a) != len(b):
        raise ValueError(f"the two gradients have {len(a)} and {len(b)} parameters")
    terms = []
    for x, y in zip(a, b):
        ref = x if x is not None else y
        if ref is None:
            continue
        zero = torch.zeros_like(local_tensor(ref).flatten().float())
        xl = local_tensor(x).flatten().float() if x is not None else zero
        yl = local_tensor(y).flatten().float() if y is not None else zero
        terms.append((ref, torch.stack([xl @ xl, yl @ yl, xl @ yl]).double()))
    device = local_tensor(terms[0][0]).device if terms else torch.device("cpu")
    aa, bb, ab = sum_over_shards(terms, zero=torch.zeros(3, dtype=torch.float64, device=device)).tolist()
    return aa, bb, ab


class ProcessRanks:
    """This process among the ranks, and the cross-rank reductions the algorithm's measurements use
    (``train.algorithm.quality.Ranks``): the gradient-quality probe and the auto router get it from their
    caller, so that train/algorithm/ runs no collective of its own."""

    dots = staticmethod(global_dots)
    broadcast = staticmethod(broadcast_object)  # rank 0's ``obj`` on every rank

    @property
    def rank(self) -> int:
        return get_rank()

    @property
    def world_size(self) -> int:
        return get_world_size()
