"""Whether a run can still learn, step by step: steps that cannot change the weights, rewards without spread, and
weights or images that left any sane range.

A step is *bad* when it skipped its update (a NaN or inf reward: ``train/skipped_nan_reward``) or none of
its optimizer steps moved the weights: each was skipped for a non-finite gradient norm (NaN weights,
a NaN loss) or the gradient norm was exactly 0 (every advantage 0, e.g. rewards whose weights cancel).
After ``health.max_bad_steps`` bad steps in a row, or at the end of a session none of whose steps was good
(a short run whose every reward was NaN), the trainer writes a checkpoint and stops with ``NotLearning``:
such weights are not exported as if trained. A reward whose scores tie within every group for
``SPREAD_STEPS`` steps in a row (``spread/<reward>`` = 0, the largest range of its scores within a group)
contributes no advantage: a warning names it, once until it spreads again.

A run *diverged* when its weights or its images leave any sane range, although every number is finite (an
``optimizer.lr`` far too large blows the weights up to 1e9 and the images go black):

* ``health/weight_growth``: the L2 norm of the trainable weights over its value at the start of the run (the
  model as loaded, or LoRA's initial adapters, before any checkpoint loads), beyond ``health.max_weight_growth``
  or below its inverse, after step k: the weights after step k are not saved;
* ``health/flat_images``: the fraction of the step's images (every rank's) whose pixels span less than
  ``health.flat_image_range``; all of them flat in step k: the weights after step k - 1 sampled them.

The trainer then stops with ``Diverged`` without saving those weights, naming the last checkpoint before them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from settings import check_range, non_negative
from settings.configurable import Configurable
from train.distributed.collectives import all_reduce_sum
from train.distributed.parallelize import local_tensor, sum_over_shards

log = logging.getLogger(__name__)
SPREAD_STEPS = 3  # steps in a row without spread before a reward is named in a warning
WEIGHT_GROWTH, FLAT_IMAGES = "health/weight_growth", "health/flat_images"


def bad_step(metrics: Mapping[str, float], optimizer_steps: int) -> str | None:
    """Why the step with ``metrics`` could not change the weights, or None."""
    if metrics.get("train/skipped_nan_reward", 0.0) > 0:
        return "a reward was NaN or inf (the update was skipped)"
    if metrics.get("train/skipped_optimizer_steps", 0) >= optimizer_steps:
        return "the gradient was not finite (every optimizer step was skipped)"
    if metrics.get("train/grad_norm") == 0.0:
        return "the gradient was 0 (every advantage was 0)"
    return None


@torch.no_grad()
def weight_norm(params: list[nn.Parameter]) -> float:
    """The L2 norm of ``params`` over all ranks (each shard counted once; a collective)."""
    if not params:
        return 0.0
    zero = torch.zeros((), dtype=torch.float64, device=local_tensor(params[0]).device)
    terms = ((p, local_tensor(p).detach().float().pow(2).sum().double()) for p in params)
    return math.sqrt(float(sum_over_shards(terms, zero=zero)))


@torch.no_grad()
def flat_fraction(images: Tensor, flat_range: float) -> float:
    """The fraction of the images [B, 3, H, W] of every rank whose pixel values span less than ``flat_range``
    (a collective)."""
    spans = images.flatten(1).amax(1) - images.flatten(1).amin(1)
    counts = torch.tensor([float((spans < flat_range).sum()), float(images.shape[0])], device=images.device)
    flat, total = all_reduce_sum(counts).tolist()
    return flat / total


@dataclass(frozen=True)
class Verdict:
    """Why the run stops after a step. ``bad_from``: None when the weights after the step are sane (they are
    checkpointed: ``NotLearning``), else the first step count whose weights diverged (never saved: ``Diverged``)."""

    line: str
    bad_from: int | None = None


class Health:
    """Counts bad steps in a row and steps without spread per reward, and bounds the weights and images of a
    session of steps ``first`` to ``last``; ``observe`` says when to stop. The counters go into each checkpoint
    (``state_dict``) and a resumed session goes on from them, so a run preempted often still stops when it cannot
    learn."""

    def __init__(self, config: HealthConfig, *, optimizer_steps: int, first: int, last: int, start_norm: float) -> None:
        self.config, self.optimizer_steps = config, optimizer_steps
        self.first, self.last, self.start_norm = first, last, start_norm
        self.bad_in_a_row = 0
        self._flat: dict[str, int] = {}  # reward -> steps in a row without spread

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the counters, so that a resumed session goes on counting."""
        return {"bad_in_a_row": self.bad_in_a_row, "flat": dict(self._flat)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The counters a checkpoint kept (``state_dict``)."""
        self.bad_in_a_row = int(state.get("bad_in_a_row", 0))
        self._flat = {str(name): int(steps) for name, steps in dict(state.get("flat", {})).items()}

    def measure(self, params: list[nn.Parameter]) -> dict[str, float]:
        """``health/weight_growth`` of the weights ``params`` now (a collective)."""
        if not self.start_norm:
            return {}
        return {WEIGHT_GROWTH: weight_norm(params) / self.start_norm}

    def observe(self, metrics: Mapping[str, float], step: int) -> Verdict | None:
        """Take the metrics of training step ``step``; why to stop, or None to go on."""
        self._spread(metrics)
        if diverged := self._diverged(metrics, step):
            return diverged
        why = bad_step(metrics, self.optimizer_steps)
        self.bad_in_a_row = self.bad_in_a_row + 1 if why else 0
        limit = self.config.max_bad_steps
        if not (why and limit):
            return None
        first = step - self.bad_in_a_row + 1
        fix = (
            "check the rewards (reward.components) and the model weights, then resume=auto "
            "(health.max_bad_steps=0 never stops)"
        )
        if self.bad_in_a_row >= limit:
            return Verdict(
                f"health.max_bad_steps={limit}: steps {first} to {step} could not change the weights "
                f"(the last: {why}); the run cannot learn: {fix}"
            )
        if step == self.last and first <= self.first:  # the streak began in this session or before it
            return Verdict(
                f"health.max_bad_steps: none of steps {first} to {step} could change the weights (the last: {why}), "
                f"so nothing is exported as trained: {fix}"
            )
        return None

    def _diverged(self, metrics: Mapping[str, float], step: int) -> Verdict | None:
        growth, bound = metrics.get(WEIGHT_GROWTH), self.config.max_weight_growth
        if growth is not None and bound and not 1 / bound <= growth <= bound:
            return Verdict(
                f"health.max_weight_growth={bound:g}: after step {step} the trainable weights' norm is {growth:.3g} "
                "times its value at the start of the run: the run diverged",
                bad_from=step + 1,
            )
        if self.config.flat_image_range and metrics.get(FLAT_IMAGES) == 1.0:
            which = "the model as loaded (model.path)" if step == 0 else f"the weights after {step} steps"
            return Verdict(
                f"health.flat_image_range={self.config.flat_image_range:.3g}: every image sampled in step {step} is "
                f"one flat colour: {which} collapsed",
                bad_from=step,
            )
        return None

    def _spread(self, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            if not key.startswith("spread/") or not math.isfinite(value):
                continue
            name = key.removeprefix("spread/")
            self._flat[name] = self._flat.get(name, 0) + 1 if value == 0 else 0
            if self._flat[name] == SPREAD_STEPS:
                log.warning(
                    "reward.components.%s: its scores tied within every group for %d steps in a row, so it adds "
                    "no advantage: check the scorer's arguments, or that it can tell these images apart",
                    name,
                    SPREAD_STEPS,
                )


@dataclass
class HealthConfig(Configurable["Health"]):
    """When a run that cannot learn, or that diverged, stops; ``build`` makes the run's ``Health``."""

    max_bad_steps: int = 10
    """Stop (after a checkpoint) once this many consecutive steps skipped their update (a NaN reward, a non-finite
    gradient) or had a zero gradient (every advantage 0): such a run cannot learn; a run none of whose steps
    changed the weights stops so at its end, without an export (0 = never stop).
    """
    max_weight_growth: float = 10.0
    """Stop, without saving the weights, once the L2 norm of the trainable weights (over all ranks) is more than
    this many times its value at the start of the run (the model as loaded, or LoRA's initial adapters), or less
    than 1 / this: the run diverged (logged as health/weight_growth; a sane run stays within a few percent of 1
    when it trains every weight, within a few times 1 with LoRA); > 1 (0 = never stop).
    """
    flat_image_range: float = 1 / 255
    """An image whose pixel values (in [0, 1]) span less than this (1/255: one level of an 8-bit image) is one flat
    colour; a step whose every image is flat stops the run without saving the weights that sampled them: the policy
    collapsed (logged as health/flat_images, the fraction of flat images); in [0, 1) (0 = never stop).
    """

    def __post_init__(self) -> None:
        non_negative(self.max_bad_steps, "max_bad_steps", " (0 = never stop)")
        if self.max_weight_growth != 0:
            check_range(self.max_weight_growth, "max_weight_growth", low=1, low_open=True, why=" (0 = never stop)")
        check_range(self.flat_image_range, "flat_image_range", low=0, high=1, high_open=True, why=" (0 = never stop)")

    @classmethod
    def owner(cls) -> type[Health]:
        return Health
