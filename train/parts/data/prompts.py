"""The training prompts' settings (the ``data`` group), prompt files and the deterministic, resumable order in
which ranks draw prompts.

Step ``k`` of a run deals the prompts ``k * P * R .. (k + 1) * P * R - 1`` of an endless sequence of
epochs (each epoch a permutation of the file from the stream (seed, "prompt_order", epoch)); rank r
takes P of them. Group ids are the positions in that sequence, so they are unique across ranks and steps, and the data
position of a run is just the step counter: resuming at step k needs no other state.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import MISSING

from train.distributed.seeds import stream_generator
from train.ground.errors import ConfigError, PathError


@dataclass
class DataConfig:
    """The training prompts."""

    train_prompts: str = MISSING
    """Text file, one prompt per line."""


@dataclass(frozen=True)
class PromptRecord:
    prompt: str
    category: str | None = None


def read_prompts(path: str | Path, *, field_name: str = "data.train_prompts") -> list[PromptRecord]:
    """One prompt per line (text), or JSON lines with "prompt" and optional "category"; UTF-8 (a BOM is dropped)."""
    path = Path(path)
    if path.is_dir():
        raise PathError(f"{field_name}={str(path)!r} is a folder; name the prompt file in it")
    if path.exists() and not path.is_file():  # a FIFO or a shell's <(...): read once, and the run reads it again
        raise PathError(
            f"{field_name}={str(path)!r} is a pipe or another file that is not a regular one; the trainer reads the "
            "prompts more than once (every rank, the evaluation, a resume): write them to a file and name that"
        )
    if not path.is_file():
        raise PathError(f"{field_name}={str(path)!r} does not exist")
    records = []
    for number, line in enumerate(_decode(path.read_bytes(), path, field_name).splitlines(), start=1):
        line = line.strip()
        if not line:
            continue
        if "\x00" in line:
            raise ConfigError(f"{field_name}: {path}:{number} holds a NUL byte: is it a text file?")
        records.append(_json_record(line, path, number, field_name) if path.suffix == ".jsonl" else PromptRecord(line))
    if not records:
        raise ConfigError(f"{field_name}={str(path)!r} has no prompts (the file is empty)")
    return records


def _json_record(line: str, path: Path, number: int, field_name: str) -> PromptRecord:
    """A JSON line ``{"prompt": <non-empty text>, "category": <text or null>}``."""
    where = f"{field_name}: {path}:{number}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError:
        item = None
    if not isinstance(item, dict) or "prompt" not in item:
        raise ConfigError(f"{where} is not a JSON object with a 'prompt' key")
    prompt, category = item["prompt"], item.get("category")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError(f"{where}: 'prompt' must be a non-empty string, got {json.dumps(prompt)}")
    if category is not None and not isinstance(category, str):
        raise ConfigError(f"{where}: 'category' must be a string or null, got {json.dumps(category)}")
    return PromptRecord(prompt, category)


def _decode(raw: bytes, path: Path, field_name: str) -> str:
    """The text of a prompt file; an error names the first line that is not UTF-8."""
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise ConfigError(
            f"{field_name}={str(path)!r} is UTF-16 (it starts with a UTF-16 byte-order mark); prompt files are "
            f"UTF-8: convert it, e.g. iconv -f utf-16 -t utf-8"
        )
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        column = err.start - raw.rfind(b"\n", 0, err.start)
        raise ConfigError(
            f"{field_name}={str(path)!r}: line {line} is not UTF-8 (byte 0x{raw[err.start]:02x} at column {column}); "
            "prompt files are UTF-8: convert it, e.g. iconv -f latin1 -t utf-8"
        ) from None


def prompts_digest(records: list[PromptRecord]) -> str:
    """What a checkpoint records of the training prompts (train/parts/checkpoint/settings.py): their number and a hash
    of the prompts in order, which is what a step draws from (not the file's path, format or blank lines)."""
    digest = hashlib.sha256(json.dumps([r.prompt for r in records]).encode()).hexdigest()
    return f"{len(records)} prompts, sha256 {digest[:16]}"


@dataclass(frozen=True)
class PromptBatch:
    prompts: list[str]  # P prompts of this rank
    group_ids: list[int]  # P global group ids (unique over ranks and steps)


class PromptSampler:
    """Deals ``prompts_per_rank`` prompts to each rank at each step, reproducibly from (seed, step)."""

    def __init__(self, records: list[PromptRecord], *, seed: int, rank: int, world_size: int, prompts_per_rank: int):
        self.records, self.seed = records, seed
        self.digest = prompts_digest(records)  # recorded with each checkpoint
        self.rank, self.world_size, self.per_rank = rank, world_size, prompts_per_rank
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    def _prompt_at(self, position: int) -> str:
        epoch, offset = divmod(position, len(self.records))
        if epoch != self._epoch:
            generator = stream_generator(self.seed, "prompt_order", epoch)
            self._epoch, self._order = epoch, torch.randperm(len(self.records), generator=generator)
        return self.records[int(self._order[offset])].prompt

    def batch(self, step: int) -> PromptBatch:
        first = (step * self.world_size + self.rank) * self.per_rank
        ids = list(range(first, first + self.per_rank))
        return PromptBatch([self._prompt_at(i) for i in ids], ids)
