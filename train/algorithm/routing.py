"""Routing: which groups of W transitions a step trains, and which path each takes (``update.routing``).

A router plans the groups of one micro-batch: it picks ``int(timestep_fraction * num_groups)`` of
them with the step's shared generator (``train.algorithm.jagg.pick_groups``) and gives each a path.

* ``prefix`` (``PrefixRouter``, the paper's rule): group [k, k + W) takes ``update.mode`` when
  k + W <= round(update.jagg_frac * M), M the trajectory's trainable transitions, and the exact path
  otherwise (``train.algorithm.groups.prefix_path``).
* ``auto`` (``AutoRouter``): every ``update.auto_every`` training steps (and on the first step of a
  run or of a resume), before the update's first micro-batch, ``train.algorithm.probe.measure_trajectories``
  measures cos(g_mode, g_exact) per group on ``update.auto_rollouts`` trajectories of the step's own
  rollout, with their advantages, under the current weights. Group [start, stop) then takes
  ``update.mode`` while its mean cosine is >= ``update.auto_threshold``, and the exact path
  otherwise; the table holds until the next probe. A group the last probe did not see (a
  Flow-GRPO-Fast window drawn elsewhere) takes the exact path.

Departure from the paper for ``auto``, where jagg_frac is fixed per model from an offline
measurement (Appendix E): the routing follows the policy as it trains, and is per group instead of a
prefix of groups (``routing/rule_jagg_frac`` logs what the prefix rule would give).

Under FSDP every rank must plan the same groups or the collectives deadlock. The cosines are global
quantities (equal on all ranks up to reduction order); rank 0's table is broadcast so the decision
is identical on every rank.

Metrics of ``auto``, on probe steps: ``routing/cos_<start>_<stop>``, ``routing/rho_<start>_<stop>``
(means over the probe's trajectories), ``routing/<mode>_<start>_<stop>`` (1 = the group takes
update.mode, 0 = exact) and ``routing/rule_jagg_frac``. The probe's time is ``time/probe``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch
from torch import nn

from samplers.rollout import Trajectory
from train.algorithm.groups import Group, RoutedGroup, pick_groups, route_groups
from train.algorithm.probe import GroupQuality, measure_trajectories, recommend_jagg_frac, summarize_groups
from train.algorithm.update import UpdateBatch
from train.distributed.collectives import broadcast_object, get_world_size

ROUTINGS = ("prefix", "auto")  # update.routing


class Router(abc.ABC):
    """Plans the groups of a trajectory; ``refresh`` lets a router measure before a step's update."""

    def __init__(self, *, mode: str, window: int, timestep_fraction: float) -> None:
        self.mode, self.window, self.timestep_fraction = mode, window, timestep_fraction

    def due(self, step: int) -> bool:
        """Whether ``refresh`` measures something at ``step``."""
        return False

    def refresh(self, step: int, batch: UpdateBatch, params: Sequence[nn.Parameter]) -> dict[str, float]:
        """Measure and re-route when ``due(step)``; returns the routing metrics. Needs empty gradients
        and leaves them empty."""
        return {}

    @abc.abstractmethod
    def plan(self, traj: Trajectory, generator: torch.Generator | None) -> list[RoutedGroup]:
        """The groups one micro-batch trains, high noise first, each with its path."""


class PrefixRouter(Router):
    """``update.routing=prefix``: the groups ending at or before round(jagg_frac * M) take the mode's path."""

    def __init__(self, *, mode: str, window: int, timestep_fraction: float, jagg_frac: float) -> None:
        super().__init__(mode=mode, window=window, timestep_fraction=timestep_fraction)
        self.jagg_frac = jagg_frac

    def plan(self, traj: Trajectory, generator: torch.Generator | None) -> list[RoutedGroup]:
        return route_groups(
            traj.trainable_steps(),
            window=self.window,
            mode=self.mode,
            jagg_frac=self.jagg_frac,
            num_transitions=traj.num_transitions,
            timestep_fraction=self.timestep_fraction,
            generator=generator,
        )


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


class AutoRouter(Router):
    """``update.routing=auto``: the routing table measured every ``every`` steps."""

    def __init__(
        self, *, mode: str, window: int, timestep_fraction: float, every: int, threshold: float, num_rollouts: int
    ) -> None:
        if mode == "exact":
            raise ValueError("update.routing=auto routes between update.mode and exact: pick update.mode=jagg")
        if every < 1 or num_rollouts < 1:
            raise ValueError(f"update.auto_every ({every}) and update.auto_rollouts ({num_rollouts}) must be >= 1")
        super().__init__(mode=mode, window=window, timestep_fraction=timestep_fraction)
        self.every, self.threshold, self.num_rollouts = every, threshold, num_rollouts
        self.modes: dict[Group, str] | None = None  # the last probe's table; None before the first

    def due(self, step: int) -> bool:
        return self.modes is None or step % self.every == 0

    def refresh(self, step: int, batch: UpdateBatch, params: Sequence[nn.Parameter]) -> dict[str, float]:
        if not self.due(step):
            return {}
        traj = batch.traj
        count = min(self.num_rollouts, traj.batch_size * get_world_size())
        samples = measure_trajectories(batch, params, num_rollouts=count, mode=self.mode)
        groups = summarize_groups(samples, traj.timesteps)
        self.modes = broadcast_object(route_by_cosine(groups, threshold=self.threshold, mode=self.mode))
        return routing_metrics(
            groups, self.modes, mode=self.mode, threshold=self.threshold, num_transitions=traj.num_transitions
        )

    def plan(self, traj: Trajectory, generator: torch.Generator | None) -> list[RoutedGroup]:
        if self.modes is None:
            raise RuntimeError("AutoRouter.plan before the first refresh: the routing table is empty")
        groups = pick_groups(
            traj.trainable_steps(), window=self.window, timestep_fraction=self.timestep_fraction, generator=generator
        )
        return [RoutedGroup(a, b, self.modes.get((a, b), "exact")) for a, b in groups]
