"""Worker of tests/tools/test_plan.py: ``torchrun --nproc_per_node 2 plan_worker.py OUT OVERRIDES...``.

Runs the planner's phases of one training step with real tensors on a real 2-rank gloo group,
built and traced by the same functions ``python -m train.plan`` uses on fake tensors, and writes
rank 0's traced peaks (bytes, frozen models excluded) to ``OUT/real_peaks.json``.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
from hydra import compose, initialize_config_module

from train.components.build import FSDP_VIEW_WARNING
from train.components.config import register_schema
from train.distributed.collectives import init_distributed, shutdown
from train.plan.command import arch_folder, plan_config
from train.plan.config import register
from train.plan.tracing import expected_groups, trace_step, traced_run


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
            traced = trace_step(run, expected_groups(cfg))
        peaks = {p.name: p.peak_bytes for p in traced.phases + traced.updates}
        if dist.is_main:
            (out / "real_peaks.json").write_text(json.dumps(peaks))
    finally:
        shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
