"""The update stage of one training step: stored transitions -> accumulated policy gradients.

Samples are processed in micro-batches of rows the caller picks. For each micro-batch the
trainable transitions are routed into segments of W (train/algorithm/routing.py: which segments train and
which path each takes) and each segment goes through ``train.algorithm.jagg.backward_segment`` with the
real per-step loss

    L_k = PPO-clip(logp_theta(z_{k+1} | z_k), logp_old, A) + kl_beta * KL(mean_theta || mean_ref),

scaled by (rows / gradient_accumulation_steps) / (trained transitions), so that one optimizer
step sees the mean over its samples and their trained transitions. The KL reference runs one
batched no-grad call per segment, over its W steps. A jagg or jagg_sequential segment takes its middle
steps' velocities from the rollout when the caller says they are still valid (``reuse_velocities``, as
``UpdateConfig.reuse_velocities`` allows) instead of recomputing them. The step loss is a value:
it returns (scaled loss, metrics) and ``backward_segment`` hands the metrics back per step, where
``UpdateStats`` sums them, each by its own reduction (train/algorithm/metrics.py), for the caller to
reduce over ranks, so the curves logged from them do not depend on the number of ranks.

The shared start (``UpdateConfig.share_group_start``): a group's G rows start from one noise with one
prompt, so at the trajectory's first trainable transition k (the first SDE step) z_k is the same in
all of them. ``shared_start`` runs that step once per group over the rows of one optimizer step that
train it (one forward with grad, and the KL reference's no-grad call, on one row per group); each
micro-batch's segment takes its rows' v_k from it, broadcast, computes its per-row step losses on it and
adds d(loss)/dv_k into the start (``backward_segment(..., start=)``); ``SharedStart.backward`` then runs
one backward: J^T sum_i s_i, the per-row sum by linearity. Only rows of one optimizer step share
(the weights change between them), and only those whose drawn route trains step k. Departure: the
shared forward is its own call before the optimizer step's micro-batches, and its graph (one row per
group) stays alive until the last of them.

``UpdateConfig.exact_batched``: the segments routed to exact run ``train.algorithm.jagg``'s exact path batched.

The route (which segments train, Flow-GRPO-Fast's window) is drawn from a generator shared by all
ranks, never a per-rank one: under FSDP every rank must run the same sequence of forward and
backward calls, or the collectives would deadlock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from samplers.rollout import Predict, Trajectory
from samplers.sde import SDE, StepOutput, step
from train.algorithm.grpo import kl_to_reference, ppo_clip_loss, ppo_step_loss, ratio_norm_log_ratio
from train.algorithm.grpo_config import GRPOConfig
from train.algorithm.jagg import BoundPredict, Counts, Metrics, SegmentStats, backward_segment
from train.algorithm.metrics import Metric, Reduce, Stat
from train.algorithm.segments import RoutedSegment
from train.algorithm.update_config import MIDDLE_MODES, UpdateConfig


@dataclass(frozen=True)
class UpdateBatch:
    """A step's rollout with its advantages, the policies that train on it, and the update's settings."""

    traj: Trajectory
    advantages: Tensor  # [B], one per row of traj
    predict: Predict  # the policy being trained: (z, t, cond) -> v
    reference: Predict | None  # the KL reference; needed when the KL term is on (kl_beta > 0)
    config: UpdateConfig
    grpo: GRPOConfig
    gradient_accumulation_steps: int  # samples per rank per optimizer step

    def __post_init__(self) -> None:
        if self.grpo.kl_beta > 0 and self.reference is None:
            raise ValueError("a KL term (kl_beta > 0 in grpo) needs a reference policy, and reference is None")


@dataclass
class UpdateStats:
    """What one rank's update stage computed. Stats add; ``metrics`` gives them as ``Stat``s for the caller
    to reduce over ranks (each metric by its own ``Reduce``).

    A step metric m of a micro-batch of b rows enters its mean as b * m with weight b, so a logged mean is
    over every sample (of every rank, once reduced); a ``max`` (``min``) metric is the largest (smallest)
    value of any step. The ``count/*`` counters are totals.
    """

    stats: dict[str, Stat] = field(default_factory=dict)  # settled step metrics
    counts: Counts = Counts()
    segments: Counter[str] = field(default_factory=Counter)  # segments per path
    # (rows, metrics) of the steps added since the metrics were last read: ``add_segment`` reads no
    # tensor, so a caller that never adds or reads the stats syncs nothing (and a fake tensor traces)
    pending: list[tuple[int, Metrics]] = field(default_factory=list)

    def add_segment(self, mode: str, result: SegmentStats, *, rows: int, reference_forwards: int = 0) -> None:
        """Count one ``backward_segment`` call over ``rows`` rows and add the metrics of every step it evaluated."""
        self.pending += [(rows, metrics) for metrics in result.metrics.values()]
        self.counts += result.counts + Counts(nograd_forwards=reference_forwards)
        self.segments[str(mode)] += 1

    def _settle(self) -> None:
        """Read the pending metrics into the stats, in the order they were added."""
        for rows, metrics in self.pending:
            for name, metric in metrics.items():
                _merge(self.stats, name, Stat.of(metric, rows))
        self.pending = []

    def __add__(self, other: UpdateStats) -> UpdateStats:
        self._settle()
        other._settle()
        out = UpdateStats(dict(self.stats), self.counts + other.counts, self.segments + other.segments)
        for name, stat in other.stats.items():
            _merge(out.stats, name, stat)
        return out

    def metrics(self) -> dict[str, Stat]:
        """The logged metrics of this rank, by name: ``train/<step metric>``, ``count/<counter>`` and
        ``count/segments_<path>`` (every rank must hold the same names, as every rank routes alike)."""
        self._settle()
        order = {Reduce.mean: 0, Reduce.sum: 0, Reduce.max: 1, Reduce.min: 2}  # means, then maxima, then minima
        ranked = sorted(self.stats.items(), key=lambda item: (order[item[1].reduce], item[0]))
        out = {f"train/{name}": stat for name, stat in ranked}
        out |= {f"count/{name}": Stat(Reduce.sum, value) for name, value in asdict(self.counts).items()}
        out |= {f"count/segments_{mode}": Stat(Reduce.sum, num) for mode, num in sorted(self.segments.items())}
        return out


def _merge(stats: dict[str, Stat], name: str, stat: Stat) -> None:
    stats[name] = stats[name] + stat if name in stats else stat


def _tiled(cond, rows: int):
    """Conditioning for a batched call over several steps: the micro-batch rows tiled."""
    reps = rows // cond.batch_size
    return cond if reps == 1 else type(cond).cat([cond] * reps)


def bind(predict: Predict, cond) -> BoundPredict:
    """``predict`` on the micro-batch's conditioning ``cond``, tiled to the rows of each call."""

    def policy(z: Tensor, t: Tensor) -> Tensor:
        return predict(z, t, _tiled(cond, z.shape[0]))

    return policy


@dataclass(frozen=True)
class StepLoss:
    """The GRPO loss of the W transitions [start, start + W) of a micro-batch, times ``scale``, called
    on (j, v_j) with v_j [b, ...] the velocity at step start + j:

    L_j = PPO-clip(logp_theta(z_{j+1} | z_j), logp_old, A) + kl_beta * KL(mean_theta || mean_ref).
    Returns (scale * L_j, metrics): ``loss`` (L_j before scaling), ``kl`` with a KL term, and
    ``ppo_step_loss``'s. ``latents[:-1]`` and ``timesteps`` are the segment's inputs of the policy. With
    ``sampled`` (the rollout's v of the W steps) the PPO ratio is GRPO-Guard's normalised one
    (``ratio_norm_log_ratio``), its mean std taken over the micro-batch's rows of step j.
    """

    sde: SDE
    latents: list[Tensor]  # W + 1 stored latents [b, ...]: z at steps start .. start + W
    timesteps: Tensor  # [W] network-input timesteps
    sigmas: Tensor  # [W + 1]
    sigma_guard: float
    old_log_probs: Tensor  # [b, W] the rollout's log-probs
    advantages: Tensor  # [b]
    reference: list[Tensor] | None  # the KL reference's v of the W steps [b, ...]; None without a KL term
    sampled: Tensor | None  # [W, b, ...] the rollout's v of the W steps, for GRPO-Guard; None without it
    clip_range: float
    kl_beta: float
    scale: float

    @property
    def z(self) -> list[Tensor]:
        return self.latents[:-1]

    @property
    def reference_forwards(self) -> int:
        """The steps the KL reference ran (without grad) for this loss."""
        return 0 if self.reference is None else len(self.reference)

    def transition(self, j: int, v: Tensor) -> StepOutput:
        """Step j's stored transition z_j -> z_{j+1} scored under velocity ``v``."""
        z, next_z = self.latents[j], self.latents[j + 1]
        return step(self.sde, v, z, self.sigmas[j], self.sigmas[j + 1], next_z=next_z, sigma_guard=self.sigma_guard)

    def __call__(self, j: int, v: Tensor) -> tuple[Tensor, Metrics]:
        out = self.transition(j, v)
        assert out.log_prob is not None  # step_loss() refuses ODE steps
        old = self.old_log_probs[:, j]
        if self.sampled is None:
            loss, metrics = ppo_step_loss(out.log_prob, old, self.advantages, clip_range=self.clip_range)
        else:
            old_mean = self.transition(j, self.sampled[j].to(v.device, v.dtype)).mean
            log_ratio = ratio_norm_log_ratio(out.log_prob, old, out.mean, old_mean, out.std)
            loss, metrics = ppo_clip_loss(log_ratio, self.advantages, clip_range=self.clip_range)
        if self.reference is not None:
            kl = kl_to_reference(out.mean, self.transition(j, self.reference[j]).mean, out.diffusion)
            loss = loss + self.kl_beta * kl
            metrics = {**metrics, "kl": Metric(kl.detach())}
        return loss * self.scale, {"loss": Metric(loss.detach()), **metrics}


def step_loss(
    batch: UpdateBatch, rows: Tensor, segment: tuple[int, int], *, scale: float, reference: list[Tensor] | None
) -> StepLoss:
    """The ``StepLoss`` of transitions [start, stop) of ``rows``; ``reference``: the KL reference's v of
    these steps (``reference_velocities``), None without a KL term."""
    traj, grpo = batch.traj, batch.grpo
    start, stop = segment
    for k in range(start, stop):
        if not bool(traj.stochastic[k]):
            raise ValueError(f"transition {k} is an ODE step; it has no log-probability to train on")
    return StepLoss(
        sde=traj.sde,
        latents=[traj.latents[rows, k] for k in range(start, stop + 1)],
        timesteps=traj.timesteps[start:stop],
        sigmas=traj.sigmas[start : stop + 1],
        sigma_guard=traj.sigma_guard,
        old_log_probs=traj.log_probs[rows, start:stop],
        advantages=batch.advantages[rows],
        reference=reference,
        sampled=kept_velocities(traj, rows, segment) if grpo.ratio_norm else None,
        clip_range=grpo.clip_range,
        kl_beta=grpo.kl_beta,
        scale=scale,
    )


@torch.no_grad()
def reference_velocities(
    batch: UpdateBatch, rows: Tensor, segment: tuple[int, int], *, start: SharedStart | None = None
) -> list[Tensor] | None:
    """The KL reference's v of transitions [start, stop) of ``rows``, from one batched call over them
    (one FSDP gather per module); None when the loss has no KL term (``kl_beta`` = 0). With ``start``
    (the shared start of the segment's first step) that step's v comes from it."""
    if batch.reference is None or batch.grpo.kl_beta <= 0:
        return None
    traj, ks = batch.traj, range(segment[0] + (start is not None), segment[1])
    z = torch.cat([traj.latents[rows, k] for k in ks])
    t = torch.cat([traj.timesteps[k].expand(len(rows)) for k in ks])
    out = list(batch.reference(z, t, _tiled(traj.cond.index(rows), len(z))).split(len(rows)))
    return out if start is None else [start.reference_of(rows), *out]


@dataclass
class SharedStart:
    """The shared transition ``step`` of one optimizer step's rows (module docstring): v and the KL
    reference's v at it, one row per group, and the upstream gradient its rows add."""

    step: int  # k: the trajectory's first trainable transition
    slots: Tensor  # [B] long: row i's row of ``v`` (-1: row i does not take it)
    v: Tensor  # [groups, ...] the policy's v at step k, with grad
    reference: Tensor | None  # [groups, ...] the KL reference's v at step k; None without a KL term
    upstream: Tensor  # [groups, ...] sum over the rows of each group of d(loss)/dv_k, in the loss's dtype
    num_rows: int  # rows that take their v_k from it

    def velocity_of(self, rows: Tensor) -> Tensor:
        """v_k of ``rows`` [b, ...], detached: each row its group's."""
        return self.v.detach()[self.slots[rows]]

    def reference_of(self, rows: Tensor) -> Tensor:
        assert self.reference is not None
        return self.reference[self.slots[rows]]

    def add(self, rows: Tensor, upstream: Tensor | None) -> None:
        """Add d(loss)/dv_k of ``rows`` [b, ...] (``SegmentStats.start_upstream``) to their groups'."""
        assert upstream is not None, "a segment that took v_k from the shared start reports its upstream"
        self.upstream.index_add_(0, self.slots[rows], upstream.to(self.upstream.dtype))

    def backward(self) -> UpdateStats:
        """The one backward of the shared forward (J^T of the summed upstream); its counts."""
        torch.autograd.backward(self.v, self.upstream.to(self.v.dtype))
        saved = self.num_rows - self.v.shape[0]
        counts = Counts(grad_forwards=1, backward_calls=1, shared_start_grad_rows=saved)
        if self.reference is not None:
            counts += Counts(nograd_forwards=1, shared_start_forward_rows=saved)
        return UpdateStats(counts=counts)


def shared_start(
    batch: UpdateBatch, micro_batches: Sequence[Sequence[int]], routes: Sequence[Sequence[RoutedSegment]]
) -> SharedStart | None:
    """The shared start of one optimizer step whose micro-batches (rows) train ``routes``: step k's forward
    with grad on the first row of each group among the rows that train k; None when no two such rows
    are of one group (G = 1, share_group_start false, or a micro-batch of whole different groups)."""
    traj = batch.traj
    size, step = batch.config.shared_rows(batch.grpo.group_size), traj.trainable_steps()[0]
    rows = [r for micro, route in zip(micro_batches, routes) if any(s.start == step for s in route) for r in micro]
    first_of: dict[int, int] = {}  # group -> its first row that trains step k, in row order
    for r in rows:
        first_of.setdefault(r // size, r)
    if len(first_of) == len(rows):
        return None
    slot = {group: i for i, group in enumerate(first_of)}
    taking = dict.fromkeys(rows)
    slots = torch.tensor([slot[r // size] if r in taking else -1 for r in range(traj.batch_size)])
    firsts = list(first_of.values())
    z = traj.latents[firsts, step]
    t = traj.timesteps[step].expand(len(firsts))
    cond = traj.cond.index(firsts)
    v = batch.predict(z, t, cond)
    reference = None
    if batch.reference is not None and batch.grpo.kl_beta > 0:
        with torch.no_grad():
            reference = batch.reference(z, t, cond)
    upstream = torch.zeros(v.shape, dtype=torch.promote_types(v.dtype, torch.float32), device=v.device)
    return SharedStart(step, slots.to(z.device), v, reference, upstream, num_rows=len(rows))


def kept_velocities(traj: Trajectory, rows: Tensor, segment: tuple[int, int]) -> Tensor:
    """[W, rows, ...] the rollout's v of transitions [start, stop) of ``rows`` (maybe on the host)."""
    if traj.velocities is None:
        raise ValueError("the rollout kept no velocities to reuse (rollout(..., velocities=KeptVelocities()))")
    return traj.velocities[rows.to(traj.velocities.device), segment[0] : segment[1]].transpose(0, 1)


def update_micro_batch(
    batch: UpdateBatch,
    rows: Tensor,
    route: list[RoutedSegment],
    *,
    reuse_velocities: bool = False,
    start: SharedStart | None = None,
) -> UpdateStats:
    """Accumulate into ``.grad`` the gradient of the micro-batch ``rows`` over the routed segments.

    ``reuse_velocities``: the weights are those that produced the trajectory's kept velocities (or the
    caller accepts stale ones); the jagg and jagg_sequential segments then take their middle steps' v
    from them instead of recomputing. ``start``: the optimizer step's shared start (``shared_start``);
    the segment that begins at its step takes v there from it and leaves that step's backward to it.
    """
    trained = sum(s.stop - s.start for s in route)
    scale = (len(rows) / batch.gradient_accumulation_steps) / trained
    policy = bind(batch.predict, batch.traj.cond.index(rows))
    stats = UpdateStats()
    for segment in route:
        span = (segment.start, segment.stop)
        shared = start if start is not None and segment.start == start.step else None
        reference = reference_velocities(batch, rows, span, start=shared)
        loss = step_loss(batch, rows, span, scale=scale, reference=reference)
        reuse = reuse_velocities and segment.mode in MIDDLE_MODES
        given = kept_velocities(batch.traj, rows, span) if reuse else None
        v0 = None if shared is None else shared.velocity_of(rows)
        batched = batch.config.exact_batched
        result = backward_segment(
            segment.mode, policy, loss, loss.z, loss.timesteps, velocities=given, start=v0, exact_batched=batched
        )
        if shared is not None:
            shared.add(rows, result.start_upstream)
        ran = loss.reference_forwards - (shared is not None and reference is not None)
        stats.add_segment(segment.mode, result, rows=len(rows), reference_forwards=ran)
    return stats
