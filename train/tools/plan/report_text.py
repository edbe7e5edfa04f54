"""A plan as ``python -m train.plan`` prints it: the run, memory per rank and each phase's peak, FLOPs,
communication, the time estimate, the same step on other clusters, and the verdict with the changes that
would lower the peak."""

from __future__ import annotations

from dataclasses import replace

from train.tools.plan.advice import advice, largest_term
from train.tools.plan.comm import Traffic
from train.tools.plan.report import GIB, PlanReport, in_gib


def _memory_lines(r: PlanReport) -> list[str]:
    lines = [
        "memory per rank, GiB",
        f"  transformer shards (float32)               {in_gib(r.param_bytes):>7}",
        f"  gradients (float32 shards)                 {in_gib(r.grad_bytes):>7}",
        f"  optimizer state (AdamW)                    {in_gib(r.optimizer_bytes):>7}",
        f"  KL reference (shards)                      {in_gib(r.reference_bytes):>7}",
        f"  EMA (float32 shards)                       {in_gib(r.ema_bytes):>7}",
        f"  step tensors (trajectories, images)        {in_gib(r.step_tensor_bytes):>7}"
        f"   of which kept velocities {in_gib(r.velocity_bytes)}",
    ]
    for m in r.frozen:
        label = f"{m.role} {m.name} (replicated)"
        lines.append(f"  {label:<42} {in_gib(m.num_bytes):>7}   {m.num_params / 1e9:.2f} B parameters")
    lines += ["", "phase peaks per rank, GiB (working: the phase's own activations, all-gathered blocks, temporaries)"]
    labels = [
        p.name if p.checkpointing is None else f"{p.name}, {'AC' if p.checkpointing else 'no AC'}"
        for p in r.phases + r.updates
    ]
    width = max(map(len, labels))
    for p, label in zip([*r.phases, *r.updates], labels):
        note = "" if p.checkpointing in (None, r.checkpointing) else "  (other checkpointing setting)"
        lines.append(
            f"  {label:<{width}} peak {in_gib(p.peak_bytes):>6}   working {in_gib(p.working_bytes):>6}"
            f" (activations {in_gib(p.activation_bytes)}, all-gathered {in_gib(p.gathered_bytes)}){note}"
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
    if r.post_window_flops:
        rollout = r.phases[0].flops * r.phases[0].calls_per_step
        lines.append(
            f"  after the SDE window (sampler.post_window) the rollout is {rollout / 1e12:.1f}, "
            f"{(rollout + r.post_window_flops) / 1e12:.1f} on every step of the schedule: the step is "
            f"{step / 1e12:.1f} instead of {(step + r.post_window_flops) / 1e12:.1f}"
            f" -> {(step + r.post_window_flops) / step:.3f}x"
        )
    reference = r.reference_step_flops()
    lines.append(
        f"  the step as the reference trainers run it (every segment exact, no shared start, every step of the "
        f"schedule): {reference / 1e12:.1f} -> {reference / step:.2f}x fewer FLOPs"
    )
    return lines


def _gb(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.4g}"


def _sent(t: Traffic) -> str:
    """A traffic's columns of the communication table, GB."""
    gb = [_gb(x) for x in t.astuple()]  # all-gather, reduce-scatter, all-reduce, in node, across
    return f" {gb[0]:>11} {gb[1]:>15} {gb[2]:>11} {gb[3]:>8} {gb[4]:>7}"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 600 else f"{seconds / 3600:.1f} h"


def _comm_lines(r: PlanReport) -> list[str]:
    c = r.cluster
    nodes = max(1, r.world_size // r.gpus_per_node)
    sharding = "FSDP" if r.replicate == 1 else f"HSDP, {r.replicate} replicas of {c.shard_size} ranks"
    lines = [
        f"communication per rank per training step, GB sent ({sharding}; {r.world_size} ranks on {nodes} node(s) of "
        f"{r.gpus_per_node}; ring algorithms: train/tools/plan/comm.py)",
    ]
    width = max(len(p.name) for p in r.phases + r.configured_updates())
    lines.append(f"  {'phase':<{width}}  forwards  backwards  all-gather  reduce-scatter  all-reduce  in node  across")
    for p in [*r.phases, *r.configured_updates()]:
        calls = f"{p.forwards * p.calls_per_step:>9g} {p.backwards * p.calls_per_step:>10g}"
        lines.append(f"  {p.name:<{width}} {calls}{_sent(r.traffic(p))}")
    if r.shared_calls != (0.0, 0.0):
        forwards, backwards = r.shared_calls
        lines.append(f"  {'shared start':<{width}} {forwards:>+9.3g} {backwards:>+10.3g}{_sent(r.shared_traffic())}")
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


def _reward_lines(r: PlanReport) -> list[str]:
    """The reward stage: exposed (added to the step) and hidden behind the rollout, and what it assumes."""
    stage = r.reward
    if stage is None:
        return []
    exposed, hidden = r.reward_seconds()
    local = ", ".join(stage.local) or "none"
    if stage.local_seconds is None:
        local += f" ({stage.local_flops / 1e12:.1f} TFLOP at the MFU above)"
    served = "none"
    if stage.served:
        what = "assumed" if stage.source != "measured" else "measured"
        served = f"{', '.join(stage.served)} ({stage.served_seconds:.3g} s per chunk, {what}: {stage.source})"
    return [
        f"  reward     exposed  {exposed:>8.1f} s   hidden behind the rollout {hidden:>8.1f} s   "
        f"({stage.chunks} chunk(s) of reward.chunk_groups; local {local}; served {served})"
    ]


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
    lines += _reward_lines(r)
    step = r.step_seconds()
    lines.append(f"  training step {step:.1f} s; {r.num_steps} steps {_duration(r.num_steps * step)}")
    e = r.evaluation
    if e is not None:
        lines.append(
            f"  evaluation: {e.count} x {e.images} images ({e.images_per_rank} per rank, {e.flops / 1e12:.1f} TFLOP"
            f" each) {_duration(r.evaluation_seconds())}"
        )
    lines.append(f"  run: {_duration(r.run_seconds())} (not counted: text encoding, VAE decode, checkpoints)")
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
        lines.append(f"fits: the largest phase is {peak.name} at {in_gib(peak.peak_bytes)} GiB, within {budget};")
        lines.append(f"  its largest term is {largest_term(r, peak)}")
    else:
        over = in_gib(peak.peak_bytes - r.budget_bytes)
        lines.append(f"does not fit: {peak.name} needs {in_gib(peak.peak_bytes)} GiB, {over} GiB over {budget};")
        lines.append(f"  its largest term is {largest_term(r, peak)}. Each change alone:")
        lines += advice(r)
    need = in_gib(peak.peak_bytes + r.reserved_gib * GIB)
    lines.append(
        f"needs GPUs of at least {need} GiB each ({r.reserved_gib:g} GiB reserved); traced in {r.seconds:.0f} s"
    )
    verdict = "fits" if r.fits else "does not fit"
    lines.append(f"peak per rank {in_gib(peak.peak_bytes)} GiB of {r.gpu_memory_gib:g} GiB: {verdict}")
    return "\n".join(lines)
