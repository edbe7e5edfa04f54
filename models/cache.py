"""A prompt-embedding cache on disk, so training need not keep the text encoders in memory.

Layout of a cache folder (written once by scripts/precompute_embeddings.py):

    index.json                 {"format": 1, "signature": {...}, "prompts": [[prompt, shard], ...]}
    shard-00000.safetensors    tensors "<row>.<field>" [1, ...], one conditioning row each, unpadded
    shard-00001.safetensors    ...

``signature`` records what produced the rows (backbone name, encoding options, embedding sizes);
a backbone loading the cache compares it with its own and refuses a mismatch. Rows are stored as
``Conditioning.trim()`` leaves them, so a backbone whose text length varies (Qwen-Image) stores
each prompt without padding and ``lookup`` pads a batch exactly as on-the-fly encoding does.
Shards are opened lazily and memory-mapped: only the rows a batch asks for are read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from models.base import Conditioning

FORMAT = 1
INDEX = "index.json"


def _shard_name(shard: int) -> str:
    return f"shard-{shard:05d}.safetensors"


class EmbeddingCache:
    """Read-only view of a cache folder: prompt -> conditioning row."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index_path = self.path / INDEX
        if not index_path.is_file():
            raise FileNotFoundError(
                f"embedding_cache: {index_path} does not exist; write the cache with "
                "scripts/precompute_embeddings.py or fix the path"
            )
        index = json.loads(index_path.read_text())
        if index.get("format") != FORMAT:
            raise ValueError(f"embedding_cache: {self.path} has format {index.get('format')}, expected {FORMAT}")
        self.signature: dict[str, Any] = index["signature"]
        self._rows = {prompt: (row, shard) for row, (prompt, shard) in enumerate(index["prompts"])}
        self._shards: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def check_signature(self, expected: Mapping[str, Any]) -> None:
        """Raise unless every non-None entry of ``expected`` equals the cache's."""
        diff = {
            k: (self.signature.get(k), v) for k, v in expected.items() if v is not None and self.signature.get(k) != v
        }
        if diff:
            details = ", ".join(f"{k}: cache has {c!r}, model has {m!r}" for k, (c, m) in diff.items())
            raise ValueError(
                f"embedding_cache: {self.path} was written for another text encoding ({details}); "
                "rewrite it with scripts/precompute_embeddings.py for this model"
            )

    def _shard(self, shard: int) -> Any:
        if shard not in self._shards:
            self._shards[shard] = safe_open(str(self.path / _shard_name(shard)), framework="pt")
        return self._shards[shard]

    def lookup(self, prompts: list[str], cls: type[Conditioning]) -> Conditioning:
        """Conditioning of ``prompts`` (CPU, stored dtype), padded as one encoded batch would be."""
        missing = [p for p in prompts if p not in self._rows]
        if missing:
            raise ValueError(
                f"embedding_cache: {len(missing)} prompt(s) are not in {self.path}, e.g. {missing[0]!r}; "
                "rerun scripts/precompute_embeddings.py on the prompt file used for training"
            )
        rows = []
        for prompt in prompts:
            row, shard = self._rows[prompt]
            handle = self._shard(shard)
            rows.append(cls(**{f.name: handle.get_tensor(f"{row}.{f.name}") for f in fields(cls)}))
        return cls.cat(rows)

    @staticmethod
    def write(
        path: str | Path,
        batches: Iterable[tuple[list[str], Conditioning]],
        *,
        signature: Mapping[str, Any],
        rows_per_shard: int = 1024,
    ) -> int:
        """Write (prompts, conditioning) batches to a new cache folder; returns the number of rows.

        A prompt seen twice is stored once. The index is written last, so a crash leaves no
        readable half-cache.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        index: list[tuple[str, int]] = []
        seen: set[str] = set()
        pending: dict[str, Tensor] = {}
        for prompts, cond in batches:
            for i, prompt in enumerate(prompts):
                if prompt in seen:
                    continue
                seen.add(prompt)
                row = cond.index([i]).trim()
                pending.update({f"{len(index)}.{k}": v.contiguous().cpu() for k, v in row.tensors().items()})
                index.append((prompt, len(index) // rows_per_shard))
                if len(index) % rows_per_shard == 0:
                    save_file(pending, str(path / _shard_name(len(index) // rows_per_shard - 1)))
                    pending = {}
        if pending:
            save_file(pending, str(path / _shard_name(index[-1][1])))
        body = {"format": FORMAT, "signature": dict(signature), "prompts": index}
        (path / INDEX).write_text(json.dumps(body))
        return len(index)
