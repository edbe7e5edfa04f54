"""Worker of tests/unit/test_reward_stage.py's 2-rank test: ``torchrun --nproc_per_node 2 stage_worker.py OUT``.

Each rank scores 2 toy groups of its own with a required term and an optional one that fails on rank 1 only (a
served judge), over gloo; it writes ``OUT/rank{r}.json``: the step's metrics, its advantages, and the console
lines of the reward stage."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from stage_toys import ToyRollout, ToyScorer, brightness, redness, toy_stage

from train.loop.step import roll_out_and_score
from train.parts.observe.perf import PhaseTimer
from train.run.start import process_group


def main() -> None:
    out = Path(sys.argv[1])
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("train.parts.scoring.stage").addHandler(handler)
    with process_group() as dist:
        fail = RuntimeError("the judge went away") if dist.rank == 1 else None
        judge = ToyScorer(redness, served=True, fail=fail)
        components = {"a": (ToyScorer(brightness), 1.0), "judge": (judge, 1.0)}
        stage = toy_stage(components, chunk_groups=1, optional=["judge"], rank=dist.rank, world_size=dist.world_size)
        rollout = ToyRollout(num_groups=2, first_group=2 * dist.rank)
        _, _, scored = roll_out_and_score(rollout, stage, PhaseTimer())  # type: ignore[arg-type]  # a toy rollout
    result = {"metrics": scored.metrics, "advantages": scored.advantages.tolist(), "lines": lines}
    (out / f"rank{dist.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
