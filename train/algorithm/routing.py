"""Routing: which segments of W transitions a step trains, and which path each takes (``UpdateConfig.routing``).

A router routes the segments of one micro-batch: it picks ``int(timestep_fraction * num_segments)`` of
them with the step's shared generator (``train.algorithm.segments.pick_segments``) and gives each a path.

* ``prefix`` (``PrefixRouter``, the paper's rule): segment [k, k + W) takes the config's ``mode`` when
  k + W <= round(jagg_frac * M), M the trajectory's trainable transitions, and the exact path
  otherwise (``train.algorithm.segments.prefix_path``).
* ``auto`` (``AutoRouter``): every ``auto_every`` training steps (and on the first step it routes, a
  resumed run's too), before the update's first micro-batch, ``train.algorithm.quality.measure_trajectories``
  measures cos(g_mode, g_exact) per segment on ``auto_rollouts`` trajectories of the step's own
  rollout, with their advantages, under the current weights. Segment [start, stop) then takes
  ``mode`` while its mean cosine is >= ``auto_threshold``, and the exact path
  otherwise; the table holds until the next probe. A segment the last probe did not see (a
  Flow-GRPO-Fast window drawn elsewhere) takes the exact path.

Departure from the paper for ``auto``, where jagg_frac is fixed per model from an offline
measurement (Appendix E): the routing follows the policy as it trains, and is per segment instead of a
prefix of segments (``routing/rule_jagg_frac`` logs what the prefix rule would give).

Under FSDP every rank must route the same segments or the collectives deadlock. The cosines are global
quantities (equal on all ranks up to reduction order); rank 0's table is broadcast so the decision
is identical on every rank. The caller's ``Ranks`` (train/algorithm/quality.py) does both reductions.

Metrics of ``auto``, on probe steps: ``routing/cos_<start>_<stop>``, ``routing/rho_<start>_<stop>``
(means over the probe's trajectories), ``routing/<mode>_<start>_<stop>`` (1 = the segment takes
``mode``, 0 = exact) and ``routing/rule_jagg_frac``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch
from torch import nn

from samplers.rollout import Trajectory
from train.algorithm.quality import Ranks, measure_trajectories, recommend_jagg_frac, summarize_segments
from train.algorithm.segments import RoutedSegment, Span, pick_segments, route_segments
from train.algorithm.update import UpdateBatch
from train.algorithm.update_config import Routing, UpdateConfig, UpdateMode


class Router(abc.ABC):
    """Routes the segments of a trajectory; ``refresh`` lets a router measure before a step's update."""

    def __init__(self, update: UpdateConfig) -> None:
        self.update = update

    def due(self, step: int) -> bool:
        """Whether ``refresh`` measures something at ``step``."""
        return False

    def refresh(
        self, step: int, batch: UpdateBatch, params: Sequence[nn.Parameter], *, ranks: Ranks
    ) -> dict[str, float]:
        """Measure and re-route when ``due(step)``; returns the routing metrics. Needs empty gradients
        and leaves them empty. ``ranks``: the cross-rank reductions of the measurement."""
        return {}

    @abc.abstractmethod
    def route(self, traj: Trajectory, generator: torch.Generator | None) -> list[RoutedSegment]:
        """The segments one micro-batch trains, high noise first, each with its path."""


class PrefixRouter(Router):
    """``routing=prefix``: the segments ending at or before round(jagg_frac * M) take the mode's path."""

    def route(self, traj: Trajectory, generator: torch.Generator | None) -> list[RoutedSegment]:
        u = self.update
        return route_segments(
            traj.trainable_steps(),
            length=u.segment_length,
            mode=u.mode,
            jagg_frac=u.jagg_frac,
            num_transitions=traj.num_transitions,
            timestep_fraction=u.timestep_fraction,
            generator=generator,
        )


class AutoRouter(Router):
    """``routing=auto``: the routing table measured every ``auto_every`` steps."""

    def __init__(self, update: UpdateConfig) -> None:
        super().__init__(update)
        self.modes: dict[Span, UpdateMode] | None = None  # the last probe's table; None before the first

    def due(self, step: int) -> bool:
        return self.modes is None or step % self.update.auto_every == 0

    def refresh(
        self, step: int, batch: UpdateBatch, params: Sequence[nn.Parameter], *, ranks: Ranks
    ) -> dict[str, float]:
        if not self.due(step):
            return {}
        traj, u = batch.traj, self.update
        count = min(u.auto_rollouts, traj.batch_size * ranks.world_size)
        samples = measure_trajectories(batch, params, num_rollouts=count, mode=u.mode, ranks=ranks)
        segments = summarize_segments(samples, traj.timesteps)
        # a segment without samples has a NaN mean cosine: exact
        table = {(s.start, s.stop): u.mode if s.cos_mean >= u.auto_threshold else UpdateMode.exact for s in segments}
        self.modes = ranks.broadcast(table)
        out: dict[str, float] = {}
        for s in segments:
            key = f"{s.start:02d}_{s.stop:02d}"
            out[f"routing/cos_{key}"] = s.cos_mean
            out[f"routing/rho_{key}"] = s.rho_mean
            out[f"routing/{u.mode}_{key}"] = float(self.modes[(s.start, s.stop)] == u.mode)
        rule = recommend_jagg_frac(segments, threshold=u.auto_threshold, num_transitions=traj.num_transitions)
        return out | {"routing/rule_jagg_frac": rule}

    def route(self, traj: Trajectory, generator: torch.Generator | None) -> list[RoutedSegment]:
        if self.modes is None:
            raise RuntimeError("AutoRouter.route before the first refresh: the routing table is empty")
        segments = pick_segments(
            traj.trainable_steps(),
            length=self.update.segment_length,
            timestep_fraction=self.update.timestep_fraction,
            generator=generator,
        )
        return [RoutedSegment(a, b, self.modes.get((a, b), UpdateMode.exact)) for a, b in segments]


def build_router(update: UpdateConfig) -> Router:
    """The router that the ``routing`` of ``update`` (an ``UpdateConfig``) names."""
    return AutoRouter(update) if update.routing is Routing.auto else PrefixRouter(update)
