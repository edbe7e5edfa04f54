"""One training step, phase by phase: rollout -> decode and score -> advantages -> update -> optimizer.

On each rank:
  1. draw ``prompts_per_rank`` prompts (train/run/prompts.py); each is a group of G samples on this rank
     that starts from one initial noise drawn from the stream (seed, "initial_noise", group id);
  2. roll out the N-step trajectory without gradients (SDE or Flow-GRPO-Fast window);
  3. decode, score every reward component, combine, and take group advantages;
  4. update: the router (train/algorithm/routing.py) may measure first; then micro-batches through
     train/algorithm/update.py (exact or JAGG per segment), one optimizer step per
     ``gradient_accumulation_steps`` samples, after clipping the global gradient norm. The routes of an
     optimizer step's micro-batches are drawn first, in order; its shared start (the first trainable
     step, once per group) runs before them and its backward after them.

The rollout keeps its velocities when the JAGG path can reuse them (``update.reuse_velocities``):
``fresh`` hands them to the update until an optimizer step has changed the weights, ``stale`` for the
whole step. A skipped optimizer step leaves the weights, hence the velocities, valid. Nothing of them is
checkpointed: a resumed step rolls out again and keeps them anew.

A NaN or inf reward (``rewards.combine.NonFiniteRewardError``) or a non-finite gradient skips the
update (all ranks together) instead of corrupting the weights; an exception while a rank decodes and scores
its samples ends the step on every rank at the same point (``reward_phase``); the remote reward's answer outside
its protocol is a ``ScorerFailed`` (one line naming reward.components.remote).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from models.base import Backbone, Conditioning, decode_in_chunks
from models.model_config import ModelConfig
from rewards.combine import AdvantageFn, NonFiniteRewardError
from rewards.remote import RemoteRewardError, RemoteScorer
from samplers.rollout import KeptVelocities, Predict, Trajectory, group_noise, rollout, shared_start_steps
from samplers.schedule import check_timesteps
from samplers.window import rollout_forwards, sde_window
from train.algorithm.grpo import group_advantages
from train.algorithm.jagg import Counts
from train.algorithm.metrics import Reduce, Stat
from train.algorithm.update import UpdateBatch, UpdateStats, shared_start, update_micro_batch
from train.algorithm.update_config import ReuseVelocities
from train.config.schema import AdvStd, GRPOConfig, TrainConfig
from train.distributed.collectives import all_gather_tensor, all_reduce_max, all_reduce_sum
from train.distributed.parallelize import ProcessRanks, clip_grad_norm_
from train.distributed.seeds import stream_generator, stream_seed
from train.observe.health import FLAT_IMAGES, flat_fraction
from train.observe.logger import PhaseTimer, RunLogger
from train.observe.perf import perf_metrics
from train.optim.ema import EMA
from train.run.errors import RankFailed, ScorerFailed, config_key, mark_agreed
from train.run.parts import ModelParts, Run

log = logging.getLogger(__name__)


def rollout_phase(run: Run, step: int, *, keep_velocities: bool | None = None) -> tuple[Trajectory, list[str]]:
    """The step's rollout and its prompts; it keeps its velocities when ``keep_velocities`` says so,
    by default when the update can reuse them."""
    cfg, backbone, device = run.cfg, run.model.backbone, run.device
    batch = run.data.prompts.batch(step)
    size, s = cfg.grpo.group_size, cfg.sampler
    seeds = [stream_seed(cfg.seed, "initial_noise", gid) for gid in batch.group_ids]
    h, w = cfg.model.height, cfg.model.width
    noise = group_noise(backbone.initial_noise, seeds, group_size=size, height=h, width=w, device=device)
    # the window decides which transitions train: the same on every rank
    window = sde_window(s, step, stream_generator(cfg.seed, "sde_window", step))
    with config_key("sampler", ["shift"]):
        sigmas = backbone.sigmas(s.num_steps, height=h, width=w, shift=s.shift)
        check_timesteps(sigmas, quantize=s.quantize_timesteps)
    # SDE noise per group, from (seed, group id): the same samples however groups spread over ranks.
    sde_noise = [stream_generator(cfg.seed, "sde_noise", gid, device) for gid in batch.group_ids]
    keep = cfg.update.keeps_velocities(ratio_norm=cfg.grpo.ratio_norm) if keep_velocities is None else keep_velocities
    with torch.no_grad():
        cond = backbone.encode(batch.prompts).repeat(size)
    traj = sample_trajectories(
        run.model.policy,
        cfg,
        cond,
        noise,
        sigmas=sigmas,
        group_ids=torch.tensor(batch.group_ids, device=device).repeat_interleave(size),
        sde_window=window,
        sde_noise=sde_noise,
        keep_velocities=keep,
        velocity_dtype=run.model.compute_dtype,  # the transformer's output precision: nothing is lost
    )
    prompts = [p for p in batch.prompts for _ in range(size)]
    return traj, prompts


def sample_trajectories(
    predict: Predict,
    cfg: TrainConfig,
    cond: Conditioning,
    noise: Tensor,
    *,
    sigmas: Tensor,
    group_ids: Tensor,
    sde_window: tuple[int, int] | None,
    sde_noise: list[torch.Generator] | None,
    keep_velocities: bool,
    velocity_dtype: torch.dtype,
) -> Trajectory:
    """The sampler's rollout (no gradients) of ``predict`` with ``cfg.sampler``'s settings from ``noise``
    [B, ...] and ``cond`` (B rows, in groups of G consecutive rows: with ``update.share_group_start`` the
    shared start runs one row per group); the velocities kept in ``velocity_dtype``, in host memory with
    ``update.offload_velocities``."""
    velocities = KeptVelocities(velocity_dtype, "cpu" if cfg.update.offload_velocities else None)
    return rollout(
        predict,
        cond,
        noise,
        cfg.sampler,
        sigmas=sigmas,
        sde_window=sde_window,
        generator=sde_noise,
        group_ids=group_ids,
        group_size=rollout_group_size(cfg),
        velocities=velocities if keep_velocities else None,
    )


def rollout_group_size(cfg: TrainConfig) -> int:
    """The rows that share a start in the rollout: G with ``update.share_group_start``, else 1."""
    return cfg.update.shared_rows(cfg.grpo.group_size)


def rollout_shared_rows(cfg: TrainConfig, traj: Trajectory) -> int:
    """Rows of transformer forwards the rollout's shared start did not run (on this rank)."""
    size = rollout_group_size(cfg)
    steps = shared_start_steps(traj.stochastic.tolist()) if size > 1 else 0
    return steps * (traj.batch_size - traj.batch_size // size)


def rollout_metrics(cfg: TrainConfig, traj: Trajectory) -> dict[str, float]:
    """The rollout's transformer calls per sample and, with an SDE window, where it started."""
    flags = traj.stochastic.tolist()
    window = None
    if cfg.sampler.sde_window_size > 0 and any(flags):
        window = (flags.index(True), flags.index(True) + sum(flags))
    metrics: dict[str, float] = {"count/rollout_forwards": rollout_forwards(cfg.sampler, window)}
    return metrics if window is None else metrics | {"sampler/window_start": window[0]}


def decode_images(backbone: Backbone, latents: Tensor, model: ModelConfig) -> Tensor:
    """Images [B, 3, H, W] of the final ``latents`` [B, ...], ``model.decode_batch`` per VAE call."""
    with torch.no_grad():
        return decode_in_chunks(backbone, latents, rows=model.decode_batch, height=model.height, width=model.width)


def advantage_fn(g: GRPOConfig) -> AdvantageFn:
    """Group advantages with ``grpo``'s settings (a global std all-gathers the step's rewards)."""

    def fn(rewards: Tensor, group_ids: Tensor) -> Tensor:
        unbiased = g.adv_std is AdvStd.unbiased
        global_std = all_gather_tensor(rewards).std(unbiased=unbiased) if g.global_std else None
        return group_advantages(
            rewards, group_ids, eps=g.adv_eps, adv_clip_max=g.adv_clip_max, global_std=global_std, unbiased=unbiased
        )

    return fn


@dataclass
class Scored:
    """The reward phase's result on this rank."""

    advantages: Tensor | None  # [B]; None when the step must be skipped (a non-finite reward on some rank)
    images: Tensor  # [B, 3, H, W] in [0, 1]
    rewards: Tensor | None  # [B] combined reward per sample (None when skipped)
    metrics: dict[str, float]


OK, NAN_REWARD, FAILED = 0, 1, 2  # a rank's outcome of its own part of the reward phase


def reward_phase(run: Run, traj: Trajectory, prompts: list[str]) -> Scored:
    """Decode and score this rank's samples (its own VAE and reward models: no collective), then agree with
    the other ranks, in one all-reduce, on what each got: a NaN reward anywhere skips the update; an
    exception on some rank ends the step on every rank at this point (``RankFailed`` on the others), so
    that they can still checkpoint the steps trained before it together (train/trainer.py)."""
    outcome, scores, images = OK, {}, None
    failure: Exception | None = None
    try:
        images = decode_images(run.model.backbone, traj.latents[:, -1], run.cfg.model)
        with torch.no_grad():
            scores = run.data.rewards.score(images, prompts)
    except NonFiniteRewardError as err:  # it names its scorer; skip the update on every rank
        log.warning("skipping the update of this step: %s", err)
        outcome = NAN_REWARD
    except RemoteRewardError as err:  # the server's answer or refusal: a setting or the server to fix, in one line
        outcome, failure = FAILED, ScorerFailed(f"reward.components.{RemoteScorer.name}: {err}")
    except Exception as err:  # the other ranks learn of it below, then it is re-raised
        outcome, failure = FAILED, err
    outcomes = torch.zeros(run.dist.world_size, device=run.device)
    outcomes[run.dist.rank] = outcome
    outcomes = all_reduce_max(outcomes)
    failed = [rank for rank, value in enumerate(outcomes.tolist()) if value == FAILED]
    if failure is not None:
        raise mark_agreed(failure)
    if failed:
        raise RankFailed(
            f"rank {', '.join(map(str, failed))} failed in the reward phase of this step (its error is in its "
            "own output); this rank stopped with it"
        )
    assert images is not None
    if outcomes.max() == NAN_REWARD:
        return Scored(None, images, None, {"train/skipped_nan_reward": 1.0})
    advantages, _ = run.data.rewards.advantages(scores, traj.group_ids, advantage_fn(run.cfg.grpo))
    total = run.data.rewards.total(scores)
    # every rank holds as many samples: the gathered tensors are the whole step's
    metrics = {f"reward/{name}": float(all_gather_tensor(s).mean()) for name, s in scores.items()}
    metrics |= {f"spread/{name}": group_spread(s, traj.group_ids) for name, s in scores.items()}
    everyone = all_gather_tensor(advantages)
    metrics |= {
        "reward/total": float(all_gather_tensor(total).mean()),
        "adv/mean": float(everyone.mean()),
        "adv/std": float(everyone.std(unbiased=False)),
        "adv/abs_max": float(everyone.abs().max()),
        "train/skipped_nan_reward": 0.0,
    }
    return Scored(advantages, images, total, metrics)


def group_spread(scores: Tensor, group_ids: Tensor) -> float:
    """The largest range (max - min) of ``scores`` [B] within a group, over the groups of every rank: 0 when
    every group ties, so the reward adds no advantage (train/observe/health.py warns)."""
    everyone, ids = all_gather_tensor(scores.float()), all_gather_tensor(group_ids)
    return max(float(everyone[ids == gid].max() - everyone[ids == gid].min()) for gid in ids.unique())


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


def update_batch(model: ModelParts, cfg: TrainConfig, traj: Trajectory, advantages: Tensor) -> UpdateBatch:
    """The update stage's input: the step's trajectories and advantages, the run's predictors and settings."""
    return UpdateBatch(
        traj=traj,
        advantages=advantages,
        predict=model.policy,
        reference=model.kl_reference,
        config=cfg.update,
        grpo=cfg.grpo,
        gradient_accumulation_steps=cfg.batch.gradient_accumulation_steps,
    )


def micro_batches(cfg: TrainConfig, first: int) -> list[range]:
    """The rows of each micro-batch of the optimizer step that starts at row ``first``."""
    b = cfg.batch
    return [range(r, r + b.micro_batch) for r in range(first, first + b.gradient_accumulation_steps, b.micro_batch)]


def train_step(run: Run, step: int) -> dict[str, float]:
    """One step (the phases above); the update runs here, micro-batch by micro-batch, so that the call
    path from the trainer to a segment's loss stays short."""
    b, timer, optim = run.cfg.batch, PhaseTimer(run.device, run.perf.flops), run.optim
    if run.perf.compiles is not None:
        run.perf.compiles.begin()
    with timer.phase("step"):
        with timer.phase("rollout"):
            traj, prompts = rollout_phase(run, step)
        with timer.phase("reward"):
            scored = reward_phase(run, traj, prompts)
        metrics = scored.metrics | {FLAT_IMAGES: flat_fraction(scored.images, run.cfg.health.flat_image_range)}
        if scored.advantages is not None:
            batch = update_batch(run.model, run.cfg, traj, scored.advantages)
            routing: dict[str, float] = {}
            if optim.router.due(step):  # it measures on the step's own rollout, before any gradient exists
                with timer.phase("probe"):
                    routing = optim.router.refresh(step, batch, run.model.params, ranks=ProcessRanks())
            route_gen = stream_generator(run.cfg.seed, "update_plan", step)  # same on every rank
            stats = UpdateStats(counts=Counts(shared_start_forward_rows=rollout_shared_rows(run.cfg, traj)))
            norms, moved = [], False
            for chunk in range(0, traj.batch_size, b.gradient_accumulation_steps):
                stale = batch.config.reuse_velocities is ReuseVelocities.stale
                reuse = batch.config.reuses_velocities and (stale or not moved)
                with timer.phase("update"):
                    micro = micro_batches(run.cfg, chunk)
                    routes = [optim.router.route(traj, route_gen) for _ in micro]  # drawn in micro-batch order
                    start = shared_start(batch, micro, routes)  # this optimizer step's, when rows share it
                    for rows, route in zip(micro, routes):
                        rows_t = torch.arange(rows.start, rows.stop, device=run.device)
                        stats += update_micro_batch(batch, rows_t, route, reuse_velocities=reuse, start=start)
                    if start is not None:
                        stats += start.backward()
                with timer.phase("optimizer"):
                    clip = run.cfg.optimizer.max_grad_norm
                    norms.append(optimizer_step(run.model.params, optim.optimizer, optim.ema, max_grad_norm=clip))
                    moved |= norms[-1][1]  # the kept velocities are no longer those of the current weights
            metrics |= reduce_over_ranks(stats.metrics(), run.device) | routing
            metrics |= optimizer_metrics(optim.optimizer, norms)
    metrics |= timer.pop()
    metrics |= perf_metrics(metrics, run.perf.peak)
    if run.perf.compiles is not None:
        metrics |= run.perf.compiles.end(step)
    metrics |= rollout_metrics(run.cfg, traj)
    if traj.velocities is not None:  # what keeping them costs, per sample of the rollout, on every rank
        metrics["memory/velocity_bytes_per_sample"] = traj.velocities[0].nbytes
    every = run.cfg.logging.sample_every
    if every and (step + 1) % every == 0:
        log_samples(run.io.logger, scored, prompts, step, group_size=run.cfg.grpo.group_size)
    return metrics


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


def log_samples(logger: RunLogger, scored: Scored, prompts: list[str], step: int, *, group_size: int) -> None:
    """The step's images, one row per group: its G samples share the prompt and the initial noise. The
    files are numbered step + 1, as the evaluation and the checkpoint after this step are (wandb: its row)."""
    rewards = None if scored.rewards is None else scored.rewards.float().cpu().tolist()
    logger.log_images(
        "samples",
        scored.images,
        prompts,
        step,
        scores=rewards,
        score_name="reward/total",
        nrow=group_size,
        shown_step=step + 1,
    )
