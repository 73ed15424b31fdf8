"""The intervals a sweep's success rates carry (agent_kv.harness.intervals)."""

import pytest

from agent_kv.harness.intervals import paired_difference_interval, success_interval


def test_wilson_interval_matches_its_closed_form():
    # 23 of 36: centre (p + z^2/2n) / (1 + z^2/n), half-width z sqrt(p(1-p)/n + z^2/4n^2) / (..)
    z, n, p = 1.959964, 36, 23 / 36
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5 / (1 + z * z / n)
    low, high = success_interval(23, 36)
    assert (low, high) == pytest.approx((centre - half, centre + half), abs=1e-6)
    assert success_interval(0, 10)[0] == 0.0 and success_interval(10, 10)[1] == 1.0
    assert success_interval(0, 0) is None
    with pytest.raises(ValueError, match="within 0..3"):
        success_interval(4, 3)


def test_paired_interval_resamples_tasks_together():
    policy = [1, 1, 0, 1, 0, 1, 1, 0, 1, 1] * 3
    full = [1, 1, 1, 1, 0, 1, 1, 1, 1, 1] * 3  # the policy loses 2 of 10 tasks
    low, high = paired_difference_interval(policy, full)
    assert low < -0.2 < high <= 0.0  # never above 0: no task where the policy wins
    assert paired_difference_interval(policy, full) == (low, high)  # seeded: reproducible
    assert paired_difference_interval([1, 0], [1, 0]) == (0.0, 0.0)
    assert paired_difference_interval([1], [0]) is None
    with pytest.raises(ValueError, match="differ in length"):
        paired_difference_interval([1, 0], [1])
