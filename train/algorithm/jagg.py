"""The update paths of one segment of W consecutive denoising steps (``backward_segment``).

For step j of a segment, L_j(v_j) is the per-step loss, v_j = model(z_j, t_j) the velocity, J_j its
Jacobian with respect to the parameters and s_j = dL_j/dv_j, taken on a detached copy of v_j (no
transformer backward). z_j carries no gradient (the per-step REINFORCE approximation).

    exact            sum_j J_j^T s_j                            W forwards with grad, W backwards
    exact_batched    same as exact                              the W steps in one batched forward
                                                                with grad, one backward
    jagg             J_0^T s_base + J_{W-1}^T s_corr            W-2 no-grad forwards (one batched
                                                                call, or none with ``velocities``),
                                                                both endpoints in one batched
                                                                forward, one backward
    jagg_sequential  same as jagg                               endpoint 0 forward+backward, then
                                                                endpoint W-1: one graph alive
    ablate           J_0^T s_0 + J_{W-1}^T s_{W-1}              endpoints only, one backward

with alpha_j = (t_0 - t_j) / (t_0 - t_{W-1}) over the network-input timesteps,
s_base = sum_j (1 - alpha_j) s_j and s_corr = sum_j alpha_j s_j. JAGG is exact when v is linear
in (z, t) and the W points lie on the affine path between the endpoints (the paper's Theorem 1).
PPO clipping needs no special case: a clipped step has s_j = 0.

The middle steps' v_j only feed s_j. ``velocities`` hands them in (the rollout's, while the weights are
still those that sampled it): jagg and jagg_sequential then run no middle forward at all, and their
gradient is the recomputing one up to float rounding (the rollout ran other batch shapes).

``exact_batched`` gives exact's gradient from one forward over the W steps with grad and one backward
(fewer FSDP2 all-gathers: 2n instead of 2Wn for n sharded modules; about W times the activations).

The shared start: when step 0's v comes from elsewhere (``start``, v_0 [B, ...] detached, computed once
for rows that share their input), a path runs no forward of step 0 and leaves its backward to the
caller: ``SegmentStats.start_upstream`` holds d(sum_j L_j)/dv_0 [B, ...], and the caller's one backward of
the shared forward gives J_0^T of its sum over the rows that share (train/algorithm/update.py).

Departure from the paper's Algorithm 1: the two endpoints run as one batched forward, so under
FSDP2 each sharded module is all-gathered once in the forward and once in the backward.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

from samplers.sde import compute_dtype
from train.algorithm.metrics import Metric
from train.algorithm.update_config import MIDDLE_MODES, UpdateMode

UPDATE_MODES = tuple(mode.value for mode in UpdateMode)
EXACT_BATCHED = "exact_batched"  # the exact gradient from one batched forward and one backward (update.exact_batched)

BoundPredict = Callable[[Tensor, Tensor], Tensor]  # (z [B, ...], t [B]) -> v [B, ...]: the conditioning is bound
Metrics = dict[str, Metric]  # name -> a detached scalar and its reduction
Velocities = Sequence[Tensor] | Tensor  # W tensors [B, ...], or one [W, B, ...]: v_j at the current weights
LossFn = Callable[[int, Tensor], tuple[Tensor, Metrics]]  # (j, v_j [B, ...]) -> (scalar loss of step j, metrics)
# A path: yields (j, v_j) for each step it evaluates and receives L_j back (backward_segment calls the loss).
Path = Generator[tuple[int, Tensor], Tensor, None]


@dataclass(frozen=True)
class Counts:
    """What a piece of the update ran; forwards are in steps (rows of B each). Counts add."""

    grad_forwards: int = 0
    nograd_forwards: int = 0
    backward_calls: int = 0
    reused_velocities: int = 0  # middle steps whose v came from ``velocities`` instead of a forward
    # the shared start's saving (train/algorithm/update.py, samplers/rollout.py), in rows of one step:
    shared_start_forward_rows: int = 0  # rows of no-grad forwards not run (rollout, KL reference)
    shared_start_grad_rows: int = 0  # rows of forwards with grad, and of their backward, not run

    def __add__(self, other: Counts) -> Counts:
        return Counts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass
class SegmentStats:
    """What one ``backward_segment`` call did."""

    losses: dict[int, Tensor] = field(default_factory=dict)  # step j -> detached scalar L_j
    metrics: dict[int, Metrics] = field(default_factory=dict)  # step j -> what step_loss reported for it
    counts: Counts = Counts()
    start_upstream: Tensor | None = None  # with ``start``: d(sum_j L_j)/dv_0 [B, ...], for the caller's backward


def interpolation_weights(t: Tensor) -> Tensor:
    """alpha_j = (t_0 - t_j) / (t_0 - t_{W-1}) for the W network-input timesteps t [W].

    Reads no value: a segment whose first and last timesteps are equal (alpha undefined) cannot be
    drawn, as ``split_segments`` cuts segments from distinct transitions of a decreasing schedule."""
    if t.ndim != 1 or t.shape[0] < 2:
        raise ValueError(f"t must be [W] with W >= 2, got shape {tuple(t.shape)}")
    return (t[0] - t) / (t[0] - t[-1])


def aggregate(s: Sequence[Tensor], t: Tensor) -> tuple[Tensor, Tensor]:
    """(s_base, s_corr) = (sum_j (1 - alpha_j) s_j, sum_j alpha_j s_j)."""
    if len(s) != t.shape[0]:
        raise ValueError(f"got {len(s)} upstream gradients for {t.shape[0]} timesteps")
    alpha = interpolation_weights(t)
    s_base = sum((1 - a) * s_j for a, s_j in zip(alpha, s))
    s_corr = sum(a * s_j for a, s_j in zip(alpha, s))
    return s_base, s_corr


def _rows(t_j: Tensor, batch: int) -> Tensor:
    return t_j.expand(batch)


def _forward(predict: BoundPredict, zs: Sequence[Tensor], ts: Sequence[Tensor] | Tensor) -> list[Tensor]:
    """One batched call of ``predict`` over several steps; returns one v per step."""
    batch = zs[0].shape[0]
    v = predict(torch.cat(list(zs)), torch.cat([_rows(t_j, batch) for t_j in ts]))
    return list(v.split(batch))


def _upstream(j: int, v: Tensor) -> Generator[tuple[int, Tensor], Tensor, Tensor]:
    """s_j = dL_j/dv_j on a detached proxy of v (no model backward).

    The proxy is float32 for half-precision models (the SDE log-prob needs it) and keeps float64.
    """
    proxy = v.detach().to(compute_dtype(v.dtype)).requires_grad_(True)
    loss = yield j, proxy
    if not loss.requires_grad:  # the loss does not depend on v (e.g. zero advantage folded to a constant)
        return torch.zeros_like(proxy)
    (s,) = torch.autograd.grad(loss, proxy, materialize_grads=True)
    return s


def _given_start(start: Tensor | None, stats: SegmentStats) -> Generator[tuple[int, Tensor], Tensor, Tensor | None]:
    """s_0 on the given v_0 (``start``), None without one: step 0's forward ran elsewhere."""
    if start is None:
        return None
    s0 = yield from _upstream(0, start)
    stats.start_upstream = s0
    return s0


def _exact(
    predict: BoundPredict,
    z: Sequence[Tensor],
    t: Tensor,
    stats: SegmentStats,
    velocities: Sequence[Tensor] | None,
    start: Tensor | None,
) -> Path:
    """Each step's forward with grad and its backward (``velocities`` are not needed)."""
    first = 0 if (yield from _given_start(start, stats)) is None else 1
    for j in range(first, len(z)):
        v = predict(z[j], _rows(t[j], z[j].shape[0]))
        stats.counts += Counts(grad_forwards=1)
        loss = yield j, v
        if loss.requires_grad:
            loss.backward()
            stats.counts += Counts(backward_calls=1)


def _exact_batched(
    predict: BoundPredict,
    z: Sequence[Tensor],
    t: Tensor,
    stats: SegmentStats,
    velocities: Sequence[Tensor] | None,
    start: Tensor | None,
) -> Path:
    """exact's gradient sum_j J_j^T s_j from one batched forward with grad over the steps and one backward."""
    first = 0 if (yield from _given_start(start, stats)) is None else 1
    v = _forward(predict, z[first:], t[first:])
    stats.counts += Counts(grad_forwards=len(v))
    s = []
    for j, v_j in enumerate(v, start=first):
        s.append((yield from _upstream(j, v_j)))
    torch.autograd.backward(v, [s_j.to(v_j.dtype) for s_j, v_j in zip(s, v)])
    stats.counts += Counts(backward_calls=1)


def _middle(
    predict: BoundPredict, z: Sequence[Tensor], t: Tensor, stats: SegmentStats, velocities: Sequence[Tensor] | None
) -> Generator[tuple[int, Tensor], Tensor, list[Tensor]]:
    """s_j of the W-2 middle steps: on the given velocities, or from one batched no-grad forward."""
    width = len(z)
    if width == 2:
        return []
    if velocities is not None:  # possibly offloaded to host memory: each comes to its latent's device
        v_mid = [v_j.to(z_j.device, non_blocking=True) for v_j, z_j in zip(velocities[1:-1], z[1:-1])]
        stats.counts += Counts(reused_velocities=width - 2)
    else:
        with torch.no_grad():
            v_mid = _forward(predict, z[1:-1], t[1:-1])
        stats.counts += Counts(nograd_forwards=width - 2)
    s_mid = []
    for j, v_j in enumerate(v_mid, start=1):
        s_mid.append((yield from _upstream(j, v_j)))
    return s_mid


def _joint_endpoints(
    predict: BoundPredict,
    z: Sequence[Tensor],
    t: Tensor,
    stats: SegmentStats,
    velocities: Sequence[Tensor] | None,
    start: Tensor | None,
    *,
    correct: bool = True,
) -> Path:
    """jagg (``correct``) and ablate: both endpoints in one batched forward with grad, one backward
    (endpoint W-1 alone when v_0 is given)."""
    s_mid = (yield from _middle(predict, z, t, stats, velocities)) if correct else []
    if start is None:
        v0, v_last = _forward(predict, [z[0], z[-1]], [t[0], t[-1]])
        outs = [v0, v_last]
    else:
        (v_last,) = outs = _forward(predict, [z[-1]], [t[-1]])
    stats.counts += Counts(grad_forwards=len(outs))
    s0 = yield from _upstream(0, outs[0] if start is None else start)
    s_last = yield from _upstream(len(z) - 1, v_last)
    g0, g_last = aggregate([s0, *s_mid, s_last], t.to(s0.dtype)) if correct else (s0, s_last)
    if start is not None:
        stats.start_upstream = g0
    grads = [g0, g_last] if start is None else [g_last]
    torch.autograd.backward(outs, [g.to(v.dtype) for g, v in zip(grads, outs)])
    stats.counts += Counts(backward_calls=1)


def _ablate(
    predict: BoundPredict,
    z: Sequence[Tensor],
    t: Tensor,
    stats: SegmentStats,
    velocities: Sequence[Tensor] | None,
    start: Tensor | None,
) -> Path:
    """The endpoints' own s_j only (``velocities`` are not needed)."""
    return _joint_endpoints(predict, z, t, stats, None, start, correct=False)


def _sequential(
    predict: BoundPredict,
    z: Sequence[Tensor],
    t: Tensor,
    stats: SegmentStats,
    velocities: Sequence[Tensor] | None,
    start: Tensor | None,
) -> Path:
    """The paper's Algorithm 2: at most one endpoint graph alive at a time. Each endpoint's backward
    carries its share of the middle steps (``aggregate`` with the endpoints' own s_j left out)."""
    s_mid = yield from _middle(predict, z, t, stats, velocities)
    none = torch.zeros(())  # an endpoint's s_j before its forward: zero, as alpha_0 = 0 and 1 - alpha_{W-1} = 0 do
    s_base, s_corr = aggregate([none, *s_mid, none], t)
    for j, partial in ((0, s_base), (len(z) - 1, s_corr)):
        if j == 0 and start is not None:
            stats.start_upstream = partial + (yield from _upstream(0, start))
            continue
        v = predict(z[j], _rows(t[j], z[j].shape[0]))
        stats.counts += Counts(grad_forwards=1)
        s_j = yield from _upstream(j, v)
        v.backward((partial + s_j).to(v.dtype))
        stats.counts += Counts(backward_calls=1)


PATHS = {
    UpdateMode.exact: _exact,
    EXACT_BATCHED: _exact_batched,
    UpdateMode.jagg: _joint_endpoints,
    UpdateMode.jagg_sequential: _sequential,
    UpdateMode.ablate: _ablate,
}


def _checked_velocities(velocities: Velocities, z: Sequence[Tensor]) -> list[Tensor]:
    """The W given velocities, detached, each checked to be shaped like its z_j (on any device)."""
    if len(velocities) != len(z):
        raise ValueError(f"velocities must hold one v per step of the segment ({len(z)}), got {len(velocities)}")
    out = [v_j.detach() for v_j in velocities]
    for j, (v_j, z_j) in enumerate(zip(out, z)):
        if v_j.shape != z_j.shape:
            raise ValueError(f"velocities[{j}] has shape {tuple(v_j.shape)}, its latent {tuple(z_j.shape)}")
    return out


def backward_segment(
    mode: str,
    predict: BoundPredict,
    step_loss: LossFn,
    z: Sequence[Tensor],
    t: Tensor,
    *,
    velocities: Velocities | None = None,
    start: Tensor | None = None,
) -> SegmentStats:
    """Accumulate into ``.grad`` the gradient of sum_j L_j, (L_j, metrics_j) = step_loss(j, predict(z[j], t_j)),
    by ``mode`` (one of UPDATE_MODES, or EXACT_BATCHED); returns each step's loss and metrics with the counts.

    z: W latents [B, ...] (no gradient); t: [W] network-input timesteps, one per step.
    velocities: v_j = predict(z[j], t_j) at the current weights, W tensors [B, ...] or one [W, B, ...]
    (e.g. the rollout's); jagg and jagg_sequential take the middle steps' from them instead of
    running a forward, exact and ablate need none and ignore them.
    start: v_0 = predict(z[0], t_0) [B, ...] at the current weights, computed by the caller (the shared
    start): no path runs step 0's forward, and its part of the gradient is left to the caller as
    ``SegmentStats.start_upstream`` (module docstring).

    The mode's path (``PATHS``) runs the forwards and backwards; the step loss is called here, on
    each (j, v_j) the path hands over, and its value goes back to the path.
    """
    if mode not in PATHS:
        raise ValueError(f"update.mode must be one of {UPDATE_MODES}, got {mode!r}")
    if len(z) != t.shape[0] or len(z) < 2:
        raise ValueError(f"a segment needs W >= 2 latents and W timesteps, got {len(z)} and {t.shape[0]}")
    z = [z_j.detach() for z_j in z]
    given = _checked_velocities(velocities, z) if velocities is not None and mode in MIDDLE_MODES else None
    if start is not None:
        if start.shape != z[0].shape:
            raise ValueError(f"start (v_0) has shape {tuple(start.shape)}, its latent {tuple(z[0].shape)}")
        start = start.detach()
    stats = SegmentStats()
    path = PATHS[mode](predict, z, t, stats, given, start)
    request = next(path, None)
    while request is not None:
        j, v = request
        with torch.enable_grad():
            loss, metrics = step_loss(j, v)
        stats.losses[j], stats.metrics[j] = loss.detach(), metrics
        request = _resume(path, loss)
    stats.losses = dict(sorted(stats.losses.items()))
    stats.metrics = dict(sorted(stats.metrics.items()))
    return stats


def _resume(path: Path, loss: Tensor) -> tuple[int, Tensor] | None:
    """The path's next (j, v_j) once it has step j's loss; None when it is done."""
    try:
        return path.send(loss)
    except StopIteration:
        return None
