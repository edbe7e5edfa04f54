"""Evaluation: sample a prompt file with the ODE and fixed seeds, score it, write JSON and a grid.

    python -m train.eval experiment=flux_dance model.path=... data.eval_prompts=hpsv2_bench.jsonl \
        eval.scorers.hpsv2.checkpoint=... eval.scorers.pickscore.model=... eval.scorers.clipscore.model=...
    python -m train.eval eval.transformer=runs/demo/<run>/export   # a trained transformer

Prompt i always starts from the noise of the stream (eval.seed, "eval_noise", i), so scores do not
depend on the number of ranks or the batch size. Prompts are dealt round-robin to ranks and the
scores gathered; the trainer calls ``evaluate`` every ``logging.eval_every`` steps on all ranks.
Output: ``<run_dir>/eval/<tag>.json`` with means overall and per category (when the prompt file is
JSON lines with a "category", as the HPSv2 benchmark) and ``<run_dir>/eval/<tag>.png``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from models.base import Backbone
from rewards.base import Scorer, build_scorer
from rewards.summary import image_grid, summarize
from samplers.rollout import group_noise, rollout
from samplers.sde import SDE
from train.config import TrainConfig, register_schema
from train.data import PromptRecord, read_prompts
from train.distributed import DistInfo, all_gather_tensor
from train.seeds import stream_seed


def build_eval_scorers(cfg: TrainConfig, device: torch.device) -> dict[str, Scorer]:
    """The evaluation metrics of ``eval.scorers`` (name -> constructor arguments)."""
    return {name: build_scorer(name, **kwargs).to(device) for name, kwargs in cfg.eval.scorers.items()}


def _sample(backbone: Backbone, predict, prompts: list[str], indices: list[int], cfg: TrainConfig) -> Tensor:
    """Images of ``prompts`` by the ODE; prompt i's noise comes from (eval.seed, i)."""
    device = next(backbone.transformer.parameters()).device
    h, w = cfg.model.height, cfg.model.width
    seeds = [stream_seed(cfg.eval.seed, "eval_noise", i) for i in indices]
    noise = group_noise(backbone.initial_noise, seeds, group_size=1, height=h, width=w, device=device)
    sigmas = backbone.sigmas(cfg.eval.num_steps, height=h, width=w, shift=cfg.sampler.shift)
    traj = rollout(
        predict,
        backbone.encode(prompts),
        noise,
        sigmas=sigmas,
        sde=SDE("ode"),
        quantize_timesteps=cfg.sampler.quantize_timesteps,
    )
    return backbone.decode(traj.latents[:, -1], height=h, width=w)


@torch.no_grad()
def evaluate(
    backbone: Backbone,
    predict,
    scorers: dict[str, Scorer],
    records: list[PromptRecord],
    cfg: TrainConfig,
    dist: DistInfo,
    *,
    tag: str,
) -> dict[str, float]:
    """Sample and score ``records`` across ranks; rank 0 writes JSON and grid; returns the means."""
    per_rank = math.ceil(len(records) / dist.world_size)
    mine = list(range(dist.rank, len(records), dist.world_size)) or [0]  # a rank with none pads with prompt 0
    scores: dict[str, list[Tensor]] = {name: [] for name in scorers}
    grid = []
    for first in range(0, per_rank, cfg.eval.batch_size):
        idx = [mine[min(i, len(mine) - 1)] for i in range(first, min(first + cfg.eval.batch_size, per_rank))]
        prompts = [records[i].prompt for i in idx]
        images = _sample(backbone, predict, prompts, idx, cfg)
        for name, scorer in scorers.items():
            scores[name].append(scorer(images, prompts))
        grid.append(images)
    # Every rank scored per_rank prompts (padded by repeating its last one): gather, then drop pads.
    owner = all_gather_tensor(torch.tensor([mine[min(i, len(mine) - 1)] for i in range(per_rank)]))
    keep = _first_occurrences(owner)
    gathered = {name: all_gather_tensor(torch.cat(vals))[keep] for name, vals in scores.items()}
    categories = [records[int(i)].category for i in owner[keep]]
    summary = summarize(gathered, categories if all(c is not None for c in categories) else None)
    if dist.is_main:
        out = Path(cfg.run_dir) / "eval"
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{tag}.json").write_text(json.dumps({"num_prompts": len(records), **summary}, indent=2))
        images = torch.cat(grid)[: cfg.eval.grid_size]
        image_grid(images).save(out / f"{tag}.png")
    return summary


def _first_occurrences(ids: Tensor) -> Tensor:
    seen, keep = set(), []
    for position, value in enumerate(ids.tolist()):
        if value not in seen:
            seen.add(value)
            keep.append(position)
    return torch.tensor(keep, dtype=torch.long)


register_schema()


@hydra.main(config_path="pkg://configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    from train.trainer import build_for_eval

    config: TrainConfig = OmegaConf.to_object(cfg)
    backbone, predict, dist = build_for_eval(config)
    records = read_prompts(config.data.eval_prompts or config.data.train_prompts, field_name="data.eval_prompts")
    if config.data.num_eval_prompts:
        records = records[: config.data.num_eval_prompts]
    summary = evaluate(
        backbone,
        predict,
        build_eval_scorers(config, next(backbone.transformer.parameters()).device),
        records,
        config,
        dist,
        tag="eval",
    )
    if dist.is_main:
        print(json.dumps(summary, indent=2))
        print(f"wrote {Path(config.run_dir) / 'eval' / 'eval.json'} and eval.png")


if __name__ == "__main__":
    main()
