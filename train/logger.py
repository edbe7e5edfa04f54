"""One run logger (metrics.jsonl, sample grids, wandb), a phase timer and the progress bar.

* ``RunLogger`` is a no-op off rank 0: every rank calls it, only rank 0 writes. It writes the run's
  resolved configuration to ``run_dir/config.yaml`` when it starts. Each ``log`` call
  appends one JSON line ``{"step", "wall_time", <metric>: float, ...}`` to
  ``run_dir/metrics.jsonl`` and flushes it, so a crashed run keeps every logged step. A row at step
  k is training step k, or (``eval/*`` only) the policy after k steps. A resumed run calls
  ``rewind(k)`` first: the rows of the steps it will replay go, so every step has one row.
* wandb is optional (``wandb_mode`` disabled, offline or online). Offline runs write into
  ``run_dir/wandb/``. Any exception raised by wandb (import, init, log, finish) is caught, warned
  once, and wandb is switched off for the rest of the run: observability never stops training.
  The JSONL file is the record of truth either way.
* ``PhaseTimer`` sums wall-clock seconds per phase (``time/<phase>``); on CUDA it synchronizes
  before reading the clock, since kernels run asynchronously and would be billed to the next phase.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import torch
from omegaconf import OmegaConf
from torch import Tensor
from tqdm import tqdm

from rewards.summary import image_grid

WANDB_MODES = ("disabled", "offline", "online")


def _to_float(key: str, value: float | int | bool | Tensor) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric {key!r} is a tensor of shape {tuple(value.shape)}; log a scalar")
        return float(value.detach().float().item())
    return float(value)


class RunLogger:
    """Metrics and sample images of one run, written by rank 0 only."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        is_main: bool,
        wandb_mode: str = "disabled",
        project: str = "jagg-grpo",
        group: str | None = None,
        name: str | None = None,
        tags: Sequence[str] = (),
        config: Mapping[str, Any] | None = None,
    ) -> None:
        if wandb_mode not in WANDB_MODES:
            raise ValueError(f"logging.wandb_mode={wandb_mode!r}; accepted: {', '.join(WANDB_MODES)}")
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self._start = time.time()
        self._wandb: Any = None
        self._file: TextIO | None = None
        if not is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if config is not None:  # what ran, next to what it logged (train.compare labels runs from it)
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(dict(config)), encoding="utf-8")
        # Kept open for the whole run (appended to every step); closed by finish().
        self._file = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        if wandb_mode != "disabled":
            self._guard(self._init_wandb, wandb_mode, project=project, group=group, name=name, tags=tags, config=config)

    def _init_wandb(self, mode: str, **kwargs: Any) -> None:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        kwargs["tags"] = list(kwargs["tags"])
        kwargs["config"] = dict(kwargs["config"] or {})
        # mode is one of WANDB_MODES (checked in __init__); wandb annotates it as a Literal
        self._wandb = wandb.init(mode=mode, dir=str(self.run_dir), **kwargs)  # type: ignore[arg-type]

    def _guard(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Run a wandb call; on any error warn once and stop using wandb."""
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # wandb may raise anything; training must go on without it
            warnings.warn(f"wandb failed ({exc!r}); continuing without wandb", RuntimeWarning, stacklevel=3)
            self._wandb = None

    @property
    def wandb_active(self) -> bool:
        return self._wandb is not None

    def log(self, metrics: Mapping[str, float | int | bool | Tensor], step: int) -> None:
        """Append one JSON line (and a wandb point) with ``metrics`` at ``step``."""
        if not self.is_main:
            return
        if self._file is None:
            raise RuntimeError("RunLogger.log after finish()")
        values = {key: _to_float(key, value) for key, value in metrics.items()}
        record = {"step": step, "wall_time": round(time.time() - self._start, 3), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._guard(self._wandb.log, values, step=step)

    def rewind(self, step: int) -> int:
        """Drop the rows that a run resumed at ``step`` logs again; returns how many were dropped.

        Kept: training rows of steps < ``step`` and the evaluation after ``step`` steps (logged before
        the checkpoint of ``step`` was written; a run resumed at 0 evaluates again). A line cut short
        by a crash is dropped too. Rank 0 rewrites the file through a temporary file and a rename, so
        a crash here leaves the old file or the new one.
        """
        if not self.is_main:
            return 0
        if self._file is None:
            raise RuntimeError("RunLogger.rewind after finish()")
        path = self._file.name
        self._file.close()
        lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if _logged_before(line, step)]
        if len(kept) != len(lines):
            tmp = Path(f"{path}.tmp")
            tmp.write_text("".join(line if line.endswith("\n") else line + "\n" for line in kept), encoding="utf-8")
            os.replace(tmp, path)
        self._file = open(path, "a", encoding="utf-8")
        return len(lines) - len(kept)

    def log_images(self, key: str, images: Tensor, captions: Sequence[str], step: int) -> Path | None:
        """Save a PNG grid ``samples/<key>_<step>.png`` (+ captions .txt) and send images to wandb."""
        if not self.is_main:
            return None
        if len(captions) != images.shape[0]:
            raise ValueError(f"log_images: {images.shape[0]} images but {len(captions)} captions")
        folder = self.run_dir / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        stem = f"{key.replace('/', '_')}_{step:08d}"
        path = folder / f"{stem}.png"
        image_grid(images).save(path)
        (folder / f"{stem}.txt").write_text("\n".join(captions) + "\n", encoding="utf-8")
        if self._wandb is not None:
            self._guard(self._log_wandb_images, key, images, captions, step)
        return path

    def _log_wandb_images(self, key: str, images: Tensor, captions: Sequence[str], step: int) -> None:
        import wandb

        pixels = (images.detach().float().clamp(0, 1).cpu() * 255).round().to(torch.uint8)
        entries = [wandb.Image(img.permute(1, 2, 0).numpy(), caption=cap) for img, cap in zip(pixels, captions)]
        self._wandb.log({key: entries}, step=step)

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._guard(self._wandb.finish)
            self._wandb = None


def _logged_before(line: str, step: int) -> bool:
    """Whether a metrics.jsonl row was logged before the checkpoint of ``step`` (see ``RunLogger.rewind``)."""
    try:
        row = json.loads(line)
        logged = int(row["step"])
    except (ValueError, KeyError, TypeError):
        return False
    metrics = [key for key in row if key not in ("step", "wall_time")]
    return logged < step or (logged == step > 0 and all(key.startswith("eval/") for key in metrics))


class PhaseTimer:
    """``with timer.phase("rollout"): ...`` sums seconds per phase until ``pop()``."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._totals: dict[str, float] = defaultdict(float)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self._now()
        try:
            yield
        finally:
            self._totals[name] += self._now() - start

    def pop(self) -> dict[str, float]:
        """{"time/<phase>": seconds} accumulated since the last pop; resets the totals."""
        out = {f"time/{name}": seconds for name, seconds in self._totals.items()}
        self._totals.clear()
        return out


def progress_bar(total: int, *, is_main: bool, initial: int = 0, desc: str = "train") -> tqdm:
    """A tqdm bar over optimizer steps, shown on rank 0 only (disabled elsewhere)."""
    return tqdm(total=total, initial=initial, desc=desc, disable=not is_main, dynamic_ncols=True)
