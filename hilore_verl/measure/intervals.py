"""95% confidence intervals of means and of paired ratios: the bench's rounds and the planner's measured trial.

Samples are paired where two things are timed back to back (every method once per bench round, one
mini-batch of each arm in the trial), so the ratio within a pair cancels the machine's drift between pairs. The interval of a mean over
n rounds is mean +- t(0.975, n - 1) * sd / sqrt(n) (Student's t; the rounds' values taken as
independent draws).
"""

from __future__ import annotations

import math
import statistics

# two-sided 95% quantiles of Student's t, t(0.975, df), df = 1..30; past 30 the normal's 1.96 is
# within 4% of t and the table's last entries decrease towards it
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t975(df: int) -> float:
    if df < 1:
        raise ValueError("an interval needs at least two values")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high) of the 95% interval of the mean; one value: (v, nan, nan)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def paired_ratio_ci(numerator: list[float], denominator: list[float]) -> tuple[float, float, float]:
    """The 95% interval of the mean of per-round ratios numerator[i] / denominator[i]."""
    if len(numerator) != len(denominator):
        raise ValueError("paired values need as many rounds on both sides")
    return mean_ci([a / b for a, b in zip(numerator, denominator)])


__all__ = ["mean_ci", "paired_ratio_ci", "t975"]
