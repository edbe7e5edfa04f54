"""Statistics over seeds (train/parts/observe/stats.py) on hand-made numbers; comments say why."""

import math

import pytest

from train.parts.observe.stats import estimate, median, paired, quantile, t975, trapezoid_mean


def test_interval_by_hand():
    # values 1, 2, 3: mean 2, sample std 1, t_{0.975, 2} = 4.303 -> half-width 4.303 / sqrt(3) = 2.4843
    e = estimate([1.0, 2.0, 3.0])
    assert (e.mean, e.std, e.n) == (2.0, 1.0, 3)
    assert e.half_width == pytest.approx(4.303 / math.sqrt(3))
    assert e.distinguishable_from_zero is False  # 2 < 2.48: the interval holds 0
    assert estimate([10.0, 11.0, 12.0]).distinguishable_from_zero is True
    assert e.format(2) == "2.00 ± 2.48"


def test_one_seed_has_no_interval_and_is_never_distinguishable():
    e = estimate([0.7])
    assert math.isnan(e.half_width) and not e.distinguishable_from_zero and e.format() == "0.7000 (n=1)"


def test_t_quantiles():
    assert t975(1) == 12.706 and t975(2) == 4.303 and t975(30) == 2.042 and t975(1000) == 1.96
    with pytest.raises(ValueError, match="degrees of freedom"):
        t975(0)


def test_paired_uses_common_seeds_only():
    # seeds 0 and 1 in common: differences +0.1 and +0.3 -> mean +0.2, std 0.1414, t_{0.975,1} = 12.706
    d = paired({0: 0.6, 1: 0.8, 2: 0.5}, {0: 0.5, 1: 0.5, 3: 0.9})
    assert d.n == 2 and d.mean == pytest.approx(0.2) and d.half_width == pytest.approx(12.706 * 0.1 / 1.0)
    with pytest.raises(ValueError, match="no seed in common"):
        paired({0: 1.0}, {1: 1.0})


def test_estimate_rejects_empty_and_nan():
    for bad in ([], [1.0, math.nan]):
        with pytest.raises(ValueError, match="finite"):
            estimate(bad)


def test_median_quantile_and_trapezoid():
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.25) == 2.0 and quantile([0.0, 10.0], 0.75) == 7.5
    # 0 -> 1 over steps 0..20, then flat to step 60: area 10 + 40 = 50 over 60 steps
    assert trapezoid_mean({0: 0.0, 20: 1.0, 60: 1.0}) == pytest.approx(50 / 60)
    assert trapezoid_mean({5: 0.3}) == 0.3
