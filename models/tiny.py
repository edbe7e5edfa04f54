"""Tiny random pipelines of every registered backbone, built offline and saved with ``save_pretrained``.

Each adapter supplies its own random pipeline (``Backbone.tiny_pipeline(size)``, as diffusers' tests
build 1-2 layer Flux and Qwen-Image models), so a new backbone brings its tiny configuration with
it; tests and the CPU demo load these folders through the real ``load_backbone`` path.

Sizes (image -> VAE latent -> packed tokens):
    tiny   32x32 px -> 16x16x4 -> 64 tokens; the diffusers test dummies (1+1 Flux blocks, 2 Qwen blocks)
    small  64x64 px -> 32x32x16 -> 256 tokens; 4+4 Flux blocks / 4 Qwen blocks, head dim 64, 4 heads,
           text width 256 (the CPU benchmark configuration)

A build is deterministic in its seed (the adapter draws every weight from torch's global RNG, in a
fixed order) and is skipped when the folder already holds the same build (a marker file written
last, after an atomic rename of the finished folder).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from models.components import quiet_progress_bars
from models.model_config import TinySize
from models.registry import get_backbone_class

SIZES = tuple(size.value for size in TinySize)
MARKER = "tiny_build.json"
IMAGE_SIZE = {"tiny": 32, "small": 64}  # pixels per side of the images each size is built for


def build_tiny(name: str, path: str | Path, *, size: str = "tiny", seed: int = 0) -> Path:
    """Write (or reuse) the random pipeline folder of backbone ``name``; returns its path."""
    if size not in SIZES:
        raise ValueError(f"tiny {name} size must be one of {SIZES}, got {size!r}")
    backbone = get_backbone_class(name)
    path = Path(path)
    spec = {"kind": name, "size": size, "seed": seed}
    marker = path / MARKER
    if marker.is_file():
        if json.loads(marker.read_text()) != spec:
            raise ValueError(f"{path} holds another tiny build ({marker.read_text()}), not {spec}; pick another folder")
        return path
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"{path} exists and is not a complete tiny build; remove it or pick another folder")
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with torch.random.fork_rng(devices=[]), quiet_progress_bars():
        torch.manual_seed(seed)
        backbone.tiny_pipeline(size).save_pretrained(tmp)
    (tmp / MARKER).write_text(json.dumps(spec))
    try:
        os.replace(tmp, path)  # atomic; replaces an empty folder, fails on a full one
    except OSError:  # another process finished the same build first
        shutil.rmtree(tmp, ignore_errors=True)
    return path
