"""Toy parts for the reward stage's tests (train/parts/scoring/stage.py, with the step's chunk loop of
train/loop/step.py), without a transformer: a rollout of seeded final latents per group that decodes them into [0, 1],
and scorers whose behaviour the test picks (local or served, slow, failing, NaN)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from probe_toys import ToyCond
from torch import Tensor

from rewards.base import Scorer
from rewards.combine import RewardCombiner
from samplers.rollout import Trajectory
from samplers.sampler_config import SamplerConfig
from train.algorithm.grpo_config import GRPOConfig
from train.distributed.collectives import DistInfo
from train.parts.scoring.stage import RewardStage, RewardStageConfig, advantage_fn

SIDE = 4  # the toy images are [3, SIDE, SIDE]


@dataclass
class ToyRollout:
    """``num_groups`` groups of ``group_size`` rows; a row's final latent is drawn from its group's own seed, so
    any chunking gives the same rows. ``interrupt_at``: the chunk whose rollout raises KeyboardInterrupt;
    ``before_chunk``: called with each chunk's index as its rollout starts."""

    num_groups: int
    group_size: int = 2
    first_group: int = 0  # the id of the first group (another rank's groups start elsewhere)
    interrupt_at: int | None = None
    before_chunk: Callable[[int], None] | None = None
    chunks: int = 0  # chunks rolled out so far

    def chunk(self, groups: range) -> tuple[Trajectory, list[str]]:
        if self.chunks == self.interrupt_at:
            raise KeyboardInterrupt
        if self.before_chunk is not None:
            self.before_chunk(self.chunks)
        self.chunks += 1
        ids = [self.first_group + g for g in groups]
        rows = [torch.randn(self.group_size, 3 * SIDE * SIDE, generator=torch.Generator().manual_seed(i)) for i in ids]
        latents = torch.stack([torch.zeros(len(ids) * self.group_size, 3 * SIDE * SIDE), torch.cat(rows)], dim=1)
        batch = latents.shape[0]
        traj = Trajectory(
            latents=latents,
            timesteps=torch.ones(1),
            sigmas=torch.tensor([1.0, 0.0]),
            log_probs=torch.zeros(batch, 1),
            stochastic=torch.tensor([True]),
            trainable=torch.tensor([False]),
            velocities=None,
            cond=ToyCond(torch.zeros(batch, 1)),
            group_ids=torch.tensor(ids).repeat_interleave(self.group_size),
            sde=SamplerConfig().transition,
            sigma_guard=1.0,
        )
        return traj, [f"prompt {i}" for i in ids for _ in range(self.group_size)]

    def decode(self, traj: Trajectory) -> Tensor:
        """A chunk's final toy latents [b, 3 * SIDE * SIDE] as images in [0, 1]."""
        return torch.sigmoid(traj.latents[:, -1]).reshape(-1, 3, SIDE, SIDE)


class ToyScorer(Scorer):
    """``fn(images) -> [B]`` as the score; ``served``: run in the stage's background worker; ``delay_s``: each call
    takes this long; ``fail``: an exception raised instead (from the ``fail_from``-th call on)."""

    name = "toy"

    def __init__(
        self,
        fn: Callable[[Tensor], Tensor],
        *,
        served: bool = False,
        delay_s: float = 0.0,
        fail: Exception | None = None,
        fail_from: int = 0,
    ) -> None:
        self.fn, self.served, self.delay_s, self.fail, self.fail_from = fn, served, delay_s, fail, fail_from
        self.calls: list[str] = []  # the thread of each call

    @property
    def runs_remotely(self) -> bool:  # type: ignore[override]  # per instance here
        return self.served

    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        self.calls.append(threading.current_thread().name)
        time.sleep(self.delay_s)
        if self.fail is not None and len(self.calls) > self.fail_from:
            raise self.fail
        return self.fn(images)

    def to(self, device: torch.device | str) -> ToyScorer:
        return self


def brightness(images: Tensor) -> Tensor:
    return images.mean(dim=(1, 2, 3))


def redness(images: Tensor) -> Tensor:
    return images[:, 0].mean(dim=(1, 2)) - images[:, 2].mean(dim=(1, 2))


def nan_scores(images: Tensor) -> Tensor:
    return torch.full((images.shape[0],), math.nan)


def toy_stage(
    components: dict[str, tuple[Scorer, float]],
    *,
    chunk_groups: int = 0,
    mode: str = "sum",
    optional: Sequence[str] = (),
    rank: int = 0,
    world_size: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> RewardStage:
    """A reward stage of ``components`` in chunks of ``chunk_groups`` groups, on the CPU."""
    dist = DistInfo(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"), is_main=rank == 0)
    return RewardStageConfig(chunk_groups=chunk_groups).build(
        rewards=RewardCombiner(components, mode=mode, optional=optional),
        advantage=advantage_fn(GRPOConfig(group_size=2)),
        dist=dist,
        device=torch.device("cpu"),
        clock=clock,
    )
