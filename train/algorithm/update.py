"""The update stage of one training step: stored transitions -> accumulated policy gradients.

Samples are processed in micro-batches of ``grpo.micro_batch`` rows. For each micro-batch the
trainable transitions are planned into groups of W (train/algorithm/routing.py: which groups train and which
path each takes) and each group goes through ``train.algorithm.jagg.backward_group`` with the real per-step
loss

    L_k = PPO-clip(logp_theta(z_{k+1} | z_k), logp_old, A) + kl_beta * KL(mean_theta || mean_ref),

scaled by (rows / gradient_accumulation_steps) / (trained transitions), so that one optimizer
step sees the mean over its samples and their trained transitions. The KL reference runs one
batched no-grad call per group, over its W steps. A jagg or jagg_sequential group takes its middle
steps' velocities from the rollout when the caller says they are still valid
(``update.reuse_velocities``, train/step.py) instead of recomputing them. The step loss is a value:
it returns (scaled loss, metrics) and ``backward_group`` hands the metrics back per step, where
``UpdateStats`` sums them; its summary is over all ranks (means over every sample, maxima and
minima where the name says so), so the logged curves do not depend on the number of ranks.

The plan (which groups train, Flow-GRPO-Fast's window) is drawn from a generator shared by all
ranks, never a per-rank one: under FSDP every rank must run the same sequence of forward and
backward calls, or the collectives would deadlock.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from samplers.rollout import Predict, Trajectory, transition
from train.algorithm.groups import RoutedGroup
from train.algorithm.grpo import kl_to_reference, ppo_step_loss
from train.algorithm.jagg import MIDDLE_MODES, BoundPredict, GroupStats, Metrics, StepLoss, backward_group
from train.distributed.collectives import all_reduce_max, all_reduce_sum


@dataclass(frozen=True)
class UpdateSettings:
    mode: str  # the JAGG path of a routed group: exact | jagg | jagg_sequential | ablate
    window: int  # W
    timestep_fraction: float
    clip_range: float
    kl_beta: float
    gradient_accumulation_steps: int
    reuse_velocities: str = "fresh"  # fresh | stale | off (train/components/config.py, update.reuse_velocities)

    @property
    def keeps_velocities(self) -> bool:
        """Whether the rollout keeps its velocities: only a path with middle steps (W > 2) reuses them."""
        return self.reuse_velocities != "off" and self.mode in MIDDLE_MODES and self.window > 2


@dataclass(frozen=True)
class UpdateBatch:
    """A step's rollout with its advantages, and the policies that train on it."""

    traj: Trajectory
    advantages: Tensor  # [B], one per row of traj
    predict: Predict  # the policy being trained: (z, t, cond) -> v
    reference: Predict | None  # the KL reference; needed when settings.kl_beta > 0
    settings: UpdateSettings


@dataclass
class UpdateStats:
    """What one rank's update stage computed; ``summary`` reduces it over all ranks.

    A step metric m of a micro-batch of b rows enters its sum as b * m and b enters the row count, so
    a logged mean is over every sample of every rank; a metric named ``*_max`` (``*_min``) logs the
    largest (smallest) value of any step on any rank. The ``count/*`` counters are totals over ranks.
    """

    sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # sum of rows * value
    maxima: dict[str, float] = field(default_factory=dict)  # the *_max metrics
    minima: dict[str, float] = field(default_factory=dict)  # the *_min metrics
    num_rows: int = 0  # rows of every evaluated step: the denominator of the means
    grad_forwards: int = 0
    nograd_forwards: int = 0
    backward_calls: int = 0
    reused_velocities: int = 0
    groups: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add_group(self, mode: str, result: GroupStats, *, rows: int, reference_forwards: int = 0) -> None:
        """Count one ``backward_group`` call over ``rows`` rows and add the metrics of every step it evaluated."""
        for metrics in result.metrics.values():
            for name, value in metrics.items():
                self._add(name, float(value), rows)
            self.num_rows += rows
        self.grad_forwards += result.grad_forwards
        self.nograd_forwards += result.nograd_forwards + reference_forwards
        self.backward_calls += result.backward_calls
        self.reused_velocities += result.reused_velocities
        self.groups[mode] += 1

    def _add(self, name: str, value: float, rows: int) -> None:
        if name.endswith("_max"):
            self.maxima[name] = max(self.maxima.get(name, -math.inf), value)
        elif name.endswith("_min"):
            self.minima[name] = min(self.minima.get(name, math.inf), value)
        else:
            self.sums[name] += rows * value

    def merge(self, other: UpdateStats) -> None:
        for name, value in other.sums.items():
            self.sums[name] += value
        for name, value in other.maxima.items():
            self.maxima[name] = max(self.maxima.get(name, -math.inf), value)
        for name, value in other.minima.items():
            self.minima[name] = min(self.minima.get(name, math.inf), value)
        for mode, num in other.groups.items():
            self.groups[mode] += num
        self.num_rows += other.num_rows
        self.grad_forwards += other.grad_forwards
        self.nograd_forwards += other.nograd_forwards
        self.backward_calls += other.backward_calls
        self.reused_velocities += other.reused_velocities

    def summary(self, device: torch.device) -> dict[str, float]:
        """The logged metrics, over all ranks (two collectives; every rank must call it with the same
        metric names, as every rank runs the same plan). ``device`` holds the reduced tensors."""
        counters = {
            "count/grad_forwards": self.grad_forwards,
            "count/nograd_forwards": self.nograd_forwards,
            "count/backward_calls": self.backward_calls,
            "count/reused_velocities": self.reused_velocities,
        }
        counters |= {f"count/groups_{mode}": num for mode, num in sorted(self.groups.items())}
        mean_names, max_names, min_names = sorted(self.sums), sorted(self.maxima), sorted(self.minima)
        totals = [*(self.sums[n] for n in mean_names), *counters.values(), self.num_rows]
        summed = all_reduce_sum(torch.tensor(totals, dtype=torch.float64, device=device)).tolist()
        extremes = [*(self.maxima[n] for n in max_names), *(-self.minima[n] for n in min_names)]
        largest = all_reduce_max(torch.tensor(extremes, dtype=torch.float64, device=device)).tolist()
        num_rows = max(summed[-1], 1.0)
        out = {f"train/{name}": total / num_rows for name, total in zip(mean_names, summed)}
        out |= {f"train/{name}": value for name, value in zip(max_names, largest)}
        out |= {f"train/{name}": -value for name, value in zip(min_names, largest[len(max_names) :])}
        out |= {name: int(total) for name, total in zip(counters, summed[len(mean_names) :])}
        return out


def _tiled(cond, rows: int):
    """Conditioning for a batched call over several steps: the micro-batch rows tiled."""
    reps = rows // cond.batch_size
    return cond if reps == 1 else type(cond).cat([cond] * reps)


@dataclass(frozen=True)
class GroupInputs:
    """The arguments of ``backward_group`` for one group [start, stop) of one micro-batch."""

    policy: BoundPredict  # (z [b, ...], t [b]) -> v, the micro-batch's conditioning tiled to b rows
    step_loss: StepLoss  # (j, v_j) -> (scaled GRPO loss of transition start + j, its metrics)
    z: list[Tensor]  # W latents [rows, ...]
    t: Tensor  # [W] network-input timesteps
    num_reference_forwards: int  # steps the KL reference ran (without grad) to build step_loss
    velocities: Tensor | None  # [W, rows, ...] the rollout's v of these steps, when asked for (maybe on the host)


def group_inputs(
    batch: UpdateBatch, rows: Tensor, group: tuple[int, int], *, scale: float = 1.0, velocities: bool = False
) -> GroupInputs:
    """The per-step GRPO loss of transitions [start, stop) of ``rows``, times ``scale``:

    L_k = PPO-clip(logp_theta(z_{k+1} | z_k), logp_old, A) + kl_beta * KL(mean_theta || mean_ref).
    Its metrics: ``loss`` (L_k before scaling), ``kl`` with a KL term, and ``ppo_step_loss``'s.
    ``velocities``: hand back the trajectory's kept velocities of these steps too (it must hold them).
    """
    traj, settings = batch.traj, batch.settings
    cond = traj.cond.index(rows)
    adv = batch.advantages[rows]
    ks = list(range(*group))
    z = [traj.latents[rows, k] for k in ks]
    t = traj.timesteps[ks]
    ref_v = _reference_velocities(batch.reference, z, t, cond) if settings.kl_beta > 0 else None
    kept = None
    if velocities:
        if traj.velocities is None:
            raise ValueError("the rollout kept no velocities to reuse (rollout(..., keep_velocities=True))")
        kept = traj.velocities[rows.to(traj.velocities.device), group[0] : group[1]].transpose(0, 1)

    def policy(z: Tensor, t: Tensor) -> Tensor:
        return batch.predict(z, t, _tiled(cond, z.shape[0]))

    def step_loss(j: int, v: Tensor) -> tuple[Tensor, Metrics]:
        out = transition(traj, ks[j], v, rows)
        assert out.log_prob is not None  # transition() refuses ODE steps
        loss, metrics = ppo_step_loss(out.log_prob, traj.log_probs[rows, ks[j]], adv, clip_range=settings.clip_range)
        if ref_v is not None:
            ref_mean = transition(traj, ks[j], ref_v[j], rows).mean
            kl = kl_to_reference(out.mean, ref_mean, out.diffusion)
            loss = loss + settings.kl_beta * kl
            metrics = {**metrics, "kl": kl.detach()}
        return loss * scale, {"loss": loss.detach(), **metrics}

    return GroupInputs(policy, step_loss, z, t, len(ks) if ref_v is not None else 0, kept)


def update_micro_batch(
    batch: UpdateBatch, rows: Tensor, plan: list[RoutedGroup], *, reuse_velocities: bool = False
) -> UpdateStats:
    """Accumulate into ``.grad`` the gradient of the micro-batch ``rows`` over the planned groups.

    ``reuse_velocities``: the weights are those that produced the trajectory's kept velocities (or the
    caller accepts stale ones); the jagg and jagg_sequential groups then take their middle steps' v
    from them instead of recomputing.
    """
    trained = sum(p.stop - p.start for p in plan)
    scale = (len(rows) / batch.settings.gradient_accumulation_steps) / trained
    stats = UpdateStats()
    for group in plan:
        result, reference_forwards = update_group(batch, rows, group, scale=scale, reuse_velocities=reuse_velocities)
        stats.add_group(group.mode, result, rows=len(rows), reference_forwards=reference_forwards)
    return stats


def update_group(
    batch: UpdateBatch, rows: Tensor, group: RoutedGroup, *, scale: float, reuse_velocities: bool = False
) -> tuple[GroupStats, int]:
    """One planned group of the micro-batch ``rows`` through ``backward_group`` on the GRPO loss times
    ``scale``: (what it did, the steps the KL reference ran). Reads no tensor's value, so
    ``python -m train.plan`` traces it on fake tensors."""
    reuse = reuse_velocities and group.mode in MIDDLE_MODES
    inputs = group_inputs(batch, rows, (group.start, group.stop), scale=scale, velocities=reuse)
    result = backward_group(
        group.mode, inputs.policy, inputs.step_loss, inputs.z, inputs.t, velocities=inputs.velocities
    )
    return result, inputs.num_reference_forwards


@torch.no_grad()
def _reference_velocities(reference: Predict | None, z: list[Tensor], t: Tensor, cond) -> list[Tensor]:
    """The reference's v of the W steps, from one batched call over them (one FSDP gather per module)."""
    if reference is None:
        raise ValueError("grpo.kl_beta > 0 needs a reference policy")
    rows = z[0].shape[0]
    v = reference(torch.cat(z), torch.cat([t_j.expand(rows) for t_j in t]), _tiled(cond, len(z) * rows))
    return list(v.split(rows))
