"""``update.jagg_frac=auto``: route each group by the gradient quality measured on the current policy.

Every ``update.auto_every`` training steps (and on the first step of a run or of a resume), before
the update's first micro-batch, ``train.grad_quality.measure_trajectories`` measures
cos(g_mode, g_exact) per group on ``update.auto_rollouts`` trajectories of the step's own rollout,
with their advantages, under the current weights. Group [start, stop) then takes ``update.mode``
while its mean cosine is >= ``update.auto_threshold``, and the exact path otherwise; the table holds
until the next probe. A group the last probe did not see (a Flow-GRPO-Fast window drawn elsewhere)
takes the exact path.

Departure from the paper, where jagg_frac is fixed per model from an offline measurement
(Appendix E): the routing follows the policy as it trains, and is per group instead of a prefix of
groups (``routing/rule_jagg_frac`` logs what the prefix rule would give).

Under FSDP every rank must plan the same groups or the collectives deadlock. The cosines are global
quantities (equal on all ranks up to reduction order); rank 0's table is broadcast so the decision
is identical on every rank.

Metrics, on probe steps: ``routing/cos_<start>_<stop>``, ``routing/rho_<start>_<stop>`` (means over
the probe's trajectories), ``routing/<mode>_<start>_<stop>`` (1 = the group takes update.mode,
0 = exact) and ``routing/rule_jagg_frac``. The probe's time is ``time/probe``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from torch import Tensor, nn

from samplers.rollout import Trajectory
from train.config import UpdateConfig
from train.distributed import broadcast_object, get_world_size
from train.grad_quality import GroupQuality, measure_trajectories, recommend_jagg_frac, summarize_groups
from train.update import Predict, UpdateSettings

Group = tuple[int, int]


def route_by_cosine(groups: Sequence[GroupQuality], *, threshold: float, mode: str) -> dict[Group, str]:
    """``mode`` for every group whose mean cosine is >= ``threshold``, else exact (also with no sample)."""
    return {(g.start, g.stop): mode if g.cos_mean >= threshold else "exact" for g in groups}


def routing_metrics(
    groups: Sequence[GroupQuality], modes: dict[Group, str], *, mode: str, threshold: float, num_transitions: int
) -> dict[str, float]:
    out: dict[str, float] = {}
    for g in groups:
        key = f"{g.start:02d}_{g.stop:02d}"
        out[f"routing/cos_{key}"] = g.cos_mean
        out[f"routing/rho_{key}"] = g.rho_mean
        out[f"routing/{mode}_{key}"] = float(modes[(g.start, g.stop)] == mode)
    out["routing/rule_jagg_frac"] = recommend_jagg_frac(groups, threshold=threshold, num_transitions=num_transitions)
    return out


class AutoRouter:
    """The routing table of ``update.jagg_frac=auto`` and when to re-measure it."""

    def __init__(self, *, mode: str, every: int, threshold: float, num_rollouts: int) -> None:
        if mode == "exact":
            raise ValueError("update.jagg_frac=auto routes between update.mode and exact: pick update.mode=jagg")
        if every < 1 or num_rollouts < 1:
            raise ValueError(f"update.auto_every ({every}) and update.auto_rollouts ({num_rollouts}) must be >= 1")
        self.mode, self.every, self.threshold, self.num_rollouts = mode, every, threshold, num_rollouts
        self.modes: dict[Group, str] | None = None  # the last probe's table; None before the first

    @classmethod
    def from_config(cls, update: UpdateConfig) -> AutoRouter:
        u = update
        return cls(mode=u.mode, every=u.auto_every, threshold=u.auto_threshold, num_rollouts=u.auto_rollouts)

    def due(self, step: int) -> bool:
        return self.modes is None or step % self.every == 0

    def refresh(
        self,
        step: int,
        predict: Predict,
        traj: Trajectory,
        advantages: Tensor,
        params: Sequence[nn.Parameter],
        settings: UpdateSettings,
        *,
        reference: Predict | None = None,
    ) -> dict[str, float]:
        """Probe and re-route when ``due(step)``; returns the routing metrics ({} when not due).

        Call with empty gradients, before the update's first micro-batch; they are left empty.
        """
        if not self.due(step):
            return {}
        count = min(self.num_rollouts, traj.batch_size * get_world_size())
        samples = measure_trajectories(
            predict, traj, advantages, params, settings, num_rollouts=count, mode=self.mode, reference=reference
        )
        groups = summarize_groups(samples, traj.timesteps)
        self.modes = broadcast_object(route_by_cosine(groups, threshold=self.threshold, mode=self.mode))
        return routing_metrics(
            groups, self.modes, mode=self.mode, threshold=self.threshold, num_transitions=traj.num_transitions
        )

    def apply(self, settings: UpdateSettings) -> UpdateSettings:
        """``settings`` with the table in place of the jagg_frac rule (call after a first ``refresh``)."""
        if self.modes is None:
            raise RuntimeError("AutoRouter.apply before the first refresh: the routing table is empty")
        return replace(settings, group_modes=dict(self.modes))
