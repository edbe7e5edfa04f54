"""The planner against the measured step, and the full-depth plan re-made with what was measured.

Memory: the planner traces the reduced model the preflight ran; its error on this cluster is the ratio of the
measured peak (the caching allocator's reserved bytes: fragmentation included) to the traced one. The full-depth
plan's phase peaks are multiplied by that ratio, and the budget is the device's memory less what torch does not
hold (the CUDA context, NCCL's buffers), as measured; so ``plan.reserved_gib``'s guess is replaced by both
measurements.

Time: the full-depth plan re-timed by the planner's own arithmetic (train/tools/plan/comm.py) with the device's peak and
the MFU measured on the reduced step (its rollout, update and optimizer phases) in place of ``plan.mfu`` and
``plan.gpu``, and the measured link rates in place of ``plan.intra_node_gbps`` / ``plan.inter_node_gbps``; the
measured reward phase (decode and scoring, which the planner does not time and which do not grow with depth) is
added per step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from train.tools.plan.advice import advice
from train.tools.plan.report import GIB, Phase, PlanReport, in_gib


@dataclass(frozen=True)
class MemoryCompare:
    traced_bytes: float  # the planner's peak of the reduced model
    measured_bytes: float  # the reduced step's measured peak (the largest rank's)

    @property
    def ratio(self) -> float:
        return self.measured_bytes / self.traced_bytes

    @property
    def error(self) -> float:
        """The planner's error: (traced - measured) / measured, negative when it under-counts."""
        return (self.traced_bytes - self.measured_bytes) / self.measured_bytes

    def line(self) -> str:
        return (
            f"reduced model: traced peak {in_gib(self.traced_bytes)} GiB, measured {in_gib(self.measured_bytes)} GiB "
            f"(the planner's error {self.error:+.0%})"
        )


def _scaled(phase: Phase, ratio: float) -> Phase:
    return replace(phase, peak_bytes=round(phase.peak_bytes * ratio), working_bytes=round(phase.working_bytes * ratio))


def corrected_memory(
    report: PlanReport, memory: MemoryCompare, *, total_bytes: float, other_bytes: float
) -> PlanReport:
    """``report`` (full depth) with every phase's peak times the measured ratio, on the measured device budget."""
    r = memory.ratio
    return replace(
        report,
        phases=[_scaled(p, r) for p in report.phases],
        updates=[_scaled(u, r) for u in report.updates],
        gpu_memory_gib=total_bytes / GIB,
        reserved_gib=other_bytes / GIB,
    )


def bound_parts(report: PlanReport) -> list[str]:
    """The parts of a step whose communication takes longer than their compute."""
    return [name for name, flops, traffic in report.time_terms() if report.seconds_of(flops, traffic) >
            flops / (report.peak_tflops * 1e12 * report.mfu)]  # fmt: skip


def plan_summary(report: PlanReport, extra_step_seconds: float) -> dict[str, Any]:
    """fits, the peak, s/step and h/run of a (corrected, re-timed) plan, and the update calls and optimizer steps
    it counts per step and rank (every pass of grpo.inner_epochs); ``extra_step_seconds``: measured per step besides
    the planner's parts."""
    step = report.step_seconds() + extra_step_seconds
    run = report.run_seconds() + extra_step_seconds * report.num_steps
    return {
        "fits": report.fits,
        "peak_gib": report.peak.peak_bytes / GIB,
        "peak_phase": report.peak.name,
        "budget_gib": report.budget_bytes / GIB,
        "step_seconds": step,
        "run_hours": run / 3600,
        "update_calls": sum(u.calls_per_step for u in report.configured_updates()),
        "optimizer_steps": sum(p.calls_per_step for p in report.phases if p.name == "optimizer"),
        "communication_bound": bound_parts(report),
        "advice": [line.strip() for line in advice(report)] if not report.fits else [],
    }
