"""Start-up checks the ranks agree on: a check that fails on one rank stops every rank together, in one line,
rather than leaving the others waiting in the next collective."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from train.distributed.collectives import DistInfo, broadcast_object, gather_objects
from train.ground.errors import StartRefused, UserError

T = TypeVar("T")


def failed_ranks_line(lines: list[str | None]) -> str:
    """Each rank's failure (``lines[rank]``, None where it passed) in one line: the line alone when every rank
    failed alike, else ``rank 1: <line>; rank 0,2: <line>``."""
    ranks: dict[str, list[int]] = {}
    for rank, line in enumerate(lines):
        if line is not None:
            ranks.setdefault(line, []).append(rank)
    if len(ranks) == 1 and len(next(iter(ranks.values()))) == len(lines):
        return next(iter(ranks))
    return "; ".join(f"rank {','.join(map(str, who))}: {line}" for line, who in ranks.items())


def agreed(fn: Callable[[], T]) -> T:
    """``fn()``, a rank's own checks (files read where this rank reads them, its device), then one gather: where it
    raised a UserError on any rank, every rank raises StartRefused naming each failing rank's line (rank 0 prints
    it). A rank that failed alone would otherwise skip the next collective, and the others wait in it for
    dist.timeout_s."""
    refusal: UserError | None = None
    try:
        result = fn()
    except UserError as err:
        refusal = err
    lines = gather_objects(None if refusal is None else str(refusal))
    if refusal is not None and len(lines) == 1:  # one process: its own error as it was raised
        raise refusal
    if any(line is not None for line in lines):
        raise StartRefused(failed_ranks_line(lines))
    return result


def main_decides(dist: DistInfo, fn: Callable[[], T]) -> T | None:
    """``fn()`` on rank 0 alone, the other ranks waiting for it (a collective every rank reaches, whatever rank 0
    found): a UserError it raises is raised on every rank, in rank 0's words (rank 0 prints it). Rank 0's result,
    None elsewhere."""
    result, refusal = None, None
    if dist.is_main:
        try:
            result = fn()
        except UserError as err:
            refusal = err
    message = broadcast_object(None if refusal is None else str(refusal))
    if refusal is not None:
        raise refusal
    if message is not None:
        raise StartRefused(message)
    return result
