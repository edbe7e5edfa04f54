"""The trainer's evaluation: an ``Evaluator`` built once with its prompts (and the held-out ones), scorers and
the step-0 result, called after ``step`` training steps on all ranks.

A call runs the protocol of train/parts/eval/protocol.py (with the EMA weights when kept) on the
evaluation prompts and, when ``eval.heldout_prompts`` is set, on those as a second evaluation; logs
``eval/<metric>[/<category>]`` and ``eval/<metric>/held-out[/<category>]`` at ``step``, last (a resumed run
evaluates again a step whose row is missing); before that rank 0 prints the line against step 0 (``eval step
20: shape_alignment 0.5735 (step 0: 0.5862); held-out: shape_alignment 0.5401 (step 0: 0.5362)``), sends the
captioned grid to wandb and writes ``eval/before_after_<tag>.png``: the same prompts and noise at step 0 and
after ``step`` steps. A file the disk refuses ends the run in one line on every rank (``SaveFailed``). A scorer left
out of an evaluation (a served one that failed: train/parts/eval/protocol.py) has no ``eval/<metric>`` in its row;
an evaluation that no scorer could score logs nothing, and training goes on.

The step-0 grid is saved as ``eval/step_00000000.grid.pt`` (uint8) beside its scores: a resumed
session does not evaluate step 0 again, and its ``Evaluator`` reads the step-0 result back from the files.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

from rewards.summary import overall
from train.distributed.collectives import agree_on_write
from train.parts.data.prompts import PromptRecord, read_prompts
from train.parts.eval.eval_config import EvalConfig
from train.parts.eval.protocol import EvalParts, EvalResult, before_after, evaluate, read_scores
from train.parts.eval.tags import HELD_OUT, eval_line, eval_tag, heldout_tag
from train.parts.observe.logger import RunLogger
from train.parts.optim.ema import EMA

log = logging.getLogger(__name__)


class Evaluator:
    """The evaluation of the policy during training (the module docstring says what one call does)."""

    def __init__(
        self,
        parts: EvalParts,
        *,
        train_prompts: str,
        folder: Path,
        num_steps: int,
        start: int,
        ema: EMA | None,
        logger: RunLogger,
        before_writing: Callable[[], None] | None = None,
    ) -> None:
        """The evaluation of ``parts.predict`` (the policy: it follows backbone.transformer as it trains; the EMA's
        weights, swapped in, when kept) into ``folder`` (``<run_dir>/eval``) for a session that starts at step
        ``start``: a resumed session's rank 0 reads the step-0 result back from there, for its comparisons.
        ``before_writing`` runs on every rank once an evaluation's scores are gathered, before it writes anything
        (a collective)."""
        self.parts, self.folder, self.num_steps = parts, folder, num_steps
        self.ema, self.logger, self.before_writing = ema, logger, before_writing
        self.records = read_eval_prompts(parts.cfg, train_prompts)  # eval.samples_per_prompt times each
        self.heldout = read_heldout_prompts(parts.cfg)  # likewise; empty: no held-out evaluation
        resumed = start > 0 and parts.dist.is_main
        # rank 0: the step-0 result and the held-out prompts' step-0 means, for the lines and the before/after sheets
        self.before = read_result(folder, eval_tag(0)) if resumed else None
        self.heldout_before = read_summary(folder, heldout_tag(0)) if resumed and self.heldout else None

    def due(self, done: int) -> bool:
        """After ``done`` steps: every eval.every steps, and after the last step whatever its number."""
        return done % self.parts.cfg.every == 0 or done == self.num_steps

    def __call__(self, step: int) -> dict[str, float]:
        """Evaluate the policy after ``step`` training steps: log it on all ranks, show it on rank 0; the row it
        logged (empty when no scorer scored). A file the disk refuses (rank 0 writes them) ends the run on every
        rank with SaveFailed (DiskFull), in one line; the evaluation's row is not logged, so a resumed run
        evaluates it again."""
        logged: dict[str, float] = {}
        agree_on_write(lambda: logged.update(self._run(step)), self.folder, f"the evaluation after step {step}")
        return logged

    def _run(self, step: int) -> dict[str, float]:
        result = self._evaluate(self.records, eval_tag(step))
        if not result.summary:  # every scorer left out: no row, so a resume from this step's checkpoint redoes it
            if self.parts.dist.is_main:
                log.warning(
                    "the evaluation after step %d has no scores (the lines above say why): training goes on", step
                )
            return {}
        metrics = logged_metrics(result.summary, "")
        heldout = (self._evaluate(self.heldout, heldout_tag(step)).summary or None) if self.heldout else None
        if heldout is not None:
            metrics |= logged_metrics(heldout, f"/{HELD_OUT}")
        if self.parts.dist.is_main:  # the files first: the row says the evaluation is whole (a resume looks for it)
            self._show(result, heldout, step)
        self.logger.log(metrics, step)
        return metrics

    def _evaluate(self, records: list[PromptRecord], tag: str) -> EvalResult:
        with self.ema.swapped() if self.ema is not None else nullcontext():
            return evaluate(self.parts, records, tag=tag, out=self.folder, before_writing=self.before_writing)

    def _show(self, result: EvalResult, heldout: dict[str, float] | None, step: int) -> None:
        """The console line, the grid on wandb and the sheet against step 0 (which step 0 itself keeps)."""
        if step == 0:
            self.before, self.heldout_before = result, heldout
            save_grid(result, self.folder)
        before = self.before
        first = before.summary if before is not None else None
        log.info(eval_line(step, result.summary, first, heldout=heldout, heldout_first=self.heldout_before))
        metric = next(iter(overall(result.summary)))
        prompts = [self.records[i].prompt for i in result.indices]
        scores = result.grid_scores(metric)
        captions = [f"#{i} {metric} {v:.4f}: {p}" for i, v, p in zip(result.indices, scores, prompts)]
        self.logger.log_wandb_images("eval/images", result.images, captions, step)
        if step > 0 and before is not None and before.indices == result.indices and metric in before.summary:
            sheet = before_after(before, result, prompts, metric, ("step 0", f"step {step}"))
            path = self.folder / f"before_after_{result.tag}.png"
            sheet.save(path)
            self.logger.log_wandb_images("eval/before_after", path, [f"step 0 | step {step}: {metric}"], step)


def logged_metrics(summary: dict[str, float], suffix: str) -> dict[str, float]:
    """eval/<metric><suffix>[/<category>] for a summary's <metric>[/<category>] keys."""
    keyed = {}
    for key, value in summary.items():
        metric, _, category = key.partition("/")
        keyed[f"eval/{metric}{suffix}" + (f"/{category}" if category else "")] = value
    return keyed


def save_grid(result: EvalResult, folder: Path) -> None:
    """``<folder>/<tag>.grid.pt``: the grid's images as uint8 and their prompt indices (``read_result``)."""
    pixels = (result.images.clamp(0, 1) * 255).round().to(torch.uint8)
    torch.save({"images": pixels, "indices": result.indices}, folder / f"{result.tag}.grid.pt")


def read_summary(folder: Path, tag: str) -> dict[str, float] | None:
    """The means of the evaluation ``tag`` in ``folder`` (its ``<tag>.json``), or None when it is missing."""
    path = folder / f"{tag}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def read_result(folder: Path, tag: str) -> EvalResult | None:
    """The evaluation ``tag`` read back from its files in ``folder`` (the grid to 1/255), or None
    when its summary or grid is missing."""
    summary, grid = read_summary(folder, tag), folder / f"{tag}.grid.pt"
    if summary is None or not grid.is_file():
        return None
    saved = torch.load(grid)
    rows = read_scores(folder / f"{tag}.scores.jsonl")
    return EvalResult(tag, summary, rows, saved["images"].float() / 255, saved["indices"])


def read_eval_prompts(cfg: EvalConfig, train_prompts: str) -> list[PromptRecord]:
    """``eval.prompts`` (or ``train_prompts``, data.train_prompts), cut to ``eval.num_prompts`` when set, each
    ``eval.samples_per_prompt`` times (item j * n + i is sample j of prompt i: its own noise)."""
    records = read_prompts(cfg.prompts or train_prompts, field_name="eval.prompts")
    return records[: cfg.num_prompts or None] * cfg.samples_per_prompt


def read_heldout_prompts(cfg: EvalConfig) -> list[PromptRecord]:
    """``eval.heldout_prompts`` (none when unset), each ``eval.samples_per_prompt`` times."""
    if cfg.heldout_prompts is None:
        return []
    return read_prompts(cfg.heldout_prompts, field_name="eval.heldout_prompts") * cfg.samples_per_prompt


def evaluates(cfg: EvalConfig, *, start: int, num_steps: int, again: bool) -> bool:
    """Whether a session that starts at step ``start`` evaluates at all: eval.every > 0 and a step left to train, or
    the evaluation after step ``start`` to do again (lost to a crash), even after the last step."""
    return bool(cfg.every) and (start < num_steps or again)
