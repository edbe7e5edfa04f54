"""The update phase of a step (train/loop/step.py): ``grpo.inner_epochs`` passes over the rollout's samples, the
first in the rollout's order and each later one reshuffled (``pass_order``); per ``gradient_accumulation_steps``
samples the router's routes, the shared start (the first trainable step, once per group), the micro-batches through
train/algorithm/update.py (exact or JAGG per segment) and an optimizer step after clipping the global gradient norm.

The rollout keeps its velocities when the JAGG path can reuse them (``update.reuse_velocities``): ``fresh`` hands
them to the update until an optimizer step of the step has changed the weights, ``stale`` for the whole first pass.
A skipped optimizer step leaves the weights, hence the velocities, valid. Nothing of them is checkpointed: a resumed
step rolls out again and keeps them anew.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from samplers.rollout import (
    Trajectory,
    shared_start_steps,
)
from train.algorithm.jagg import Counts
from train.algorithm.metrics import Reduce, Stat
from train.algorithm.update import UpdateBatch, UpdateStats, shared_start, update_micro_batch
from train.algorithm.update_config import ReuseVelocities
from train.distributed.collectives import all_reduce_max, all_reduce_sum
from train.distributed.parallelize import ProcessRanks, clip_grad_norm_
from train.distributed.seeds import stream_generator
from train.parts.config.schema import TrainConfig
from train.parts.observe.perf import PhaseTimer
from train.parts.optim.ema import EMA
from train.parts.policy.parts import ModelParts
from train.run.parts import OptimParts


def update(
    model: ModelParts,
    optim: OptimParts,
    cfg: TrainConfig,
    *,
    step: int,
    traj: Trajectory,
    advantages: Tensor,
    timer: PhaseTimer,
    device: torch.device,
) -> dict[str, float]:
    """Train ``model``'s weights on step ``step``'s trajectories and advantages with ``optim``'s optimizer and
    router, ``grpo.inner_epochs`` passes over the samples (``pass_order``); the phase's metrics, reduced over
    ranks (the update's tensors live on ``device``), with each pass's ratio and clip fraction when there are
    several."""
    accumulation = cfg.batch.gradient_accumulation_steps
    batch = UpdateBatch(traj, advantages, model.policy, model.kl_reference, cfg.update, cfg.grpo, accumulation)
    routing: dict[str, float] = {}
    if optim.router.due(step):  # it measures on the step's own rollout, before any gradient exists
        with timer.phase("probe"):
            routing = optim.router.refresh(step, batch, model.params, ranks=ProcessRanks())
    route_gen = stream_generator(cfg.seed, "update_plan", step)  # same on every rank, drawn on over the passes
    stats = UpdateStats(counts=Counts(shared_start_forward_rows=rollout_shared_rows(cfg, traj)))
    norms: list[tuple[float, bool]] = []
    passes: dict[str, Stat] = {}
    for number in range(cfg.grpo.inner_epochs):
        order = pass_order(cfg.seed, step, number, traj.batch_size)
        done = update_pass(model, optim, cfg, batch, order, route_gen, norms, timer, first=number == 0, device=device)
        stats += done
        if cfg.grpo.inner_epochs > 1:
            passes |= pass_metrics(done, number)
    return reduce_over_ranks(stats.metrics() | passes, device) | routing | optimizer_metrics(optim.optimizer, norms)


def pass_order(seed: int, step: int, number: int, rows: int) -> list[int]:
    """The order of a rank's ``rows`` samples in update pass ``number`` (0 = the first) of step ``step``: the
    first pass in the rollout's order, each later one a permutation drawn from the stream (seed, "pass_order",
    (step, pass)), as flow_grpo reshuffles its samples per inner epoch. Every rank draws the same permutation of
    its rows (each then runs the same calls, as FSDP needs), and a resumed step draws it again."""
    if number == 0:
        return list(range(rows))
    return torch.randperm(rows, generator=stream_generator(seed, "pass_order", (step, number))).tolist()


def update_pass(
    model: ModelParts,
    optim: OptimParts,
    cfg: TrainConfig,
    batch: UpdateBatch,
    order: list[int],
    route_gen: torch.Generator,
    norms: list[tuple[float, bool]],
    timer: PhaseTimer,
    *,
    first: bool,
    device: torch.device,
) -> UpdateStats:
    """One pass over the samples in ``order``: per ``gradient_accumulation_steps`` of them, the micro-batches'
    routes drawn from ``route_gen`` in order, the shared start, the micro-batches and the optimizer step, whose
    (norm, stepped) it appends to ``norms`` (those of the step's earlier passes already there). The kept
    velocities are those of the current weights until an optimizer step of the step moved them (``fresh``);
    ``stale`` takes them for the whole first pass only, a later pass recomputing at the weights it moved."""
    stats = UpdateStats()
    stale = first and cfg.update.reuse_velocities is ReuseVelocities.stale
    for start_row in range(0, len(order), cfg.batch.gradient_accumulation_steps):
        reuse = cfg.update.reuses_velocities and (stale or not any(moved for _, moved in norms))
        with timer.phase("update"):
            micro = micro_batches(cfg, order, start_row)
            routes = [optim.router.route(batch.traj, route_gen) for _ in micro]  # drawn in micro-batch order
            start = shared_start(batch, micro, routes)  # this optimizer step's, when rows share it
            for rows, route in zip(micro, routes):
                rows_t = torch.tensor(rows, dtype=torch.long, device=device)
                stats += update_micro_batch(batch, rows_t, route, reuse_velocities=reuse, start=start)
            if start is not None:
                stats += start.backward()
        with timer.phase("optimizer"):
            clip = cfg.optimizer.max_grad_norm
            norms.append(optimizer_step(model.params, optim.optimizer, optim.ema, max_grad_norm=clip))
    return stats


PASS_METRICS = ("ratio_mean", "clip_frac")  # logged per pass as train/pass<k>/<name>, k from 1


def pass_key(k: int, name: str) -> str:
    """The logged name of metric ``name`` of update pass ``k`` (from 1)."""
    return f"train/pass{k}/{name}"


def pass_metrics(stats: UpdateStats, number: int) -> dict[str, Stat]:
    """``PASS_METRICS`` of pass ``number``'s ``stats``, as ``train/pass<number + 1>/<name>``."""
    metrics = stats.metrics()
    return {pass_key(number + 1, name): metrics[f"train/{name}"] for name in PASS_METRICS}


def logged_passes(metrics: Mapping[str, float]) -> int:
    """The update passes of the step whose ``metrics`` these are: those ``pass_metrics`` logged, 1 without any."""
    k = 1
    while pass_key(k + 1, PASS_METRICS[0]) in metrics:
        k += 1
    return k


def micro_batches(cfg: TrainConfig, order: list[int], first: int) -> list[list[int]]:
    """The rows of each micro-batch of the optimizer step that starts at position ``first`` of ``order``."""
    b = cfg.batch
    return [order[r : r + b.micro_batch] for r in range(first, first + b.gradient_accumulation_steps, b.micro_batch)]


def rollout_shared_rows(cfg: TrainConfig, traj: Trajectory) -> int:
    """Rows of transformer forwards the rollout's shared start did not run (on this rank)."""
    size = cfg.update.shared_rows(cfg.grpo.group_size)
    steps = shared_start_steps(traj.stochastic.tolist()) if size > 1 else 0
    return steps * (traj.batch_size - traj.batch_size // size)


def optimizer_step(
    params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, ema: EMA | None, *, max_grad_norm: float
) -> tuple[float, bool]:
    """Clip the global norm and step; a non-finite norm skips the step. Returns (norm, stepped)."""
    norm = clip_grad_norm_(params, max_grad_norm)
    finite = bool(torch.isfinite(norm))
    if finite:
        step_weights(optimizer, ema)
    optimizer.zero_grad(set_to_none=True)
    return float(norm), finite


def step_weights(optimizer: torch.optim.Optimizer, ema: EMA | None) -> None:
    """The optimizer step on the clipped gradients, then the EMA of the new weights."""
    optimizer.step()
    if ema is not None:
        ema.update()


def reduce_over_ranks(stats: Mapping[str, Stat], device: torch.device) -> dict[str, float]:
    """The logged values of this rank's ``stats``, each reduced over all ranks by its own ``Reduce`` (two
    collectives, on ``device``; every rank passes the same names, as every rank routes alike). A mean is
    its summed weighted values over its summed weight; a sum (a counter) stays an integer."""
    summed = [name for name, stat in stats.items() if stat.reduce in (Reduce.sum, Reduce.mean)]
    extremes = [name for name, stat in stats.items() if stat.reduce in (Reduce.max, Reduce.min)]
    sign = {Reduce.max: 1.0, Reduce.min: -1.0}  # a minimum is the maximum of the negated values
    totals = [*(stats[name].value for name in summed), *(stats[name].weight for name in summed)]
    sums = all_reduce_sum(torch.tensor(totals, dtype=torch.float64, device=device)).tolist()
    signed = [sign[stats[name].reduce] * stats[name].value for name in extremes]
    largest = all_reduce_max(torch.tensor(signed, dtype=torch.float64, device=device)).tolist()
    out: dict[str, float] = {}
    for i, name in enumerate(summed):
        total, weight = sums[i], sums[len(summed) + i]
        out[name] = total / max(weight, 1.0) if stats[name].reduce is Reduce.mean else int(total)
    out |= {name: sign[stats[name].reduce] * value for name, value in zip(extremes, largest)}
    return {name: out[name] for name in stats}


def optimizer_metrics(optimizer: torch.optim.Optimizer, steps: list[tuple[float, bool]]) -> dict[str, float]:
    """The optimizer's metrics of a step, from each optimizer step's (gradient norm, stepped)."""
    return {
        "train/grad_norm": sum(norm for norm, _ in steps) / len(steps),
        "train/skipped_optimizer_steps": sum(not stepped for _, stepped in steps),
        "train/lr": optimizer.param_groups[0]["lr"],
    }
