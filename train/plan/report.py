"""What the planner found, and how it prints it: the phases' peaks and FLOPs, the verdict, and the
changes that would lower the peak."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from train.plan.comm import Cluster, ModelBytes, Traffic, phase_seconds
from train.plan.fake import Measured
from train.plan.frozen import FrozenModel

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
    segments: dict[str, float]  # expected segments per micro-batch, per update path
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
    # transformer (forwards, backwards) per rank per step the shared start adds to the update's calls (negative:
    # saves; train.plan.tracing.expected_shared_calls), as routed and with every segment exact
    shared_calls: tuple[float, float] = (0.0, 0.0)
    shared_calls_exact: tuple[float, float] = (0.0, 0.0)
    seconds: float = 0.0
    # the communication and time estimate (train/plan/comm.py)
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
        updates = self.configured_updates()
        if exact:
            calls = sum(u.calls_per_step for u in updates)
            update = calls * next(u.flops for u in updates if u.mode == "exact")
        else:
            update = sum(u.calls_per_step * u.flops for u in updates)
        update -= self.shared_update_flops if shared else 0.0
        rollout = 0.0 if shared else self.shared_rollout_flops
        return update, update + rollout + sum(p.calls_per_step * p.flops for p in self.phases)

    @property
    def cluster(self) -> Cluster:
        return Cluster(self.world_size, self.replicate, self.gpus_per_node)

    def traffic(self, phase: Phase) -> Traffic:
        """What ``phase`` sends per rank per step."""
        return self.model_bytes.call(self.cluster, phase.forwards, phase.backwards) * phase.calls_per_step

    def update_traffic(self, *, exact: bool = False) -> Traffic:
        """The update's per rank per step, with the shared start as configured: as routed, or with every
        segment on the exact path."""
        updates = self.configured_updates()
        if exact:
            calls = sum(u.calls_per_step for u in updates)
            exact_call = next(u for u in updates if u.mode == "exact")
            out = self.model_bytes.call(self.cluster, exact_call.forwards, exact_call.backwards) * calls
        else:
            out = sum((self.traffic(u) for u in updates), Traffic())
        return out + self.shared_traffic(exact=exact)

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

    def step_seconds(self) -> float:
        return sum(self.seconds_of(flops, traffic) for _, flops, traffic in self.time_terms())

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


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f}"


Saving = tuple[str, dict[str, float], str]  # (the change, bytes it frees per phase name, how that is known)


def _everywhere(names: list[str], num_bytes: float) -> dict[str, float]:
    return dict.fromkeys(names, float(num_bytes))


def _static_savings(report: PlanReport, names: list[str]) -> list[Saving]:
    out: list[Saving] = []
    text = sum(m.num_bytes for m in report.frozen if m.role == "text encoder")
    if text:
        change = "model.embedding_cache=<folder> (scripts/precompute_embeddings.py): no text encoders"
        out.append((change, _everywhere(names, text), "exact"))
    if not report.lora:  # the rollout and the decode hold no gradients in any case
        held = report.optimizer_bytes + report.reference_bytes + report.ema_bytes
        saved = {n: float(held + (report.grad_bytes if n not in ("rollout", "decode") else 0)) for n in names}
        change = "model.lora.enabled=true: no full-size gradients, optimizer state, KL reference copy or EMA"
        out.append((change, saved, "estimate; trace it with model.lora.enabled=true"))
    evaluation = sum(m.num_bytes for m in report.frozen if m.role == "eval scorer")
    if evaluation:
        change = "eval.every=0 (evaluate with python -m train.eval): no evaluation scorers kept"
        out.append((change, _everywhere(names, evaluation), "exact"))
    if report.velocity_bytes:
        change = "update.offload_velocities=true: the rollout's velocities in host memory"
        out.append((change, _everywhere(names, report.velocity_bytes), "exact"))
    return out


def _working_savings(report: PlanReport) -> list[Saving]:
    out: list[Saving] = []
    current = {u.name: u for u in report.configured_updates()}
    if not report.checkpointing:
        other = {u.name: u for u in report.updates if u.checkpointing}
        saved = {name: float(u.peak_bytes - other[name].peak_bytes) for name, u in current.items()}
        out.append(("model.activation_checkpointing=true", saved, "traced"))
    if report.segments.get("jagg", 0) > 0:
        saved = {name: u.activation_bytes / 2 for name, u in current.items() if u.mode == "jagg"}
        change = "update.mode=jagg_sequential: one endpoint graph alive instead of two"
        out.append((change, saved, "estimate; trace it with update.mode=jagg_sequential"))
    if report.micro_batch > 1:
        share = 1 - 1 / report.micro_batch
        saved = {p.name: p.working_bytes * share for p in report.step_phases() if p.name != "decode"}
        out.append(("batch.micro_batch=1", saved, "estimate; trace it with batch.micro_batch=1"))
    decode = next(p for p in report.phases if p.name == "decode")
    per_call = report.decode_batch if 0 < report.decode_batch < report.samples_per_rank else report.samples_per_rank
    for rows in (16, 8, 4, 2, 1):  # the largest chunk that fits, if one does: working memory ~ images per call
        saved = {"decode": decode.working_bytes * (1 - rows / per_call)}
        if rows < per_call and (decode.peak_bytes - saved["decode"] <= report.budget_bytes or rows == 1):
            out.append((f"model.decode_batch={rows}", saved, f"estimate; trace it with model.decode_batch={rows}"))
            break
    return out


def advice(report: PlanReport) -> list[str]:
    """One line per change that lowers the peak: the step's peak it would leave, and whether that fits."""
    names = [p.name for p in report.step_phases()]
    lines = []
    for change, saved, how in _static_savings(report, names) + _working_savings(report):
        peak = max(p.peak_bytes - saved.get(p.name, 0) for p in report.step_phases())
        if peak < report.peak.peak_bytes:
            verdict = "fits" if peak <= report.budget_bytes else "does not fit"
            lines.append(f"  {change}: peak {_gib(peak)} GiB, {verdict} ({how})")
    return lines


def largest_term(report: PlanReport, phase: Phase) -> str:
    terms = {
        f"{phase.name} working memory": phase.working_bytes,
        "transformer shards": report.param_bytes,
        "optimizer state": report.optimizer_bytes,
        "KL reference shards": report.reference_bytes,
        "EMA shards": report.ema_bytes,
        "step tensors": report.step_tensor_bytes,
        **{f"{m.role} {m.name}": m.num_bytes for m in report.frozen},
    }
    if phase.name not in ("rollout", "decode"):
        terms["gradients"] = report.grad_bytes
    name = max(terms, key=lambda term: terms[term])
    return f"{name} ({_gib(terms[name])} GiB)"


def _memory_lines(r: PlanReport) -> list[str]:
    lines = [
        "memory per rank, GiB",
        f"  transformer shards (float32)               {_gib(r.param_bytes):>7}",
        f"  gradients (float32 shards)                 {_gib(r.grad_bytes):>7}",
        f"  optimizer state (AdamW)                    {_gib(r.optimizer_bytes):>7}",
        f"  KL reference (shards)                      {_gib(r.reference_bytes):>7}",
        f"  EMA (float32 shards)                       {_gib(r.ema_bytes):>7}",
        f"  step tensors (trajectories, images)        {_gib(r.step_tensor_bytes):>7}"
        f"   of which kept velocities {_gib(r.velocity_bytes)}",
    ]
    for m in r.frozen:
        label = f"{m.role} {m.name} (replicated)"
        lines.append(f"  {label:<42} {_gib(m.num_bytes):>7}   {m.num_params / 1e9:.2f} B parameters")
    lines += ["", "phase peaks per rank, GiB (working: the phase's own activations, all-gathered blocks, temporaries)"]
    labels = [
        p.name if p.checkpointing is None else f"{p.name}, {'AC' if p.checkpointing else 'no AC'}"
        for p in r.phases + r.updates
    ]
    width = max(map(len, labels))
    for p, label in zip([*r.phases, *r.updates], labels):
        note = "" if p.checkpointing in (None, r.checkpointing) else "  (other checkpointing setting)"
        lines.append(
            f"  {label:<{width}} peak {_gib(p.peak_bytes):>6}   working {_gib(p.working_bytes):>6}"
            f" (activations {_gib(p.activation_bytes)}, all-gathered {_gib(p.gathered_bytes)}){note}"
        )
    return lines


def _flop_lines(r: PlanReport) -> list[str]:
    lines = ["FLOPs per rank per training step, TFLOP (calls per step x TFLOP per call)"]
    width = max(len(p.name) for p in r.phases + r.configured_updates())
    for p in r.phases + r.configured_updates():
        total = p.flops * p.calls_per_step / 1e12
        lines.append(f"  {p.name:<{width}} {total:>10.1f}   ({p.calls_per_step:g} x {p.flops / 1e12:.2f})")
    update, step = r.flops_per_step()
    update_exact, step_exact = r.flops_per_step(exact=True)
    lines += [
        f"  {'update as routed':<{width}} {update / 1e12:>10.1f}   every segment exact: {update_exact / 1e12:.1f}"
        f" -> {update_exact / update:.2f}x fewer FLOPs: that speed-up at equal throughput",
        f"  {'training step':<{width}} {step / 1e12:>10.1f}   every segment exact: {step_exact / 1e12:.1f}"
        f" -> {step_exact / step:.2f}x",
    ]
    if r.shared_rollout_flops or r.shared_update_flops:
        _, unshared = r.flops_per_step(shared=False)
        lines.append(
            f"  shared start (update.share_group_start) saves {r.shared_rollout_flops / 1e12:.1f} of the rollout and "
            f"{r.shared_update_flops / 1e12:.1f} of the update: without it the step is {unshared / 1e12:.1f}"
            f" -> {unshared / step:.3f}x"
        )
    return lines


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.4g}"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 600 else f"{seconds / 3600:.1f} h"


def _comm_lines(r: PlanReport) -> list[str]:
    c = r.cluster
    nodes = max(1, r.world_size // r.gpus_per_node)
    sharding = "FSDP" if r.replicate == 1 else f"HSDP, {r.replicate} replicas of {c.shard_size} ranks"
    lines = [
        f"communication per rank per training step, GB sent ({sharding}; {r.world_size} ranks on {nodes} node(s) of "
        f"{r.gpus_per_node}; ring algorithms: train/plan/comm.py)",
    ]
    width = max(len(p.name) for p in r.phases + r.configured_updates())
    lines.append(f"  {'phase':<{width}}  forwards  backwards  all-gather  reduce-scatter  all-reduce  in node  across")
    for p in [*r.phases, *r.configured_updates()]:
        t = r.traffic(p)
        lines.append(
            f"  {p.name:<{width}} {p.forwards * p.calls_per_step:>9g} {p.backwards * p.calls_per_step:>10g}"
            f" {_gb(t.all_gather):>11} {_gb(t.reduce_scatter):>15} {_gb(t.all_reduce):>11}"
            f" {_gb(t.intra):>8} {_gb(t.inter):>7}"
        )
    if r.shared_calls != (0.0, 0.0):
        forwards, backwards = r.shared_calls
        t = r.shared_traffic()
        lines.append(
            f"  {'shared start':<{width}} {forwards:>+9.3g} {backwards:>+10.3g} {_gb(t.all_gather):>11}"
            f" {_gb(t.reduce_scatter):>15} {_gb(t.all_reduce):>11} {_gb(t.intra):>8} {_gb(t.inter):>7}"
        )
    routed, exact = r.update_traffic(), r.update_traffic(exact=True)
    lines.append(
        f"  update as routed sends {_gb(routed.total)} GB, every segment exact {_gb(exact.total)} GB: the routing "
        f"saves {_gb(exact.total - routed.total)} GB ({_gb(exact.inter - routed.inter)} GB of them across nodes)"
    )
    return lines


def _shape_lines(r: PlanReport) -> list[str]:
    """The step's communication and time on other cluster shapes: a rank's step is the same on any (its
    samples are batch.prompts_per_rank), only its collectives' groups change."""
    lines = ["the same step on other clusters (per rank; FSDP over every rank, or HSDP with one replica per node)"]
    for nodes in (1, 2, 8):
        for replicate in (1, nodes) if nodes > 1 else (1,):
            shape = replace(r, world_size=nodes * r.gpus_per_node, replicate=replicate)
            t = sum((shape.traffic(p) for p in shape.phases), shape.update_traffic())
            name = "FSDP" if replicate == 1 else f"HSDP R={replicate}"
            lines.append(
                f"  {nodes} node(s) x {r.gpus_per_node}, {name:<9} in node {_gb(t.intra):>8} GB   across nodes"
                f" {_gb(t.inter):>8} GB   step {shape.step_seconds():>7.1f} s"
            )
    return lines


def _time_lines(r: PlanReport) -> list[str]:
    lines = [
        f"time estimate per rank: compute at {r.mfu:g} MFU of {r.peak_tflops:g} TFLOP/s ({r.peak_source}), links "
        f"{r.intra_gbps:g} Gb/s in a node, {r.inter_gbps:g} Gb/s across; a part takes the longer of its compute "
        "and its communication (overlapped), a step the sum of its parts"
    ]
    for name, flops, traffic in r.time_terms():
        compute = flops / (r.peak_tflops * 1e12 * r.mfu)
        comm = traffic.seconds(r.intra_gbps, r.inter_gbps)
        bound = "compute" if compute >= comm else "communication"
        lines.append(f"  {name:<10} compute {compute:>8.1f} s   communication {comm:>8.1f} s   -> {bound}-bound")
    step = r.step_seconds()
    lines.append(f"  training step {step:.1f} s; {r.num_steps} steps {_duration(r.num_steps * step)}")
    e = r.evaluation
    if e is not None:
        lines.append(
            f"  evaluation: {e.count} x {e.images} images ({e.images_per_rank} per rank, {e.flops / 1e12:.1f} TFLOP"
            f" each) {_duration(r.evaluation_seconds())}"
        )
    lines.append(
        f"  run: {_duration(r.run_seconds())} (not counted: text encoding, reward scoring, VAE decode, checkpoints)"
    )
    return lines


def format_report(report: PlanReport) -> str:
    r = report
    segments = ", ".join(f"{mode} {n:g}" for mode, n in sorted(r.segments.items()))
    what = "LoRA" if r.lora else "full fine-tuning"
    checkpointing = "on" if r.checkpointing else "off"
    lines = [
        f"plan of experiment={r.experiment} ({r.backbone}, architecture from {r.arch})",
        f"  {r.world_size} ranks x {r.gpu_memory_gib:g} GiB; transformer {r.num_params / 1e9:.2f} B parameters, "
        f"{what} ({r.num_trainable / 1e9:.3f} B trained), activation checkpointing {checkpointing}",
        f"  {r.samples_per_rank} samples per rank per step, {r.image_tokens} image + {r.text_tokens} text tokens each; "
        f"micro-batch {r.micro_batch}, segments per micro-batch: {segments}",
        "",
        *_memory_lines(r),
        "",
        *_flop_lines(r),
        "",
        *_comm_lines(r),
        "",
        *_time_lines(r),
        "",
        *_shape_lines(r),
        "",
    ]
    peak = r.peak
    budget = f"{r.gpu_memory_gib:g} GiB less {r.reserved_gib:g} GiB reserved (CUDA context, NCCL, fragmentation)"
    if r.fits:
        lines.append(f"fits: the largest phase is {peak.name} at {_gib(peak.peak_bytes)} GiB, within {budget};")
        lines.append(f"  its largest term is {largest_term(r, peak)}")
    else:
        over = _gib(peak.peak_bytes - r.budget_bytes)
        lines.append(f"does not fit: {peak.name} needs {_gib(peak.peak_bytes)} GiB, {over} GiB over {budget};")
        lines.append(f"  its largest term is {largest_term(r, peak)}. Each change alone:")
        lines += advice(r)
    need = _gib(peak.peak_bytes + r.reserved_gib * GIB)
    lines.append(
        f"needs GPUs of at least {need} GiB each ({r.reserved_gib:g} GiB reserved); traced in {r.seconds:.0f} s"
    )
    verdict = "fits" if r.fits else "does not fit"
    lines.append(f"peak per rank {_gib(peak.peak_bytes)} GiB of {r.gpu_memory_gib:g} GiB: {verdict}")
    return "\n".join(lines)
