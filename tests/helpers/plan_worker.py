"""Worker of tests/tools/test_plan_trace.py: ``torchrun --nproc_per_node 2 plan_worker.py OUT OVERRIDES...``.

Runs the planner's phases of one training step with real tensors on a real 2-rank gloo group,
built and traced by the same functions ``python -m train.plan`` uses on fake tensors, and writes
rank 0's traced peaks (bytes, frozen models excluded) to ``OUT/real_peaks.json`` and the collectives
each phase issued (counts, and the bytes of their unsharded tensors) to ``OUT/real_collectives.json``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
from collective_counter import CollectiveCounts, count_collectives
from hydra import compose, initialize_config_module
from torch.distributed.fsdp import FSDPModule

import train.tools.plan.tracing as tracing
from train.distributed.collectives import init_distributed, shutdown
from train.parts.config.schema import register_schema
from train.parts.policy.builder import FSDP_VIEW_WARNING
from train.tools.plan.command import arch_folder, plan_config
from train.tools.plan.counts import expected_segments
from train.tools.plan.fake_run import traced_run
from train.tools.plan.plan_config import register
from train.tools.plan.tracing import trace_step


class PhaseCollectives:
    """``train.tools.plan.tracing``'s ``measure`` and ``to_phase``, wrapped: each measured call counts its
    collectives, which the phase named next receives."""

    def __init__(self) -> None:
        self.by_phase: dict[str, dict[str, int]] = {}
        self._last: CollectiveCounts | None = None
        self._measure, self._to_phase = tracing.measure, tracing.to_phase

    def measure(self, root, optimizer, resident, fn):
        def counted():
            with count_collectives() as self._last:
                fn()

        return self._measure(root, optimizer, resident, counted)

    def to_phase(self, name, m, calls_per_step, **kwargs):
        c, self._last = self._last, None
        assert c is not None, name
        self.by_phase[name] = {
            "all_gathers": c.num_all_gathers,
            "reduce_scatters": c.num_reduce_scatters,
            "all_gather_bytes": c.all_gather_bytes,
            "reduce_scatter_bytes": c.reduce_scatter_bytes,
        }
        return self._to_phase(name, m, calls_per_step, **kwargs)

    def __enter__(self) -> PhaseCollectives:
        tracing.measure, tracing.to_phase = self.measure, self.to_phase
        return self

    def __exit__(self, *exc) -> None:
        tracing.measure, tracing.to_phase = self._measure, self._to_phase


def main(out: Path, overrides: list[str]) -> None:
    register_schema()
    register()
    with initialize_config_module(config_module="configs", version_base=None):
        cfg, model_path_given = plan_config(compose(config_name="plan", overrides=overrides))
    dist = init_distributed(backend="gloo")
    try:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=FSDP_VIEW_WARNING)
            run = traced_run(cfg, arch_folder(cfg, model_path_given))
            with PhaseCollectives() as collectives:
                traced = trace_step(run, expected_segments(cfg))
        peaks = {p.name: p.peak_bytes for p in traced.phases + traced.updates}
        modules = sum(isinstance(m, FSDPModule) for m in run.backbone.transformer.modules())
        if dist.is_main:
            (out / "real_peaks.json").write_text(json.dumps(peaks))
            real = {"fsdp_modules": modules, "phases": collectives.by_phase}
            (out / "real_collectives.json").write_text(json.dumps(real))
    finally:
        shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
