"""The router's measured engine rates (router.engine_rates): exact arithmetic on decayed sums."""

from __future__ import annotations

import pytest

from router.engine_rates import DECAY, PRIOR_S, EngineRates, bounded_prefill_rate


def test_the_prior_stands_until_samples_outweigh_it():
    rates = EngineRates.with_prior(2000.0)
    assert rates.prefill_tokens_per_s == pytest.approx(2000.0)
    assert rates.decode_step_s == 0.0  # unknown: no decode term yet
    rates.observe_first_token(500, 1.0)  # 500 tokens in a second: a slow engine
    want = (2000.0 * PRIOR_S * DECAY + 500) / (PRIOR_S * DECAY + 1.0)
    assert rates.prefill_tokens_per_s == pytest.approx(want)
    for _ in range(200):
        rates.observe_first_token(500, 1.0)
    assert rates.prefill_tokens_per_s == pytest.approx(500.0, rel=1e-3)


def test_the_first_token_step_is_not_prefill_time():
    rates = EngineRates.with_prior(1000.0)
    for _ in range(200):
        rates.observe_decode(10, 0.5)  # 0.05 s a step
    assert rates.decode_step_s == pytest.approx(0.05)
    for _ in range(200):
        rates.observe_first_token(300, 0.35)  # 0.3 s of prefill, then the token's step
    assert rates.prefill_tokens_per_s == pytest.approx(1000.0, rel=1e-3)


def test_empty_samples_change_nothing_and_the_prior_must_be_positive():
    rates = EngineRates.with_prior(1000.0)
    rates.observe_first_token(0, 1.0)
    rates.observe_first_token(10, 0.0)
    rates.observe_decode(0, 1.0)
    assert rates.prefill_tokens_per_s == pytest.approx(1000.0) and rates.decode_step_s == 0.0
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        EngineRates.with_prior(0.0)


def test_requests_still_waiting_bound_the_rate_from_above():
    # 600 tokens sent 2 s ago and still no first token: at most 300 tokens/s there
    assert bounded_prefill_rate(2000.0, [(8.0, 600), (9.9, 50)], now_s=10.0) == 300.0
    assert bounded_prefill_rate(2000.0, [(10.0, 600)], now_s=10.0) == 2000.0  # just sent
    assert bounded_prefill_rate(100.0, [(8.0, 600)], now_s=10.0) == 100.0  # already lower
    assert bounded_prefill_rate(2000.0, [], now_s=10.0) == 2000.0
