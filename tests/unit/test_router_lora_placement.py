"""prefix_aware under LoRA adapters: the adapter's cost term (a read from its path where host
memory lacks it, the wait for a step slot where every slot holds another adapter in use),
scored together with the prefix and the queue; and what the router believes an engine holds
(``router.engine_adapters``), from its own requests, the load report and KV events."""

from __future__ import annotations

import pytest

from quire.v1 import engine_pb2 as pb
from router.balancer import (AdapterState, EndpointSnapshot, PrefixAware, RoutingRequest,
                             adapter_cost_s, choose)
from router.engine_adapters import EngineAdapters
from router.vllm_client import parse_load

BLOCK_SIZE = 16
REQUEST = RoutingRequest(block_hashes=tuple(range(5)), num_prompt_tokens=80)  # 5 full blocks


def adapter(running=False, loaded=False, num_slot_waits=0, max_loras=2, load_s=0.05,
            slot_wait_s=1.0):
    return AdapterState(running=running, loaded=loaded, num_slot_waits=num_slot_waits,
                        max_loras=max_loras, load_s=load_s, slot_wait_s=slot_wait_s)


def endpoint(engine_id, cached_blocks=0, **kwargs):
    kwargs.setdefault("prefill_tokens_per_s", 1000.0)
    return EndpointSnapshot(engine_id=engine_id, healthy=True, cached_blocks=cached_blocks,
                            block_size=BLOCK_SIZE, **kwargs)


def test_the_cost_term():
    assert adapter_cost_s(None) == 0.0  # the base model
    assert adapter_cost_s(adapter(running=True)) == 0.0  # it holds a slot, nobody waits
    # it holds a slot, but three adapters wait ahead: the engine soon lets nothing pass them
    assert adapter_cost_s(adapter(running=True, num_slot_waits=3)) == 1.5
    assert adapter_cost_s(adapter(loaded=True)) == 0.0
    assert adapter_cost_s(adapter(loaded=False)) == 0.05  # a read
    # one slot to turn over, of two: half a request's time on average
    assert adapter_cost_s(adapter(loaded=True, num_slot_waits=1)) == 0.5
    assert adapter_cost_s(adapter(loaded=False, num_slot_waits=3)) == 1.55
    with pytest.raises(ValueError, match="load_s"):
        adapter(load_s=-1.0)
    with pytest.raises(ValueError, match="max_loras"):
        adapter(max_loras=0)


def test_prefers_the_engine_holding_the_adapter():
    decision = choose(REQUEST, [endpoint("a", adapter=adapter(loaded=False)),
                                endpoint("b", adapter=adapter(loaded=True))], PrefixAware())
    assert decision.engine_id == "b"
    assert decision.scores == {"a": pytest.approx(0.13), "b": pytest.approx(0.08)}


def test_adapter_and_prefix_score_together():
    # "a" holds 64 cached tokens of the prompt under the adapter but must read the adapter
    # (0.05 s); "b" holds it loaded, nothing cached: 0.016 + 0.05 < 0.08
    assert choose(REQUEST, [endpoint("a", 4, adapter=adapter(loaded=False)),
                            endpoint("b", 0, adapter=adapter(loaded=True))],
                  PrefixAware()).engine_id == "a"
    # a slow read (0.1 s) tips it the other way
    assert choose(REQUEST, [endpoint("a", 4, adapter=adapter(loaded=False, load_s=0.1)),
                            endpoint("b", 0, adapter=adapter(loaded=True))],
                  PrefixAware()).engine_id == "b"


def test_an_unloaded_adapter_goes_where_it_costs_least():
    # nobody holds it: "a" has a free slot, "b" must wait for one, "c" has a queue
    endpoints = [endpoint("a", adapter=adapter(), num_queued_tokens=30),
                 endpoint("b", adapter=adapter(num_slot_waits=1)),
                 endpoint("c", adapter=adapter(), num_queued_tokens=60)]
    decision = choose(REQUEST, endpoints, PrefixAware())
    assert decision.engine_id == "a"
    assert decision.scores["b"] > decision.scores["c"] > decision.scores["a"]


def test_a_hot_adapter_spreads_once_its_queue_costs_more_than_a_load():
    def pick(queued):
        return choose(REQUEST, [endpoint("a-hot", 4, num_queued_tokens=queued,
                                         adapter=adapter(running=True)),
                                endpoint("b-cold", 0, adapter=adapter())],
                      PrefixAware()).engine_id

    # b must read the adapter (0.05 s = 50 tokens) and prefill all 80: the queue on a must
    # exceed 64 + 50 tokens before b wins
    assert pick(114) == "a-hot"
    assert pick(115) == "b-cold"


def test_no_thrashing_a_slot_in_use_while_another_engine_has_one_free():
    # both engines read it; "a"'s slots all hold adapters in use, "b" has a free one but a
    # longer queue (0.4 s): waiting for one of a's two slots (0.5 s) costs more
    decision = choose(REQUEST, [endpoint("a", adapter=adapter(num_slot_waits=1)),
                                endpoint("b", num_queued_tokens=400, adapter=adapter())],
                      PrefixAware())
    assert decision.engine_id == "b"


# ------------------------------------------------------------------------- engine adapters
def test_the_router_s_own_requests_count_before_the_report_shows_them():
    seen = EngineAdapters()
    for name in ("x", "x", "y"):
        seen.sent(name)
    seen.started("x")
    seen.started("y")
    # x and y run (both slots held); a second x request waits: z waits for a slot to turn
    # over, x joins its slot
    z = seen.state("z", None, max_loras=2, load_s=0.05, slot_wait_s=0.4)
    assert z == AdapterState(running=False, loaded=False, num_slot_waits=1, max_loras=2,
                             load_s=0.05, slot_wait_s=0.4)
    assert seen.state("x", None, max_loras=2, load_s=0.05, slot_wait_s=0.4).running
    seen.ended("y", started=True)
    assert seen.state("z", None, max_loras=2, load_s=0.05, slot_wait_s=0.4).num_slot_waits == 0
    seen.ended("x", started=True)
    seen.ended("x", started=False)
    assert (seen.sent_only, seen.streaming) == ({}, {})


def test_the_load_report_names_loaded_running_and_waiting_adapters():
    # three slots: r runs; w and v wait (v first) for the two free ones; a new adapter
    # would be the third in line: one slot must turn over
    report = pb.LoadReport(running_lora_adapters=["r"], waiting_lora_adapters=["v", "w"],
                           loaded_lora_adapters=["old", "r"], max_loras=3,
                           lora_adapter_load_s=0.02)
    seen = EngineAdapters()
    old = seen.state("old", report, max_loras=1, load_s=0.05, slot_wait_s=0.4)
    assert old == AdapterState(running=False, loaded=True, num_slot_waits=1, max_loras=3,
                               load_s=0.05, slot_wait_s=0.4)
    report.lora_adapter_load_s = 0.2  # a read measured slower than the configured price
    assert seen.state("old", report, max_loras=1, load_s=0.05, slot_wait_s=0.4).load_s == 0.2
    w = seen.state("w", report, max_loras=1, load_s=0.05, slot_wait_s=0.4)
    assert (w.running, w.loaded, w.num_slot_waits) == (False, True, 0)  # its read is paid
    r = seen.state("r", report, max_loras=1, load_s=0.05, slot_wait_s=0.4)
    assert (r.running, r.num_slot_waits) == (True, 0)  # v and w fit in the free slots
    report.running_lora_adapters.append("s")  # now only one is free: v or w must wait
    r = seen.state("r", report, max_loras=1, load_s=0.05, slot_wait_s=0.4)
    assert (r.running, r.num_slot_waits) == (True, 1)


def test_kv_events_stand_in_for_an_unreported_host_lru():
    # a vLLM engine reports running / waiting adapters and max_lora, not its host LRU
    report = parse_load('vllm:lora_requests_info{max_lora="2",running_lora_adapters="",'
                        'waiting_lora_adapters=""} 1.7e9\n')
    assert report.max_loras == 2
    seen = EngineAdapters()
    seen.stored(["a", None, "b", "c", "b"])  # blocks stored under a, then c, then b last
    loaded = {name: seen.state(name, report, max_loras=0, load_s=0.05, slot_wait_s=0.0).loaded
              for name in "abc"}
    assert loaded == {"a": False, "b": True, "c": True}


def test_vllm_lora_info_latest_series_wins():
    text = ('vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",'
            'waiting_lora_adapters=""} 100.0\n'
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="c",'
            'waiting_lora_adapters="d,e"} 200.0\n')
    report = parse_load(text)
    assert (list(report.running_lora_adapters), list(report.waiting_lora_adapters),
            report.max_loras) == (["c"], ["d", "e"], 4)


# ------------------------------------------------------------------ flow control's slots
def test_requests_waiting_for_an_adapter_slot_do_not_shrink_an_engine_s_batch():
    from router.engine_slots import EngineSlots

    # two adapters run (max_loras 2) and a third one's requests wait: the engine's batch is
    # not full, an adapter must leave first
    bound = pb.LoadReport(running_lora_adapters=["a", "b"], waiting_lora_adapters=["c"],
                          max_loras=2, num_running=2, num_waiting=3)
    assert EngineAdapters().bound(bound, max_loras=0)
    assert not EngineAdapters().bound(pb.LoadReport(running_lora_adapters=["a"],
                                                    waiting_lora_adapters=["c"],
                                                    max_loras=2), max_loras=0)
    assert not EngineAdapters().bound(pb.LoadReport(running_lora_adapters=["a", "b"],
                                                    waiting_lora_adapters=["a"],
                                                    max_loras=2), max_loras=0)

    def snapshot(adapter_bound):
        return EndpointSnapshot(engine_id="e", healthy=True, cached_blocks=0, block_size=16,
                                num_running=2, num_waiting=3, adapter_bound=adapter_bound)

    reports = [snapshot(True)]
    slots = EngineSlots(lambda: reports, initial=8)
    assert [slots.observe() for _ in range(3)] == [8, 8, 8]
    reports[:] = [snapshot(False)]  # waiting for room in the batch: two reports, then 2
    assert [slots.observe() for _ in range(2)] == [8, 2]
