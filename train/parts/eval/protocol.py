"""Evaluation: sample a prompt file with the ODE and fixed seeds, score it, write JSON, scores per prompt and a grid.

Prompt i always starts from the noise of the stream (eval.seed, "eval_noise", i), so scores do not
depend on the number of ranks or the batch size, and two models evaluated with the same prompts and
eval.seed saw the same noise: their per-prompt scores pair up. Prompts are dealt round-robin to
ranks and the scores gathered; the trainer's Evaluator (train/parts/eval/evaluator.py) calls
``evaluate`` every ``eval.every`` steps on all ranks and ``python -m train.eval``
(train/tools/eval/command.py) once or twice.
Output in ``<out>`` (``<run_dir>/eval`` for the trainer):

* ``<tag>.json``: means overall and per category (when the prompt file is JSON lines with a
  "category", as the HPSv2 benchmark), the number of prompts and the standard error over prompts;
* ``<tag>.scores.jsonl``: one line per prompt, ``{"index", "prompt", "category", "seed", <scorer>:
  value, ...}``; prompt ``index`` (its line in the prompt file; with ``eval.samples_per_prompt`` = m,
  item j * n + i is sample j of prompt i of n) started from the noise of the stream
  (seed, "eval_noise", index);
* ``<tag>.png``: the first ``eval.grid_size`` prompts' images, each with its index and first scorer's value.

A served scorer (a judge, the remote reward) that fails during an evaluation (a batch it could not score: NaN once
its tries ran out; an answer outside its protocol) is asked nothing more in that evaluation, and a scorer with a NaN
or inf score on any rank is left out of it on every rank (the gathered scores agree): one line names
``eval.scorers.<name>`` and why, the other scorers' means and files are written without it, and the next evaluation
asks it again. With no scorer left the evaluation writes nothing (its ``summary`` is empty): its caller says so.

Rank 0 prints a progress line every ``PROGRESS_S`` seconds of an evaluation (``eval step_00000025: 256/512
images, 31 s, eta 31 s``): a large evaluation set is not silence.

``paired_difference`` compares two such score files prompt by prompt (after - before, with the
standard error of the mean difference, which is what a before/after claim needs: the prompts'
own spread cancels out).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from models.base import Backbone
from models.model_config import ModelConfig
from rewards.base import Scorer
from rewards.served import RemoteRewardError
from rewards.summary import overall, summarize
from samplers.rollout import Predict, group_noise, rollout
from samplers.sampler_config import SamplerConfig
from samplers.sde import SDEKind
from train.distributed.collectives import DistInfo, all_gather_tensor
from train.distributed.seeds import stream_seed
from train.ground.errors import config_key
from train.parts.data.prompts import PromptRecord
from train.parts.eval.eval_config import EvalConfig
from train.parts.observe.console import format_seconds
from train.parts.observe.grid import MIN_TILE, before_after_sheet, image_grid
from train.parts.observe.stats import standard_error

log = logging.getLogger(__name__)
PROGRESS_S = 10.0  # seconds between an evaluation's progress lines


class _Progress:
    """``eval <tag>: <done>/<total> images, <elapsed>, eta <left>`` every PROGRESS_S seconds, on rank 0."""

    def __init__(self, tag: str, total: int, *, enabled: bool) -> None:
        self.tag, self.total, self.enabled = tag.removeprefix("eval_"), total, enabled
        self.began = self.last = time.perf_counter()

    def __call__(self, done: int) -> None:
        now = time.perf_counter()
        if not self.enabled or now - self.last < PROGRESS_S or done >= self.total:
            return
        self.last, elapsed = now, now - self.began
        left = format_seconds(elapsed / done * (self.total - done))
        log.info("eval %s: %d/%d images, %s, eta %s", self.tag, done, self.total, format_seconds(elapsed), left)


@dataclass
class EvalParts:
    """What an evaluation samples and scores with: the model (``predict``, the policy while it trains), the scorers
    of eval.scorers, and the groups it reads (eval.*, the sampler's shift, the model's image size)."""

    backbone: Backbone
    predict: Predict
    scorers: dict[str, Scorer]
    cfg: EvalConfig
    sampler: SamplerConfig
    model: ModelConfig
    dist: DistInfo
    device: torch.device


def _sample(parts: EvalParts, prompts: list[str], indices: list[int]) -> Tensor:
    """Images of ``prompts`` by the ODE; prompt i's noise comes from (eval.seed, i)."""
    backbone, h, w = parts.backbone, parts.model.height, parts.model.width
    seeds = [stream_seed(parts.cfg.seed, "eval_noise", i) for i in indices]
    noise = group_noise(backbone.initial_noise, seeds, group_size=1, height=h, width=w, device=parts.device)
    with config_key("sampler", ["shift"]):
        sigmas = backbone.sigmas(parts.cfg.num_steps, height=h, width=w, shift=parts.sampler.shift)
    ode = replace(parts.sampler, sde=SDEKind.ode)
    traj = rollout(parts.predict, backbone.encode(prompts), noise, ode, sigmas=sigmas)
    return backbone.decode(traj.latents[:, -1], height=h, width=w)


@dataclass
class EvalResult:
    """What one evaluation measured. ``rows`` and ``images`` are filled on rank 0 only."""

    tag: str
    summary: dict[str, float]  # mean of every scorer, overall and "<scorer>/<category>"
    rows: list[dict[str, Any]]  # per prompt, in prompt order: index, prompt, category, seed, <scorer>: value
    images: Tensor  # [n, 3, H, W]: the grid's images (rank 0's first eval.grid_size prompts)
    indices: list[int]  # prompt index of each of ``images``

    def means(self) -> dict[str, tuple[float, float]]:
        """Each scorer's mean over the prompts and its standard error (from ``rows``)."""
        summary = overall(self.summary).items()
        return {name: (value, standard_error([row[name] for row in self.rows])) for name, value in summary}

    def grid_scores(self, metric: str) -> list[float]:
        """``metric`` of each of ``images``."""
        by_index = {row["index"]: row[metric] for row in self.rows}
        return [float(by_index[i]) for i in self.indices]


@dataclass
class _Sampled:
    """What one rank sampled and scored: each scorer's scores per batch, and the grid's images (rank 0's)."""

    scores: dict[str, list[Tensor]]
    grid: list[Tensor]
    grid_indices: list[int]
    failed: dict[str, str] = field(default_factory=dict)  # a served scorer asked nothing more -> why (this rank's)


def _score(sampled: _Sampled, name: str, scorer: Scorer, images: Tensor, prompts: list[str]) -> Tensor:
    """``scorer``'s scores of a batch; NaN once it failed in this evaluation (an answer outside its protocol, or a
    batch its server could not score), so that a server that is down costs one request's tries, not every batch's."""
    if name not in sampled.failed:
        try:
            scores = scorer(images, prompts)
        except RemoteRewardError as err:
            sampled.failed[name] = f"it failed: {err}"
        else:
            if scorer.runs_remotely and not torch.isfinite(scores).all():
                sampled.failed[name] = "its server could not score a batch (the line above says why)"
            return scores
    return torch.full((images.shape[0],), math.nan, device=images.device)


def _sample_and_score(parts: EvalParts, records: list[PromptRecord], *, tag: str, mine: list[int]) -> _Sampled:
    """Sample and score this rank's prompts ``mine`` in batches of eval.batch_size, keeping rank 0's first images
    for the grid."""
    cfg, dist = parts.cfg, parts.dist
    sampled = _Sampled({name: [] for name in parts.scorers}, [], [])
    progress = _Progress(tag, len(records), enabled=dist.is_main)
    for first in range(0, len(mine), cfg.batch_size):
        idx = mine[first : first + cfg.batch_size]
        prompts = [records[i].prompt for i in idx]
        images = _sample(parts, prompts, idx)
        for name, scorer in parts.scorers.items():
            sampled.scores[name].append(_score(sampled, name, scorer, images, prompts))
        if dist.is_main and len(sampled.grid_indices) < cfg.grid_size:
            sampled.grid.append(images.cpu())
            sampled.grid_indices += idx
        progress(min((first + len(idx)) * dist.world_size, len(records)))
    return sampled


def _rows(
    records: list[PromptRecord], order: list[int], gathered: dict[str, Tensor], seed: int
) -> list[dict[str, Any]]:
    """One row per prompt, in prompt order: index, prompt, category, seed and each scorer's value."""
    values = {name: v.float().cpu().tolist() for name, v in gathered.items()}
    rows = [
        {"index": i, "prompt": records[i].prompt, "category": records[i].category, "seed": seed}
        | {name: values[name][k] for name in values}
        for k, i in enumerate(order)
    ]
    return sorted(rows, key=lambda row: row["index"])


@torch.no_grad()
def evaluate(
    parts: EvalParts,
    records: list[PromptRecord],
    *,
    tag: str,
    out: Path,
    before_writing: Callable[[], None] | None = None,
) -> EvalResult:
    """Sample and score ``records`` across ranks; rank 0 writes ``<out>/<tag>.{json,scores.jsonl,png}``.
    ``before_writing`` (a collective: every rank calls it) runs once the scores are gathered, before anything is
    written: the trainer's check that the run folder is still its own."""
    dist = parts.dist
    # Every rank scores per_rank prompts (its own, padded by repeating its last one; a rank with none pads with
    # prompt 0), so the gather is even: the pads go after it.
    per_rank = math.ceil(len(records) / dist.world_size)
    mine = list(range(dist.rank, len(records), dist.world_size)) or [0]
    mine += mine[-1:] * (per_rank - len(mine))
    sampled = _sample_and_score(parts, records, tag=tag, mine=mine)
    owner = all_gather_tensor(torch.tensor(mine))
    keep = first_occurrences(owner)
    gathered = {name: all_gather_tensor(torch.cat(vals))[keep] for name, vals in sampled.scores.items()}
    gathered = _without_failed(gathered, sampled.failed, tag=tag, is_main=dist.is_main)
    order = owner[keep].tolist()
    categories = [records[i].category for i in order]
    named = [c for c in categories if c is not None]
    summary = summarize(gathered, named if len(named) == len(categories) else None)
    result = EvalResult(tag, summary, [], torch.empty(0), [])
    if before_writing is not None:
        before_writing()
    if not dist.is_main or not summary:
        return result
    result.rows = _rows(records, order, gathered, parts.cfg.seed)
    count = min(parts.cfg.grid_size, len(sampled.grid_indices))
    result.images, result.indices = torch.cat(sampled.grid)[:count], sampled.grid_indices[:count]
    write_result(result, records, out)
    return result


def _without_failed(
    gathered: dict[str, Tensor], failed: dict[str, str], *, tag: str, is_main: bool
) -> dict[str, Tensor]:
    """The gathered scores of the scorers whose every score is finite; each one left out said in one line, on rank 0
    and on a rank where it failed (``failed``: this rank's own causes)."""
    kept = {}
    for name, values in gathered.items():
        bad = int((~torch.isfinite(values)).sum())
        if not bad:
            kept[name] = values
        elif is_main or name in failed:
            why = failed.get(name, f"it scored NaN or inf on {bad} of {values.numel()} images")
            log.warning(
                "eval.scorers.%s is left out of the evaluation %s (the other scorers are kept, the next evaluation "
                "asks it again): %s",
                name,
                tag.removeprefix("eval_"),
                why,
            )
    return kept


def write_result(result: EvalResult, records: list[PromptRecord], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    means = result.means()
    errors = {f"{name}_se": se for name, (_, se) in means.items()}
    (out / f"{result.tag}.json").write_text(
        json.dumps({"num_prompts": len(records), **result.summary, **errors}, indent=2) + "\n"
    )
    with open(out / f"{result.tag}.scores.jsonl", "w", encoding="utf-8") as file:
        file.writelines(json.dumps(row) + "\n" for row in result.rows)
    metric = next(iter(means))
    labels = [f"#{i}  {value:.4f}\n{records[i].prompt}" for i, value in zip(result.indices, result.grid_scores(metric))]
    # an image per evaluation item: eval.samples_per_prompt images of each prompt, each from its own noise
    title = f"{result.tag}: #prompt {metric} (mean over {len(records)} images {result.summary[metric]:.4f})"
    image_grid(result.images, labels=labels, title=title, min_tile=MIN_TILE).save(out / f"{result.tag}.png")


def before_after(
    before: EvalResult, after: EvalResult, prompts: Sequence[str], metric: str, names: tuple[str, str]
) -> Image.Image:
    """The sheet of ``after``'s grid beside ``before``'s (the same prompts and noise), ``metric`` under
    each image; ``prompts`` are the grid's, in its order."""
    return before_after_sheet(
        before.images,
        after.images,
        list(prompts),
        before_scores=before.grid_scores(metric),
        after_scores=after.grid_scores(metric),
        names=names,
        indices=after.indices,
        metric=metric,
    )


def read_scores(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``<tag>.scores.jsonl`` file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such per-prompt score file (evaluate writes <tag>.scores.jsonl)")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@dataclass(frozen=True)
class Paired:
    """Means over the same prompts before and after, and their paired difference, each with its standard error."""

    metric: str
    num_prompts: int
    before: float
    before_se: float
    after: float
    after_se: float
    difference: float  # mean over prompts of (after - before)
    difference_se: float

    def line(self, before_name: str = "before", after_name: str = "after") -> str:
        return (
            f"{self.metric}: {before_name} {self.before:.4f} ± {self.before_se:.4f} -> {after_name} "
            f"{self.after:.4f} ± {self.after_se:.4f}; paired difference {self.difference:+.4f} ± "
            f"{self.difference_se:.4f} (standard errors over {self.num_prompts} images)"
        )


def paired_difference(before: list[dict[str, Any]], after: list[dict[str, Any]], metric: str) -> Paired:
    """``metric`` of the same prompts (matched by index and prompt) under two models."""
    a = {(row["index"], row["prompt"]): float(row[metric]) for row in before if metric in row}
    b = {(row["index"], row["prompt"]): float(row[metric]) for row in after if metric in row}
    if not a or a.keys() != b.keys():
        raise ValueError(
            f"paired_difference: the two evaluations must score the same prompts with {metric!r} "
            f"({len(a)} and {len(b)} scored, {len(a.keys() & b.keys())} in common): use the same "
            "eval.prompts, eval.num_prompts and eval.seed"
        )
    keys = sorted(a)
    x, y = [a[k] for k in keys], [b[k] for k in keys]
    d = [v - u for u, v in zip(x, y)]
    n = len(keys)
    return Paired(
        metric, n, sum(x) / n, standard_error(x), sum(y) / n, standard_error(y), sum(d) / n, standard_error(d)
    )


def first_occurrences(ids: Tensor) -> Tensor:
    """The positions of each value's first occurrence in ``ids`` [N], in order (a gather's padding rows go)."""
    first: dict[int, int] = {}
    for position, value in enumerate(ids.tolist()):
        first.setdefault(value, position)
    return torch.tensor(list(first.values()), dtype=torch.long)
