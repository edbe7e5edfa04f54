"""The run's metrics file, ``run_dir/metrics.jsonl``: the record of truth of what a run logged.

Each row is one JSON line ``{"step", "wall_time", <metric>: float, ...}``, appended and flushed, so a crashed run
keeps every logged step (a disk that refuses a row ends the run with ``SaveFailed``, one line naming the disk). The
file is created by the first row: a tool that logs nothing (the probe) leaves no empty one behind. A row at step k
is training step k, or (``eval/*`` only) the policy after k steps. A resumed run calls ``rewind(k)`` first: the rows
of the steps it will replay go, so every step has one row (a row cut short by the crash goes with them, named in
one line). ``wall_time`` is seconds of this run: a resumed run continues from the last record it keeps.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any, TextIO

from train.ground.disk import write_failure

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


def metrics_row(line: str) -> dict[str, Any] | None:
    """A metrics.jsonl row (a JSON object with an integer step), or None (a line cut short)."""
    try:
        row = json.loads(line)
        int(row["step"])
    except (ValueError, KeyError, TypeError):
        return None
    return row if isinstance(row, dict) else None


def evaluation_only(row: Mapping[str, Any]) -> bool:
    """Whether a metrics.jsonl row is an evaluation's (``eval/*`` metrics only), not a training step's."""
    return all(key.startswith("eval/") for key in row if key not in ("step", "wall_time"))


def _logged_before(line: str, step: int) -> bool:
    """Whether a metrics.jsonl row was logged before the checkpoint of ``step`` (see ``MetricsFile.rewind``)."""
    row = metrics_row(line)
    if row is None:
        return False
    logged = int(row["step"])
    return logged < step or (logged == step > 0 and evaluation_only(row))


class MetricsFile:
    """The metrics.jsonl at ``path`` as rank 0 writes it, and the clock of its ``wall_time``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO | None = None  # kept open for the whole run (appended to every step); closed by close()
        self._closed = False
        self._start = time.time() - last_wall_time(read_lines(path))

    def append(self, step: int, values: dict[str, float]) -> float:
        """Append the row of ``values`` at ``step``; returns its ``wall_time``."""
        if self._closed:
            raise RuntimeError("RunLogger.log after finish()")
        record = {"step": step, "wall_time": round(time.time() - self._start, 3), **values}
        try:
            if self._file is None:
                self._file = open(self.path, "a", encoding="utf-8")
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as err:  # the disk refused the row: the file is dropped, its buffer with it
            with suppress(OSError):  # closing flushes the rest of the row again, which fails again
                self._close_file()
            self._file = None
            raise write_failure(err, self.path, f"the row of step {step}") or err from None
        return record["wall_time"]

    def rewind(self, step: int, aside: Path | None = None) -> int:
        """Drop the rows that a run resumed at ``step`` logs again; returns how many were dropped.

        Kept: training rows of steps < ``step`` and the evaluation after ``step`` steps (logged before
        the checkpoint of ``step`` was written; a run resumed at 0 evaluates again). A line cut short
        by a crash is dropped too. With ``aside``, the dropped rows go there (a retired timeline's rows,
        train/run/timeline.py). The file is rewritten through a temporary file and a rename, so a crash
        here leaves the old file or the new one.
        """
        lines = self._reopened_lines()
        kept = [line for line in lines if _logged_before(line, step)]
        cut = [number for number, line in enumerate(lines, start=1) if metrics_row(line) is None and line.strip()]
        if cut:
            where = f"line {cut[0]} was" if len(cut) == 1 else f"lines {', '.join(map(str, cut))} were"
            log.warning("%s: %s cut short by the crash that ended a session: dropped", self.path, where)
        if aside is not None:
            _write_lines(
                aside, [line for line in lines if metrics_row(line) is not None and not _logged_before(line, step)]
            )
        if len(kept) != len(lines):
            _write_lines(self.path, kept)
        self._start = time.time() - last_wall_time(kept)  # the replayed steps' time is not counted twice
        return len(lines) - len(kept)

    def bring_back(self, source: Path, step: int) -> None:
        """Append the rows of ``source`` (a retired timeline's, train/run/timeline.py) logged before the checkpoint
        of ``step``; the others stay in ``source`` (which goes when none is left)."""
        if not source.is_file():
            return
        lines = self._reopened_lines()
        rows = read_lines(source)
        back = [line for line in rows if _logged_before(line, step)]
        _write_lines(self.path, [*lines, *back])
        rest = [line for line in rows if not _logged_before(line, step)]
        if rest:
            _write_lines(source, rest)
        else:
            source.unlink()
        self._start = time.time() - last_wall_time([*lines, *back])

    def _reopened_lines(self) -> list[str]:
        """The lines of the file, closed first (``append`` opens it again)."""
        if self._closed:
            raise RuntimeError("RunLogger: the metrics file was rewritten after finish()")
        self._close_file()
        return read_lines(self.path)

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> None:
        """No row is written after this."""
        self._closed = True
        self._close_file()
