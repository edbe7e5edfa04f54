"""One training step, phase by phase: rollout -> decode and score -> advantages -> update -> optimizer.

On each rank:
  1. draw ``prompts_per_rank`` prompts (train/parts/data/prompts.py); each is a group of G samples on this rank
     that starts from one initial noise drawn from the stream (seed, "initial_noise", group id);
  2. roll out the N-step trajectory without gradients (SDE or Flow-GRPO-Fast window), in chunks of whole
     groups (``reward.chunk_groups``), each chunk decoded and handed to the reward stage as it finishes
     (``roll_out_and_score``), which scores it, a served reward while the next chunk rolls out;
  3. once every score is in, combine and take group advantages (the reward stage, train/parts/scoring/stage.py);
  4. update (``update``, train/loop/passes.py: ``grpo.inner_epochs`` passes, the micro-batches through
     train/algorithm/update.py, exact or JAGG per segment, and the optimizer steps; the rollout's kept velocities).

A NaN or inf reward (``rewards.combine.NonFiniteRewardError``) or a non-finite gradient skips the
update (all ranks together) instead of corrupting the weights; an exception while a rank decodes and scores
its samples ends the step on every rank at the same point; the remote reward's answer outside its protocol is a
``ScorerFailed`` (one line naming reward.components.remote); an optional reward term that fails is left out of
the step (train/parts/scoring/stage.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from models.base import Backbone, Conditioning, decode_in_chunks
from models.model_config import ModelConfig
from samplers.rollout import (
    KeptVelocities,
    Predict,
    Trajectory,
    cat_trajectories,
    group_noise,
    rollout,
)
from samplers.schedule import check_timesteps
from samplers.window import rollout_forwards, sde_window
from train.distributed.seeds import stream_generator, stream_seed
from train.ground.errors import config_key
from train.loop.passes import update
from train.parts.config.schema import TrainConfig
from train.parts.data.prompts import PromptSampler
from train.parts.observe.health import FLAT_IMAGES, flat_fraction
from train.parts.observe.perf import PhaseTimer, perf_metrics
from train.parts.policy.parts import ModelParts
from train.parts.scoring.stage import RewardStage, Scored, StepScores, never
from train.run.parts import Run

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRollout:
    """A step's rollout on this rank, drawn once (the groups' initial noise and SDE-noise streams, the SDE window,
    the schedule, the conditioning) and run in chunks of whole groups (``roll_out_and_score``): a group's samples
    depend on its own streams only, so any chunking gives the same trajectories to float rounding."""

    predict: Predict
    backbone: Backbone  # its decoder
    cfg: TrainConfig
    cond: Conditioning  # B rows, G consecutive rows per group
    noise: Tensor  # [B, ...] z_0
    sigmas: Tensor  # [N+1]
    group_ids: Tensor  # [B]
    window: tuple[int, int] | None  # the SDE window, the same on every rank
    sde_noise: list[torch.Generator]  # one per group
    prompts: list[str]  # B, one per row
    keep_velocities: bool
    velocity_dtype: torch.dtype

    @property
    def num_groups(self) -> int:
        return len(self.sde_noise)

    def chunk(self, groups: range) -> tuple[Trajectory, list[str]]:
        """The trajectories of ``groups`` (indices among this rank's groups) and their prompts."""
        size = self.cfg.grpo.group_size
        rows = range(groups.start * size, groups.stop * size)
        traj = sample_trajectories(
            self.predict,
            self.cfg,
            self.cond.index(list(rows)),
            self.noise[rows.start : rows.stop],
            sigmas=self.sigmas,
            group_ids=self.group_ids[rows.start : rows.stop],
            sde_window=self.window,
            sde_noise=self.sde_noise[groups.start : groups.stop],
            keep_velocities=self.keep_velocities,
            velocity_dtype=self.velocity_dtype,
        )
        return traj, self.prompts[rows.start : rows.stop]

    def decode(self, traj: Trajectory) -> Tensor:
        """The images [b, 3, H, W] in [0, 1] of a chunk's final latents."""
        return decode_images(self.backbone, traj.latents[:, -1], self.cfg.model)


def step_rollout(
    model: ModelParts,
    prompts: PromptSampler,
    cfg: TrainConfig,
    step: int,
    *,
    device: torch.device,
    keep_velocities: bool | None = None,
) -> StepRollout:
    """The rollout of step ``step``'s prompts with ``model``'s policy, ready to run on ``device``; it keeps its
    velocities when ``keep_velocities`` says so, by default when the update can reuse them."""
    backbone, batch = model.backbone, prompts.batch(step)
    size, s = cfg.grpo.group_size, cfg.sampler
    seeds = [stream_seed(cfg.seed, "initial_noise", gid) for gid in batch.group_ids]
    h, w = cfg.model.height, cfg.model.width
    noise = group_noise(backbone.initial_noise, seeds, group_size=size, height=h, width=w, device=device)
    with config_key("sampler", ["shift"]):
        sigmas = backbone.sigmas(s.num_steps, height=h, width=w, shift=s.shift)
        check_timesteps(sigmas, quantize=s.quantize_timesteps)
    keep = cfg.update.keeps_velocities(ratio_norm=cfg.grpo.ratio_norm) if keep_velocities is None else keep_velocities
    with torch.no_grad():
        cond = backbone.encode(batch.prompts).repeat(size)
    return StepRollout(
        predict=model.policy,
        backbone=backbone,
        cfg=cfg,
        cond=cond,
        noise=noise,
        sigmas=sigmas,
        group_ids=torch.tensor(batch.group_ids, device=device).repeat_interleave(size),
        # the window decides which transitions train: the same on every rank
        window=sde_window(s, step, stream_generator(cfg.seed, "sde_window", step)),
        # SDE noise per group, from (seed, group id): the same samples however groups spread over ranks or chunks
        sde_noise=[stream_generator(cfg.seed, "sde_noise", gid, device) for gid in batch.group_ids],
        prompts=[p for p in batch.prompts for _ in range(size)],
        keep_velocities=keep,
        velocity_dtype=model.compute_dtype,  # the transformer's output precision: nothing is lost
    )


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
        group_size=cfg.update.shared_rows(cfg.grpo.group_size),
        velocities=velocities if keep_velocities else None,
    )


def decode_images(backbone: Backbone, latents: Tensor, model: ModelConfig) -> Tensor:
    """Images [B, 3, H, W] of the final ``latents`` [B, ...], ``model.decode_batch`` per VAE call."""
    with torch.no_grad():
        return decode_in_chunks(backbone, latents, rows=model.decode_batch, height=model.height, width=model.width)


def roll_out_and_score(
    rollout: StepRollout, stage: RewardStage, timer: PhaseTimer, stopped: Callable[[], bool] = never
) -> tuple[Trajectory, list[str], Scored]:
    """Roll out the step in the reward stage's chunks (``reward.chunk_groups``), each decoded and handed to its
    scores as soon as it is rolled out, so that a served term scores it while the next one rolls out (timed as
    ``rollout`` and ``reward``: the reward time this thread spent decoding, scoring locally and waiting for the
    served scores); the whole step's trajectories, prompts and scores. ``stopped`` (a signal) stops the served
    requests at once, and the step ends untrained on every rank (``StepStopped``: a resume runs it again)."""
    parts: list[Trajectory] = []
    prompts: list[str] = []
    with stage.scores(stopped) as scores:
        for groups in stage.config.chunks(rollout.num_groups):
            with timer.phase("rollout"):
                traj, chunk_prompts = rollout.chunk(groups)
            parts.append(traj)
            prompts += chunk_prompts
            with timer.phase("reward"):
                hand_over(scores, rollout, traj, chunk_prompts)
        with timer.phase("reward"):
            collected = scores.collect()
    traj = cat_trajectories(parts)
    with timer.phase("reward"):
        scored = stage.agree(scores, collected, traj.group_ids)
    return traj, prompts, scored


def hand_over(scores: StepScores, rollout: StepRollout, traj: Trajectory, prompts: list[str]) -> None:
    """Decode a chunk and hand its images to ``scores``; nothing once this rank failed (the step ends: the rest
    still rolls out, a sharded transformer's forwards being collectives); a decode that raises fails the step."""
    if scores.failed:
        return
    try:
        images = rollout.decode(traj)
    except Exception as err:
        scores.fail(None, err)
        return
    scores.add(images, prompts)


def rollout_metrics(cfg: TrainConfig, traj: Trajectory) -> dict[str, float]:
    """The rollout's transformer calls per sample and, with an SDE window, where it started."""
    flags = traj.stochastic.tolist()
    window = None
    if cfg.sampler.sde_window_size > 0 and any(flags):
        window = (flags.index(True), flags.index(True) + sum(flags))
    metrics: dict[str, float] = {"count/rollout_forwards": rollout_forwards(cfg.sampler, window)}
    return metrics if window is None else metrics | {"sampler/window_start": window[0]}


def train_step(run: Run, step: int, stopped: Callable[[], bool] = never) -> dict[str, float]:
    """One step: the rollout, reward and update phases (above), each on the parts it reads; the step's metrics.
    ``stopped``: true once the run is to stop (a signal), which stops the step's served requests."""
    cfg, timer = run.cfg, PhaseTimer(run.device, run.perf.flops)
    if run.perf.compiles is not None:
        run.perf.compiles.begin()
    with timer.phase("step"):
        with timer.phase("rollout"):
            rollout = step_rollout(run.model, run.data.prompts, cfg, step, device=run.device)
        traj, prompts, scored = roll_out_and_score(rollout, run.data.reward_stage, timer, stopped)
        metrics = scored.metrics | {FLAT_IMAGES: flat_fraction(scored.images, cfg.health.flat_image_range)}
        if scored.advantages is not None:
            advantages = scored.advantages
            metrics |= update(
                run.model, run.optim, cfg, step=step, traj=traj, advantages=advantages, timer=timer, device=run.device
            )
    metrics |= timer.pop()
    metrics |= perf_metrics(metrics, run.perf.peak)
    if run.perf.compiles is not None:
        metrics |= run.perf.compiles.end(step)
    metrics |= rollout_metrics(cfg, traj)
    if traj.velocities is not None:  # what keeping them costs, per sample of the rollout, on every rank
        metrics["memory/velocity_bytes_per_sample"] = traj.velocities[0].nbytes
    every = cfg.logging.sample_every
    if every and (step + 1) % every == 0:
        # one row per group (its G samples share the prompt and the initial noise), the files numbered step + 1 as
        # the evaluation and the checkpoint after this step are (wandb: its row)
        rewards = None if scored.rewards is None else scored.rewards.float().cpu().tolist()
        run.io.logger.log_images(
            "samples",
            scored.images,
            prompts,
            step,
            scores=rewards,
            score_name="reward/total",
            nrow=cfg.grpo.group_size,
            shown_step=step + 1,
        )
    return metrics
