"""What the planner found: the phases' peaks, FLOPs and calls, the run's evaluations, and what follows from them
(the step's peak, whether it fits, its FLOPs, traffic and time). train/tools/plan/report_text.py prints it;
train/tools/plan/advice.py finds the changes that would lower the peak."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from train.algorithm.update_config import UpdateMode
from train.tools.plan.comm import Cluster, ModelBytes, Traffic, phase_seconds
from train.tools.plan.fake import Measured
from train.tools.plan.frozen import FrozenModel
from train.tools.plan.reward import RewardTiming

GIB = 2**30


@dataclass
class Phase:
    """One traced call on rank 0. Its peak includes the frozen models once ``plan`` adds them."""

    name: str  # rollout | decode | update <mode>[, rollout velocities] | optimizer (mode: a path or exact_batched)
    peak_bytes: int
    working_bytes: int  # the call's own memory: its peak minus what was live when it started
    activation_bytes: int  # of which activations and backward temporaries, at the peak
    gathered_bytes: int  # of which all-gathered (unsharded) parameters, at the peak
    # of one call; an update's call is one segment of W steps of one micro-batch, without the shared start
    # (the rollout's is with it, as it runs: PlanReport.shared_rollout_flops says what it saves)
    flops: int
    calls_per_step: float  # calls per rank per training step
    # transformer forwards per call (with and without gradients; the policy's and the KL reference's), and of
    # them those with gradients, each with its backward
    forwards: float = 0.0
    backwards: float = 0.0
    checkpointing: bool | None = None  # updates: traced with activation checkpointing
    mode: str | None = None  # updates: the path


def to_phase(name: str, m: Measured, calls_per_step: float, **kwargs: Any) -> Phase:
    at_peak = m.at_peak
    return Phase(
        name=name,
        peak_bytes=m.peak_bytes,
        working_bytes=m.peak_bytes - m.start_bytes,
        activation_bytes=at_peak.get("Activation", 0) + at_peak.get("Temp", 0),
        gathered_bytes=at_peak.get("All Gather", 0) + at_peak.get("Unsharded Param", 0),
        flops=m.flops,
        calls_per_step=calls_per_step,
        **kwargs,
    )


@dataclass
class PlanReport:
    """Everything ``python -m train.plan`` prints (and writes as JSON to plan.output)."""

    experiment: str
    backbone: str
    arch: str
    world_size: int
    gpu_memory_gib: float
    reserved_gib: float
    num_params: int
    num_trainable: int
    lora: bool
    checkpointing: bool
    image_tokens: int
    text_tokens: int
    samples_per_rank: int
    decode_batch: int
    micro_batch: int
    segments: dict[UpdateMode, float]  # expected segments per micro-batch, per update path
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    reference_bytes: int
    ema_bytes: int
    step_tensor_bytes: int  # trajectories (with the velocities kept on the GPU), conditioning, images
    velocity_bytes: int  # of which the rollout's velocities kept on the GPU for the update
    frozen: list[FrozenModel]
    phases: list[Phase]  # rollout, decode, optimizer
    updates: list[Phase]  # per traced path, with and without activation checkpointing
    # FLOPs per rank per step the shared start (update.share_group_start) saves: the rollout's steps before
    # the first SDE noise and the update's first trainable step (with its KL reference), run once per group
    shared_rollout_flops: float = 0.0
    shared_update_flops: float = 0.0
    # FLOPs per rank per step the compressed schedule after the SDE window (sampler.post_window.ratio) saves
    post_window_flops: float = 0.0
    # transformer (forwards, backwards) per rank per step the shared start adds to the update's calls (negative:
    # saves; train.tools.plan.counts.expected_shared_calls), as routed and with every segment exact
    shared_calls: tuple[float, float] = (0.0, 0.0)
    shared_calls_exact: tuple[float, float] = (0.0, 0.0)
    seconds: float = 0.0
    # the communication and time estimate (train/tools/plan/comm.py)
    replicate: int = 1
    gpus_per_node: int = 8
    model_bytes: ModelBytes = ModelBytes(0.0, 0.0)
    peak_tflops: float = 0.0
    peak_source: str = ""
    mfu: float = 0.35
    intra_gbps: float = 0.0
    inter_gbps: float = 0.0
    num_steps: int = 0  # training steps of the run
    evaluation: Evaluation | None = None  # None: the run does not evaluate (eval.every=0)
    reward: RewardTiming | None = None  # the scorers' time and what the rollout hides of it (plan/reward.py)

    @property
    def frozen_bytes(self) -> int:
        return sum(m.num_bytes for m in self.frozen)

    @property
    def budget_bytes(self) -> float:
        return (self.gpu_memory_gib - self.reserved_gib) * GIB

    def configured_updates(self) -> list[Phase]:
        return [u for u in self.updates if u.checkpointing == self.checkpointing]

    def step_phases(self) -> list[Phase]:
        """The phases of a step as configured: the updates the run routes to, its checkpointing."""
        return self.phases + [u for u in self.configured_updates() if u.calls_per_step > 0]

    @property
    def peak(self) -> Phase:
        return max(self.step_phases(), key=lambda p: p.peak_bytes)

    @property
    def fits(self) -> bool:
        return self.peak.peak_bytes <= self.budget_bytes

    def flops_per_step(self, *, exact: bool = False, shared: bool = True) -> tuple[float, float]:
        """(update, whole step) FLOPs per rank: as routed, or with every segment on the exact path; with the
        shared start as configured, or (``shared=False``) without it."""
        updates = [self._all_exact()] if exact else self.configured_updates()
        update = sum(u.calls_per_step * u.flops for u in updates) - (self.shared_update_flops if shared else 0.0)
        rollout = 0.0 if shared else self.shared_rollout_flops
        return update, update + rollout + sum(p.calls_per_step * p.flops for p in self.phases)

    def reference_step_flops(self) -> float:
        """The whole step's FLOPs per rank as the reference trainers run it: every segment exact, no shared
        start, the rollout on every step of the schedule (no post-window solver)."""
        return self.flops_per_step(exact=True, shared=False)[1] + self.post_window_flops

    @property
    def cluster(self) -> Cluster:
        return Cluster(self.world_size, self.replicate, self.gpus_per_node)

    def traffic(self, phase: Phase) -> Traffic:
        """What ``phase`` sends per rank per step."""
        return self.model_bytes.call(self.cluster, phase.forwards, phase.backwards) * phase.calls_per_step

    def update_traffic(self, *, exact: bool = False) -> Traffic:
        """The update's per rank per step, with the shared start as configured: as routed, or with every
        segment on the exact path."""
        updates = [self._all_exact()] if exact else self.configured_updates()
        return sum((self.traffic(u) for u in updates), Traffic()) + self.shared_traffic(exact=exact)

    def _all_exact(self) -> Phase:
        """The update with every segment on the exact path: the update's calls, each the exact path's."""
        updates = self.configured_updates()
        exact = next(u for u in updates if u.mode == UpdateMode.exact)
        return replace(exact, calls_per_step=sum(u.calls_per_step for u in updates))

    def shared_traffic(self, *, exact: bool = False) -> Traffic:
        """What the shared start adds to the update's traffic per rank per step (negative: saves)."""
        return self.model_bytes.call(self.cluster, *(self.shared_calls_exact if exact else self.shared_calls))

    def time_terms(self) -> list[tuple[str, float, Traffic]]:
        """(part, FLOPs, traffic) per rank per step: the rollout, the update (with the shared start as
        configured), the optimizer step."""
        rollout, _, optimizer = self.phases
        update, _ = self.flops_per_step()
        return [
            ("rollout", rollout.flops * rollout.calls_per_step, self.traffic(rollout)),
            ("update", update, self.update_traffic()),
            ("optimizer", optimizer.flops * optimizer.calls_per_step, self.traffic(optimizer)),
        ]

    def seconds_of(self, flops: float, traffic: Traffic) -> float:
        return phase_seconds(
            flops, traffic, tflops=self.peak_tflops, mfu=self.mfu, intra=self.intra_gbps, inter=self.inter_gbps
        )

    def reward_seconds(self) -> tuple[float, float]:
        """(exposed, hidden) seconds of the reward stage per step: what adds to the step, what the rollout hides."""
        if self.reward is None:
            return 0.0, 0.0
        (_, flops, traffic), *_ = self.time_terms()
        return self.reward.split(self.seconds_of(self.reward.local_flops, Traffic()), self.seconds_of(flops, traffic))

    def step_seconds(self) -> float:
        """The transformer's parts and the reward stage's exposed time."""
        parts = sum(self.seconds_of(flops, traffic) for _, flops, traffic in self.time_terms())
        return parts + self.reward_seconds()[0]

    def evaluation_seconds(self) -> float:
        """All the run's evaluations."""
        e = self.evaluation
        if e is None:
            return 0.0
        traffic = self.model_bytes.call(self.cluster, e.forwards, 0.0)
        return e.count * self.seconds_of(e.flops, traffic)

    def run_seconds(self) -> float:
        return self.num_steps * self.step_seconds() + self.evaluation_seconds()


@dataclass
class Evaluation:
    """One evaluation on one rank (the trainer's, every eval.every steps), and how many the run makes."""

    count: int  # evaluations per run: before training, every eval.every steps, after the last
    images: int  # images per evaluation, all ranks
    images_per_rank: int
    forwards: float  # transformer calls per rank: sampling calls of eval.batch_size images x eval.num_steps
    flops: float  # per rank: eval.num_steps forwards of each of its images, at the rollout's FLOPs per row


def in_gib(num_bytes: float) -> str:
    """Bytes as GiB with one decimal, as the report prints them."""
    return f"{num_bytes / GIB:.1f}"
