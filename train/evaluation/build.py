"""The trainer's evaluation, built for a session: the evaluation prompts (and the held-out ones), the
evaluation's scorers, and for a resumed session the step-0 result read back from the run folder."""

from __future__ import annotations

import torch

from models.base import Backbone
from samplers.rollout import Predict
from train.components.config import TrainConfig
from train.distributed.collectives import DistInfo
from train.evaluation.evaluator import Evaluator, read_result, read_summary
from train.evaluation.summary import eval_tag, heldout_tag
from train.observe.logger import RunLogger
from train.optim.ema import EMA
from train.run.layout import RunLayout
from train.run.prompts import PromptRecord, read_prompts
from train.run.scorers import build_eval_scorers


def read_eval_prompts(cfg: TrainConfig) -> list[PromptRecord]:
    """``eval.prompts`` (or the training prompts), cut to ``eval.num_prompts`` when set, each
    ``eval.samples_per_prompt`` times (item j * n + i is sample j of prompt i: its own noise)."""
    records = read_prompts(cfg.eval.prompts or cfg.data.train_prompts, field_name="eval.prompts")
    return records[: cfg.eval.num_prompts or None] * cfg.eval.samples_per_prompt


def read_heldout_prompts(cfg: TrainConfig) -> list[PromptRecord]:
    """``eval.heldout_prompts`` (none when unset), each ``eval.samples_per_prompt`` times."""
    if cfg.eval.heldout_prompts is None:
        return []
    return read_prompts(cfg.eval.heldout_prompts, field_name="eval.heldout_prompts") * cfg.eval.samples_per_prompt


def build_evaluator(
    cfg: TrainConfig,
    dist: DistInfo,
    *,
    start: int,
    device: torch.device,
    backbone: Backbone,
    predict: Predict,
    ema: EMA | None,
    logger: RunLogger,
) -> Evaluator | None:
    """The trainer's evaluation of ``predict`` (the policy; the EMA's weights when kept) for a session that
    starts at step ``start``, or None when it would evaluate nothing (eval.every=0, or no step
    left). A resumed session's rank 0 reads the step-0 result back from the run folder, for its comparisons."""
    if not cfg.eval.every or start == cfg.num_steps:
        return None
    records, heldout = read_eval_prompts(cfg), read_heldout_prompts(cfg)
    resumed = start > 0 and dist.is_main
    folder = RunLayout(cfg.run_dir).eval
    return Evaluator(
        cfg=cfg,
        dist=dist,
        device=device,
        backbone=backbone,
        predict=predict,
        ema=ema,
        logger=logger,
        scorers=build_eval_scorers(cfg, device),
        records=records,
        heldout=heldout,
        before=read_result(folder, eval_tag(0)) if resumed else None,
        heldout_before=read_summary(folder, heldout_tag(0)) if resumed and heldout else None,
    )
