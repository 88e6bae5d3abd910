"""The router's measured engine rates (router.engine_rates): exact arithmetic on decayed sums."""

from __future__ import annotations

import pytest

from router.engine_rates import DECAY, PRIOR_S, EngineRates, PrefillClock


def test_the_prior_stands_until_samples_outweigh_it():
    rates = EngineRates.with_prior(2000.0)
    assert rates.prefill_tokens_per_s == pytest.approx(2000.0)
    assert rates.decode_step_s == 0.0  # unknown: no decode term yet
    rates.observe_prefill(500, 1.0)  # 500 tokens in a second: a slow engine
    want = (2000.0 * PRIOR_S * DECAY + 500) / (PRIOR_S * DECAY + 1.0)
    assert rates.prefill_tokens_per_s == pytest.approx(want)
    for _ in range(200):
        rates.observe_prefill(500, 1.0)
    assert rates.prefill_tokens_per_s == pytest.approx(500.0, rel=1e-3)


def test_the_first_token_step_is_not_prefill_time():
    rates = EngineRates.with_prior(1000.0)
    for _ in range(200):
        rates.observe_decode(10, 0.5)  # 0.05 s a step
    assert rates.decode_step_s == pytest.approx(0.05)
    for _ in range(200):
        rates.observe_prefill(300, 0.35)  # 0.3 s of prefill, then the token's step
    assert rates.prefill_tokens_per_s == pytest.approx(1000.0, rel=1e-3)


def test_empty_samples_change_nothing_and_the_prior_must_be_positive():
    rates = EngineRates.with_prior(1000.0)
    rates.observe_prefill(0, 1.0)
    rates.observe_prefill(10, -1.0)
    rates.observe_decode(0, 1.0)
    assert rates.prefill_tokens_per_s == pytest.approx(1000.0) and rates.decode_step_s == 0.0
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        EngineRates.with_prior(0.0)


def test_the_rate_is_tokens_over_busy_time_whatever_the_order():
    """Three 500-token prompts sent one after another, all answered by one step 1.5 s after
    the first was sent (the engine batched the later two into the first one's step): the
    first waited 1.5 s for 500 tokens, but the engine did 1,500 tokens in 1.5 s busy. The
    idle second between two busy periods is not counted."""
    rates = EngineRates.with_prior(1e-3)
    rates.prefill = type(rates.prefill)()  # no prior: the samples alone
    for sent in (0.0, 0.2, 0.4):
        rates.sent(sent, 500)
    for _ in range(3):
        rates.first_token(1.5, 500)
    assert rates.prefill_tokens_per_s == pytest.approx(
        (500 * DECAY ** 2 + 500 * DECAY + 500) / (1.5 * DECAY ** 2))
    assert rates.clock.num_pending == 0 and rates.clock.pending_tokens == 0
    rates.sent(2.5, 100)  # idle from 1.5 to 2.5
    rates.first_token(2.6, 100)
    assert rates.clock.busy_s == 0.0
    assert rates.prefill.denominator == pytest.approx(1.5 * DECAY ** 3 + 0.1)


def test_pending_work_bounds_the_rate_from_above():
    clock = PrefillClock()
    assert clock.bound(10.0) is None  # nothing pending
    clock.sent(8.0, 600)
    assert clock.bound(8.0) is None  # no time has passed
    clock.sent(9.9, 50)
    # busy 2 s with 650 tokens not done: at most 325 tokens/s
    assert clock.bound(10.0) == pytest.approx(325.0)
    clock.answered(10.5, 600)  # done 600 of them; 50 still pending after 3 s busy
    assert clock.bound(11.0) == pytest.approx(650 / 3.0)
    clock.dropped(11.0, 50)  # cancelled: nothing pending, nothing bounds
    assert clock.bound(12.0) is None and clock.busy_s == 0.0
    rates = EngineRates.with_prior(2000.0)
    rates.sent(8.0, 600)
    assert rates.bounded_prefill_rate(2000.0, 10.0) == pytest.approx(300.0)
    assert rates.bounded_prefill_rate(100.0, 10.0) == 100.0  # already lower
