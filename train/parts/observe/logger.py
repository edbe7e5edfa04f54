"""One run logger: metrics.jsonl (train/parts/observe/metrics.py), sample grids and wandb.

* ``RunLogger`` is a no-op off rank 0: every rank calls it, only rank 0 writes. It writes the run's
  resolved configuration to ``run_dir/config.yaml`` when it starts (a resumed session to
  ``config.<n>.yaml``: the first session's stays). Each ``log`` call appends one row to ``run_dir/metrics.jsonl``
  (``MetricsFile``, with the rewind of a resumed run) and sends the same values to wandb.
* wandb is optional (``wandb_mode`` disabled, offline or online). Offline runs write into
  ``run_dir/wandb/``. The wandb run id is kept in ``run_dir/wandb_run_id``, so a resumed run (or
  any later session in the same folder) continues the same wandb run. wandb gets ``wall_time`` too
  (train.tools.compare.command plots against it). The steps a resumed run replays: offline, each session writes a
  folder of its own and train.tools.compare.command keeps the later values (as ``rewind`` does here); online,
  wandb keeps the first values of a step and drops the replay, which differs only in timings,
  since a resumed run replays bit for bit. Any exception raised by
  wandb (import, init, log, finish) is caught, warned once, and wandb is switched off for the rest
  of the run: observability never stops training. The JSONL file is the record of truth either way.
"""

from __future__ import annotations

import os
import secrets
import string
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import Tensor

from train.ground.disk import write_failure
from train.ground.layout import RunLayout
from train.parts.observe.grid import MIN_TILE, image_grid
from train.parts.observe.metrics import MetricsFile
from train.parts.observe.observe_config import LoggingConfig, WandbMode


def session_config(layout: RunLayout, *, resumed: bool) -> Path:
    """Where a session writes its configuration: ``config.yaml``, or for a resumed run, which keeps the first
    session's there, ``config.<n>.yaml`` (n = 2, 3, ... per resumed session)."""
    if not resumed or not layout.config.exists():
        return layout.config
    n = 2
    while layout.session_config(n).exists():
        n += 1
    return layout.session_config(n)


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
        settings: LoggingConfig,
        layout: RunLayout,
        *,
        is_main: bool,
        experiment: str | None = None,
        name: str | None = None,
        tags: Sequence[str] = (),
        config: Mapping[str, Any] | None = None,
        resumed: bool = False,
    ) -> None:
        """``experiment``, ``name`` and ``tags``: the run's own wandb group, name and tags, which the settings'
        group and name replace and their tags add to; ``config``: the run's configuration, written into the run
        folder (``session_config``) and given to wandb."""
        self.is_main, self.layout = is_main, layout
        self.metrics: MetricsFile | None = None  # rank 0's
        self._wandb: Any = None
        if not is_main:
            return
        layout.root.mkdir(parents=True, exist_ok=True)
        if config is not None:  # what ran, next to what it logged (train.tools.compare.command labels runs from it)
            path = session_config(layout, resumed=resumed)
            try:
                path.write_text(OmegaConf.to_yaml(dict(config)), encoding="utf-8")
            except OSError as err:
                raise write_failure(err, path, "the run's configuration") or err from None
        self.metrics = MetricsFile(layout.metrics)
        if settings.wandb_mode is not WandbMode.disabled:
            self._guard(
                self._init_wandb,
                settings.wandb_mode.value,
                project=settings.project,
                entity=settings.entity,
                group=settings.group or experiment,
                name=settings.name or name,
                tags=list(dict.fromkeys([*tags, *settings.tags])),
                notes=settings.notes,
                config=config,
            )

    def _init_wandb(self, mode: str, **kwargs: Any) -> None:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        id_file = self.layout.wandb_run_id
        if id_file.is_file():
            run_id = id_file.read_text(encoding="utf-8").strip()
        else:
            # wandb's own ids are 8 characters of [a-z0-9]; its generator is not public API
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
            id_file.write_text(run_id + "\n", encoding="utf-8")
        kwargs["config"] = dict(kwargs["config"] or {})
        # mode is a WandbMode (LoggingConfig checks it); wandb annotates it as a Literal.
        # resume="allow": the run of this id continues when it exists (a resumed training run), else starts.
        self._wandb = wandb.init(
            mode=mode,  # type: ignore[arg-type]
            dir=str(self.layout.root),
            id=run_id,
            resume="allow",
            **kwargs,
        )

    def _guard(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Run a wandb call; on any error warn once and stop using wandb."""
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # wandb may raise anything; training must go on without it
            warnings.warn(f"wandb failed ({exc!r}); continuing without wandb", RuntimeWarning, stacklevel=3)
            self._wandb = None

    def log(self, metrics: Mapping[str, float | int | bool | Tensor], step: int) -> None:
        """Append one row to metrics.jsonl (and a wandb point) with ``metrics`` at ``step``."""
        if self.metrics is None:
            return
        values = {key: _to_float(key, value) for key, value in metrics.items()}
        wall_time = self.metrics.append(step, values)
        if self._wandb is not None:
            self._guard(self._wandb.log, {"wall_time": wall_time, **values}, step=step)

    def rewind(self, step: int, aside: Path | None = None) -> int:
        """Rank 0 drops the rows of metrics.jsonl that a run resumed at ``step`` logs again (``MetricsFile.rewind``);
        returns how many were dropped."""
        return self.metrics.rewind(step, aside) if self.metrics is not None else 0

    def bring_back(self, source: Path, step: int) -> None:
        """Rank 0 appends the rows of a retired timeline's ``source`` logged before the checkpoint of ``step``."""
        if self.metrics is not None:
            self.metrics.bring_back(source, step)

    def log_images(
        self,
        key: str,
        images: Tensor,
        captions: Sequence[str],
        step: int,
        *,
        scores: Sequence[float] | None = None,
        score_name: str = "reward",
        nrow: int | None = None,
        shown_step: int | None = None,
    ) -> Path | None:
        """Save a captioned PNG grid ``samples/<key>_<shown_step>.png``, with ``score_name`` per image when
        ``scores`` is given, ``nrow`` per row, and ``<key>_<shown_step>.txt`` (``index<TAB>score<TAB>caption``
        per image); send the images to wandb at ``step``. ``shown_step`` (default ``step``) names and titles
        the files: the trainer's count of steps, as its evaluations and checkpoints say it."""
        if not self.is_main:
            return None
        if len(captions) != images.shape[0] or (scores is not None and len(scores) != len(captions)):
            raise ValueError(f"log_images: {images.shape[0]} images, {len(captions)} captions and scores to match")
        folder = self.layout.samples
        folder.mkdir(parents=True, exist_ok=True)
        shown = step if shown_step is None else shown_step
        stem = f"{key.replace('/', '_')}_{shown:08d}"
        path = folder / f"{stem}.png"
        values = [f"{score:.4f}" for score in scores] if scores is not None else [""] * len(captions)
        labels = [f"#{i}  {value}\n{caption}" for i, (value, caption) in enumerate(zip(values, captions))]
        title = f"{key}, step {shown}" + (f": #index {score_name}" if scores is not None else "")
        lines = [f"{i}\t{value}\t{caption}" for i, (value, caption) in enumerate(zip(values, captions))]
        header = f"index\t{score_name}\tcaption" if scores is not None else "index\t\tcaption"
        try:
            image_grid(images, nrow, labels=labels, title=title, min_tile=MIN_TILE).save(path)
            (folder / f"{stem}.txt").write_text("\n".join([header, *lines]) + "\n", encoding="utf-8")
        except OSError as err:
            raise write_failure(err, folder, f"the sample grid of step {shown}") or err from None
        self.log_wandb_images(key, images, [f"{v} {c}".strip() for v, c in zip(values, captions)], step)
        return path

    def log_wandb_images(self, key: str, images: Tensor | Path, captions: Sequence[str], step: int) -> None:
        """Images [B, 3, H, W] in [0, 1] with one caption each, or one PNG file with one caption, to wandb."""
        if self.is_main and self._wandb is not None:
            self._guard(self._log_wandb_images, key, images, captions, step)

    def _log_wandb_images(self, key: str, images: Tensor | Path, captions: Sequence[str], step: int) -> None:
        import wandb

        if isinstance(images, Path):
            self._wandb.log({key: wandb.Image(str(images), caption=captions[0])}, step=step)
            return
        pixels = (images.detach().float().clamp(0, 1).cpu() * 255).round().to(torch.uint8)
        entries = [wandb.Image(img.permute(1, 2, 0).numpy(), caption=cap) for img, cap in zip(pixels, captions)]
        self._wandb.log({key: entries}, step=step)

    def finish(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self._wandb is not None:
            self._guard(self._wandb.finish)
            self._wandb = None
