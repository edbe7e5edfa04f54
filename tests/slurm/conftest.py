"""The one-node Slurm cluster the recipe's tests share (slurm_cluster.py), stopped after the last of them, also
when one fails."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from slurm_cluster import Cluster, started


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with started() as running:
        yield running
