"""The balancer: a pure function from request + endpoint snapshots to a decision."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from router.balancer import (POLICIES, Decision, EndpointSnapshot, LeastLoaded, NoEndpointError,
                             PrefixAffinity, PrefixAware, RoundRobin, RoutingRequest,
                             SessionAffinity, choose, make_policy, rendezvous_weight)

BLOCK_SIZE = 16
REQUEST = RoutingRequest(block_hashes=tuple(range(5)), num_prompt_tokens=80)  # 5 full blocks


def endpoint(engine_id, cached_blocks=0, **kwargs):
    kwargs.setdefault("prefill_tokens_per_s", 1000.0)
    return EndpointSnapshot(engine_id=engine_id, healthy=kwargs.pop("healthy", True),
                            cached_blocks=cached_blocks, block_size=BLOCK_SIZE, **kwargs)


# ------------------------------------------------------------------------------ prefix aware
def test_prefix_aware_picks_longest_prefix_at_equal_load():
    endpoints = [endpoint("a", 1), endpoint("b", 4), endpoint("c", 2)]
    decision = choose(REQUEST, endpoints, PrefixAware())
    assert decision == Decision(engine_id="b", policy="prefix_aware",
                                scores={"a": 0.064, "b": 0.016, "c": 0.048},
                                predicted_cached_tokens=64)


def test_fully_cached_prompt_still_prefills_its_last_token():
    decision = choose(REQUEST, [endpoint("a", 5)], PrefixAware())
    assert decision.predicted_cached_tokens == 79
    assert decision.scores == {"a": 0.001}


def test_hot_prefix_spreads_when_queue_outweighs_cache():
    # "hot" caches 64 of 80 tokens: 16 to prefill. "cold" must prefill all 80. With both at
    # 1000 tokens/s, hot stays better while its queue is under 64 tokens, ties at 64 (engine id
    # breaks it), and loses at 65.
    def pick(queued):
        return choose(REQUEST, [endpoint("a-hot", 4, num_queued_tokens=queued),
                                endpoint("b-cold", 0)], PrefixAware())

    assert pick(63).engine_id == "a-hot"
    assert pick(64).engine_id == "a-hot"
    assert pick(64).scores["a-hot"] == pick(64).scores["b-cold"] == 0.08
    assert pick(65).engine_id == "b-cold"
    assert pick(65).predicted_cached_tokens == 0
    # the router's own in-flight tokens count the same as the engine's reported queue ...
    assert choose(REQUEST, [endpoint("a-hot", 4, inflight_tokens=65),
                            endpoint("b-cold", 0)], PrefixAware()).engine_id == "b-cold"
    # ... but the report already holds the router's requests once the engine has them: the
    # larger of the two is the work ahead, never their sum (40 + 25 would be 65)
    both = [endpoint("a-hot", 4, num_queued_tokens=40, inflight_tokens=25), endpoint("b-cold")]
    assert choose(REQUEST, both, PrefixAware()).engine_id == "a-hot"
    assert choose(REQUEST, [replace(both[0], inflight_tokens=65), both[1]],
                  PrefixAware()).engine_id == "b-cold"


def test_faster_engine_wins_ttft():
    endpoints = [endpoint("a", 0, prefill_tokens_per_s=1000.0),
                 endpoint("b", 0, prefill_tokens_per_s=4000.0)]
    assert choose(REQUEST, endpoints, PrefixAware()).engine_id == "b"


def test_a_longer_decode_step_counts_once_per_engine():
    # b holds the whole prefix but runs a big batch (0.05 s steps); a is cold and idle
    endpoints = [endpoint("a", 0), endpoint("b", 4, decode_step_s=0.05)]
    decision = choose(REQUEST, endpoints, PrefixAware())
    assert decision.engine_id == "b" and decision.scores["b"] == pytest.approx(0.05 + 0.016)
    endpoints = [endpoint("a", 0), endpoint("b", 4, decode_step_s=0.07)]
    assert choose(REQUEST, endpoints, PrefixAware()).engine_id == "a"  # 0.086 > 0.08


def test_prefix_affinity_ignores_the_queue_except_for_ties():
    endpoints = [endpoint("a", 4, num_queued_tokens=10_000), endpoint("b", 0),
                 endpoint("c", 4, num_queued_tokens=50)]
    assert choose(REQUEST, endpoints, PrefixAffinity()).engine_id == "c"
    assert choose(REQUEST, endpoints[:2], PrefixAffinity()).engine_id == "a"
    cold = [endpoint("a", 0, inflight_tokens=5), endpoint("b", 0)]
    assert choose(REQUEST, cold, PrefixAffinity()).engine_id == "b"


def test_kv_usage_alone_does_not_move_a_prefix():
    # no hand threshold on the cache's fill: a full cache shows as a queue (requests wait
    # for blocks) and as slower measured rates, which the estimate already weighs
    endpoints = [endpoint("a", 4, kv_cache_usage=1.0), endpoint("b", 0, kv_cache_usage=0.1)]
    assert choose(REQUEST, endpoints, PrefixAware()).engine_id == "a"


# ------------------------------------------------------------------------------ least loaded
def test_least_loaded_tokens_then_running():
    endpoints = [endpoint("a", 5, num_queued_tokens=100, num_running=0),
                 endpoint("b", 0, num_queued_tokens=30, inflight_tokens=60, num_running=3),
                 endpoint("c", 0, num_queued_tokens=60, num_running=2)]
    decision = choose(REQUEST, endpoints, LeastLoaded())
    assert decision.engine_id == "c"  # 60 tokens each for b and c; c runs fewer
    assert decision.policy == "least_loaded"
    assert decision.scores == {"a": 100.0, "b": 60.75, "c": 60.5}
    endpoints[2] = replace(endpoints[2], num_running=3)
    assert choose(REQUEST, endpoints, LeastLoaded()).engine_id == "b"  # full tie: engine id


# ------------------------------------------------------------------------------- round robin
def test_round_robin_cycles_in_engine_id_order_over_healthy():
    policy = RoundRobin()
    endpoints = [endpoint("c"), endpoint("a"), endpoint("b")]
    picks = [choose(REQUEST, endpoints, policy).engine_id for _ in range(7)]
    assert picks == ["a", "b", "c", "a", "b", "c", "a"]
    endpoints[2] = replace(endpoints[2], healthy=False)  # b goes down
    picks = [choose(REQUEST, endpoints, policy).engine_id for _ in range(4)]
    assert picks == ["c", "a", "c", "a"]  # the 8th call: turn 7 % 2 = 1 of [a, c]


def test_round_robin_scores_rank_the_rotation():
    policy = RoundRobin()
    endpoints = [endpoint("a"), endpoint("b"), endpoint("c")]
    choose(REQUEST, endpoints, policy)
    decision = choose(REQUEST, endpoints, policy)
    assert decision.scores == {"b": 0.0, "c": 1.0, "a": 2.0}
    assert decision.policy == "round_robin"


# -------------------------------------------------------------------------- session affinity
def test_session_affinity_is_stable_and_ignores_load():
    policy = SessionAffinity()
    endpoints = [endpoint(f"e{i}") for i in range(4)]
    request = replace(REQUEST, session_key="user-42")
    first = choose(request, endpoints, policy).engine_id
    loaded = [replace(e, num_queued_tokens=10_000) if e.engine_id == first else e
              for e in endpoints]
    for candidates in (endpoints, list(reversed(endpoints)), loaded):
        assert choose(request, candidates, SessionAffinity()).engine_id == first


def test_session_affinity_moves_only_keys_of_removed_engine():
    policy = SessionAffinity()
    endpoints = [endpoint(f"e{i}") for i in range(4)]
    keys = [f"session-{i}" for i in range(2000)]

    def assign(candidates):
        return {key: choose(replace(REQUEST, session_key=key), candidates, policy).engine_id
                for key in keys}

    before = assign(endpoints)
    counts = {e.engine_id: sum(v == e.engine_id for v in before.values()) for e in endpoints}
    assert all(350 < n < 650 for n in counts.values()), counts  # roughly even spread
    removed = "e2"
    after = assign([e for e in endpoints if e.engine_id != removed])
    moved = {key for key in keys if before[key] != after[key]}
    assert moved == {key for key in keys if before[key] == removed}  # exactly e2's keys
    assert len(keys) - len(moved) > 0.6 * len(keys)  # most keys keep their engine
    # marking it unhealthy is the same as removing it
    down = [replace(e, healthy=False) if e.engine_id == removed else e for e in endpoints]
    assert assign(down) == after


def test_session_affinity_without_key_falls_back_to_prefix_aware():
    endpoints = [endpoint("a", 1), endpoint("b", 4)]
    decision = choose(REQUEST, endpoints, SessionAffinity())
    assert decision.engine_id == "b"
    assert decision.scores == choose(REQUEST, endpoints, PrefixAware()).scores


# ------------------------------------------------------------------------- health and errors
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_unhealthy_never_chosen(name):
    policy = make_policy(name)
    # the unhealthy engine would win every policy: longest prefix, idle, first id
    endpoints = [endpoint("a", 5, healthy=False), endpoint("b", 0, num_queued_tokens=500),
                 endpoint("c", 0, num_queued_tokens=900, num_running=4)]
    for i in range(20):
        request = replace(REQUEST, session_key=f"k{i}" if name == "session_affinity" else None)
        decision = choose(request, endpoints, policy)
        assert decision.engine_id != "a"
        assert "a" not in decision.scores


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_healthy_endpoint_raises(name):
    with pytest.raises(NoEndpointError):
        choose(REQUEST, [endpoint("a", healthy=False)], make_policy(name))
    with pytest.raises(NoEndpointError):
        choose(REQUEST, [], make_policy(name))


def test_registry_and_validation():
    assert set(POLICIES) == {"prefix_aware", "prefix_affinity", "least_loaded", "round_robin",
                             "session_affinity"}
    assert all(make_policy(name).name == name for name in POLICIES)
    with pytest.raises(ValueError, match="policy"):
        make_policy("random")
    with pytest.raises(ValueError, match="block_size"):
        EndpointSnapshot("a", True, 0, block_size=0)
    with pytest.raises(ValueError, match="kv_cache_usage"):
        endpoint("a", kv_cache_usage=1.5)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        endpoint("a", prefill_tokens_per_s=0.0)
    with pytest.raises(ValueError, match="num_queued_tokens"):
        endpoint("a", num_queued_tokens=-1)
    with pytest.raises(ValueError, match="decode_step_s"):
        endpoint("a", decode_step_s=-1.0)


def test_router_modules_do_not_import_torch():
    code = ("import sys, router.prefix_index, router.balancer; "
            "bad = sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_a_session_key_that_is_not_utf8_hashes_as_its_bytes():
    """A header value aiohttp decoded with surrogateescape places like any other key, by the
    bytes sent (the same in every router replica)."""
    raw = b"s\xff\xfe".decode("utf-8", "surrogateescape")
    assert rendezvous_weight(raw, "e0") == rendezvous_weight(raw, "e0")
    assert rendezvous_weight(raw, "e0") != rendezvous_weight("s", "e0")
    request = RoutingRequest(block_hashes=(), num_prompt_tokens=4, session_key=raw)
    endpoints = [EndpointSnapshot(engine_id=f"e{i}", healthy=True, cached_blocks=0,
                                  block_size=BLOCK_SIZE) for i in range(3)]
    assert choose(request, endpoints, SessionAffinity()).engine_id in {"e0", "e1", "e2"}
