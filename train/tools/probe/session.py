"""The gradient-quality probe of a configured run (the paper's Appendix E): roll out batches with the
trainer's phases and measure (train/algorithm/quality.py) until K trajectories had a gradient; the report.

``python -m train.probe`` (train/tools/probe/command.py) runs ``run_probe``: it builds as the trainer
does, with wandb off and only as many prompts per rank as K trajectories need; with
``resume=<checkpoint folder>`` it measures those weights. It logs no metric (its folder gets no
metrics.jsonl), only ``probe.json`` and the table on the console.

With ``update.reuse_velocities=stale`` (and a ``probe.mode`` with middle steps) it also measures what
staleness costs: on every batch it moves the weights by one optimizer step on the batch (the
trainer's first step of a training step: the configured paths, one fresh AdamW step at optimizer.lr, which
moves every weight by about lr, the largest first step), measures there the path with its middle
velocities recomputed (fresh) and taken from the rollout (stale), and restores the weights. The
trainer's later chunks lag further behind (c steps for chunk c); this is the first of them.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from samplers.rollout import Trajectory
from train.algorithm.quality import (
    Samples,
    measure_staleness,
    measure_trajectories,
    probe_report,
    summarize_segments,
)
from train.algorithm.segments import route_segments
from train.algorithm.update import UpdateBatch, update_micro_batch
from train.algorithm.update_config import MIDDLE_MODES, ReuseVelocities
from train.distributed.parallelize import ProcessRanks, clip_grad_norm_
from train.ground.layout import RunLayout
from train.loop.step import roll_out_and_score, step_rollout
from train.loop.trainer import Trainer
from train.parts.config.schema import TrainConfig
from train.parts.observe.observe_config import WandbMode
from train.parts.observe.perf import PhaseTimer
from train.parts.optim.optimizer import adamw_settings
from train.run.build import open_run
from train.run.parts import Run
from train.run.start import load_config, process_group
from train.tools.probe.probe_config import ProbeConfig, probe_settings
from train.tools.probe.table import format_table

log = logging.getLogger(__name__)
MAX_BATCHES_PER_K = 10


@contextmanager
def one_step_later(
    params: list[torch.nn.Parameter], cfg: TrainConfig, batch: UpdateBatch, device: torch.device
) -> Iterator[None]:
    """The weights after one optimizer step on ``batch`` for the duration of the block, then restored.

    The step: the first ``gradient_accumulation_steps`` samples (or all there are) through the
    configured paths (every segment, the prefix rule), the global-norm clip, and a fresh AdamW's first
    step (the run's optimizer state is not touched).
    """
    b = cfg.batch
    saved = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, **adamw_settings(cfg.optimizer))
    traj = batch.traj
    route = route_segments(
        traj.trainable_steps(),
        length=cfg.update.segment_length,
        mode=cfg.update.mode,
        jagg_frac=cfg.update.jagg_frac,
        num_transitions=traj.num_transitions,
    )
    rows = min(b.gradient_accumulation_steps, traj.batch_size)
    for first in range(0, rows, b.micro_batch):
        micro = torch.arange(first, min(first + b.micro_batch, rows), device=device)
        update_micro_batch(batch, micro, route, reuse_velocities=False)
    clip_grad_norm_(params, cfg.optimizer.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, value in zip(params, saved):
                p.copy_(value)


@dataclass
class Measurements:
    """Per segment, what the probe measured of each trajectory so far; with staleness, also one optimizer step
    later, with the middle velocities recomputed (fresh) and taken from the rollout (stale)."""

    samples: Samples = field(default_factory=lambda: defaultdict(list))
    fresh_after: Samples = field(default_factory=lambda: defaultdict(list))
    stale_after: Samples = field(default_factory=lambda: defaultdict(list))

    def num_measured(self) -> int:
        """Trajectories measured on every segment."""
        return min((len(v) for v in self.samples.values()), default=0)


def measure_batch(
    run: Run, p: ProbeConfig, update: UpdateBatch, into: Measurements, *, count: int, stale: bool, ranks: ProcessRanks
) -> None:
    """Measure ``count`` trajectories of one batch into ``into``; with ``stale``, also one optimizer step later."""
    params = run.model.params
    for segment, values in measure_trajectories(update, params, num_rollouts=count, mode=p.mode, ranks=ranks).items():
        into.samples[segment] += values
    if not stale:
        return
    with one_step_later(params, run.cfg, update, run.device):
        fresh, old = measure_staleness(update, params, num_rollouts=count, mode=p.mode, ranks=ranks)
    for segment in fresh:
        into.fresh_after[segment] += fresh[segment]
        into.stale_after[segment] += old[segment]


def probe(run: Run, p: ProbeConfig) -> dict[str, Any]:
    """Roll out batches until ``probe.num_rollouts`` trajectories are measured; the JSON report.

    A trajectory whose advantage is 0 (its group's rewards all equal) has no gradient and is not
    measured; batches are drawn until K trajectories were, at most ``MAX_BATCHES_PER_K`` times as
    many batches as K needs.
    """
    cfg = run.cfg
    predict, reference = run.model.policy, run.model.kl_reference
    per_batch = cfg.grpo.group_size * cfg.batch.prompts_per_rank * run.dist.world_size
    u, ranks = cfg.update, ProcessRanks()
    stale = u.reuse_velocities is ReuseVelocities.stale and p.mode in MIDDLE_MODES and u.segment_length > 2
    measured = Measurements()
    traj, done = None, 0
    max_batches = MAX_BATCHES_PER_K * math.ceil(p.num_rollouts / per_batch)
    for batch in range(max_batches):
        keep = stale or cfg.grpo.ratio_norm
        rollout = step_rollout(run.model, run.data.prompts, cfg, batch, device=run.device, keep_velocities=keep)
        traj, _, scored = roll_out_and_score(rollout, run.data.reward_stage, PhaseTimer(run.device))
        advantages = scored.advantages
        if advantages is None:  # a NaN reward (the reward stage warned); this batch is not measured
            continue
        count = min(per_batch, p.num_rollouts - done)
        update = UpdateBatch(traj, advantages, predict, reference, u, cfg.grpo, cfg.batch.gradient_accumulation_steps)
        measure_batch(run, p, update, measured, count=count, stale=stale, ranks=ranks)
        done = measured.num_measured()
        if done >= p.num_rollouts:
            break
    else:
        log.warning("probe: %d of K = %d trajectories had a gradient after %d batches", done, p.num_rollouts, batch + 1)
    assert traj is not None  # validate() keeps probe.num_rollouts >= 1, so a batch was drawn
    return report(run, p, measured, traj, stale=stale)


def report(run: Run, p: ProbeConfig, measured: Measurements, traj: Trajectory, *, stale: bool) -> dict[str, Any]:
    """The probe's JSON report of what it measured (``traj``: the last batch's, for its timesteps)."""
    cfg = run.cfg
    segments, fresh, old = [
        summarize_segments(s, traj.timesteps) for s in (measured.samples, measured.fresh_after, measured.stale_after)
    ]
    return probe_report(
        segments,
        mode=p.mode,
        threshold=p.threshold,
        num_transitions=traj.num_transitions,
        staleness=(fresh, old) if stale else None,
        experiment=cfg.experiment,
        model=cfg.model.name,
        segment_length=cfg.update.segment_length,
        sampler=cfg.sampler.sde,
        num_rollouts=p.num_rollouts,
        world_size=run.dist.world_size,
    )


def run_probe(cfg: DictConfig) -> dict[str, Any]:
    """Build as the trainer does, probe, and write the report (rank 0 prints the table)."""
    config = load_config(cfg)
    p = probe_settings(config)
    config.logging.wandb_mode = WandbMode.disabled
    with process_group(config.dist.timeout_s) as dist:
        needed = math.ceil(p.num_rollouts / (config.grpo.group_size * dist.world_size))
        if needed < config.batch.prompts_per_rank:  # samples no trajectory would use are not rolled out
            log.info("probe: %d prompt(s) per rank per rollout batch cover K = %d", needed, p.num_rollouts)
            config.batch.prompts_per_rank = needed
        with open_run(config, dist, training=False) as run:
            if config.resume is not None:
                Trainer(run).resume()
            rep = probe(run, p)
        if dist.is_main:
            out = Path(p.output or RunLayout(config.run_dir).probe)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(rep, indent=2) + "\n")
            log.info("%s\nreport: %s", format_table(rep), out)
    return rep
