"""One training step of the run traced on fake tensors: the run's parts (train/tools/plan/fake_run.py) and the
trainer's own step functions (train/tools/plan/step_calls.py) run phase by phase under ``measure``, in the order
a step runs them."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import cast

import torch
from torch import Tensor

from models.diffusers_backbone import DiffusersBackbone
from samplers.window import rollout_forwards
from train.algorithm.update_config import UpdateMode
from train.run.build import optimizer_steps_per_step
from train.tools.plan.counts import drawn_windows, first_window, update_variants
from train.tools.plan.fake import Measured, measure
from train.tools.plan.fake_run import TracedRun, ema_shards, hold_gradients, reference_shards, traced_run
from train.tools.plan.plan_config import PlanRunConfig
from train.tools.plan.report import Phase, to_phase
from train.tools.plan.step_calls import (
    EXACT_TRACED_STEPS,
    Forwards,
    StepTensors,
    TracedOnce,
    run_decode,
    run_optimizer_step,
    run_rollout,
    update_call,
)


def progress(what: str) -> None:
    """A line on stderr while the planner traces (a preset takes a minute or two on 2 cores)."""
    print(f"plan: {what}", file=sys.stderr, flush=True)


def measure_counting(run: TracedRun, resident: Sequence[Tensor], call: Callable) -> tuple[Measured, Forwards]:
    """``measure`` of ``call``, with the forwards of the transformer and of the KL reference copy counted."""
    forwards = Forwards()
    roots = [m for m in (run.backbone.transformer, run.reference) if m is not None]
    hooks = [m.register_forward_pre_hook(forwards.count) for m in roots]
    try:
        return measure(run.backbone.transformer, run.optimizer, resident, call), forwards
    finally:
        for hook in hooks:
            hook.remove()


def _storage_bytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def trace_updates(run: TracedRun, tensors: StepTensors, segments: dict[UpdateMode, float]) -> list[Phase]:
    """Every update call of the run (``update_variants``) on one segment of one micro-batch, with the
    run's activation checkpointing and gradients held."""
    cfg = run.cfg
    assert tensors.traj is not None
    offloaded = cfg.update.offload_velocities
    resident = tensors.resident(offloaded_velocities=offloaded) + reference_shards(run) + ema_shards(run)
    out = []
    for mode, reuse, calls in update_variants(cfg, segments, kept_velocities=cfg.update.reuses_velocities):
        name = f"update {mode}" + (", rollout velocities" if reuse else "")
        progress(f"  {name}, activation checkpointing {'on' if cfg.model.activation_checkpointing else 'off'}")
        m, forwards = measure_counting(run, resident, update_call(run, tensors, mode, reuse=reuse))
        backwards = float(forwards.with_grad)  # each graph is backpropagated once
        if mode == UpdateMode.exact:  # its W steps, each freed before the next, traced on EXACT_TRACED_STEPS
            m.flops = round(m.flops * cfg.update.segment_length / EXACT_TRACED_STEPS)
            backwards *= cfg.update.segment_length / EXACT_TRACED_STEPS
        calls_of = {"forwards": forwards.without_grad + backwards, "backwards": backwards}
        out.append(to_phase(name, m, calls, checkpointing=cfg.model.activation_checkpointing, mode=mode, **calls_of))
    return out


@dataclass
class Traced:
    """Everything measured on rank 0 of the run as configured."""

    phases: list[Phase]
    updates: list[Phase]
    tensors: StepTensors
    at_step: dict[str, int]  # tracker categories when the optimizer step starts: shards, gradients, state, inputs
    num_params: int
    num_trainable: int
    step_tensor_bytes: int
    reference_bytes: int
    ema_bytes: int
    velocity_bytes: int
    shared_rollout_flops: float  # what the rollout's shared start saves (rows of the steps before the first SDE noise)
    post_window_flops: float  # what the compressed schedule after the window saves (sampler.post_window.ratio)
    forward_flops_per_row: float  # of one transformer forward of one row without gradients (the rollout's)
    image_tokens: int


def _rollout_calls(
    run: TracedRun, predict: TracedOnce, windows: dict[tuple[int, int] | None, float], resident: Sequence[Tensor]
) -> tuple[float, float]:
    """(rows, calls) of the transformer in a rollout, expected over the ``windows`` the run draws: ``predict``
    holds those of the first, which the trace measured; the others run here (each new shape is traced once)."""
    first, *others = windows
    rows, calls = predict.called_rows * windows[first], predict.calls * windows[first]
    for window in others:
        progress(f"  rollout with the SDE window {window}")
        rows_before, calls_before = predict.called_rows, predict.calls
        call = partial(run_rollout, run, StepTensors(), predict, window)
        measure(run.backbone.transformer, run.optimizer, resident, call)
        rows += (predict.called_rows - rows_before) * windows[window]
        calls += (predict.calls - calls_before) * windows[window]
    return rows, calls


def trace_step(run: TracedRun, segments: dict[UpdateMode, float]) -> Traced:
    """The phases in the order a step runs them, with gradients held where the trainer holds them."""
    cfg, b = run.cfg, run.cfg.batch
    root, opt = run.backbone.transformer, run.optimizer
    offloaded = cfg.update.offload_velocities
    always = reference_shards(run) + ema_shards(run)
    tensors = StepTensors()
    # the rollout and the decode run after the last optimizer step's zero_grad(set_to_none)
    predict, windows = TracedOnce(run.policy()), drawn_windows(cfg)
    progress(f"  rollout of {cfg.grpo.group_size * b.prompts_per_rank} samples, SDE window {first_window(cfg)}")
    rollout = measure(root, opt, always, partial(run_rollout, run, tensors, predict, first_window(cfg)))
    assert tensors.traj is not None
    if offloaded and tensors.traj.velocities is not None:  # allocated during the rollout, in host memory
        rollout.peak_bytes -= _storage_bytes([tensors.traj.velocities])
    per_row = rollout.flops / predict.traced_rows  # counted: the first forward of each shape (TracedOnce)
    rows, calls = _rollout_calls(run, predict, windows, always)
    rollout.flops = round(per_row * rows)
    batch = tensors.traj.batch_size
    forwards = sum(rollout_forwards(cfg.sampler, window) * share for window, share in windows.items())  # per row
    shared_rollout_flops = per_row * (forwards * batch - rows)
    post_window_flops = per_row * (cfg.sampler.num_steps - forwards) * batch
    phases = [to_phase("rollout", rollout, 1, forwards=calls)]
    progress("  decode")
    resident = always + tensors.resident(offloaded_velocities=offloaded)
    decode = measure(root, opt, resident, partial(run_decode, run, tensors))
    phases.append(to_phase("decode", decode, 1))
    tensors.advantages = torch.zeros(batch)
    hold_gradients(run)
    updates = trace_updates(run, tensors, segments)
    resident = always + tensors.resident(offloaded_velocities=offloaded)
    progress("  optimizer step")
    optimizer = measure(root, opt, resident, partial(run_optimizer_step, run))
    phases.append(to_phase("optimizer", optimizer, optimizer_steps_per_step(cfg)))
    return Traced(
        phases=phases,
        updates=updates,
        tensors=tensors,
        at_step=optimizer.at_start,
        num_params=sum(p.numel() for p in root.parameters()),
        num_trainable=sum(p.numel() for p in run.params),
        step_tensor_bytes=_storage_bytes(tensors.resident(offloaded_velocities=offloaded)),
        reference_bytes=_storage_bytes(reference_shards(run)),
        ema_bytes=_storage_bytes(ema_shards(run)),
        velocity_bytes=0 if offloaded or tensors.traj.velocities is None else _storage_bytes([tensors.traj.velocities]),
        shared_rollout_flops=shared_rollout_flops,
        post_window_flops=post_window_flops,
        forward_flops_per_row=per_row,
        image_tokens=math.prod(cast(DiffusersBackbone, run.backbone).latent_grid(cfg.model.height, cfg.model.width)),
    )


def trace_other_checkpointing(
    cfg: PlanRunConfig, arch: Path, tensors: StepTensors, segments: dict[UpdateMode, float]
) -> list[Phase]:
    """The update traces with activation checkpointing flipped, on the same step's tensors (a second
    model: checkpointing wraps the blocks before FSDP2 shards them)."""
    other = replace(cfg, model=replace(cfg.model, activation_checkpointing=not cfg.model.activation_checkpointing))
    run = traced_run(other, arch)
    hold_gradients(run)
    return trace_updates(run, tensors, segments)
