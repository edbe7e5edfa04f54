"""The settings of what a run shows of itself: the logger's (the ``logging`` group), the run's health
(``health``) and the performance counters (``perf``), each checking its own ranges when it is built; the trainer
adds the group's path in front (train/parts/config/keys.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from settings import Choice, check_range, member, non_negative, positive


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
class HealthConfig:
    """When a run that cannot learn, or that diverged, stops (train/parts/observe/health.py)."""

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
