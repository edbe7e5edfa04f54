"""The settings of what a run shows of itself: the logger's (the ``logging`` group) and the performance counters
(``perf``), each checking its own ranges when it is built; the trainer adds the group's path in front
(train/parts/config/keys.py). The run's health (``health``) has its settings beside it, in health.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from settings import Choice, member, non_negative, positive


class WandbMode(Choice):
    """logging.wandb_mode."""

    disabled = "disabled"
    offline = "offline"
    online = "online"


@dataclass
class LoggingConfig:
    """Metrics, wandb, sample grids and the progress line (train/parts/observe/logger.py)."""

    wandb_mode: WandbMode = WandbMode.disabled
    """disabled | offline | online."""
    project: str = "jagg-grpo"
    """wandb project."""
    entity: str | None = None
    """wandb entity (user or team); null = wandb's default entity."""
    group: str | None = None
    """wandb group; null = the experiment name (scripts/launch/compare_modes.sh sets one)."""
    name: str | None = None
    """wandb run name; null = <experiment>-<update.mode>-s<seed>."""
    tags: list[str] = field(default_factory=list)
    """wandb tags, added to the automatic ones (mode, seed<N>, sde)."""
    notes: str | None = None
    """wandb notes: a sentence on what this run tests."""
    sample_every: int = 0
    """Save (and send to wandb) a captioned grid of rollout images every N steps (0 = never)."""
    progress_bar: bool = True
    """A tqdm bar on rank 0; when false, a heartbeat line instead."""
    heartbeat_s: float = 60.0
    """progress_bar=false: seconds between progress lines (0 = one line per step)."""

    def __post_init__(self) -> None:
        self.wandb_mode = member(WandbMode, self.wandb_mode, "wandb_mode")
        if self.wandb_mode is not WandbMode.disabled and not self.project.strip():
            raise ValueError("project is empty: name the wandb project")
        non_negative(self.sample_every, "sample_every", " (0 = never)")
        non_negative(self.heartbeat_s, "heartbeat_s", " (0 = a line per step)")


@dataclass
class PerfConfig:
    """Performance accounting (train/parts/observe/perf.py)."""

    peak_tflops: float | None = None
    """Peak TFLOP/s of one device, the denominator of perf/mfu/<phase>; null = the device's: the table of
    train/parts/observe/perf.py on a GPU (A100, H100, H200, B200 bf16 dense), on CPU this machine's float32 matmul
    rate measured once at start-up; > 0.
    """

    def __post_init__(self) -> None:
        if self.peak_tflops is not None:
            positive(self.peak_tflops, "peak_tflops", " (null = the device's own)")
