"""Every random stream of a run, derived from (seed, purpose, index) by one function.

A run draws random numbers for several purposes: the global RNGs of each rank, the model's random
initialisation (LoRA adapters), a group's shared initial noise and its SDE noise, the
Flow-GRPO-Fast window and the update plan of a step, the prompt order of an epoch, the evaluation
noise of a prompt. Each draws from its own generator seeded by ``stream_seed(seed, purpose, index)``,
a 63-bit hash of the three, so

* streams never collide: seed 42's SDE noise is not seed 43's initial noise (as ``seed + 1``
  would make it), and group 1 of seed 0 is not group 0 of seed 1 (as ``seed + group`` would);
* runs with different seeds are independent in every stream, which a comparison over seeds needs;
* a stream depends on its index only (the group id, the step, the epoch, the rank), never on
  how many ranks there are or what else was drawn before, so a resumed run replays exactly and a
  step does not depend on how its groups are spread over ranks.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch

PURPOSES = (
    "global",  # the global torch / numpy / random RNGs of rank <index>
    "model_init",  # random initialisation of trainable weights (LoRA), identical on every rank
    "initial_noise",  # the shared z_0 of group <index>
    "sde_noise",  # the SDE noise of group <index>
    "sde_window",  # the SDE window of step <index> (sampler.sde_window_schedule fixed or random)
    "update_plan",  # the groups of transitions trained at step <index>
    "pass_order",  # the order of the samples in update pass <index[1]> of step <index[0]> (grpo.inner_epochs)
    "prompt_order",  # the permutation of the prompt file in epoch <index>
    "eval_noise",  # the initial noise of evaluation prompt <index>
)


def stream_seed(seed: int, purpose: str, index: int | tuple[int, ...] = 0) -> int:
    """The seed of stream ``purpose`` number ``index`` of a run seeded with ``seed``; a tuple ``index`` names a
    stream by several numbers (a step and a pass), a 1-tuple the same stream as its number."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown random stream {purpose!r}; known: {', '.join(PURPOSES)}")
    numbers = index if isinstance(index, tuple) else (index,)
    key = ":".join(str(int(number)) for number in numbers)
    digest = hashlib.blake2b(f"{int(seed)}:{purpose}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def stream_generator(
    seed: int, purpose: str, index: int | tuple[int, ...] = 0, device: torch.device | str = "cpu"
) -> torch.Generator:
    """A generator on ``device`` seeded by ``stream_seed(seed, purpose, index)``."""
    return torch.Generator(device=device).manual_seed(stream_seed(seed, purpose, index))


def seed_everything(seed: int, rank: int) -> None:
    """Seed torch (CPU and CUDA), numpy and random from the ``global`` stream of ``rank``.

    Ranks draw differently; nothing the trainer needs to be identical across ranks or world sizes
    reads these RNGs (those use their own stream).
    """
    value = stream_seed(seed, "global", rank)
    torch.manual_seed(value)
    np.random.seed(value % 2**32)
    random.seed(value)
