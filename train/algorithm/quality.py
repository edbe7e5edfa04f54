"""Gradient quality of a JAGG path per segment (the paper's Appendix E, Table 5), and the jagg_frac it gives.

The measurement behind the gradient-quality probe and the ``auto`` routing (train/algorithm/routing.py). For one
trajectory and one segment of W transitions [start, stop), with the update stage's own per-step GRPO loss
(``train.algorithm.update.StepLoss``: PPO clip + KL, on the rollout's advantage):

    g_exact = sum_j J_j^T s_j                        backward_segment("exact")
    g_mode                                           backward_segment(mode), mode = jagg by default
    cos = <g_mode, g_exact> / (|g_mode| |g_exact|)   rho = |g_mode| / |g_exact|

over every trainable parameter. A segment reports the mean and the sample standard deviation (n - 1)
of cos and rho over K trajectories. A trajectory whose exact gradient is zero (zero advantage) has no
cosine and is left out of that segment (``num_samples`` counts the others); a zero g_mode against a
nonzero g_exact counts as cos = 0, rho = 0.

The rule (the paper's): a segment qualifies when its mean cos >= threshold (0.5). The recommended
jagg_frac is the end of the run of qualifying segments that starts at the highest-noise segment, over M
(the trajectory's trainable transitions), so ``train.algorithm.segments.prefix_path`` sends exactly that
run to the path.
The paper then sets 0.6 for Flux where this rule gives 0.8, to stay clear of a high-variance segment;
the report carries the standard deviations for such a judgement.

torchrun + FSDP2: trajectory m is row m // R of rank m % R and is measured in a turn of all ranks.
FSDP's collectives need every rank to run the same forwards and backwards, so each rank runs the
segment on its own row m // R, but only the owner's loss has weight 1 (the others weight 0): the
reduce-scattered gradient is the owner's gradient / R, and cos and rho do not see the factor. Dot
products are over the full gradient: the local shards' products summed over ranks by the caller's
``Ranks.dots`` (as ``clip_grad_norm_`` sums its squares), accumulated in float64.

Staleness (``UpdateConfig.reuse_velocities`` = stale): after an optimizer step the rollout's velocities are
no longer the policy's. ``measure_staleness`` compares with g_exact both the fresh g_mode (middle
velocities recomputed) and g_mode on the trajectory's kept velocities, at the current weights, which the
caller has moved by an optimizer step first.

The probe writes ``.grad``: it needs empty gradients (None) and leaves them None, so nothing it
computes reaches an optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor, nn

from settings import check_range
from train.algorithm.jagg import BoundPredict, backward_segment
from train.algorithm.segments import Span, prefix_path, split_segments
from train.algorithm.update import StepLoss, UpdateBatch, bind, kept_velocities, reference_velocities, step_loss
from train.algorithm.update_config import UpdateMode

Samples = dict[Span, list[tuple[float, float]]]  # segment -> (cos, rho) per measured trajectory
T = TypeVar("T")


class Ranks(Protocol):
    """This process among the ranks, and the cross-rank reductions a measurement needs, given by the
    caller: the algorithm runs no collective of its own."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def dots(self, a: Sequence[Tensor | None], b: Sequence[Tensor | None]) -> tuple[float, float, float]:
        """(<a, a>, <b, b>, <a, b>) of two gradients given per parameter (None = zero), over all ranks."""
        ...

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        ...


def _clear(params: Sequence[nn.Parameter]) -> None:
    for p in params:
        p.grad = None


def compare_to_exact(
    policy: BoundPredict,
    loss: StepLoss,
    kept: Tensor | None,
    params: Sequence[nn.Parameter],
    paths: Sequence[tuple[str, bool]],
    ranks: Ranks,
) -> list[tuple[float, float]] | None:
    """(cos, rho) against the exact gradient of one segment (``loss``'s), per (mode, on the ``kept``
    velocities) path; None when g_exact = 0. The dot products are over all ranks (``ranks.dots``)."""
    backward_segment(UpdateMode.exact, policy, loss, loss.z, loss.timesteps)
    exact = [None if p.grad is None else p.grad.detach().clone() for p in params]
    _clear(params)
    out = []
    for mode, reuse in paths:
        backward_segment(mode, policy, loss, loss.z, loss.timesteps, velocities=kept if reuse else None)
        ee, mm, em = ranks.dots(exact, [p.grad for p in params])
        _clear(params)
        if ee == 0:
            return None
        out.append((0.0, 0.0) if mm == 0 else (em / math.sqrt(ee * mm), math.sqrt(mm / ee)))
    return out


def _measure(
    batch: UpdateBatch,
    params: Sequence[nn.Parameter],
    *,
    num_rollouts: int,
    paths: Sequence[tuple[str, bool]],
    ranks: Ranks,
) -> list[Samples]:
    """One ``Samples`` per path of ``compare_to_exact``, for trajectories 0 .. num_rollouts - 1.

    Trajectory m is row m // R of rank m % R (R ranks; every rank passes its own ``batch``).
    """
    world, rank = ranks.world_size, ranks.rank
    traj = batch.traj
    if num_rollouts > world * traj.batch_size:
        raise ValueError(f"asked for {num_rollouts} trajectories; the batch holds {traj.batch_size} per rank x {world}")
    assert all(p.grad is None for p in params), "the probe needs empty gradients (zero_grad(set_to_none=True))"
    reuse = any(on_kept for _, on_kept in paths)
    segments = split_segments(traj.trainable_steps(), batch.config.segment_length)
    samples: list[Samples] = [{segment: [] for segment in segments} for _ in paths]
    for m in range(num_rollouts):
        rows = torch.tensor([m // world], device=batch.advantages.device)
        weight = 1.0 if rank == m % world else 0.0
        policy = bind(batch.predict, traj.cond.index(rows))
        for segment in segments:
            reference = reference_velocities(batch, rows, segment)
            loss = step_loss(batch, rows, segment, scale=weight, reference=reference)
            kept = kept_velocities(traj, rows, segment) if reuse else None
            result = compare_to_exact(policy, loss, kept, params, paths, ranks)
            for per_path, value in zip(samples, result or []):
                per_path[segment].append(value)
    return samples


def measure_trajectories(
    batch: UpdateBatch, params: Sequence[nn.Parameter], *, num_rollouts: int, ranks: Ranks, mode: str = "jagg"
) -> Samples:
    """(cos, rho) of ``mode`` per segment of ``batch.config.segment_length`` for trajectories 0 .. num_rollouts - 1."""
    return _measure(batch, params, num_rollouts=num_rollouts, paths=[(mode, False)], ranks=ranks)[0]


def measure_staleness(
    batch: UpdateBatch, params: Sequence[nn.Parameter], *, num_rollouts: int, ranks: Ranks, mode: str = "jagg"
) -> tuple[Samples, Samples]:
    """(fresh, stale): (cos, rho) per segment of ``mode`` recomputing its middle velocities, and of ``mode``
    on the trajectory's kept velocities, both against the exact gradient at the current weights."""
    fresh, stale = _measure(batch, params, num_rollouts=num_rollouts, paths=[(mode, False), (mode, True)], ranks=ranks)
    return fresh, stale


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    if len(values) == 1:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


@dataclass(frozen=True)
class SegmentQuality:
    """Measured quality of one segment of transitions [start, stop), over its trajectories."""

    start: int
    stop: int
    t_first: float  # network-input timestep of the segment's first step (high noise = near 1)
    t_last: float  # of its last step
    cos: tuple[float, ...]  # cos(g_mode, g_exact), one per measured trajectory
    rho: tuple[float, ...]  # |g_mode| / |g_exact|, one per measured trajectory

    @property
    def num_samples(self) -> int:
        return len(self.cos)

    @property
    def cos_mean(self) -> float:
        return _mean_std(self.cos)[0]

    @property
    def cos_std(self) -> float:
        return _mean_std(self.cos)[1]

    @property
    def rho_mean(self) -> float:
        return _mean_std(self.rho)[0]

    @property
    def rho_std(self) -> float:
        return _mean_std(self.rho)[1]


def summarize_segments(
    samples: Mapping[Span, Sequence[tuple[float, float]]], timesteps: Tensor
) -> list[SegmentQuality]:
    """One ``SegmentQuality`` per segment, high noise first; ``timesteps`` [N] are the trajectory's t."""
    t = timesteps.detach().float().cpu().tolist()
    return [
        SegmentQuality(
            start=a,
            stop=b,
            t_first=t[a],
            t_last=t[b - 1],
            cos=tuple(c for c, _ in samples[(a, b)]),
            rho=tuple(r for _, r in samples[(a, b)]),
        )
        for a, b in sorted(samples)
    ]


def recommend_jagg_frac(segments: Sequence[SegmentQuality], *, threshold: float, num_transitions: int) -> float:
    """The paper's rule: stop of the last segment of the qualifying run from the highest noise, over M.

    A segment qualifies when its mean cosine is >= ``threshold`` (a segment without samples does not).
    """
    check_range(num_transitions, "num_transitions", low=1)
    stop = 0
    for segment in sorted(segments, key=lambda g: g.start):
        if not segment.cos_mean >= threshold:  # also stops at NaN (no sample)
            break
        stop = max(stop, segment.stop)
    return round(stop / num_transitions, 4)


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else value  # JSON null: a segment without samples


def _statistics(g: SegmentQuality) -> dict[str, Any]:
    return {
        "cos_mean": _finite(g.cos_mean),
        "cos_std": _finite(g.cos_std),
        "rho_mean": _finite(g.rho_mean),
        "rho_std": _finite(g.rho_std),
        "num_samples": g.num_samples,
    }


def probe_report(
    segments: Sequence[SegmentQuality],
    *,
    mode: str,
    threshold: float,
    num_transitions: int,
    staleness: tuple[Sequence[SegmentQuality], Sequence[SegmentQuality]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The JSON report: the recommendation, and per segment its statistics, samples and path under it.

    ``staleness``: (fresh, stale) per segment after an optimizer step (``measure_staleness``); each segment
    then reports both under ``after_step``.
    """
    frac = recommend_jagg_frac(segments, threshold=threshold, num_transitions=num_transitions)
    update_mode = UpdateMode(mode)
    rows: list[dict[str, Any]] = [
        {
            "segment": index,
            "start": g.start,
            "stop": g.stop,
            "t_first": g.t_first,
            "t_last": g.t_last,
            **_statistics(g),
            "qualifies": bool(g.cos_mean >= threshold),
            "path": prefix_path(g.start, g.stop, mode=update_mode, jagg_frac=frac, num_transitions=num_transitions),
            "cos": list(g.cos),
            "rho": list(g.rho),
        }
        for index, g in enumerate(segments)
    ]
    if staleness is not None:
        for row, fresh, stale in zip(rows, *staleness, strict=True):
            row["after_step"] = {"fresh": _statistics(fresh), "stale": _statistics(stale)}
    return {
        "mode": mode,
        "threshold": threshold,
        "num_transitions": num_transitions,
        "recommended_jagg_frac": frac,
        **extra,
        "segments": rows,
    }
