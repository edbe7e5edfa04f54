"""Whether a run can still learn, step by step: steps that cannot change the weights, and rewards without spread.

A step is *bad* when it skipped its update (a NaN or inf reward: ``train/skipped_nan_reward``) or none of
its optimizer steps moved the weights: each was skipped for a non-finite gradient norm (NaN weights,
a NaN loss) or the gradient norm was exactly 0 (every advantage 0, e.g. rewards whose weights cancel).
After ``health.max_bad_steps`` bad steps in a row the trainer writes a checkpoint and stops with
``NotLearning``. A reward whose scores tie within every group for ``SPREAD_STEPS`` steps in a row
(``spread/<reward>`` = 0, the largest range of its scores within a group) contributes no advantage:
a warning names it, once until it spreads again.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

log = logging.getLogger(__name__)
SPREAD_STEPS = 3  # steps in a row without spread before a reward is named in a warning


def bad_step(metrics: Mapping[str, float], optimizer_steps: int) -> str | None:
    """Why the step with ``metrics`` could not change the weights, or None."""
    if metrics.get("train/skipped_nan_reward", 0.0) > 0:
        return "a reward was NaN or inf (the update was skipped)"
    if metrics.get("train/skipped_optimizer_steps", 0) >= optimizer_steps:
        return "the gradient was not finite (every optimizer step was skipped)"
    if metrics.get("train/grad_norm") == 0.0:
        return "the gradient was 0 (every advantage was 0)"
    return None


class Health:
    """Counts bad steps in a row and steps without spread per reward; ``observe`` says when to stop."""

    def __init__(self, *, max_bad_steps: int, optimizer_steps: int) -> None:
        self.max_bad_steps, self.optimizer_steps = max_bad_steps, optimizer_steps
        self.bad_in_a_row = 0
        self._flat: dict[str, int] = {}  # reward -> steps in a row without spread

    def observe(self, metrics: Mapping[str, float], step: int) -> str | None:
        """Take the metrics of training step ``step``; the line to stop with, or None to go on."""
        self._spread(metrics)
        why = bad_step(metrics, self.optimizer_steps)
        self.bad_in_a_row = self.bad_in_a_row + 1 if why else 0
        if why and self.max_bad_steps and self.bad_in_a_row >= self.max_bad_steps:
            first = step - self.bad_in_a_row + 1
            return (
                f"health.max_bad_steps={self.max_bad_steps}: steps {first} to {step} could not change the weights "
                f"(the last: {why}); the run cannot learn: check the rewards (reward.components) and the model "
                "weights, then resume=auto (health.max_bad_steps=0 never stops)"
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
