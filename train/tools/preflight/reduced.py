"""The configured model cut to a few blocks, and training steps of it through the trainer's own code.

``reduced_folder`` writes a pipeline folder whose transformer keeps ``preflight.blocks`` blocks of each kind at full
width (``BLOCK_KEYS`` of its diffusers config), with random weights, and links every other component (VAE, text
encoders, tokenizers, scheduler) to the configured folder's. ``measured_steps`` opens a run on it in the scratch
folder (``train.run.build.open_run``: LoRA or full fine-tuning, activation checkpointing, FSDP2 or HSDP, compile,
the KL reference and the EMA as configured) and runs ``train.loop.step.train_step``; the last step is measured.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from models.base import parse_dtype
from models.components import quiet_progress_bars
from train.loop.passes import logged_passes
from train.loop.step import train_step
from train.parts.observe.observe_config import WandbMode
from train.run.parts import Run
from train.tools.plan.depth import BLOCK_KEYS
from train.tools.plan.fake import default_dtype
from train.tools.plan.frozen import build_component, diffusers_backbone_class, read_json
from train.tools.preflight.preflight_config import PreflightRunConfig
from train.tools.preflight.scorers import ScorerTiming

STAND_IN_REWARD: dict[str, dict] = {"jpeg_compressibility": {}}  # scores images without weights
TIMED_PHASES = ("rollout", "update", "optimizer")  # the transformer's phases, as the planner times them


def depth(config: dict[str, Any]) -> str:
    """ "19+38" (Flux's double and single blocks), "60" (Qwen-Image's)."""
    return "+".join(str(config[key]) for key in BLOCK_KEYS if key in config)


def reduced_folder(cfg: PreflightRunConfig, dest: Path) -> Path:
    """``dest``: model.path with its transformer cut to preflight.blocks blocks (random weights in model.dtype)."""
    source = Path(cfg.model.path).absolute()
    dest.mkdir(parents=True)
    for entry in source.iterdir():
        if entry.name != "transformer":
            (dest / entry.name).symlink_to(entry)
    component = next(c for c in diffusers_backbone_class(cfg.model.name).components if c.name == "transformer")
    config = read_json(source / "transformer" / component.config_file)
    config |= {key: min(int(config[key]), cfg.preflight.blocks) for key in BLOCK_KEYS if key in config}
    with torch.random.fork_rng(devices=[]), quiet_progress_bars():
        torch.manual_seed(cfg.seed)
        with default_dtype(parse_dtype(cfg.model.dtype)):  # built in it: a cast would warn about float32 modules
            module = build_component(component.loader, config)
        module.save_pretrained(dest / "transformer")  # type: ignore[operator]  # a diffusers model
    return dest


def step_config(cfg: PreflightRunConfig, model: Path, run_dir: Path) -> PreflightRunConfig:
    """The run's settings for steps of the reduced model in a scratch folder: a new run that logs nowhere else and
    evaluates nothing."""
    out = copy.deepcopy(cfg)
    out.model.path, out.model.build_tiny = str(model), None
    out.run_dir, out.resume, out.num_steps = str(run_dir), None, cfg.preflight.steps
    out.checkpoint.overwrite = False
    out.logging.wandb_mode, out.logging.sample_every, out.logging.progress_bar = WandbMode.disabled, 0, False
    out.eval.every = 0  # its steps evaluate nothing: no evaluation scorer is built
    if cfg.preflight.stand_in_rewards:
        out.reward.components = copy.deepcopy(STAND_IN_REWARD)
    return out


@dataclass
class StepMeasure:
    """The last step at reduced depth on one rank."""

    blocks: str  # the depth kept, e.g. "1+1"
    full_blocks: str  # the configured model's, e.g. "19+38"
    seconds: dict[str, float]  # per phase: rollout, reward, update, optimizer, step
    tflops: float  # the transformer's FLOPs of the timed phases over their time
    peak_tflops: float | None  # the device's peak the trainer's MFU uses
    peak_source: str
    peak_bytes: int | None  # CUDA: the caching allocator's peak reserved bytes; None on CPU
    allocated_bytes: int | None  # CUDA: the peak allocated by tensors
    other_bytes: int | None  # CUDA: device memory in use that is not torch's (the context, NCCL's buffers)
    total_bytes: int | None  # CUDA: the device's memory
    scorers: list[ScorerTiming] = field(default_factory=list)  # each reward's scorer timed after the steps
    skipped: list[int] = field(default_factory=list)  # the steps whose update was skipped for a NaN or inf reward
    passes: int = 1  # the update passes the measured step ran over its rollout (grpo.inner_epochs)
    update_calls: int = 0  # the measured step's update calls (segments of a micro-batch, every path and pass)

    @property
    def mfu(self) -> float | None:
        return self.tflops / self.peak_tflops if self.peak_tflops else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "mfu": self.mfu}


def measure(run: Run, metrics: dict[str, float], full: dict[str, Any]) -> StepMeasure:
    """The step's times and memory from its metrics and the allocator."""
    seconds = {key.removeprefix("time/"): value for key, value in metrics.items() if key.startswith("time/")}
    flops = sum(metrics.get(f"flops/{p}", 0.0) for p in TIMED_PHASES)
    timed = sum(seconds.get(p, 0.0) for p in TIMED_PHASES)
    peak = allocated = other = total = None
    if run.device.type == "cuda":
        peak, allocated = torch.cuda.max_memory_reserved(run.device), torch.cuda.max_memory_allocated(run.device)
        free, total = torch.cuda.mem_get_info(run.device)
        other = max(0, total - free - torch.cuda.memory_reserved(run.device))
    return StepMeasure(
        blocks=depth(run.model.backbone.configs["transformer"]),  # type: ignore[attr-defined]
        full_blocks=depth(full),
        seconds=seconds,
        tflops=flops / timed / 1e12 if timed > 0 else math.nan,
        peak_tflops=run.perf.peak.tflops,
        peak_source=run.perf.peak.source,
        peak_bytes=peak,
        allocated_bytes=allocated,
        other_bytes=other,
        total_bytes=total,
    )


def run_steps(run: Run, full: dict[str, Any]) -> StepMeasure:
    """preflight.steps training steps; the last one measured (its peak memory alone)."""
    steps = run.cfg.num_steps
    metrics: dict[str, float] = {}
    skipped = []
    for step in range(steps):
        if step == steps - 1 and run.device.type == "cuda":
            torch.cuda.synchronize(run.device)
            torch.cuda.reset_peak_memory_stats(run.device)
        metrics = train_step(run, step)
        if metrics.get("train/skipped_nan_reward", 0.0) > 0:
            skipped.append(step)
    calls = sum(int(value) for name, value in metrics.items() if name.startswith("count/segments_"))
    return replace(measure(run, metrics, full), skipped=skipped, passes=logged_passes(metrics), update_calls=calls)
