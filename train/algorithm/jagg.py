"""The update paths of one segment of W consecutive denoising steps (``backward_segment``).

For step j of a segment, L_j(v_j) is the per-step loss, v_j = model(z_j, t_j) the velocity, J_j its
Jacobian with respect to the parameters and s_j = dL_j/dv_j, taken on a detached copy of v_j (no
transformer backward). z_j carries no gradient (the per-step REINFORCE approximation).

    exact            sum_j J_j^T s_j                            W forwards with grad, W backwards
                                                                (``exact_batched``: the W steps in one
                                                                batched forward with grad, one backward)
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

``exact_batched``, a flag of the exact path, trades about W times the activations for fewer FSDP2
all-gathers: 2n instead of 2Wn for n sharded modules.

The shared start: when step 0's v comes from elsewhere (``start``, v_0 [B, ...] detached, computed once
for rows that share their input), a path runs no forward of step 0 and leaves its backward to the
caller: ``SegmentStats.start_upstream`` holds d(sum_j L_j)/dv_0 [B, ...], and the caller's one backward of
the shared forward gives J_0^T of its sum over the rows that share (train/algorithm/update.py).

Each path is a plain function of one ``Segment`` (its predictor, latents, timesteps, loss, given
velocities and stats) in the phases of the paper's Algorithm 1 (jagg) and 2 (jagg_sequential): forwards,
s_j on detached proxies, aggregation, backward. Departure from Algorithm 1: the two endpoints run as one
batched forward (and the middle steps as another), so under FSDP2 each sharded module is all-gathered once
in the forward and once in the backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

from samplers.sde import compute_dtype
from train.algorithm.metrics import Metric
from train.algorithm.update_config import MIDDLE_MODES, UpdateMode

UPDATE_MODES = tuple(mode.value for mode in UpdateMode)

BoundPredict = Callable[[Tensor, Tensor], Tensor]  # (z [B, ...], t [B]) -> v [B, ...]: the conditioning is bound
Metrics = dict[str, Metric]  # name -> a detached scalar and its reduction
Velocities = Sequence[Tensor] | Tensor  # W tensors [B, ...], or one [W, B, ...]: v_j at the current weights
LossFn = Callable[[int, Tensor], tuple[Tensor, Metrics]]  # (j, v_j [B, ...]) -> (scalar loss of step j, metrics)


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


@dataclass
class Segment:
    """One segment of W steps as a path sees it: its inputs, and the ``stats`` the path fills in."""

    predict: BoundPredict
    step_loss: LossFn
    z: list[Tensor]  # W latents [B, ...], detached
    t: Tensor  # [W] network-input timesteps
    velocities: list[Tensor] | None  # W given v_j [B, ...], detached (jagg, jagg_sequential); None: recompute
    start: Tensor | None  # the given v_0 [B, ...], detached (the shared start); None: step 0's forward runs here
    stats: SegmentStats = field(default_factory=SegmentStats)

    @property
    def last(self) -> int:
        """W - 1, the last step (the endpoint opposite step 0)."""
        return len(self.z) - 1

    def forward(self, steps: Sequence[int], *, grad: bool = True) -> list[Tensor]:
        """v_j of ``steps`` from one batched call of the model, with or without grad; one v per step."""
        batch = self.z[0].shape[0]
        with torch.set_grad_enabled(grad):
            v = self.predict(torch.cat([self.z[j] for j in steps]), torch.cat([self.t[j].expand(batch) for j in steps]))
        self.stats.counts += Counts(grad_forwards=len(steps)) if grad else Counts(nograd_forwards=len(steps))
        return list(v.split(batch))

    def loss(self, j: int, v: Tensor) -> Tensor:
        """L_j at v_j; its detached value and metrics go to ``stats``."""
        with torch.enable_grad():  # the loss's graph to v_j, whatever mode the caller runs in
            loss, metrics = self.step_loss(j, v)
        self.stats.losses[j], self.stats.metrics[j] = loss.detach(), metrics
        return loss

    def upstream(self, j: int, v: Tensor) -> Tensor:
        """s_j = dL_j/dv_j on a detached proxy of v_j (no model backward).

        The proxy is float32 for half-precision models (the SDE log-prob needs it) and keeps float64.
        """
        proxy = v.detach().to(compute_dtype(v.dtype)).requires_grad_(True)
        loss = self.loss(j, proxy)
        if not loss.requires_grad:  # the loss does not depend on v (e.g. zero advantage folded to a constant)
            return torch.zeros_like(proxy)
        (s,) = torch.autograd.grad(loss, proxy, materialize_grads=True)
        return s

    def middle(self) -> list[Tensor]:
        """s_j of the W-2 middle steps: on the given velocities, or from one batched no-grad forward."""
        steps = range(1, self.last)
        if not steps:
            return []
        if self.velocities is not None:  # possibly offloaded to host memory: each comes to its latent's device
            v = [self.velocities[j].to(self.z[j].device, non_blocking=True) for j in steps]
            self.stats.counts += Counts(reused_velocities=len(steps))
        else:
            v = self.forward(steps, grad=False)
        return [self.upstream(j, v_j) for j, v_j in zip(steps, v)]

    def backward(self, v: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
        """One autograd backward of the v_j with their upstream gradients."""
        torch.autograd.backward(list(v), [g.to(v_j.dtype) for g, v_j in zip(grads, v)])
        self.stats.counts += Counts(backward_calls=1)


def _exact(seg: Segment, *, batched: bool = False) -> None:
    """sum_j J_j^T s_j: each step's forward with grad and the backward of its loss; ``batched``: the steps in
    one forward with grad and one backward of their s_j. With a given v_0, s_0 is left to the caller."""
    steps = range(len(seg.z))
    if seg.start is not None:  # step 0's backward is the caller's
        seg.stats.start_upstream = seg.upstream(0, seg.start)
        steps = steps[1:]
    if batched:
        v = seg.forward(steps)
        seg.backward(v, [seg.upstream(j, v_j) for j, v_j in zip(steps, v)])
        return
    for j in steps:
        (v_j,) = seg.forward([j])
        loss = seg.loss(j, v_j)
        if loss.requires_grad:
            loss.backward()
            seg.stats.counts += Counts(backward_calls=1)


def _joint(seg: Segment, *, correct: bool) -> None:
    """The paper's Algorithm 1 (jagg, ``correct``): the middle steps' s_j, both endpoints in one batched forward
    with grad, their s_j, (s_base, s_corr), one backward. Without ``correct`` (ablate) the endpoints' own s_j.
    With a given v_0 only endpoint W-1 runs, and v_0's share is left to the caller."""
    s_mid = seg.middle() if correct else []
    if seg.start is None:
        v0, v_last = seg.forward([0, seg.last])
    else:
        v0, (v_last,) = seg.start, seg.forward([seg.last])
    s0, s_last = seg.upstream(0, v0), seg.upstream(seg.last, v_last)
    g0, g_last = aggregate([s0, *s_mid, s_last], seg.t.to(s0.dtype)) if correct else (s0, s_last)
    if seg.start is None:
        seg.backward([v0, v_last], [g0, g_last])
    else:  # endpoint 0's backward is the caller's
        seg.stats.start_upstream = g0
        seg.backward([v_last], [g_last])


def _sequential(seg: Segment) -> None:
    """The paper's Algorithm 2: at most one endpoint graph alive at a time. Each endpoint's backward
    carries its share of the middle steps (``aggregate`` with the endpoints' own s_j left out)."""
    s_mid = seg.middle()
    none = torch.zeros(())  # an endpoint's s_j before its forward: zero, as alpha_0 = 0 and 1 - alpha_{W-1} = 0 do
    s_base, s_corr = aggregate([none, *s_mid, none], seg.t)
    ends = [(0, s_base), (seg.last, s_corr)]
    if seg.start is not None:  # endpoint 0's backward is the caller's
        seg.stats.start_upstream = s_base + seg.upstream(0, seg.start)
        ends = ends[1:]
    for j, partial in ends:
        (v_j,) = seg.forward([j])
        seg.backward([v_j], [partial + seg.upstream(j, v_j)])


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
    exact_batched: bool = False,
) -> SegmentStats:
    """Accumulate into ``.grad`` the gradient of sum_j L_j, (L_j, metrics_j) = step_loss(j, predict(z[j], t_j)),
    by ``mode`` (one of UPDATE_MODES); returns each step's loss and metrics with the counts.

    z: W latents [B, ...] (no gradient); t: [W] network-input timesteps, one per step.
    velocities: v_j = predict(z[j], t_j) at the current weights, W tensors [B, ...] or one [W, B, ...]
    (e.g. the rollout's); jagg and jagg_sequential take the middle steps' from them instead of
    running a forward, exact and ablate need none and ignore them.
    start: v_0 = predict(z[0], t_0) [B, ...] at the current weights, computed by the caller (the shared
    start): no path runs step 0's forward, and its part of the gradient is left to the caller as
    ``SegmentStats.start_upstream`` (module docstring).
    exact_batched: the exact path runs its steps in one forward with grad and one backward.
    """
    mode = UpdateMode(mode)
    assert len(z) == t.shape[0] >= 2, "a segment is W >= 2 latents and their W timesteps"
    z = [z_j.detach() for z_j in z]
    given = _checked_velocities(velocities, z) if velocities is not None and mode in MIDDLE_MODES else None
    if start is not None and start.shape != z[0].shape:
        raise ValueError(f"start (v_0) has shape {tuple(start.shape)}, its latent {tuple(z[0].shape)}")
    seg = Segment(predict, step_loss, z, t, given, None if start is None else start.detach())
    if mode is UpdateMode.exact:
        _exact(seg, batched=exact_batched)
    elif mode is UpdateMode.jagg_sequential:
        _sequential(seg)
    else:
        _joint(seg, correct=mode is UpdateMode.jagg)
    seg.stats.losses = dict(sorted(seg.stats.losses.items()))  # in step order: the paths run the middle first
    seg.stats.metrics = dict(sorted(seg.stats.metrics.items()))
    return seg.stats
