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


def adapter(in_use=False, loaded=False, free_slots=1, load_s=0.05, slot_wait_s=1.0):
    return AdapterState(in_use=in_use, loaded=loaded, free_slots=free_slots, load_s=load_s,
                        slot_wait_s=slot_wait_s)


def endpoint(engine_id, cached_blocks=0, **kwargs):
    kwargs.setdefault("prefill_tokens_per_s", 1000.0)
    return EndpointSnapshot(engine_id=engine_id, healthy=True, cached_blocks=cached_blocks,
                            block_size=BLOCK_SIZE, **kwargs)


def test_the_cost_term():
    assert adapter_cost_s(None) == 0.0  # the base model
    assert adapter_cost_s(adapter(in_use=True, free_slots=0)) == 0.0  # it holds a slot already
    assert adapter_cost_s(adapter(loaded=True, free_slots=1)) == 0.0
    assert adapter_cost_s(adapter(loaded=False, free_slots=1)) == 0.05  # a read
    assert adapter_cost_s(adapter(loaded=True, free_slots=0)) == 1.0  # a slot to wait for
    assert adapter_cost_s(adapter(loaded=False, free_slots=-1)) == 1.05
    with pytest.raises(ValueError, match="load_s"):
        adapter(load_s=-1.0)


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
    endpoints = [endpoint("a", adapter=adapter(free_slots=1), num_queued_tokens=30),
                 endpoint("b", adapter=adapter(free_slots=0)),
                 endpoint("c", adapter=adapter(free_slots=2), num_queued_tokens=60)]
    decision = choose(REQUEST, endpoints, PrefixAware())
    assert decision.engine_id == "a"
    assert decision.scores["b"] > decision.scores["c"] > decision.scores["a"]


def test_a_hot_adapter_spreads_once_its_queue_costs_more_than_a_load():
    def pick(queued):
        return choose(REQUEST, [endpoint("a-hot", 4, num_queued_tokens=queued,
                                         adapter=adapter(in_use=True, free_slots=0)),
                                endpoint("b-cold", 0, adapter=adapter(free_slots=1))],
                      PrefixAware()).engine_id

    # b must read the adapter (0.05 s = 50 tokens) and prefill all 80: the queue on a must
    # exceed 64 + 50 tokens before b wins
    assert pick(114) == "a-hot"
    assert pick(115) == "b-cold"


def test_no_thrashing_a_slot_in_use_while_another_engine_has_one_free():
    # both engines read it; "a"'s slots all hold adapters in use, "b" has a free one but a
    # longer queue (0.5 s): waiting for a slot on "a" (1 s) costs more
    decision = choose(REQUEST, [endpoint("a", adapter=adapter(free_slots=0)),
                                endpoint("b", num_queued_tokens=500,
                                         adapter=adapter(free_slots=1))], PrefixAware())
    assert decision.engine_id == "b"


# ------------------------------------------------------------------------- engine adapters
def test_in_flight_requests_hold_slots_before_the_report_shows_them():
    seen = EngineAdapters()
    seen.sent("x")
    seen.sent("x")
    seen.sent("y")
    state = seen.state("z", None, max_loras=2, load_s=0.05, slot_wait_s=0.4)
    assert state == AdapterState(in_use=False, loaded=False, free_slots=0, load_s=0.05,
                                 slot_wait_s=0.4)
    assert seen.state("x", None, max_loras=2, load_s=0.05, slot_wait_s=0.4).in_use
    seen.ended("y")
    assert seen.state("z", None, max_loras=2, load_s=0.05, slot_wait_s=0.4).free_slots == 1
    seen.ended("x")
    seen.ended("x")
    assert seen.inflight == {}


def test_the_load_report_names_loaded_running_and_waiting_adapters():
    report = pb.LoadReport(running_lora_adapters=["r"], waiting_lora_adapters=["w"],
                           loaded_lora_adapters=["old", "r", "w"], max_loras=3,
                           lora_adapter_load_s=0.02)
    seen = EngineAdapters()
    old = seen.state("old", report, max_loras=1, load_s=0.05, slot_wait_s=0.4)
    assert old == AdapterState(in_use=False, loaded=True, free_slots=1, load_s=0.05,
                               slot_wait_s=0.4)
    report.lora_adapter_load_s = 0.2  # a read measured slower than the configured price
    assert seen.state("old", report, max_loras=1, load_s=0.05, slot_wait_s=0.4).load_s == 0.2
    new = seen.state("new", report, max_loras=1, load_s=0.05, slot_wait_s=0.4)
    assert (new.loaded, new.free_slots) == (False, 1)
    assert seen.state("w", report, max_loras=1, load_s=0.05, slot_wait_s=0.4).in_use


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
