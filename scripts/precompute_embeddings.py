"""Encode a prompt file once and write the embeddings to a cache folder (safetensors shards).

Training then loads the backbone with ``model.embedding_cache=<folder>`` and never loads the text
encoders (5-8B parameters for Flux's T5 and Qwen-Image's Qwen2.5-VL). Only the text encoders and
tokenizers are loaded here, not the transformer or the VAE.

    python scripts/precompute_embeddings.py --model flux --path /ckpt/FLUX.1-dev \\
        --prompts data/train.txt --out /ckpt/flux_train_embeddings --dtype bfloat16 --device cuda \\
        --option max_sequence_length=512

The prompt file is read as the trainer reads it (one prompt per line, or JSON lines with "prompt").
Options must match the training run's ``model.options`` that change the text encoding (e.g.
``max_sequence_length``); the cache records them and loading refuses a mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from models.cache import EmbeddingCache
from models.diffusers_backbone import DiffusersBackbone
from models.registry import backbone_names, load_backbone
from train.parts.data.prompts import read_prompts


def _key_value(text: str) -> tuple[str, object]:
    """``key=value`` with value parsed as JSON when it can be (numbers, booleans), else a string."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, choices=backbone_names(), help="backbone name")
    parser.add_argument("--path", default=None, help="local diffusers pipeline folder")
    parser.add_argument("--prompts", required=True, help="prompt file (.txt: one per line; .jsonl: {'prompt': ...})")
    parser.add_argument("--out", required=True, help="cache folder to create")
    parser.add_argument("--dtype", default="bfloat16", help="text-encoder dtype, stored as is")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per text-encoder call")
    parser.add_argument("--rows-per-shard", type=int, default=1024, help="prompts per safetensors file")
    parser.add_argument("--option", type=_key_value, action="append", default=[], help="adapter option key=value")
    parser.add_argument("--component", type=_key_value, action="append", default=[], help="component folder name=path")
    return parser.parse_args(argv)


def _batches(backbone: DiffusersBackbone, prompts: list[str], batch_size: int) -> Iterator[tuple[list[str], object]]:
    for first in range(0, len(prompts), batch_size):
        chunk = prompts[first : first + batch_size]
        yield chunk, backbone.encode(chunk)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.batch_size < 1 or args.rows_per_shard < 1:
        raise ValueError("--batch-size and --rows-per-shard must be >= 1")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} exists and is not empty; pick a new folder")
    prompts = list(dict.fromkeys(r.prompt for r in read_prompts(args.prompts, field_name="--prompts")))
    backbone = load_backbone(
        args.model,
        args.path,
        dtype=args.dtype,
        device=args.device,
        skip=("transformer", "vae"),
        **dict(args.component),
        **dict(args.option),
    )
    start = time.perf_counter()
    first = backbone.encode(prompts[:1])
    num_rows = EmbeddingCache.write(
        out,
        _batches(backbone, prompts, args.batch_size),
        signature=backbone.cache_signature(first),
        rows_per_shard=args.rows_per_shard,
    )
    print(f"wrote {num_rows} prompts to {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
