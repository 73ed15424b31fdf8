"""The uncertainty of a sweep's success rates: a 95% interval for one setting's rate, and a
paired one for its difference from full KV on the same tasks.

Both come from SciPy: Wilson's score interval for a binomial proportion (Wilson 1927,
"Probable inference, the law of succession, and statistical inference", JASA 22; through
`scipy.stats.binomtest(...).proportion_ci(method="wilson")`), and the percentile bootstrap
over tasks for a paired difference of means (Efron and Tibshirani 1993, "An Introduction to
the Bootstrap", ch. 13; `scipy.stats.bootstrap(..., paired=True)`), resampling tasks, so that
a policy and full KV are always compared on the same draw of tasks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.stats import binomtest, bootstrap

LEVEL = 0.95
RESAMPLES = 10_000
SEED = 0
"""The bootstrap's resamples and generator seed: the same records give the same interval."""


def success_interval(successes: int, trials: int) -> tuple[float, float] | None:
    """Wilson's 95% interval of a success rate, as shares (0-1); None without trials.

    Raises:
        ValueError: `successes` outside 0..`trials`.
    """
    if trials == 0:
        return None
    if not 0 <= successes <= trials:
        raise ValueError(f"successes must be within 0..{trials}, got {successes}")
    interval = binomtest(successes, trials).proportion_ci(confidence_level=LEVEL, method="wilson")
    return float(interval.low), float(interval.high)


def _mean_difference(policy: np.ndarray, full: np.ndarray, axis: int) -> np.ndarray:
    return np.mean(policy, axis=axis) - np.mean(full, axis=axis)


def paired_difference_interval(
    policy: Sequence[float], full: Sequence[float]
) -> tuple[float, float] | None:
    """The 95% percentile-bootstrap interval of mean(policy) - mean(full), tasks resampled
    in pairs (`policy[i]` and `full[i]` are one task's outcomes, e.g. 1.0 for success).

    Returns None for fewer than two tasks; (d, d) when every task differs by the same d
    (the bootstrap distribution is one point).

    Raises:
        ValueError: the two sequences differ in length.
    """
    if len(policy) != len(full):
        raise ValueError(f"paired outcomes differ in length: {len(policy)} and {len(full)}")
    if len(policy) < 2:
        return None
    ours, theirs = np.asarray(policy, dtype=float), np.asarray(full, dtype=float)
    differences = ours - theirs
    if np.all(differences == differences[0]):
        return float(differences[0]), float(differences[0])
    result = bootstrap(
        (ours, theirs),
        _mean_difference,
        paired=True,
        vectorized=True,
        n_resamples=RESAMPLES,
        confidence_level=LEVEL,
        method="percentile",
        rng=np.random.default_rng(SEED),
    )
    interval = result.confidence_interval
    return float(interval.low), float(interval.high)
