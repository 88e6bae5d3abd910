"""``quire bench lora-router``'s pieces that need no engine: the workload (seeded, Zipf over
adapters, one system prompt per adapter), the engines' counters, the ratios."""

from __future__ import annotations

import pytest

from quire_cli.bench.lora_router import LoRARouterBenchConfig, make_workload, ratios

NAMES = [f"adapter-{i}" for i in range(8)]


def test_workload_is_seeded_and_shares_each_adapter_s_system_prompt():
    cfg = LoRARouterBenchConfig(num_requests=400, request_rate=4.0, system_prompt_len=48,
                                question_len=16)
    first = make_workload(cfg, NAMES, vocab_size=49152)
    assert first == make_workload(cfg, NAMES, vocab_size=49152)
    assert len(first) == 400 and first[0].offset_s == 0.0
    assert all(a.offset_s <= b.offset_s for a, b in zip(first, first[1:]))
    prefixes = {}
    for request in first:
        assert len(request.token_ids) == 64
        assert prefixes.setdefault(request.lora_name, request.token_ids[:48]) == \
            request.token_ids[:48]
    assert len(set(prefixes.values())) == len(prefixes)  # no two adapters share one
    counts = [sum(r.lora_name == n for r in first) for n in NAMES]
    assert counts[0] > counts[3] > counts[7] > 0  # Zipf: a hot adapter and a tail


def test_config_is_checked_and_ratios_divide_first_by_other():
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRARouterBenchConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="policies"):
        LoRARouterBenchConfig(policies="prefix_aware,nope")

    def run(policy, p90, tok_s, loads):
        return {"policy": policy, "ttft_ms": {"p50": p90 / 2, "p90": p90},
                "output_token_throughput": tok_s, "adapter_loads_per_request": loads,
                "slot_loads_per_request": loads}

    got = ratios(run("prefix_aware", 100.0, 60.0, 0.3), run("round_robin", 200.0, 50.0, 0.6))
    assert got == {"vs": "round_robin", "ttft_p50": 0.5, "ttft_p90": 0.5,
                   "output_token_throughput": 1.2, "adapter_loads_per_request": 0.5,
                   "slot_loads_per_request": 0.5}
    assert ratios(run("a", 1.0, 1.0, 0.0), run("b", 1.0, 1.0, 0.0))[
        "adapter_loads_per_request"] is None
