"""``better_compute.backoff.Backoff``: the delays every retry loop waits."""

from __future__ import annotations

import pytest

from better_compute.backoff import Backoff

pytestmark = pytest.mark.unit


def test_delays_double_from_first_up_to_cap_with_equal_jitter_and_start_over_on_reset() -> None:
    backoff = Backoff(first=0.2, cap=2.0)
    ceilings = [0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0]
    for ceiling in ceilings:
        assert ceiling / 2 <= backoff.next() <= ceiling
    backoff.reset()
    assert 0.1 <= backoff.next() <= 0.2


def test_the_services_find_it_where_they_found_it_first() -> None:
    from better_compute.service import faults

    assert faults.Backoff is Backoff
