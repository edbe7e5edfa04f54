"""How far a run is from the hardware: time and FLOPs per phase, achieved TFLOP/s and MFU; and what
compiling the transformer costs (``CompileWatch``).

    perf/tflops/<phase> = flops/<phase> / time/<phase> / 1e12
    perf/mfu/<phase>    = perf/tflops/<phase> / peak

FLOPs are those of the transformer calls of a phase (the rollout's, the update's with their
backward and the KL reference's, the routing probe's), counted by torch's ``FlopCounterMode`` (the
memory planner counts with the same ``StepFlopCounter``) once per distinct input shape, on a twin of
the eager model whose tensors are fake (shapes only: no memory, no compute). So a compiled, sharded
or checkpointed transformer is counted as the model it computes: a call with gradients counts its
forward and its backward (to the trainable parameters and the inputs that need them), and
activation checkpointing's recomputation is not counted (model FLOPs, not hardware FLOPs). The VAE
decode and the reward models are not counted: ``perf/mfu/step`` is the transformer's share.

The peak (``perf.peak_tflops``) is one device's: by default the dense bf16 rate of the usual GPUs
(``GPU_PEAK_TFLOPS``, by the name CUDA reports) and, on CPU, this machine's float32 matmul rate
measured once at start-up (``cpu_matmul_tflops``).

``PhaseTimer`` sums wall-clock seconds per phase (``time/<phase>``); on CUDA it synchronizes before reading the
clock, since kernels run asynchronously and would be billed to the next phase.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode, flop_registry

from models.base import Backbone, Conditioning
from train.distributed.parallelize import CompileStats, compile_stats
from train.parts.observe.observe_config import PerfConfig

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peaks of one GPU in TFLOP/s (vendors' data sheets; SXM parts), by a name
# CUDA's device name contains.
GPU_PEAK_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0, "B200": 2250.0}


class StepFlopCounter(FlopCounterMode):
    """FlopCounterMode with two changes. No per-module breakdown: its module tracker keeps the
    tensors that activation checkpointing recomputes alive after the backward (measured: a 12-block
    full-width Flux, 5.9 GiB traced peak alone, 12.2 GiB under FlopCounterMode). And attention
    counts: the CPU flash kernel that fake tensors dispatch to has no formula of its own, so it
    takes that of the CUDA flash kernel (the same q, k, v arguments first)."""

    def __init__(self) -> None:
        super().__init__(display=False)
        aten = torch.ops.aten
        self.flop_registry[aten._scaled_dot_product_flash_attention_for_cpu] = flop_registry[
            aten._scaled_dot_product_flash_attention
        ]
        self.flop_registry[aten._scaled_dot_product_flash_attention_for_cpu_backward] = flop_registry[
            aten._scaled_dot_product_flash_attention_backward
        ]

    def __enter__(self) -> StepFlopCounter:
        self.flop_counts.clear()
        self.mode = _FlopCounterMode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        assert self.mode is not None
        self.mode.__exit__(*args)
        self.mode = None


def meta_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device (same shapes, dtypes
    and ``requires_grad``; no storage): take it before the module is wrapped (checkpointing,
    compilation, FSDP2), to count the FLOPs of the eager model."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


# FLOPs of one row of a transformer call, by (architecture, gradient mode, shapes of one row): shared
# by every meter of the process, so that runs of one architecture measure each call once.
_ROW_FLOPS: dict[tuple, int] = {}


class FlopMeter:
    """FLOPs of every transformer call so far (``total``).

    ``count(z, t, cond)`` is called with each call's inputs. A transformer's FLOPs are linear in its
    rows (every matmul and attention is computed per row), so a call counts its rows times the FLOPs
    of one row, measured once per distinct row shape and gradient mode. A call under
    ``torch.enable_grad`` is followed by its backward (every update path differentiates what it
    runs with gradients) and counts both.
    """

    def __init__(self, backbone: Backbone) -> None:
        self.backbone = backbone
        self.twin = meta_twin(backbone.transformer)
        self.architecture = (repr(self.twin), tuple(p.requires_grad for p in self.twin.parameters()))
        self.total = 0

    def count(self, z: Tensor, t: Tensor, cond: Conditioning) -> None:
        grad = torch.is_grad_enabled()
        rows = [tuple(x.shape[1:]) for x in (z, t, *cond.tensors().values())]
        key = (self.architecture, grad, *rows)
        if key not in _ROW_FLOPS:
            _ROW_FLOPS[key] = self.measure(z[:1], t[:1], cond.index([0]), grad=grad)
        self.total += _ROW_FLOPS[key] * z.shape[0]

    def measure(self, z: Tensor, t: Tensor, cond: Conditioning, *, grad: bool) -> int:
        """FLOPs of the eager transformer on these inputs (forward, and backward when ``grad``)."""
        meta = torch.device("meta")
        with StepFlopCounter() as counter, torch.enable_grad() if grad else torch.no_grad():
            v = self.backbone.predict(z.to(meta), t.to(meta), cond.to(meta), transformer=self.twin)
            if grad and v.requires_grad:
                v.sum().backward()
        self.twin.zero_grad(set_to_none=True)
        return int(counter.get_total_flops())


@dataclass(frozen=True)
class Peak:
    """One device's peak rate and where it comes from."""

    tflops: float | None  # None: unknown (a GPU missing from the table and no perf.peak_tflops)
    source: str  # "perf.peak_tflops", "H100 bf16 dense", "measured float32 matmul"


def cpu_matmul_tflops(size: int = 1024, reps: int = 5) -> float:
    """This machine's float32 matmul rate in TFLOP/s with torch's threads: the best of ``reps``
    products of two ``size`` x ``size`` matrices (the best, so that a busy moment does not count)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # the first call pays for thread start-up
    best = math.inf
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def device_peak(settings: PerfConfig, device: torch.device) -> Peak:
    """``perf.peak_tflops`` when set, else the GPU table by device name, else (CPU) the measured rate."""
    if settings.peak_tflops is not None:
        return Peak(settings.peak_tflops, "perf.peak_tflops")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for gpu, tflops in GPU_PEAK_TFLOPS.items():
            if gpu in name:
                return Peak(tflops, f"{gpu} bf16 dense")
        log.warning("perf: no peak known for GPU %r: set perf.peak_tflops=<TFLOP/s> for perf/mfu/*", name)
        return Peak(None, f"unknown for {name}")
    return Peak(cpu_matmul_tflops(), "measured float32 matmul")


def perf_metrics(metrics: Mapping[str, float], peak: Peak) -> dict[str, float]:
    """``perf/tflops/<phase>`` and ``perf/mfu/<phase>`` of every phase with FLOPs and a time."""
    out = {}
    for key, flops in metrics.items():
        phase = key.removeprefix("flops/")
        seconds = metrics.get(f"time/{phase}", 0.0)
        if key == phase or not flops or seconds <= 0:
            continue
        tflops = flops / seconds / 1e12
        out[f"perf/tflops/{phase}"] = tflops
        if peak.tflops:
            out[f"perf/mfu/{phase}"] = tflops / peak.tflops
    return out


class CompileWatch:
    """``time/compile`` (seconds compiling in a step: the first step's compilation, then any
    recompilation) and ``count/compilations`` (graphs compiled so far in the process); it warns once
    when a step after the first ``settle_steps`` of the session still compiles (shapes or guards that
    change every step would compile without end: torch then falls back to eager at its cache limit)."""

    def __init__(self, settle_steps: int = 3) -> None:
        self.settle_steps = settle_steps
        self.steps = 0
        self.warned = False
        self.before = CompileStats(graphs=0, seconds=0.0)

    def begin(self) -> None:
        """A step starts."""
        self.before = compile_stats()

    def end(self, step: int) -> dict[str, float]:
        """Step ``step`` ended: its metrics."""
        before, after = self.before, compile_stats()
        self.steps += 1
        grew = after.graphs - before.graphs
        if grew and self.steps > self.settle_steps and not self.warned:
            self.warned = True
            log.warning(
                "model.compile: step %d compiled %d more graph(s) after %d steps: something changes every step "
                "(TORCH_LOGS=recompiles names it); compilations so far: %d",
                step, grew, self.settle_steps, after.graphs,
            )  # fmt: skip
        return {"time/compile": after.seconds - before.seconds, "count/compilations": after.graphs}


class PhaseTimer:
    """``with timer.phase("rollout"): ...`` sums seconds per phase until ``pop()``, and the FLOPs that
    ``flops`` counted in each phase when given."""

    def __init__(self, device: torch.device | str = "cpu", flops: FlopMeter | None = None) -> None:
        self.device = torch.device(device)
        self.flops = flops
        self._totals: dict[str, float] = defaultdict(float)
        self._flops: dict[str, int] = defaultdict(int)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start, counted = self._now(), self.flops.total if self.flops is not None else 0
        try:
            yield
        finally:
            self._totals[name] += self._now() - start
            if self.flops is not None:
                self._flops[name] += self.flops.total - counted

    def pop(self) -> dict[str, float]:
        """{"time/<phase>": seconds, "flops/<phase>": FLOPs} accumulated since the last pop; resets the totals."""
        out = {f"time/{name}": seconds for name, seconds in self._totals.items()}
        out |= {f"flops/{name}": float(flops) for name, flops in self._flops.items() if flops}
        self._totals.clear()
        self._flops.clear()
        return out
