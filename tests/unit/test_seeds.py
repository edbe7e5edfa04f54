"""Random streams: one function of (seed, purpose, index), independent across all three."""

import random

import numpy as np
import pytest
import torch

from train.distributed.seeds import PURPOSES, seed_everything, stream_generator, stream_seed


def test_streams_of_one_run_never_collide():
    # The old layout seeded the SDE noise with seed + 1: seed 42's SDE noise was seed 43's initial
    # noise. Every (seed, purpose, index) must give its own seed.
    seeds = {(s, p, i): stream_seed(s, p, i) for s in range(4) for p in PURPOSES for i in range(16)}
    assert len(set(seeds.values())) == len(seeds)
    assert stream_seed(42, "sde_noise", 7) != stream_seed(43, "initial_noise", 7)
    assert stream_seed(0, "initial_noise", 1) != stream_seed(1, "initial_noise", 0)


def test_stream_ignores_the_global_rng_and_is_reproducible():
    torch.manual_seed(0)
    a = torch.randn(4, generator=stream_generator(5, "initial_noise", 3))
    torch.manual_seed(1)
    torch.testing.assert_close(torch.randn(4, generator=stream_generator(5, "initial_noise", 3)), a, rtol=0, atol=0)
    assert 0 <= stream_seed(5, "initial_noise", 3) < 2**63


def test_unknown_purpose_is_an_error():
    with pytest.raises(ValueError, match="unknown random stream 'noise'"):
        stream_seed(0, "noise", 0)


def test_seed_everything_is_per_rank_and_reproducible() -> None:
    def draw() -> tuple[float, float, float]:
        return float(torch.rand(())), float(np.random.rand()), random.random()

    seed_everything(7, rank=0)
    first = draw()
    seed_everything(7, rank=0)
    assert draw() == first
    seed_everything(7, rank=1)
    assert all(x != y for x, y in zip(draw(), first))
