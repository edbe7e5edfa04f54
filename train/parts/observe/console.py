"""What a run shows on the console of rank 0: the progress bar over optimizer steps and, for runs without it,
the ``Heartbeat``, a progress line at most every ``logging.heartbeat_s`` seconds; ``format_seconds`` for both and for
the evaluation's lines."""

from __future__ import annotations

import logging
import math
import time

from tqdm import tqdm

from train.parts.observe.observe_config import LoggingConfig

log = logging.getLogger(__name__)


def progress_bar(total: int, *, is_main: bool, initial: int = 0, desc: str = "train") -> tqdm:
    """A tqdm bar over optimizer steps, shown on rank 0 only (disabled elsewhere)."""
    return tqdm(total=total, initial=initial, desc=desc, disable=not is_main, dynamic_ncols=True)


def format_seconds(seconds: float) -> str:
    """``42.0s``, ``3m05s``, ``2h04m``."""
    if not math.isfinite(seconds):
        return "?"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(round(seconds), 60)
    return f"{minutes}m{sec:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


class Heartbeat:
    """``step 12/60  reward 0.5912  3.10 s/step  eta 2m29s`` at most every ``heartbeat_s`` seconds of ``settings``
    (0: every step) and after the last step, on the console of rank 0, for runs whose progress bar is off."""

    def __init__(self, settings: LoggingConfig, total: int, *, start: int, enabled: bool) -> None:
        self.total, self.start, self.every_s, self.enabled = total, start, settings.heartbeat_s, enabled
        self._began = time.perf_counter()
        self._last = -math.inf  # the first step always shows

    def tick(self, done: int, reward: float | None) -> None:
        """``done`` steps are finished (this session started at ``start``)."""
        now = time.perf_counter()
        if not self.enabled or (now - self._last < self.every_s and done < self.total):
            return
        self._last = now
        per_step = (now - self._began) / max(done - self.start, 1)
        shown = "-" if reward is None or math.isnan(reward) else f"{reward:.4f}"
        log.info(
            "step %d/%d  reward %s  %.2f s/step  eta %s",
            done,
            self.total,
            shown,
            per_step,
            format_seconds(per_step * (self.total - done)),
        )
