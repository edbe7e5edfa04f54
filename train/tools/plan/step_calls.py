"""The phases of one training step as calls to trace, each running the trainer's own step functions
(train.loop.step, train.algorithm.update) on the tensors the step keeps: the rollout, the decode, one update
call per path, the optimizer step; and what a traced call counts of the transformer's forwards."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any, cast

import torch
from torch import Tensor

from models.base import Conditioning, parse_dtype
from models.diffusers_backbone import DiffusersBackbone
from samplers.rollout import Predict, Trajectory, stochastic_flags, trainable_flags
from samplers.schedule import shifted_sigmas
from train.algorithm.segments import RoutedSegment
from train.algorithm.update import UpdateBatch, update_micro_batch
from train.algorithm.update_config import UpdateMode
from train.distributed.parallelize import clip_grad_norm_
from train.loop.passes import step_weights
from train.loop.step import decode_images, sample_trajectories
from train.tools.plan.counts import EXACT_BATCHED, text_tokens
from train.tools.plan.fake import known
from train.tools.plan.fake_run import TracedRun

EXACT_TRACED_STEPS = 2  # the exact path's steps are alike and run one after another: two show its peak


# Shapes of the conditioning fields of one prompt, from (text tokens, the transformer's config).
_FIELD_SHAPES: dict[str, Callable[[int, dict[str, Any]], tuple[int, ...]]] = {
    "prompt_embeds": lambda tokens, config: (tokens, config["joint_attention_dim"]),
    "pooled": lambda tokens, config: (config["pooled_projection_dim"],),
    "mask": lambda tokens, config: (tokens,),
}


def conditioning(backbone: DiffusersBackbone, rows: int, tokens: int) -> Conditioning:
    """What ``backbone.encode`` returns for ``rows`` prompts of ``tokens`` text tokens (its shapes)."""
    config = backbone.configs["transformer"]
    values = {}
    for f in fields(backbone.conditioning_class):
        if f.name not in _FIELD_SHAPES:
            raise ValueError(f"plan: no shape known for conditioning field {f.name!r} of backbone {backbone.name!r}")
        shape = (rows, *_FIELD_SHAPES[f.name](tokens, config))
        is_mask = f.name == "mask"
        values[f.name] = torch.ones(shape, dtype=torch.long) if is_mask else torch.randn(shape, dtype=backbone.dtype)
    return backbone.conditioning_class(**values)


@dataclass
class StepTensors:
    """What a step keeps from its rollout to its optimizer step (train.loop.step.train_step)."""

    traj: Trajectory | None = None
    images: Tensor | None = None  # [B, 3, H, W] float32, from the decode on (logged after the update)
    advantages: Tensor | None = None  # [B]

    def resident(self, *, offloaded_velocities: bool) -> list[Tensor]:
        """The tensors on the GPU: the velocities stay out when they are kept in host memory."""
        out: list[Tensor] = []
        if self.traj is not None:
            t = self.traj
            out += [t.latents, t.timesteps, t.sigmas, t.log_probs, t.group_ids, *t.cond.tensors().values()]
            if t.velocities is not None and not offloaded_velocities:
                out.append(t.velocities)
        return out + [x for x in (self.images, self.advantages) if x is not None]


class TracedOnce:
    """A predictor that runs its first call of each input shape and answers each later one with an
    uninitialized tensor of that call's output shape and dtype.

    The rollout's N steps call the transformer with the same shapes (and, with the shared start, its
    first steps with one row per group): the first forward of each shape traced gives a step's memory,
    and the rows of all calls (``called_rows``) against the traced ones (``traced_rows``) scale its
    FLOPs, which are per row. The sampler's own loop (trajectory buffers, SDE steps, log-probabilities,
    kept velocities) still runs every step, at a fraction of the CPU.
    """

    def __init__(self, predict: Predict) -> None:
        self.predict = predict
        self.first: dict[torch.Size, tuple[torch.Size, torch.dtype]] = {}  # input shape -> (output shape, dtype)
        self.traced_rows = self.called_rows = self.calls = 0

    def __call__(self, z: Tensor, t: Tensor, cond: Any) -> Tensor:
        self.called_rows += z.shape[0]
        self.calls += 1
        if z.shape not in self.first:
            v = self.predict(z, t, cond)
            self.first[z.shape] = (v.shape, v.dtype)
            self.traced_rows += z.shape[0]
            return v
        shape, dtype = self.first[z.shape]
        return torch.empty(shape, dtype=dtype, device=z.device)


def run_rollout(run: TracedRun, tensors: StepTensors, predict: TracedOnce, window: tuple[int, int] | None) -> None:
    """The rollout of every sample of the rank with the SDE ``window`` (``train.loop.step.sample_trajectories``: the
    sampler's N steps, the transformer traced on the first, ``TracedOnce``) from conditioning and noise shaped as
    ``train.loop.step.step_rollout`` makes them."""
    cfg, backbone = run.cfg, cast(DiffusersBackbone, run.backbone)
    g, b, s = cfg.grpo, cfg.batch, cfg.sampler
    cond = conditioning(backbone, b.prompts_per_rank, text_tokens(cfg)).repeat(g.group_size)
    noise = backbone.initial_noise(b.prompts_per_rank, height=cfg.model.height, width=cfg.model.width)
    # The schedule's values change no shape: a fixed shift stands in for a dynamic one.
    sigmas = known(lambda: shifted_sigmas(s.num_steps, s.shift if s.shift is not None else 1.0))
    traj = sample_trajectories(
        predict,
        cfg,
        cond,
        noise.repeat_interleave(g.group_size, dim=0),
        sigmas=sigmas,
        group_ids=torch.arange(b.prompts_per_rank).repeat_interleave(g.group_size),
        sde_window=window,
        sde_noise=[torch.Generator().manual_seed(i) for i in range(b.prompts_per_rank)],
        keep_velocities=cfg.update.keeps_velocities(ratio_norm=cfg.grpo.ratio_norm),
        velocity_dtype=parse_dtype(cfg.model.dtype),
    )
    flags = stochastic_flags(s.num_steps, traj.sde, window)  # readable, for transition() and the plan
    stochastic = known(lambda: torch.tensor(flags, dtype=torch.bool))
    trainable = known(lambda: torch.tensor(trainable_flags(flags), dtype=torch.bool))
    tensors.traj = replace(traj, stochastic=stochastic, trainable=trainable)


def run_decode(run: TracedRun, tensors: StepTensors) -> None:
    """The decode of the rollout's final latents before scoring (``train.loop.step.decode_images``)."""
    assert tensors.traj is not None
    tensors.images = decode_images(run.backbone, tensors.traj.latents[:, -1], run.cfg.model)


def update_call(run: TracedRun, tensors: StepTensors, mode: str, *, reuse: bool) -> Callable[[], object]:
    """One segment of W steps of one micro-batch through ``train.algorithm.update.update_micro_batch`` (the GRPO loss,
    the KL reference's batched call, ``backward_segment``), on the rollout's velocities when ``reuse``;
    ``mode`` exact_batched: an exact segment with update.exact_batched. Without the shared start."""
    cfg, traj = run.cfg, tensors.traj
    assert traj is not None and tensors.advantages is not None
    batch = UpdateBatch(
        traj=traj,
        advantages=tensors.advantages,
        predict=run.policy(),
        reference=run.kl_reference(),
        config=replace(cfg.update, exact_batched=mode == EXACT_BATCHED),
        grpo=cfg.grpo,
        gradient_accumulation_steps=cfg.batch.gradient_accumulation_steps,
    )
    start = traj.trainable_steps()[0]
    width = EXACT_TRACED_STEPS if mode == UpdateMode.exact else cfg.update.segment_length
    segment = RoutedSegment(start, start + width, UpdateMode.exact if mode == EXACT_BATCHED else UpdateMode(mode))
    rows = torch.arange(cfg.batch.micro_batch)  # built here, before the traced call, as the step holds them
    return partial(update_micro_batch, batch, rows, [segment], reuse_velocities=reuse)  # its scale changes nothing


def run_optimizer_step(run: TracedRun) -> None:
    """``train.loop.passes.optimizer_step`` but for its finiteness test (a value): the global-norm clip, the
    AdamW step and the EMA, then zero_grad."""
    clip_grad_norm_(run.params, run.cfg.optimizer.max_grad_norm)
    step_weights(run.optimizer, run.ema)
    run.optimizer.zero_grad(set_to_none=True)


@dataclass
class Forwards:
    """Transformer forwards a traced call ran (the policy's and the KL reference's), by whether with gradients."""

    with_grad: int = 0
    without_grad: int = 0

    def count(self, *_: Any) -> None:
        if torch.is_grad_enabled():
            self.with_grad += 1
        else:
            self.without_grad += 1
