"""Counting the c10d collectives a block of code issues (the tests' view of FSDP2's communication)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass
class CollectiveCounts:
    """Collectives issued inside ``count_collectives()``; filled as they run."""

    num_all_gathers: int = 0
    num_reduce_scatters: int = 0
    num_all_reduces: int = 0
    by_op: dict[str, int] = field(default_factory=dict)
    # per kind, the bytes of each collective's largest tensor: for FSDP2's flat all-gather (its output) and
    # reduce-scatter (its input) the unsharded size S
    all_gather_bytes: int = 0
    reduce_scatter_bytes: int = 0

    def add(self, name: str, num_bytes: int = 0) -> None:
        self.by_op[name] = self.by_op.get(name, 0) + 1
        if "allgather" in name or "all_gather" in name:
            self.num_all_gathers += 1
            self.all_gather_bytes += num_bytes
        elif "reduce_scatter" in name:
            self.num_reduce_scatters += 1
            self.reduce_scatter_bytes += num_bytes
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
            tensors = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, Tensor)]
            self.counts.add(func.name(), max((t.numel() * t.element_size() for t in tensors), default=0))
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
