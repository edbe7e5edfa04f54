"""``python -m train.eval``: sample a prompt file with the ODE and fixed seeds, score it, write JSON and a grid.

    python -m train.eval experiment=flux_dance model.path=... data.eval_prompts=hpsv2_bench.jsonl \
        eval.scorers.hpsv2.checkpoint=... eval.scorers.pickscore.model=... eval.scorers.clipscore.model=...
    python -m train.eval eval.transformer=runs/demo/<run>/export   # a trained transformer

The protocol is train/evaluation.py's; the output lands in ``<run_dir>/eval/eval.json`` and ``eval.png``.
"""

from __future__ import annotations

import json
from pathlib import Path

import hydra
from omegaconf import DictConfig

from train.build import build_eval_scorers, build_for_eval, load_config, process_group, read_eval_prompts
from train.cli import reported, run_hydra
from train.config import register_schema
from train.evaluation import evaluate

PROG = "python -m train.eval"


@hydra.main(config_path="pkg://configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    with reported(PROG):
        config = load_config(cfg)
        with process_group(config.dist.timeout_s) as dist:
            backbone, predict, device = build_for_eval(config, dist)
            scorers = build_eval_scorers(config, device)
            summary = evaluate(
                backbone, predict, scorers, read_eval_prompts(config), config, dist, device=device, tag="eval"
            )
        if dist.is_main:
            print(json.dumps(summary, indent=2))
            print(f"wrote {Path(config.run_dir) / 'eval' / 'eval.json'} and eval.png")


if __name__ == "__main__":
    register_schema()
    run_hydra(main, prog=PROG)
