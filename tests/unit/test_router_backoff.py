"""router.backoff: the one reconnect delay schedule of the router's loops."""

from __future__ import annotations

import pytest

from router.backoff import Backoff


def test_doubles_up_to_the_ceiling_and_resets():
    backoff = Backoff(0.1, 0.5)
    assert [backoff.next_s() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    backoff.reset()
    assert backoff.next_s() == 0.1


def test_a_ceiling_below_the_floor_wins():
    backoff = Backoff(0.1, 0.05)
    assert [backoff.next_s() for _ in range(2)] == [0.05, 0.05]


@pytest.mark.parametrize("min_s, max_s", [(0, 1), (1, 0), (-1, 1)])
def test_delays_must_be_positive(min_s, max_s):
    with pytest.raises(ValueError, match="min_s and max_s"):
        Backoff(min_s, max_s)
