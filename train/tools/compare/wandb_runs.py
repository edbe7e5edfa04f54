"""wandb runs as train.tools.compare.command reads them: offline run folders from their ``.wandb`` file, online runs
through wandb's public API (one run, or every run of a group).

An offline run folder (``<run_dir>/wandb/offline-run-<time>-<id>/``) holds no readable history
besides ``run-<id>.wandb``: wandb's transaction log, a header (``:W&B``, 0xBEE1, version 0), then
32 KiB blocks of chunks (CRC-32 of type and data, length, type: whole, first, middle, last), each
whole record one ``wandb.proto.wandb_internal_pb2.Record``. This module reads the run record (id,
group, name, configuration), the configuration updates and the history rows; a damaged chunk is
an error naming the file. A resumed training run writes a second offline folder with the same id:
the folders are merged in the order they were written, and a step logged twice keeps the later
values, as in metrics.jsonl. (Online, wandb keeps the first values of a step; a resumed run replays
its steps bit for bit, so only timings can differ.)
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = struct.Struct("<4sHB")  # ident, magic, version
CHUNK = struct.Struct("<IHB")  # crc32, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass
class WandbRun:
    run_id: str
    source: str  # where it was read from: the offline folder(s), or wandb:<entity>/<project>/<id>
    name: str = ""
    group: str = ""
    config: dict[str, Any] = field(default_factory=dict)  # nested, as the run was given it
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> the values logged at it


def logged(row: dict[str, Any]) -> dict[str, Any]:
    """A row or configuration without wandb's own keys (``_step``, ``_runtime``, ``_wandb``, ...)."""
    return {k: v for k, v in row.items() if not k.startswith("_")}


def records(path: Path) -> Iterator[bytes]:
    """The records of one ``.wandb`` file, checksums checked."""
    data = path.read_bytes()
    if len(data) < HEADER.size or HEADER.unpack_from(data)[:2] != (b":W&B", 0xBEE1):
        raise ValueError(f"{path} is not a wandb run file (its header is not :W&B)")
    pos, pending = HEADER.size, b""
    while pos + CHUNK.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK.size:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        crc, length, kind = CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0:  # zero fill: the block ends here
            pos += left
            continue
        body = data[pos + CHUNK.size : pos + CHUNK.size + length]
        if len(body) < length:
            return  # the file ends inside a chunk: the writer was stopped, the run ends before it
        if zlib.crc32(body, zlib.crc32(bytes([kind]))) != crc or kind not in (FULL, FIRST, MIDDLE, LAST):
            raise ValueError(f"{path} is damaged at byte {pos} (a checksum does not match)")
        pos += CHUNK.size + length
        if kind == FULL:
            yield body
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        else:
            yield pending + body
            pending = b""


def _items(items: Any) -> dict[str, Any]:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def read_offline_file(path: Path) -> WandbRun:
    """One ``run-<id>.wandb`` file."""
    from wandb.proto import wandb_internal_pb2 as pb

    run = WandbRun(run_id="", source=str(path.parent))
    for raw in records(path):
        record = pb.Record()  # type: ignore[attr-defined]  # generated protobuf module, no stubs
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id, run.name, run.group = record.run.run_id, record.run.display_name, record.run.run_group
            run.config |= _items(record.run.config.update)
        elif kind == "config":
            run.config |= _items(record.config.update)
        elif kind == "history":
            run.steps.setdefault(record.history.step.num, {}).update(logged(_items(record.history.item)))
    run.config = logged(run.config)
    if not run.run_id:
        raise ValueError(f"{path} holds no run record (the run did not start)")
    return run


def run_file(folder: Path) -> Path | None:
    """The ``.wandb`` file of an offline run folder, or None when ``folder`` is not one."""
    found = sorted(folder.glob("run-*.wandb"))
    return found[0] if found else None


def merge(parts: list[WandbRun]) -> list[WandbRun]:
    """Runs by id, the parts of each (sessions of a resumed run) merged in the order given."""
    merged: dict[str, WandbRun] = {}
    for part in parts:
        run = merged.setdefault(part.run_id, WandbRun(part.run_id, part.source, part.name, part.group))
        if run.source != part.source:
            run.source += f" + {Path(part.source).name}"
        run.config |= part.config
        for step, values in part.steps.items():
            run.steps.setdefault(step, {}).update(values)
    return list(merged.values())


def read_offline(folders: list[Path]) -> list[WandbRun]:
    """Offline run folders (sorted by name, which holds the time they were written), merged by id."""
    files = []
    for folder in sorted(folders, key=lambda f: f.name):
        path = run_file(folder)
        if path is None:
            raise ValueError(f"{folder} holds no run-<id>.wandb file: it is not a wandb run folder")
        files.append(path)
    return merge([read_offline_file(path) for path in files])


def read_online(path: str) -> list[WandbRun]:
    """``<entity>/<project>/<run id>`` (one run) or ``<entity>/<project>/group:<name>`` (every run of it)."""
    parts = path.split("/")
    if len(parts) != 3 or not all(parts):
        raise ValueError(
            f"wandb:{path}: write wandb:<entity>/<project>/<run id> or wandb:<entity>/<project>/group:<name>"
        )
    import wandb

    api = wandb.Api()
    project = "/".join(parts[:2])
    if parts[2].startswith("group:"):
        group = parts[2][len("group:") :]
        found = list(api.runs(project, filters={"group": group}))
        if not found:
            raise ValueError(f"wandb:{path}: the project has no run in group {group!r}")
    else:
        found = [api.run(path)]
    return [_online_run(project, r) for r in found]


def _online_run(project: str, run: Any) -> WandbRun:
    steps: dict[int, dict[str, Any]] = {}
    for row in run.scan_history():
        if isinstance(row.get("_step"), int):
            steps.setdefault(row["_step"], {}).update(logged(row))
    config = logged(dict(run.config))
    return WandbRun(run.id, f"wandb:{project}/{run.id}", run.name, run.group or "", config, steps)
