"""The update stage of one training step: stored transitions -> accumulated policy gradients.

Samples are processed in micro-batches of ``grpo.micro_batch`` rows. For each micro-batch the
trainable transitions are planned into groups of W (``train.jagg.plan_groups``) and each group
goes through ``train.jagg.backward_group`` with the real per-step loss

    L_k = PPO-clip(logp_theta(z_{k+1} | z_k), logp_old, A) + kl_beta * KL(mean_theta || mean_ref),

scaled by (rows / gradient_accumulation_steps) / (trained transitions), so that one optimizer
step sees the mean over its samples and their trained transitions.

The plan (which groups train, Flow-GRPO-Fast's window) is drawn from a generator shared by all
ranks, never a per-rank one: under FSDP every rank must run the same sequence of forward and
backward calls, or the collectives would deadlock.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from samplers.rollout import Trajectory, transition
from train.grpo import kl_to_reference, ppo_step_loss
from train.jagg import GroupPlan, StepLoss, backward_group, plan_groups
from train.jagg import Predict as GroupPredict  # (z, t) -> v: the conditioning is bound

Predict = Callable[[Tensor, Tensor, object], Tensor]  # (z [B, ...], t [B], cond) -> v


@dataclass
class UpdateStats:
    """Sums over one update stage; ``summary`` turns them into loggable means."""

    metric_sums: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    num_step_losses: int = 0
    grad_forwards: int = 0
    nograd_forwards: int = 0
    backward_calls: int = 0
    groups: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add_step(self, loss: Tensor, metrics: dict[str, Tensor]) -> None:
        self.metric_sums["loss"] += float(loss)
        for name, value in metrics.items():
            self.metric_sums[name] += float(value)
        self.num_step_losses += 1

    def summary(self) -> dict[str, float]:
        n = max(self.num_step_losses, 1)
        out = {f"train/{k}": v / n for k, v in self.metric_sums.items()}
        out.update(
            {
                "count/grad_forwards": self.grad_forwards,
                "count/nograd_forwards": self.nograd_forwards,
                "count/backward_calls": self.backward_calls,
            }
        )
        out.update({f"count/groups_{mode}": num for mode, num in self.groups.items()})
        return out


@dataclass(frozen=True)
class UpdateSettings:
    mode: str
    window: int
    jagg_frac: float
    timestep_fraction: float
    clip_range: float
    kl_beta: float
    gradient_accumulation_steps: int
    # update.jagg_frac=auto: the path of each group (start, stop) as measured by train/routing.py;
    # it replaces the jagg_frac rule, and a group it does not name takes the exact path.
    group_modes: Mapping[tuple[int, int], str] | None = None


def plan_for(traj: Trajectory, settings: UpdateSettings, generator: torch.Generator) -> list[GroupPlan]:
    trainable = torch.nonzero(traj.trainable).flatten().tolist()
    plan = plan_groups(
        trainable,
        window=settings.window,
        mode=settings.mode,
        jagg_frac=settings.jagg_frac,
        num_transitions=traj.num_transitions,
        timestep_fraction=settings.timestep_fraction,
        generator=generator,
    )
    if settings.group_modes is None:
        return plan
    return [replace(p, mode=settings.group_modes.get((p.start, p.stop), "exact")) for p in plan]


def _tiled(cond, rows: int):
    """Conditioning for a batched call over several steps: the micro-batch rows tiled."""
    reps = rows // cond.batch_size
    return cond if reps == 1 else type(cond).cat([cond] * reps)


@dataclass(frozen=True)
class GroupInputs:
    """The arguments of ``backward_group`` for one group [start, stop) of one micro-batch."""

    policy: GroupPredict  # (z [b, ...], t [b]) -> v, the micro-batch's conditioning tiled to b rows
    step_loss: StepLoss  # (j, v_j) -> the scaled GRPO loss of transition start + j
    z: list[Tensor]  # W latents [rows, ...]
    t: Tensor  # [W] network-input timesteps
    num_reference_forwards: int  # steps the KL reference ran (without grad) to build step_loss


def group_inputs(
    predict: Predict,
    traj: Trajectory,
    advantages: Tensor,
    rows: Tensor,
    group: tuple[int, int],
    settings: UpdateSettings,
    stats: UpdateStats,
    *,
    reference: Predict | None = None,
    scale: float = 1.0,
) -> GroupInputs:
    """The per-step GRPO loss of transitions [start, stop) of ``rows``, times ``scale``:

    L_k = PPO-clip(logp_theta(z_{k+1} | z_k), logp_old, A) + kl_beta * KL(mean_theta || mean_ref).
    Each evaluated step is added to ``stats``.
    """
    cond = traj.cond.index(rows)
    adv = advantages[rows]
    ks = list(range(*group))
    z = [traj.latents[rows, k] for k in ks]
    t = traj.timesteps[ks]
    ref_v = _reference_velocities(reference, z, t, cond) if settings.kl_beta > 0 else None

    def policy(z: Tensor, t: Tensor) -> Tensor:
        return predict(z, t, _tiled(cond, z.shape[0]))

    def step_loss(j: int, v: Tensor) -> Tensor:
        out = transition(traj, ks[j], v, rows)
        loss, metrics = ppo_step_loss(out.log_prob, traj.log_probs[rows, ks[j]], adv, clip_range=settings.clip_range)
        if ref_v is not None:
            ref_mean = transition(traj, ks[j], ref_v[j], rows).mean
            kl = kl_to_reference(out.mean, ref_mean, out.diffusion)
            loss = loss + settings.kl_beta * kl
            metrics = {**metrics, "kl": kl.detach()}
        stats.add_step(loss.detach(), metrics)
        return loss * scale

    return GroupInputs(policy, step_loss, z, t, len(ks) if ref_v is not None else 0)


def update_micro_batch(
    predict: Predict,
    traj: Trajectory,
    advantages: Tensor,
    rows: Tensor,
    plan: list[GroupPlan],
    settings: UpdateSettings,
    stats: UpdateStats,
    *,
    reference: Predict | None = None,
) -> None:
    """Accumulate the gradient of the micro-batch ``rows`` over the planned groups."""
    trained = sum(p.stop - p.start for p in plan)
    scale = (len(rows) / settings.gradient_accumulation_steps) / trained
    for group in plan:
        span = (group.start, group.stop)
        inputs = group_inputs(predict, traj, advantages, rows, span, settings, stats, reference=reference, scale=scale)
        result = backward_group(group.mode, inputs.policy, inputs.step_loss, inputs.z, inputs.t)
        stats.grad_forwards += result.grad_forwards
        stats.nograd_forwards += result.nograd_forwards + inputs.num_reference_forwards
        stats.backward_calls += result.backward_calls
        stats.groups[group.mode] += 1


@torch.no_grad()
def _reference_velocities(reference: Predict | None, z: list[Tensor], t: Tensor, cond) -> list[Tensor]:
    if reference is None:
        raise ValueError("grpo.kl_beta > 0 needs a reference policy")
    return [reference(z_j, t_j.expand(z_j.shape[0]), cond) for z_j, t_j in zip(z, t)]
