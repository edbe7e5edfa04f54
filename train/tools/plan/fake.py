"""The planner's fake environment: a fake process group, fake tensors, and torch's memory tracker
adapted to tracing one training step, with the trainer's FLOP counter (train/parts/observe/perf.py). Every
private name of torch the planner uses is imported here and nowhere else."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY
from torch.testing._internal.distributed.fake_pg import FakeStore

from train.distributed.parallelize import world_mesh
from train.ground.errors import ConfigError
from train.parts.observe.perf import StepFlopCounter


class StepMemTracker(FSDPMemTracker):
    """FSDPMemTracker keeping only the peak of the whole traced region.

    Per-module peaks are not kept (nothing here reads them, and updating them walks every FSDP
    module at every op: most of a trace's time), and module statistics are reset before
    each forward of the root, which FSDPMemTracker otherwise refuses as "multiple iterative calls":
    a rollout or an update runs the transformer several times.
    """

    def __enter__(self) -> StepMemTracker:
        super().__enter__()
        self._reset = self._root_mod.register_forward_pre_hook(lambda *_: self.reset_mod_stats(), prepend=True)
        return self

    def __exit__(self, *args: Any) -> None:
        self._reset.remove()
        super().__exit__(*args)

    def _update_peak_stats(self, peak_state: Any) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = copy.deepcopy(snapshot)


@dataclass
class Measured:
    """What one traced call did on rank 0."""

    peak_bytes: int  # everything the tracker saw at its peak
    start_bytes: int  # everything it saw when the call started
    flops: int
    at_start: dict[str, int]  # tracker categories when the call started (shards, gradients, optimizer, inputs)
    at_peak: dict[str, int]


def _categories(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    (per_device,) = snapshot.values()  # every fake tensor lives on one device
    return {str(getattr(k, "value", k)): v for k, v in per_device.items()}


def measure(root: nn.Module, optimizer: torch.optim.Optimizer, resident: Sequence[Tensor], fn: Callable) -> Measured:
    """Trace ``fn()`` with ``resident`` tensors (the step's trajectory and images, the KL reference's
    shards, the EMA) counted as live from the start."""
    tracker = StepMemTracker(root, optimizer)
    tracker.track_inputs(tuple(resident))
    counter = StepFlopCounter()
    with tracker:
        start = _categories(tracker.get_tracker_snapshot("current"))
        with counter:
            fn()
    peak = _categories(tracker.get_tracker_snapshot("peak"))
    return Measured(peak[_TOTAL_KEY], start[_TOTAL_KEY], counter.get_total_flops(), start, peak)


@contextmanager
def fake_process_group(world_size: int, replicate: int = 1) -> Iterator[None]:
    """A fake ``world_size``-rank process group (this process is rank 0) and its cpu mesh (HSDP's
    2-D one with ``replicate`` > 1)."""
    if dist.is_initialized():
        raise ConfigError("python -m train.plan creates its own fake process group: run it without torchrun")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        # outside any fake mode: building a mesh runs collectives on real tensors
        world_mesh("cpu", replicate=replicate)
        yield
    finally:
        dist.destroy_process_group()


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build modules in ``dtype``: a module of fake tensors cannot be cast after it is built."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextmanager
def fake_deepcopy() -> Iterator[None]:
    """``copy.deepcopy`` of a fake tensor that stays in its fake mode. The trainer's KL reference is a
    deep copy of the policy, and torch's ``Tensor.__deepcopy__`` puts the copy of a fake tensor in a
    fresh fake mode, whose tensors then cannot meet the policy's ("Mixing fake modes")."""

    def clone(tensor: FakeTensor, memo: dict[int, Any]) -> Tensor:
        if id(tensor) not in memo:
            with torch.no_grad():
                copied = tensor.clone()
            if isinstance(tensor, nn.Parameter):
                copied = nn.Parameter(copied, requires_grad=tensor.requires_grad)
            memo[id(tensor)] = copied
        return memo[id(tensor)]

    FakeTensor.__deepcopy__ = clone  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del FakeTensor.__deepcopy__


def known(make: Callable[[], Tensor]) -> Tensor:
    """A small tensor built for real by ``make`` and handed to the active fake mode as a constant: its
    values stay readable (``float(sigmas[1])``, ``bool(traj.stochastic[k])``) where every other fake
    tensor has a shape only."""
    mode = detect_fake_mode()
    if mode is None:
        return make()
    with unset_fake_temporarily():
        real = make()
    return mode.fake_tensor_converter.from_real_tensor(mode, real, make_constant=True)


def fake_tensors() -> FakeTensorMode:
    """The mode in which every new tensor has a shape, dtype and device but no storage."""
    return FakeTensorMode()
