"""Metrics that say how they combine: over the steps of an update, and over ranks.

A step's loss reports ``Metric``s (a detached scalar and its ``Reduce``); the update stage sums them
into ``Stat``s, which add (a mean keeps its weighted sum and its weight). The caller reduces the stats
over ranks, each by its ``Reduce``: the algorithm runs no collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from settings import Choice


class Reduce(Choice):
    """How values of one metric combine (over steps, micro-batches and ranks)."""

    sum = "sum"  # a total (counters)
    mean = "mean"  # weighted by the rows each value stands for
    max = "max"
    min = "min"


@dataclass(frozen=True)
class Metric:
    """One step's value of a metric (a detached scalar, read only when the stats are) and its reduction."""

    value: Tensor | float
    reduce: Reduce = Reduce.mean


@dataclass(frozen=True)
class Stat:
    """A metric accumulated over steps: a sum, a weighted sum and its weight (``mean``), or an extreme."""

    reduce: Reduce
    value: float  # sum: the total; mean: sum of weight * value; max / min: the extreme
    weight: float = 0.0  # mean: the total weight (rows) behind ``value``

    @classmethod
    def of(cls, metric: Metric, rows: int) -> Stat:
        """One step's ``metric`` over ``rows`` rows."""
        value = float(metric.value)
        if metric.reduce is Reduce.mean:
            return cls(Reduce.mean, rows * value, rows)
        return cls(metric.reduce, value)

    def __add__(self, other: Stat) -> Stat:
        if other.reduce is not self.reduce:
            raise ValueError(f"cannot add a {other.reduce} stat to a {self.reduce} one")
        if self.reduce is Reduce.max:
            return Stat(Reduce.max, max(self.value, other.value))
        if self.reduce is Reduce.min:
            return Stat(Reduce.min, min(self.value, other.value))
        return Stat(self.reduce, self.value + other.value, self.weight + other.weight)
