"""Backbone-agnostic rollouts: sample a batch of trajectories and keep what training needs.

A rollout starts from packed initial latents z_0 (sigma_0 = 1) and takes N transitions
z_k -> z_{k+1} from sigmas[k] to sigmas[k+1]: at each step one batched call
v = predict(z_k, t_k, cond) over the whole batch, then samplers.sde.step with the step's transition:

    * full SDE (DanceGRPO ``dance`` or Flow-GRPO ``flow``): every step is stochastic;
    * Flow-GRPO-Fast: SDE only in a window [start, start + size) of consecutive steps, ODE
      elsewhere; samplers/window.py places the window of each training step inside [lo, hi);
    * ``ode``: every step deterministic (evaluation, and the zero-noise check against diffusers).

The steps after a window (``SamplerConfig.post_window``, samplers/post_window.py) are Euler steps or DPM-Solver++ 2M,
on the sampling schedule or on fewer points of a rebuilt one. They never train: the window's steps, their
log-probs and kept velocities are the same whichever solver follows.

t_k is sigma_k, or floor(1000 sigma_k) / 1000 with ``quantize_timesteps`` (samplers/schedule.py); the SDE
always uses the exact sigmas. Trainable transitions are the stochastic ones except the last
(k = N - 1, whose tiny sigma makes the Gaussian too peaked to train on; both references drop it).
Latents and log-probs are stored in float32 so recomputing a transition sees exactly what the
rollout saw. Everything stays on the latents' device; the loop runs under no_grad (not
inference_mode, so stored latents can later be inputs of a graph with gradients).

The shared initial noise of a group comes from a generator seeded by the group's own seed, so a
group's G samples start from the same z_0 and differ only by the SDE noise (``group_noise``).

The shared start (``group_size`` > 1: consecutive blocks of G rows share z_0 and the conditioning):
until a group's first SDE noise its G rows have the same input, so the predictions of the steps up to
and including the first SDE step (``shared_start_steps``) run one row per group and their v is
broadcast to the G rows; from the first SDE noise on, rows differ and run as before. The latents and
log-probs equal those of G rows per call up to float rounding (other batch shapes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from samplers.post_window import after_window_grid, post_window_step, tail_timesteps
from samplers.sampler_config import SamplerConfig
from samplers.schedule import network_timesteps
from samplers.sde import ODE, SDE, StepOutput, step

Predict = Callable[[Tensor, Tensor, Any], Tensor]  # (z [B, ...], t [B], cond with B rows) -> v [B, ...]
Generators = torch.Generator | Sequence[torch.Generator] | None  # the SDE noise's: one, or one per block of rows


def stochastic_flags(num_steps: int, sde: SDE, sde_window: tuple[int, int] | None = None) -> list[bool]:
    """Per step, whether it is an SDE step: all (or those in [start, stop)) unless ``sde`` is the ODE."""
    if not sde.stochastic:
        return [False] * num_steps
    if sde_window is None:
        return [True] * num_steps
    start, stop = sde_window
    if not 0 <= start < stop <= num_steps:
        raise ValueError(f"sde_window must satisfy 0 <= start < stop <= num_steps = {num_steps}, got {sde_window}")
    return [start <= k < stop for k in range(num_steps)]


def shared_start_steps(flags: Sequence[bool]) -> int:
    """Steps whose input is the same in every row of a group (``flags``: which steps are SDE): those
    before the first SDE step and that step itself (all of them for an ODE rollout)."""
    return flags.index(True) + 1 if any(flags) else len(flags)


def trainable_flags(flags: Sequence[bool]) -> list[bool]:
    """Per step, whether it trains: the stochastic ones (``flags``) except the last transition."""
    return [flag and k < len(flags) - 1 for k, flag in enumerate(flags)]


@dataclass(frozen=True)
class Trajectory:
    """A batch of sampled trajectories. B rows, N transitions; ``...`` is the packed latent shape."""

    latents: Tensor  # [B, N+1, ...] float32; latents[:, k] is z at sigmas[k]
    timesteps: Tensor  # [N] t fed to the transformer at step k
    sigmas: Tensor  # [N+1] noise levels, 1 -> 0
    log_probs: Tensor  # [B, N] float32 log p(z_{k+1} | z_k) at sampling time; 0 at ODE steps
    stochastic: Tensor  # [N] bool (CPU): step k is an SDE step
    trainable: Tensor  # [N] bool (CPU): stochastic and not the last transition
    velocities: Tensor | None  # [B, N, ...] v(z_k, t_k) when kept (``KeptVelocities``), maybe on the host
    cond: Any  # the Conditioning the rollout used, B rows
    group_ids: Tensor  # [B] id of each row's group (rows of one group share z_0)
    sde: SDE  # the transition taken at stochastic steps
    sigma_guard: float  # sigmas[1]: Flow-GRPO's stand-in for sigma in 1 / (1 - sigma) at sigma = 1

    @property
    def num_steps(self) -> int:
        return self.timesteps.shape[0]

    @property
    def num_transitions(self) -> int:
        """M = N - 1: the transitions that can train (the last never does); JAGG routing uses it."""
        return self.num_steps - 1

    @property
    def batch_size(self) -> int:
        return self.latents.shape[0]

    def trainable_steps(self) -> list[int]:
        return [k for k, flag in enumerate(self.trainable.tolist()) if flag]

    def index(self, rows: Tensor | Sequence[int]) -> Trajectory:
        """The trajectories of ``rows`` only (e.g. a training micro-batch)."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.latents.device)
        velocities = None if self.velocities is None else self.velocities[rows.to(self.velocities.device)]
        return replace(
            self,
            latents=self.latents[rows],
            log_probs=self.log_probs[rows],
            velocities=velocities,
            cond=self.cond.index(rows),
            group_ids=self.group_ids[rows.to(self.group_ids.device)],
        )


def cat_trajectories(parts: Sequence[Trajectory]) -> Trajectory:
    """The rows of every trajectory batch in ``parts``, in order: the chunks of one rollout (same schedule,
    steps and transition), e.g. rolled out a few groups at a time; one part is returned as it is."""
    first = parts[0]
    if len(parts) == 1:
        return first
    for part in parts[1:]:
        same = torch.equal(part.stochastic, first.stochastic) and torch.equal(part.timesteps, first.timesteps)
        if not same or part.sde != first.sde or (part.velocities is None) != (first.velocities is None):
            raise ValueError("cat_trajectories: the parts come from rollouts with different settings")
    velocities = None
    if first.velocities is not None:
        velocities = torch.cat([part.velocities for part in parts if part.velocities is not None])
        velocities = velocities.pin_memory() if first.velocities.is_pinned() else velocities
    return replace(
        first,
        latents=torch.cat([part.latents for part in parts]),
        log_probs=torch.cat([part.log_probs for part in parts]),
        velocities=velocities,
        cond=type(first.cond).cat([part.cond for part in parts]),
        group_ids=torch.cat([part.group_ids for part in parts]),
    )


def group_noise(
    initial_noise: Callable[..., Tensor],
    seeds: Sequence[int],
    *,
    group_size: int,
    height: int,
    width: int,
    device: torch.device | str = "cpu",
) -> Tensor:
    """Initial latents [len(seeds) * group_size, ...]: one draw per seed from
    ``initial_noise(1, height=, width=, generator=)`` with a generator on ``device`` seeded by it,
    repeated for the group's G rows (row i belongs to group i // G)."""
    rows = [
        initial_noise(1, height=height, width=width, generator=torch.Generator(device).manual_seed(int(seed)))
        for seed in seeds
    ]
    return torch.cat(rows).repeat_interleave(group_size, dim=0)


def _sde_noise(generator: Generators, z: Tensor) -> Tensor:
    """eps ~ N(0, I) shaped like z, float32: from one generator, or one per block of rows."""
    if not isinstance(generator, Sequence):
        return torch.randn(z.shape, generator=generator, device=z.device, dtype=torch.float32)
    shape = (z.shape[0] // len(generator), *z.shape[1:])
    return torch.cat([torch.randn(shape, generator=g, device=z.device, dtype=torch.float32) for g in generator])


@dataclass(frozen=True)
class KeptVelocities:
    """Where a rollout keeps every v(z_k, t_k): in ``dtype`` (the transformer's compute dtype loses nothing,
    ``predict`` only upcast it) on ``device`` (None: the latents'; host memory is pinned when the latents are
    on a GPU)."""

    dtype: torch.dtype = torch.float32
    device: torch.device | str | None = None

    def buffer(self, latents: Tensor) -> Tensor:
        """[B, N, ...] for the velocities of the trajectories ``latents`` [B, N+1, ...]."""
        device = latents.device if self.device is None else torch.device(self.device)
        pin = device.type == "cpu" and latents.device.type == "cuda"
        return torch.empty(latents[:, 1:].shape, dtype=self.dtype, device=device, pin_memory=pin)


def _check_rows(batch: int, generator: Generators, group_size: int, group_ids: Tensor | None) -> None:
    """The SDE-noise generators and the groups split the ``batch`` rows evenly; ``group_ids`` is [B]."""
    if isinstance(generator, Sequence) and (not generator or batch % len(generator)):
        raise ValueError(f"{len(generator)} SDE-noise generators do not split a batch of {batch} rows evenly")
    if group_size < 1 or batch % group_size:
        raise ValueError(f"group_size={group_size} does not split a batch of {batch} rows into whole groups")
    if group_ids is not None and group_ids.shape != (batch,):
        raise ValueError(f"group_ids must be [B] = [{batch}], got {tuple(group_ids.shape)}")


def _empty_trajectory(
    noise: Tensor, cond: Any, flags: list[bool], sampler: SamplerConfig, sigmas: Tensor, group_ids: Tensor | None
) -> Trajectory:
    """The trajectories of ``noise`` (z_0) before the first step: the latents and log-probs to fill."""
    num_steps, batch, device = len(flags), noise.shape[0], noise.device
    sigma_guard = float(sigmas[1])  # read before moving: no device sync
    latents = torch.empty((batch, num_steps + 1, *noise.shape[1:]), device=device, dtype=torch.float32)
    latents[:, 0] = noise
    return Trajectory(
        latents=latents,
        timesteps=network_timesteps(sigmas, quantize=sampler.quantize_timesteps).to(device, torch.float32),
        sigmas=sigmas.to(device),
        log_probs=torch.zeros(batch, num_steps, device=device, dtype=torch.float32),
        stochastic=torch.tensor(flags, dtype=torch.bool),
        trainable=torch.tensor(trainable_flags(flags), dtype=torch.bool),
        velocities=None,
        cond=cond,
        group_ids=torch.arange(batch, device=device) if group_ids is None else group_ids,
        sde=sampler.transition,
        sigma_guard=sigma_guard,
    )


def _take_step(traj: Trajectory, k: int, v: Tensor, *, is_sde: bool, generator: Generators) -> None:
    """Transition k of ``traj`` with velocity ``v``: z_{k+1}, its log-prob and the kept v written in place."""
    z, sigma, sigma_next = traj.latents[:, k], traj.sigmas[k], traj.sigmas[k + 1]
    if is_sde:
        out = step(traj.sde, v, z, sigma, sigma_next, noise=_sde_noise(generator, z), sigma_guard=traj.sigma_guard)
    else:
        out = step(ODE, v, z, sigma, sigma_next)
    traj.latents[:, k + 1] = out.next_z
    if out.log_prob is not None:
        traj.log_probs[:, k] = out.log_prob
    if traj.velocities is not None:  # asynchronous into pinned host memory; later copies are stream-ordered
        traj.velocities[:, k].copy_(v, non_blocking=traj.velocities.is_pinned())


@torch.no_grad()
def rollout(
    predict: Predict,
    cond: Any,
    noise: Tensor,
    sampler: SamplerConfig,
    *,
    sigmas: Tensor,
    sde_window: tuple[int, int] | None = None,
    generator: Generators = None,
    group_ids: Tensor | None = None,
    group_size: int = 1,
    velocities: KeptVelocities | None = None,
) -> Trajectory:
    """Sample B trajectories from ``noise`` [B, ...] (z_0) with ``cond`` (B rows).

    ``sampler`` gives the transition (its ``transition``) and the network timesteps (its
    ``quantize_timesteps``); ``sigmas`` [N+1] fix the schedule; the transition is taken at every
    step, or only in ``sde_window`` = (start, stop) with ODE steps elsewhere; ``generator`` (on the latents'
    device) draws the SDE noise: one for the batch, or one per block of B / len(generator) consecutive rows
    (e.g. per group, so a group's samples do not depend on which other groups share the batch);
    ``group_ids`` [B] default to one group per row; ``group_size``: rows come in consecutive blocks of this
    many that share z_0 and the conditioning, and the steps of the shared start run one row per block
    (module docstring; 1 = no sharing); ``velocities``: keep every v(z_k, t_k) there (None: keep none).
    """
    batch = noise.shape[0]
    _check_rows(batch, generator, group_size, group_ids)
    flags = stochastic_flags(sigmas.shape[0] - 1, sampler.transition, sde_window)  # python values: no tensor read
    stop = sde_window[1] if sde_window is not None and any(flags) else len(flags)  # N without a window or SDE step
    grid = after_window_grid(sigmas, stop, sampler.post_window) if stop < len(flags) else []  # read before any step
    traj = _empty_trajectory(noise, cond, flags, sampler, sigmas, group_ids)
    if velocities is not None:
        traj = replace(traj, velocities=velocities.buffer(traj.latents))
    shared = shared_start_steps(flags) if group_size > 1 else 0
    firsts = torch.arange(0, batch, group_size, device=noise.device)  # the first row of each group
    first_cond = cond.index(firsts) if shared else cond
    for k, is_sde in enumerate(flags[:stop]):
        z, t = traj.latents[:, k], traj.timesteps[k]
        if k < shared:  # the group's rows have one input: one row per group, broadcast to its G rows
            v = predict(z[firsts], t.expand(len(firsts)), first_cond).repeat_interleave(group_size, 0)
        else:
            v = predict(z, t.expand(batch), cond)
        _take_step(traj, k, v, is_sde=is_sde, generator=generator)
    if grid:
        _after_window(traj, predict, sampler, v, grid, stop)
    return traj


def _after_window(
    traj: Trajectory, predict: Predict, sampler: SamplerConfig, v: Tensor, grid: list[float], stop: int
) -> None:
    """The steps after a window that stops before step ``stop``, with the solver of ``sampler``'s ``post_window``
    on ``grid`` (``after_window_grid``: sigma_L of the window's last step, whose velocity is ``v``, then the points
    after it). On the sampling schedule's own points they fill the trajectory as any ODE step does (velocities
    kept, no log-prob); on a compressed one only the final z is stored, and the grid's latents in between are NaN
    (no state lies there)."""
    num_steps, last = traj.num_steps, len(grid) - 3  # the index of the last step after the window
    compressed = len(grid) - 1 < num_steps - stop + 1
    times = traj.timesteps[stop:]
    if compressed:
        times = tail_timesteps(grid[1:], sampler.quantize_timesteps).to(traj.timesteps)
        traj.latents[:, stop + 1 : num_steps] = math.nan
    z, history = traj.latents[:, stop], None  # history: the window's last x0 (none from sigma = 1: no log-SNR)
    if grid[0] < 1.0:
        history = (traj.latents[:, stop - 1] - grid[0] * v.to(z.dtype), grid[0])
    for i in range(last + 1):
        v = predict(z, times[i].expand(traj.batch_size), traj.cond)
        z, history = post_window_step(sampler.post_window.solver, v, z, grid[i + 1], grid[i + 2], history)
        z = z.to(traj.latents.dtype)
        if not compressed or i == last:
            traj.latents[:, num_steps if compressed else stop + i + 1] = z
        if traj.velocities is not None and not compressed:
            traj.velocities[:, stop + i].copy_(v, non_blocking=traj.velocities.is_pinned())


def transition(traj: Trajectory, k: int, v: Tensor, rows: Tensor | Sequence[int] | None = None) -> StepOutput:
    """Transition k of the stored trajectories re-scored under velocity ``v`` [B', ...] (B' =
    len(rows), or B): ``log_prob`` [B'] of the stored z_{k+1}, and ``mean``/``std`` for a KL term.
    Differentiable in ``v``."""
    if not bool(traj.stochastic[k]):
        raise ValueError(f"transition {k} is an ODE step; it has no log-probability to train on")
    z, next_z = traj.latents[:, k], traj.latents[:, k + 1]
    if rows is not None:
        rows = torch.as_tensor(rows, dtype=torch.long, device=z.device)
        z, next_z = z[rows], next_z[rows]
    return step(traj.sde, v, z, traj.sigmas[k], traj.sigmas[k + 1], next_z=next_z, sigma_guard=traj.sigma_guard)
