"""Rank 0, once every rank has answered: the planner's plans (the reduced model the preflight ran, and the full
depth), the disk, the comparison with what was measured, and the verdict (train/tools/preflight/compare.py)."""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from train.ground.errors import UserError
from train.ground.layout import RunLayout
from train.parts.checkpoint.manager import CheckpointManager
from train.tools.plan.command import plan, plannable
from train.tools.plan.report import GIB, PlanReport
from train.tools.preflight.compare import MemoryCompare, corrected_memory, plan_summary
from train.tools.preflight.links import LinkRate, link_checks
from train.tools.preflight.preflight_config import PreflightRunConfig
from train.tools.preflight.reduced import STAND_IN_REWARD, StepMeasure
from train.tools.preflight.scorers import measured_reward, reward_check
from train.tools.preflight.session import Found
from train.tools.preflight.verdict import Check, Status, Verdict, merged

KEEP_ROOM = 1  # the newest checkpoint is written before the oldest is deleted: keep_last + 1 at once


def plan_settings(cfg: PreflightRunConfig, machine: dict[str, Any], arch: Path) -> PreflightRunConfig:
    """The planner's settings for this launch: its world (2 for one process: the planner traces FSDP2), its ranks
    per node, its GPU's memory."""
    p = replace(cfg.plan, world_size=max(2, machine["world_size"]), arch=str(arch), output=None)
    p.gpus_per_node = max(1, min(machine["local_world_size"], p.world_size))
    p.gpu_memory_gib = machine.get("gpu_memory_gib", p.gpu_memory_gib)
    return replace(cfg, plan=p)


def checkpoint_bytes(report: PlanReport) -> float:
    """One checkpoint of the run, one replica's shards (HSDP's replicas hold the same): the transformer, AdamW's
    moments and the EMA in float32."""
    return (report.param_bytes + report.optimizer_bytes + report.ema_bytes) * report.cluster.shard_size


def disk_check(cfg: PreflightRunConfig, report: PlanReport) -> Check:
    """Room on the run folder's disk for checkpoint.keep_last checkpoints of the full-depth run, the next one, and
    with checkpoint.keep_best the best one (its files outlive the rotation)."""
    best = int(cfg.checkpoint.keep_best)
    count = cfg.checkpoint.keep_last + KEEP_ROOM + best
    needed = count * checkpoint_bytes(report)
    manager = CheckpointManager(RunLayout(cfg.run_dir).root, cfg.checkpoint)
    kept = f"checkpoint.keep_last={cfg.checkpoint.keep_last}" + (", checkpoints/best/" if best else "")
    what = f"{count} checkpoints ({kept} and the next one being written)"
    try:
        manager.check_space(int(needed), what)
    except UserError as err:
        fix = "free space there, lower checkpoint.keep_last, or pass a hydra.run.dir on a larger disk"
        return Check("disk", Status.failed, str(err).splitlines()[0], fix)
    return Check("disk", Status.passed, f"room for {what}, {needed / 1e9:.3g} GB")


def _rates(links: list[list[LinkRate]], cfg: PreflightRunConfig) -> tuple[float, float]:
    """(in a node, across nodes) Gb/s: the slowest rank's slowest collective on that link, else the plan's."""
    rates = [rate for per_rank in links for rate in per_rank]
    intra = min((r.gbps for r in rates if not r.across_nodes), default=cfg.plan.intra_node_gbps)
    return intra, min((r.gbps for r in rates if r.across_nodes), default=cfg.plan.inter_node_gbps)


def _memory(found: Found, plan_cfg: PreflightRunConfig, scratch_model: Path) -> MemoryCompare | None:
    """The planner's trace of the reduced model against its measured peak (CUDA only: CPU has no allocator
    statistics)."""
    peaks = [s.peak_bytes for s in found.steps if s is not None and s.peak_bytes is not None]
    if not peaks or len(peaks) != len(found.steps):
        return None
    reduced_cfg = replace(plan_cfg, plan=replace(plan_cfg.plan, arch=str(scratch_model)))
    if plan_cfg.preflight.stand_in_rewards:  # as the step ran: the reward models it did not load are not counted
        reduced_cfg = replace(reduced_cfg, reward=replace(plan_cfg.reward, components=dict(STAND_IN_REWARD)))
    reduced = plan(reduced_cfg, model_path_given=True)
    return MemoryCompare(traced_bytes=reduced.peak.peak_bytes, measured_bytes=max(peaks))


def full_plan(found: Found, cfg: PreflightRunConfig, step: StepMeasure) -> tuple[list[Check], dict[str, Any]]:
    """The full-depth plan corrected and re-timed, its checks (memory compare, disk, plan) and its summary."""
    plan_cfg = plan_settings(cfg, found.machines[0], Path(cfg.model.path))
    plannable(plan_cfg)
    report = plan(plan_cfg, model_path_given=True)
    checks, out = [disk_check(cfg, report)], {"traced": plan_summary(report, 0.0)}
    memory = _memory(found, plan_cfg, RunLayout(cfg.run_dir).preflight_scratch / "model")
    if memory is not None:
        assert step.total_bytes is not None and step.other_bytes is not None
        report = corrected_memory(report, memory, total_bytes=step.total_bytes, other_bytes=step.other_bytes)
        checks.append(Check("planner memory", Status.passed, memory.line()))
        out["memory"] = {"traced_gib": memory.traced_bytes / GIB, "measured_gib": memory.measured_bytes / GIB,
                         "error": memory.error}  # fmt: skip
    else:
        checks.append(Check("planner memory", Status.skipped, "no allocator statistics on CPU: the planner's memory "
                            "is compared with a step on GPUs"))  # fmt: skip
    intra, inter = _rates(found.links, cfg)
    report = replace(report, intra_gbps=intra, inter_gbps=inter)
    if step.mfu is not None and step.peak_tflops and math.isfinite(step.mfu):  # else a GPU of unknown peak
        report = replace(report, peak_tflops=step.peak_tflops, peak_source=step.peak_source, mfu=step.mfu)
    report = measured_reward(report, step.scorers)
    if step.scorers:
        checks.append(reward_check(report, step.scorers))
        exposed, hidden = report.reward_seconds()
        out["reward"] = {"scorers": [asdict(t) for t in step.scorers], "exposed_s": exposed, "hidden_s": hidden}
    summary = plan_summary(report, _decode_seconds(step, report.samples_per_rank))
    out["corrected"] = summary
    checks.append(
        _plan_check(summary, report, planned_world=plan_cfg.plan.world_size, world=found.machines[0]["world_size"])
    )
    return checks, out


def _decode_seconds(step: StepMeasure, samples: int) -> float:
    """The measured reward phase less its scorers' time on the rank's ``samples`` images (the plan's reward stage
    holds them, measured): the VAE decode, which does not grow with the transformer's depth."""
    scoring = sum(t.batch_s * samples / t.batch for t in step.scorers if t.batch_s is not None)
    return max(0.0, step.seconds.get("reward", 0.0) - scoring)


def _plan_check(s: dict[str, Any], report: PlanReport, *, planned_world: int, world: int) -> Check:
    at = f" (planned on {planned_world} ranks: the planner traces FSDP2)" if planned_world != world else ""
    timing = f"{s['step_seconds']:.3g} s/step, {s['run_hours']:.3g} h for {report.num_steps} steps"
    if not s["fits"]:
        line = f"full depth does not fit{at}: {report.peak.name} needs {s['peak_gib']:.1f} GiB of {s['budget_gib']:.1f}"
        fix = "; ".join(s["advice"][:2]) or "python -m train.plan with these settings lists what to change"
        return Check("plan", Status.failed, f"{line}; {timing}", fix)
    line = f"full depth fits{at}: peak {s['peak_gib']:.1f} GiB ({s['peak_phase']}) of {s['budget_gib']:.1f}; {timing}"
    if s["communication_bound"]:
        fix = ("HSDP with one replica per node (dist.replicate_degree=<nodes>) or faster links; python -m train.plan "
               "shows the step on other cluster shapes")  # fmt: skip
        return Check("plan", Status.warned, f"{line}; communication-bound: {', '.join(s['communication_bound'])}", fix)
    return Check("plan", Status.passed, line)


def conclude(found: Found) -> Verdict:
    """Every rank's checks merged, the collectives held to the plan, the step and the plan."""
    checks = merged(found.checks)
    cfg, steps = found.config, found.steps
    verdict = Verdict(checks, found.machines)
    if cfg is None or not found.passed() or any(s is None for s in steps):
        checks.append(Check("plan", Status.skipped, "not planned: fix the failed checks first"))
        return verdict
    if found.links and found.links[0]:
        compared = found.machines[0]["device"].startswith("cuda")
        checks += link_checks(found.links, intra_gbps=cfg.plan.intra_node_gbps, inter_gbps=cfg.plan.inter_node_gbps,
                              slow_link=cfg.preflight.slow_link, compared=compared)  # fmt: skip
    else:
        checks.append(Check("collectives", Status.skipped, "one process: FSDP2 issues no collective"))
    step = steps[0]
    assert step is not None
    stand_in = "; scored by the stand-in reward (preflight.stand_in_rewards)" if cfg.preflight.stand_in_rewards else ""
    checks.append(step_check(step, [s for s in steps if s is not None], stand_in))
    verdict.step = {"ranks": [s.to_json() for s in steps if s is not None]}
    try:
        plan_checks, verdict.plan = full_plan(found, cfg, step)
    except UserError as err:
        plan_checks = [Check("plan", Status.skipped, f"the planner cannot plan this run: {str(err).splitlines()[0]}")]
    checks += plan_checks
    return verdict


def step_check(step: StepMeasure, every: list[StepMeasure], stand_in: str) -> Check:
    """The measured step; failed when a step's update was skipped for a NaN or inf reward (the run would not learn)."""
    line = step_line(step, every) + stand_in
    if not step.skipped:
        return Check("step", Status.passed, line)
    which = ", ".join(map(str, step.skipped))
    line += f"; the update of step {which} was skipped: a reward was NaN or inf"
    return Check("step", Status.failed, line, "the reward check names the term: fix it, then run the preflight again")


def step_line(step: StepMeasure, every: list[StepMeasure]) -> str:
    phases = ", ".join(f"{name} {step.seconds[name]:.2f}" for name in ("rollout", "reward", "update", "optimizer")
                       if name in step.seconds)  # fmt: skip
    peaks = [s.peak_bytes for s in every if s.peak_bytes is not None]
    memory = f"peak {max(peaks) / GIB:.2f} GiB reserved (largest rank)" if peaks else "peak memory: not measured on CPU"
    mfu = f"MFU {step.mfu:.3f} of {step.peak_tflops:.3g} TFLOP/s ({step.peak_source})" if step.mfu else "MFU unknown"
    passes = f"; the update's {step.passes} passes: {step.update_calls} calls" if step.passes > 1 else ""
    return (f"{step.blocks} of {step.full_blocks} blocks: {step.seconds.get('step', math.nan):.2f} s "
            f"({phases}){passes}; {memory}; {mfu}")  # fmt: skip
