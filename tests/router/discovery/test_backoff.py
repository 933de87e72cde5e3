"""``Backoff``: waits double up to the bound, each jittered in the upper half of it, and start over on reset."""

from __future__ import annotations

import random

import pytest

from router.discovery.backoff import Backoff


def test_waits_double_up_to_the_bound_with_jitter_in_the_upper_half() -> None:
    backoff = Backoff(0.5, 4.0, rng=random.Random(7))
    bounds = [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    delays = [backoff.next_delay() for _ in bounds]
    for delay, bound in zip(delays, bounds):
        assert bound / 2 <= delay <= bound
    assert backoff.failures == len(bounds)
    backoff.reset()
    assert backoff.failures == 0 and 0.25 <= backoff.next_delay() <= 0.5


def test_jitter_spreads_routers_retrying_together() -> None:
    firsts = {round(Backoff(1.0, 30.0, rng=random.Random(seed)).next_delay(), 6) for seed in range(20)}
    assert len(firsts) == 20


@pytest.mark.parametrize(("initial", "maximum"), [(0.0, 1.0), (2.0, 1.0)])
def test_bad_bounds_are_refused(initial: float, maximum: float) -> None:
    with pytest.raises(ValueError):
        Backoff(initial, maximum)
