"""Toy velocity models whose linearity the tests control (tests/tools/test_probe.py, test_routing.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from models.base import Conditioning
from samplers.rollout import KeptVelocities, Trajectory, rollout
from samplers.sampler_config import SamplerConfig
from samplers.schedule import shifted_sigmas
from samplers.sde import SDEKind
from train.algorithm.update import UpdateBatch
from train.algorithm.update_config import UpdateConfig

DIM = 8


@dataclass
class ToyCond(Conditioning):
    emb: Tensor  # [B, 1], unused by the model: the rollout and the update only index and tile it


class ToyVelocity(nn.Module):
    """v = A z + b t + c + gamma * w * sin(omega t) * [t < cutoff]; A fixed, b, c and w trained.

    With gamma = 0 the parameter Jacobian [t I, I, 0] does not depend on z and is affine in t, so
    Theorem 1 holds on any trajectory: JAGG's gradient is the exact one. gamma > 0 adds a term that
    oscillates in t below ``cutoff`` (the low-noise groups) and is absent above it.
    """

    def __init__(self, *, gamma: float = 0.0, omega: float = 20.0, cutoff: float = 0.5, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("a", 0.1 * torch.randn(DIM, DIM, generator=g))
        self.b = nn.Parameter(torch.randn(DIM, generator=g))
        self.c = nn.Parameter(torch.randn(DIM, generator=g))
        self.w = nn.Parameter(torch.randn(DIM, generator=g))
        self.gamma, self.omega, self.cutoff = gamma, omega, cutoff

    def forward(self, z: Tensor, t: Tensor, cond: ToyCond) -> Tensor:
        t = t[:, None].to(z.dtype)
        bend = torch.sin(self.omega * t) * (t < self.cutoff)
        return z @ self.a.T + self.b * t + self.c + self.gamma * self.w * bend


def toy_trajectory(
    model: nn.Module, *, batch: int = 4, num_steps: int = 13, sde: str = "dance", keep_velocities: bool = False
) -> Trajectory:
    """``num_steps`` SDE steps (num_steps - 1 trainable transitions) from seeded noise."""
    noise = torch.randn(batch, DIM, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return rollout(
            model,
            ToyCond(torch.zeros(batch, 1)),
            noise,
            SamplerConfig(sde=SDEKind(sde), num_steps=num_steps, eta=0.3, noise_level=0.7),
            sigmas=shifted_sigmas(num_steps, 3.0),
            generator=torch.Generator().manual_seed(2),
            velocities=KeptVelocities() if keep_velocities else None,
        )


@dataclass(frozen=True)
class ToySettings:
    """The update's settings of a toy run: its ``UpdateConfig`` fields, and the ``GRPOConfig`` fields the update
    reads (this object serves as them: a toy's groups may have one row, which GRPOConfig refuses)."""

    mode: str = "jagg"
    segment_length: int = 4
    timestep_fraction: float = 1.0
    reuse_velocities: str = "fresh"
    share_group_start: bool = True
    exact_batched: bool = False
    group_size: int = 1
    clip_range: float = 0.1
    kl_beta: float = 0.0
    ratio_norm: bool = False
    gradient_accumulation_steps: int = 1

    @property
    def config(self) -> UpdateConfig:
        return UpdateConfig(
            mode=self.mode,
            segment_length=self.segment_length,
            timestep_fraction=self.timestep_fraction,
            reuse_velocities=self.reuse_velocities,
            share_group_start=self.share_group_start,
            exact_batched=self.exact_batched,
        )


def toy_settings(
    *, mode: str = "jagg", segment_length: int = 4, kl_beta: float = 0.0, reuse_velocities: str = "fresh"
) -> ToySettings:
    return ToySettings(mode=mode, segment_length=segment_length, kl_beta=kl_beta, reuse_velocities=reuse_velocities)


ADVANTAGES = torch.tensor([1.0, -0.5, 0.7, -1.2])


def toy_batch(
    model: nn.Module,
    traj: Trajectory,
    settings: ToySettings,
    *,
    advantages: Tensor = ADVANTAGES,
    reference: nn.Module | None = None,
) -> UpdateBatch:
    return UpdateBatch(
        traj,
        advantages,
        predict=model,
        reference=reference,
        config=settings.config,
        grpo=settings,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
    )
