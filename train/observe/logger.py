"""One run logger (metrics.jsonl, sample grids, wandb), a phase timer, the progress bar and its heartbeat.

* ``RunLogger`` is a no-op off rank 0: every rank calls it, only rank 0 writes. It writes the run's
  resolved configuration to ``run_dir/config.yaml`` when it starts (a resumed session to
  ``config.<n>.yaml``: the first session's stays). Each ``log`` call
  appends one JSON line ``{"step", "wall_time", <metric>: float, ...}`` to
  ``run_dir/metrics.jsonl`` and flushes it, so a crashed run keeps every logged step (a disk that refuses a
  row ends the run with ``SaveFailed``, one line naming the disk). The file is
  created by the first ``log``: a tool that logs nothing (the probe) leaves no empty one behind.
  A row at step k is training step k, or (``eval/*`` only) the policy after k steps. A resumed run
  calls ``rewind(k)`` first: the rows of the steps it will replay go, so every step has one row (a row cut
  short by the crash goes with them, named in one line).
  ``wall_time`` is seconds of this run: a resumed run continues from the last record it keeps.
* wandb is optional (``wandb_mode`` disabled, offline or online). Offline runs write into
  ``run_dir/wandb/``. The wandb run id is kept in ``run_dir/wandb_run_id``, so a resumed run (or
  any later session in the same folder) continues the same wandb run. wandb gets ``wall_time`` too
  (train.compare.command plots against it). The steps a resumed run replays: offline, each session writes a
  folder of its own and train.compare.command keeps the later values (as ``rewind`` does here); online,
  wandb keeps the first values of a step and drops the replay, which differs only in timings,
  since a resumed run replays bit for bit. Any exception raised by
  wandb (import, init, log, finish) is caught, warned once, and wandb is switched off for the rest
  of the run: observability never stops training. The JSONL file is the record of truth either way.
* ``PhaseTimer`` sums wall-clock seconds per phase (``time/<phase>``); on CUDA it synchronizes
  before reading the clock, since kernels run asynchronously and would be billed to the next phase.
* ``Heartbeat``: a progress line at most every ``every_s`` seconds, for runs without the bar.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import string
import time
import warnings
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch
from omegaconf import OmegaConf
from torch import Tensor
from tqdm import tqdm

from rewards.summary import MIN_TILE, image_grid
from train.checkpoint.files import write_failure
from train.ground.errors import SaveFailed
from train.ground.layout import RunLayout
from train.observe.observe_config import LoggingConfig, WandbMode

if TYPE_CHECKING:
    from train.observe.perf import FlopMeter

log = logging.getLogger(__name__)


def read_lines(path: Path) -> list[str]:
    """The lines of a metrics.jsonl, ends kept; none when there is no file (``metrics_problem`` found it readable)."""
    return path.read_text(encoding="utf-8").splitlines(keepends=True) if path.is_file() else []


def _write_lines(path: Path, lines: list[str]) -> None:
    """Replace ``path`` with ``lines`` (a newline ended each), through a temporary file and a rename."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text("".join(line if line.endswith("\n") else line + "\n" for line in lines), encoding="utf-8")
    os.replace(tmp, path)


def metrics_problem(path: Path) -> str | None:
    """What keeps a resumed run from reading its metrics.jsonl (a line that is not UTF-8), naming the line; or None."""
    if not path.is_file():
        return None
    raw = path.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        column = err.start - raw.rfind(b"\n", 0, err.start)
        return (
            f"{path}:{line} is not UTF-8 (byte 0x{raw[err.start]:02x} at column {column}): the file is damaged; "
            f"delete that line (one step's row) or put back a copy of the file, then resume again"
        )
    return None


def last_wall_time(lines: list[str]) -> float:
    """``wall_time`` of the last readable record among a metrics.jsonl's lines; 0 when there is none."""
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        if isinstance(record, dict) and isinstance(record.get("wall_time"), int | float):
            return float(record["wall_time"])
    return 0.0


def session_config(run_dir: Path, *, resumed: bool) -> Path:
    """Where a session writes its configuration: ``config.yaml``, or for a resumed run, which keeps the first
    session's there, ``config.<n>.yaml`` (n = 2, 3, ... per resumed session)."""
    layout = RunLayout(run_dir)
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
        self.run_dir = layout.root
        self.is_main = is_main
        self.layout = layout
        self.metrics_path = self.layout.metrics
        self._start = time.time()
        self._wandb: Any = None
        self._file: TextIO | None = None
        self._finished = False
        if not is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if config is not None:  # what ran, next to what it logged (train.compare.command labels runs from it)
            path = session_config(self.run_dir, resumed=resumed)
            try:
                path.write_text(OmegaConf.to_yaml(dict(config)), encoding="utf-8")
            except OSError as err:
                raise write_failure(err, path, "the run's configuration") or err from None
        self._start -= last_wall_time(read_lines(self.metrics_path))
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
            dir=str(self.run_dir),
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
        """Append one JSON line (and a wandb point) with ``metrics`` at ``step``."""
        if not self.is_main:
            return
        if self._finished:
            raise RuntimeError("RunLogger.log after finish()")
        values = {key: _to_float(key, value) for key, value in metrics.items()}
        record = {"step": step, "wall_time": round(time.time() - self._start, 3), **values}
        try:
            if self._file is None:  # kept open for the whole run (appended to every step); closed by finish()
                self._file = open(self.metrics_path, "a", encoding="utf-8")
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as err:
            raise self._not_written(err, step) from None
        if self._wandb is not None:
            self._guard(self._wandb.log, {"wall_time": record["wall_time"], **values}, step=step)

    def _not_written(self, err: OSError, step: int) -> SaveFailed:
        """The one line for a row of ``step`` that the disk refused; the file is dropped (its buffer with it)."""
        if self._file is not None:
            try:
                self._file.close()  # flushes the rest of the row again, which fails again
            except OSError:
                pass
            self._file = None
        failure = write_failure(err, self.metrics_path, f"the row of step {step}")
        assert failure is not None  # an OSError always names the disk
        return failure

    def rewind(self, step: int, aside: Path | None = None) -> int:
        """Drop the rows that a run resumed at ``step`` logs again; returns how many were dropped.

        Kept: training rows of steps < ``step`` and the evaluation after ``step`` steps (logged before
        the checkpoint of ``step`` was written; a run resumed at 0 evaluates again). A line cut short
        by a crash is dropped too. With ``aside``, the dropped rows go there (a retired timeline's rows,
        train/run/timeline.py). Rank 0 rewrites the file through a temporary file and a rename, so
        a crash here leaves the old file or the new one.
        """
        if not self.is_main:
            return 0
        lines = self._reopened_lines()
        kept = [line for line in lines if _logged_before(line, step)]
        cut = [number for number, line in enumerate(lines, start=1) if metrics_row(line) is None and line.strip()]
        if cut:
            where = f"line {cut[0]} was" if len(cut) == 1 else f"lines {', '.join(map(str, cut))} were"
            log.warning("%s: %s cut short by the crash that ended a session: dropped", self.metrics_path, where)
        if aside is not None:
            _write_lines(
                aside, [line for line in lines if metrics_row(line) is not None and not _logged_before(line, step)]
            )
        if len(kept) != len(lines):
            _write_lines(self.metrics_path, kept)
        self._start = time.time() - last_wall_time(kept)  # the replayed steps' time is not counted twice
        return len(lines) - len(kept)

    def bring_back(self, source: Path, step: int) -> None:
        """Append the rows of ``source`` (a retired timeline's, train/run/timeline.py) logged before the checkpoint
        of ``step``; the others stay in ``source`` (which goes when none is left)."""
        if not self.is_main or not source.is_file():
            return
        lines = self._reopened_lines()
        rows = read_lines(source)
        back = [line for line in rows if _logged_before(line, step)]
        _write_lines(self.metrics_path, [*lines, *back])
        rest = [line for line in rows if not _logged_before(line, step)]
        if rest:
            _write_lines(source, rest)
        else:
            source.unlink()
        self._start = time.time() - last_wall_time([*lines, *back])

    def _reopened_lines(self) -> list[str]:
        """The lines of metrics.jsonl, its file closed first (``log()`` opens it again)."""
        if self._finished:
            raise RuntimeError("RunLogger: the metrics file was rewritten after finish()")
        if self._file is not None:
            self._file.close()
            self._file = None
        return read_lines(self.metrics_path)

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
        self._finished = True
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._guard(self._wandb.finish)
            self._wandb = None


def metrics_row(line: str) -> dict[str, Any] | None:
    """A metrics.jsonl row (a JSON object with an integer step), or None (a line cut short)."""
    try:
        row = json.loads(line)
        int(row["step"])
    except (ValueError, KeyError, TypeError):
        return None
    return row if isinstance(row, dict) else None


def evaluation_only(row: dict[str, Any]) -> bool:
    """Whether a metrics.jsonl row is an evaluation's (``eval/*`` metrics only), not a training step's."""
    return all(key.startswith("eval/") for key in row if key not in ("step", "wall_time"))


def _logged_before(line: str, step: int) -> bool:
    """Whether a metrics.jsonl row was logged before the checkpoint of ``step`` (see ``RunLogger.rewind``)."""
    row = metrics_row(line)
    if row is None:
        return False
    logged = int(row["step"])
    return logged < step or (logged == step > 0 and evaluation_only(row))


class PhaseTimer:
    """``with timer.phase("rollout"): ...`` sums seconds per phase until ``pop()``, and the FLOPs that
    ``flops`` counted in each phase when given."""

    def __init__(self, device: torch.device | str = "cpu", flops: FlopMeter | None = None) -> None:
        self.device = torch.device(device)
        self.flops = flops
        self._totals: dict[str, float] = defaultdict(float)
        self._flops: dict[str, int] = defaultdict(int)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start, counted = self._now(), self.flops.total if self.flops is not None else 0
        try:
            yield
        finally:
            self._totals[name] += self._now() - start
            if self.flops is not None:
                self._flops[name] += self.flops.total - counted

    def pop(self) -> dict[str, float]:
        """{"time/<phase>": seconds, "flops/<phase>": FLOPs} accumulated since the last pop; resets the totals."""
        out = {f"time/{name}": seconds for name, seconds in self._totals.items()}
        out |= {f"flops/{name}": float(flops) for name, flops in self._flops.items() if flops}
        self._totals.clear()
        self._flops.clear()
        return out


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
    """``step 12/60  reward 0.5912  3.10 s/step  eta 2m29s`` at most every ``every_s`` seconds (0: every
    step) and after the last step, on the console of rank 0, for runs whose progress bar is off."""

    def __init__(self, total: int, *, start: int, every_s: float, enabled: bool) -> None:
        self.total, self.start, self.every_s, self.enabled = total, start, every_s, enabled
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
