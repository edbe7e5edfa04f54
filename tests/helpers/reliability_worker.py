"""Worker of the 2-rank tests of tests/e2e/test_faults_lost_work.py: ``torchrun --nproc_per_node 2 THIS CASES``.

CASES is a JSON file {name: {"overrides": [...], "sigterm": {"rank": r, "step": k}, "fail": {"rank": r,
"step": k}}}; the cases train in turn in one process group, through the library the trainer's entry point
uses. With "sigterm", rank r sends itself SIGTERM during training step k, as a scheduler signalling one
node would; with "fail", rank r's reward raises a RuntimeError in training step k (a reward server gone).
Rank 0 writes ``outcome.json`` beside CASES: per case, how each rank's run ended ("done" or the
exception's name).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from hydra import compose, initialize_config_module

import train.loop.trainer as trainer
from train.distributed.collectives import gather_objects
from train.parts.config.schema import register_schema
from train.run.build import open_run
from train.run.start import load_config, process_group


def _server_gone(images, prompts):
    raise RuntimeError("the reward server went away")


def main() -> None:
    cases_file = Path(sys.argv[1])
    cases = json.loads(cases_file.read_text())
    register_schema()
    real_step = trainer.train_step
    outcome = {}
    with process_group() as dist:
        for name, case in cases.items():
            with initialize_config_module(config_module="configs", version_base=None):
                cfg = compose(config_name="train", overrides=case["overrides"])
            sigterm, fail = case.get("sigterm"), case.get("fail")

            def step(run, k, *stop, sigterm=sigterm, fail=fail):
                if fail and dist.rank == fail["rank"] and k == fail["step"]:
                    next(iter(run.data.reward_stage.rewards.components.values()))[0].score = _server_gone
                out = real_step(run, k, *stop)
                if sigterm and dist.rank == sigterm["rank"] and k == sigterm["step"]:
                    os.kill(os.getpid(), signal.SIGTERM)
                return out

            trainer.train_step = step
            try:
                with open_run(load_config(cfg), dist) as run:
                    trainer.Trainer(run).train()
                ended = "done"
            except Exception as err:  # how the run ended on this rank, by name
                ended = type(err).__name__
                print(f"rank {dist.rank}, case {name}: {ended}: {err}", file=sys.stderr, flush=True)
            outcome[name] = dict(enumerate(gather_objects(ended)))
    if dist.is_main:
        (cases_file.parent / "outcome.json").write_text(json.dumps(outcome))


if __name__ == "__main__":
    main()
