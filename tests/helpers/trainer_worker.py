"""Worker of tests/e2e/test_trainer.py's multi-rank test: ``torchrun --nproc_per_node 2 trainer_worker.py CASES``.

CASES is a JSON file {name: [Hydra overrides]}; every case trains in turn in one process group (one
torchrun start-up for all of them), through the library the trainer's entry point uses
(train.run.build.open_run, then train.loop.trainer.Trainer.train), each into the run_dir its overrides name.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_module

from train.loop.trainer import Trainer
from train.parts.config.schema import register_schema
from train.run.build import open_run
from train.run.start import load_config, process_group


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    register_schema()
    with process_group() as dist:
        for overrides in cases.values():
            with initialize_config_module(config_module="configs", version_base=None):
                cfg = compose(config_name="train", overrides=overrides)
            with open_run(load_config(cfg), dist) as run:
                Trainer(run).train()


if __name__ == "__main__":
    main()
