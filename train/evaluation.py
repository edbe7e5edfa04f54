"""Evaluation: sample a prompt file with the ODE and fixed seeds, score it, write JSON and a grid.

Prompt i always starts from the noise of the stream (eval.seed, "eval_noise", i), so scores do not
depend on the number of ranks or the batch size. Prompts are dealt round-robin to ranks and the
scores gathered; the trainer calls ``evaluate`` every ``logging.eval_every`` steps on all ranks and
``python -m train.eval`` (train/eval.py) once.
Output: ``<run_dir>/eval/<tag>.json`` with means overall and per category (when the prompt file is
JSON lines with a "category", as the HPSv2 benchmark) and ``<run_dir>/eval/<tag>.png``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import Tensor

from models.base import Backbone
from rewards.base import Scorer
from rewards.summary import image_grid, summarize
from samplers.rollout import Predict, group_noise, rollout
from samplers.sde import SDE
from train.config import TrainConfig
from train.data import PromptRecord
from train.distributed import DistInfo, all_gather_tensor
from train.seeds import stream_seed


def _sample(
    backbone: Backbone, predict: Predict, prompts: list[str], indices: list[int], cfg: TrainConfig, device: torch.device
) -> Tensor:
    """Images of ``prompts`` by the ODE; prompt i's noise comes from (eval.seed, i)."""
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
    predict: Predict,
    scorers: dict[str, Scorer],
    records: list[PromptRecord],
    cfg: TrainConfig,
    dist: DistInfo,
    *,
    device: torch.device,
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
        images = _sample(backbone, predict, prompts, idx, cfg, device)
        for name, scorer in scorers.items():
            scores[name].append(scorer(images, prompts))
        grid.append(images)
    # Every rank scored per_rank prompts (padded by repeating its last one): gather, then drop pads.
    owner = all_gather_tensor(torch.tensor([mine[min(i, len(mine) - 1)] for i in range(per_rank)]))
    keep = _first_occurrences(owner)
    gathered = {name: all_gather_tensor(torch.cat(vals))[keep] for name, vals in scores.items()}
    categories = [records[int(i)].category for i in owner[keep]]
    named = [c for c in categories if c is not None]
    summary = summarize(gathered, named if len(named) == len(categories) else None)
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
