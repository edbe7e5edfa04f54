"""What a checkpoint holds: the model and optimizer state (``get_state_dict``, FSDP2-aware), the caller's
``extra`` split into DTensor leaves (saved by DCP) and the rest (saved per rank), and the RNG states of a
rank (train/parts/checkpoint/manager.py writes and reads them)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer


def split_extra(tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a nested dict into (DTensor leaves, everything else), both keeping the nesting."""
    sharded: dict[str, Any] = {}
    local: dict[str, Any] = {}
    for key, value in tree.items():
        if not isinstance(key, str):
            raise ValueError(f"checkpoint extra: keys must be strings, got {key!r}")
        if isinstance(value, dict):
            sub_sharded, sub_local = split_extra(value)
            if sub_sharded:
                sharded[key] = sub_sharded
            if sub_local or not sub_sharded:
                local[key] = sub_local
        elif isinstance(value, DTensor):
            sharded[key] = value
        else:
            local[key] = value
    return sharded, local


def merge_trees(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_trees(merged[key], value)
        else:
            merged[key] = value
    return merged


def flat_keys(tree: dict[str, Any], prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for key, value in tree.items():
        path = f"{prefix}{key}"
        keys |= flat_keys(value, path + ".") if isinstance(value, dict) else {path}
    return keys


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def train_state(model: nn.Module, optimizer: Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}
