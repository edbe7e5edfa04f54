"""Statistics over seeds for comparing runs: means with 95% confidence intervals, paired differences.

With n independent runs (seeds) x_1..x_n of one arm, the mean's 95% confidence interval is
mean +- t_{0.975, n-1} s / sqrt(n), s the sample standard deviation (n - 1). Two arms run on the
same seeds are compared pairwise: d_i = x_i(arm) - x_i(baseline), and the difference is
distinguishable from zero when the interval of mean(d) excludes 0. Pairing removes what a seed
does to both arms alike (its prompts, its noise), so it is tighter than comparing two intervals.
One seed has no interval (``half_width`` is NaN) and is never called distinguishable.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# Two-sided 95% quantiles t_{0.975, df} of Student's t for df = 1..30; beyond, the normal 1.96.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: int) -> float:
    """t_{0.975, df}: the 95% two-sided quantile of Student's t with ``df`` >= 1 degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96


@dataclass(frozen=True)
class Estimate:
    """Mean of n values with the half-width of its 95% confidence interval (NaN for n < 2)."""

    mean: float
    half_width: float
    n: int
    std: float  # sample standard deviation (n - 1); NaN for n < 2

    @property
    def distinguishable_from_zero(self) -> bool:
        return self.n >= 2 and abs(self.mean) > self.half_width

    def format(self, digits: int = 4, *, signed: bool = False) -> str:
        sign = "+" if signed else ""
        if self.n < 2:
            return f"{self.mean:{sign}.{digits}f} (n=1)"
        return f"{self.mean:{sign}.{digits}f} ± {self.half_width:.{digits}f}"


def sample_std(values: Sequence[float]) -> float:
    """Standard deviation with n - 1; NaN below two values."""
    n = len(values)
    if n < 2:
        return math.nan
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean, std (n - 1) / sqrt(n); NaN below two values."""
    return sample_std(values) / math.sqrt(len(values)) if values else math.nan


def estimate(values: Sequence[float]) -> Estimate:
    """Mean and 95% confidence interval of ``values`` (at least one finite number)."""
    values = [float(v) for v in values]
    if not values or not all(math.isfinite(v) for v in values):
        raise ValueError(f"need at least one value, all finite; got {values}")
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return Estimate(mean, math.nan, n, math.nan)
    std = sample_std(values)
    return Estimate(mean, t975(n - 1) * std / math.sqrt(n), n, std)


def paired(arm: dict[int, float], baseline: dict[int, float]) -> Estimate:
    """Mean difference arm - baseline over the seeds both have, with its 95% interval."""
    common = sorted(set(arm) & set(baseline))
    if not common:
        raise ValueError(f"no seed in common: {sorted(arm)} against the baseline's {sorted(baseline)}")
    return estimate([arm[s] - baseline[s] for s in common])


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of ``values`` at ``q`` in [0, 1]."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def trapezoid_mean(curve: dict[int, float]) -> float:
    """The area under a curve {step: value} divided by its step range: its mean over training.

    One point is its own mean.
    """
    steps = sorted(curve)
    if not steps:
        raise ValueError("an empty curve has no area")
    if len(steps) == 1:
        return curve[steps[0]]
    area = sum((b - a) * (curve[a] + curve[b]) / 2 for a, b in zip(steps, steps[1:]))
    return area / (steps[-1] - steps[0])
