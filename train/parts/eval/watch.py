"""The watch over a run's evaluations: the best one so far (``checkpoint.keep_best`` keeps its checkpoint) and the
guard (``eval.guard``) against a reward that training games, from the rows the run logs.

The watched metric is ``eval/<scorer>/held-out`` (``eval/<scorer>`` without held-out prompts), ``<scorer>`` being
``eval.metric`` or the first of ``eval.scorers``; higher is better. The best is the highest value of an evaluation
after at least one training step (step 0 is the model as loaded: nothing to keep), the earlier step on a tie.

The guard compares each evaluation with the one before: the metric *fell* while the training reward *rose* when
the value is lower than the previous evaluation's and the mean ``reward/total`` of the steps trained since the
previous evaluation is higher than that of the steps before it (a window without a finite reward compares as
nothing: no rise). ``eval.guard.patience`` such evaluations in a row raise the alarm (a warning, or the end of the
run with ``eval.guard.action=stop``), and every further one in a row raises it again; an evaluation that does not
fall-while-rising starts the count again. An evaluation without the metric (its scorer left out) changes nothing.

Everything here is a function of the rows of metrics.jsonl in the order they were logged, so a resumed session
replays the rows kept by its rewind (``replay``): the checkpoint of step k is written before the evaluation after
step k, and those rows are exactly what the session that wrote it had seen once that evaluation was logged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from train.parts.eval.eval_config import EvalConfig, GuardAction
from train.parts.eval.tags import HELD_OUT
from train.parts.observe.metrics import evaluation_only

REWARD = "reward/total"  # the training reward the guard watches


def watched_key(cfg: EvalConfig) -> str | None:
    """The logged key of the watched metric: eval/<scorer>/held-out, or eval/<scorer> without held-out prompts;
    None without eval.scorers (nothing to watch)."""
    scorer = cfg.metric or next(iter(cfg.scorers), None)
    if scorer is None:
        return None
    return f"eval/{scorer}" + (f"/{HELD_OUT}" if cfg.heldout_prompts is not None else "")


@dataclass(frozen=True)
class Mark:
    """One evaluation's value of the watched metric: after ``step`` training steps."""

    step: int
    value: float


@dataclass(frozen=True)
class Verdict:
    """What one evaluation changed: ``best`` (a new best), ``alarm`` (the guard's line, None when quiet)."""

    best: bool
    alarm: str | None


@dataclass
class Watch:
    """The best evaluation so far and the guard's count, fed the training rows (``trained``) and the evaluations
    (``evaluated``) in the order they are logged."""

    key: str | None  # None: nothing to watch
    patience: int = 0  # 0: no guard
    best: Mark | None = None
    last: Mark | None = None  # the previous evaluation with the metric
    falls: int = 0  # evaluations in a row whose metric fell while the training reward rose
    window: list[float] = field(default_factory=list)  # the finite rewards since the previous evaluation
    window_before: float | None = None  # the mean reward of the window before the previous evaluation

    @classmethod
    def of(cls, cfg: EvalConfig) -> Watch:
        """The watch of the evaluation settings ``cfg`` (the guard counting only when it is on)."""
        return cls(watched_key(cfg), cfg.guard.patience if cfg.guard.action is not GuardAction.off else 0)

    def trained(self, metrics: Mapping[str, Any]) -> None:
        """A training step's metrics: its ``reward/total`` joins the window when finite."""
        if (reward := finite(metrics.get(REWARD))) is not None:
            self.window.append(reward)

    def evaluated(self, step: int, metrics: Mapping[str, Any]) -> Verdict:
        """The evaluation after ``step`` steps (its logged ``eval/*`` metrics): whether it is the new best, and the
        guard's alarm."""
        if self.key is None or (value := finite(metrics.get(self.key))) is None:
            return Verdict(best=False, alarm=None)
        mark, reward = Mark(step, value), (sum(self.window) / len(self.window) if self.window else None)
        rose = reward is not None and self.window_before is not None and reward > self.window_before
        fell = self.last is not None and mark.value < self.last.value
        self.falls = self.falls + 1 if fell and rose else 0
        alarm = self._alarm(mark, reward) if self.patience and self.falls >= self.patience else None
        new_best = step > 0 and (self.best is None or mark.value > self.best.value)
        if new_best:
            self.best = mark
        self.last, self.window, self.window_before = mark, [], reward
        return Verdict(best=new_best, alarm=alarm)

    def _alarm(self, mark: Mark, reward: float | None) -> str:
        best = f"; the best was {self.best.value:.4f} after step {self.best.step}" if self.best is not None else ""
        return (
            f"eval.guard: {self.key} fell for {self.falls} evaluation{'s' if self.falls > 1 else ''} in a row while "
            f"the training {REWARD} rose "
            f"(now {mark.value:.4f} after step {mark.step}, mean {REWARD} {reward:.4f} since the evaluation "
            f"before{best}): the reward may be gamed"
        )

    def margin_line(self) -> str | None:
        """The best evaluation against the last one, for the run's summary; None before an evaluation after a
        training step."""
        if self.best is None or self.last is None:
            return None
        best, last = self.best, self.last
        return (
            f"best evaluation: {self.key} {best.value:.4f} after step {best.step}, {best.value - last.value:+.4f} "
            f"over the last (after step {last.step}: {last.value:.4f})"
        )

    def replay(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Feed the rows of metrics.jsonl, in the order they were logged (``logged_order``)."""
        for row in logged_order(rows):
            step = int(row["step"])
            if evaluation_only(row):
                self.evaluated(step, row)
            else:
                self.trained(row)


def best_of(series: Mapping[int, float]) -> Mark | None:
    """The best evaluation of a series (step -> value) as the watch ranks them: the highest finite value after at
    least one training step, the earlier step on a tie; None when there is none (python -m train.compare)."""
    marks = [Mark(step, value) for step, value in sorted(series.items()) if step > 0 and math.isfinite(value)]
    return max(marks, key=lambda mark: mark.value, default=None)  # max keeps the first of equal values


def finite(value: Any) -> float | None:
    """``value`` as the float metrics.jsonl logs (a one-element tensor too), or None when it is not a finite
    number: the live session and a replay of its rows see the same numbers."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def logged_order(rows: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The rows in the order the trainer logs them: by step, the evaluation after k steps before training step k
    (its row has step k too), the last row of a step and kind winning (a replayed step's)."""
    latest: dict[tuple[int, int], Mapping[str, Any]] = {}
    for row in rows:
        latest[(int(row["step"]), 0 if evaluation_only(row) else 1)] = row
    return [latest[key] for key in sorted(latest)]
