"""Worker of tests/distributed/test_distributed_fsdp.py's exit check: ``torchrun --nproc_per_node 2 THIS``.

Inside ``process_group`` (train/run/start.py) it shards a tensor over ``world_mesh`` and gathers it back (DTensor
caches the mesh's plans), then leaves. An exit handler registered first runs last, after the command's own: it
prints the names of the process's gloo threads still alive then (``gloo threads at exit: [...]``)."""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import Shard, distribute_tensor

from train.distributed.parallelize import world_mesh
from train.run.start import process_group


def gloo_threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{task}/comm").read_text().strip()
        except OSError:  # a thread that ended meanwhile
            continue
        names += [name] if "gloo" in name else []
    return sorted(names)


def shard_and_gather() -> None:
    whole = torch.arange(8.0)
    assert torch.equal(distribute_tensor(whole, world_mesh("cpu"), [Shard(0)]).full_tensor(), whole)


def main() -> None:
    atexit.register(lambda: print(f"gloo threads at exit: {gloo_threads()}", file=sys.stderr, flush=True))
    with process_group():
        shard_and_gather()


if __name__ == "__main__":
    main()
