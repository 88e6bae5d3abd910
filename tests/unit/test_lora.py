"""LoRA's pieces, exactly: the grouped shrink/expand against a per-token computation, the
device slots (LRU, zero-padded ranks, pre-scaled B), ``--lora-modules`` parsing, and the
scheduler's ``max_loras`` admission rule without starvation."""

from __future__ import annotations

import pytest
import torch

from engine_worker.kv_cache.manager import KVCacheManager
from engine_worker.lora.adapter import LoRAAdapter, LoRAModule
from engine_worker.lora.config import LoRAConfig, parse_lora_modules
from engine_worker.lora.ops import REFERENCE_OPS
from engine_worker.lora.slots import LoRASlots
from engine_worker.scheduler.scheduler import LORA_MAX_SKIPPED_STEPS, Scheduler
from tests.unit.scheduler_harness import FakeRunner, make_request

PROJECTIONS = {"qkv_proj": (("q_proj", 8, 8), ("k_proj", 8, 4), ("v_proj", 8, 4)),
               "down_proj": (("down_proj", 6, 8),)}


def _adapter(name: str, rank: int, seed: int, modules=("q_proj", "v_proj", "down_proj")
             ) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    sizes = {m: (i, o) for mods in PROJECTIONS.values() for m, i, o in mods}
    return LoRAAdapter(name, f"/{name}", rank, {
        (layer, m): LoRAModule(torch.randn(rank, sizes[m][0], generator=g),
                               torch.randn(sizes[m][1], rank, generator=g), 0.5 + layer)
        for layer in range(2) for m in modules})


def _per_token(x, adapter: LoRAAdapter | None, layer: int, projection: str) -> torch.Tensor:
    """The delta PEFT adds, token by token: scaling * B (A x), per module, concatenated."""
    parts = []
    for module, _, out in PROJECTIONS[projection]:
        w = None if adapter is None else adapter.modules.get((layer, module))
        parts.append(torch.zeros(out) if w is None else
                     w.scaling * (w.lora_b @ (w.lora_a @ x)))
    return torch.cat(parts)


@pytest.mark.parametrize("token_adapters", [
    [0, 1, 2, 0, 1, 1, 2, 0],  # mixed, base tokens between
    [1, 1, 1],  # one adapter, every token
    [0, 0, 2],
])
def test_grouped_shrink_expand_is_the_per_token_delta(token_adapters):
    adapters = [None, _adapter("a", 3, 1), _adapter("b", 4, 2)]
    slots = LoRASlots(PROJECTIONS, num_layers=2, max_loras=2, max_rank=4,
                      dtype=torch.float64, device=torch.device("cpu"))
    slot_of = slots.activate([a for a in adapters[1:]])
    token_slots = [0 if i == 0 else slot_of[adapters[i].name] for i in token_adapters]
    batch = slots.batch(token_slots, REFERENCE_OPS, torch.device("cpu"))
    for layer in range(2):
        for projection, modules in PROJECTIONS.items():
            x = torch.randn(len(token_adapters), modules[0][1], dtype=torch.float64)
            y = torch.randn(len(token_adapters), sum(m[2] for m in modules),
                            dtype=torch.float64)
            want = y + torch.stack([_per_token(x[t].float(), adapters[a], layer, projection)
                                    .double() for t, a in enumerate(token_adapters)])
            got = batch.add(y.clone(), x, layer, projection)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_all_base_step_has_no_lora_batch():
    slots = LoRASlots(PROJECTIONS, 2, 2, 4, torch.float32, torch.device("cpu"))
    assert slots.batch([0, 0, 0], REFERENCE_OPS, torch.device("cpu")) is None


def test_slots_are_reused_least_recently_used_first():
    slots = LoRASlots(PROJECTIONS, 2, max_loras=2, max_rank=4, dtype=torch.float32,
                      device=torch.device("cpu"))
    a, b, c = _adapter("a", 2, 1), _adapter("b", 2, 2), _adapter("c", 4, 3)
    assert slots.activate([a]) == {"a": 1}
    assert slots.activate([b]) == {"b": 2}
    assert slots.activate([a]) == {"a": 1}  # held: not rewritten
    assert slots.activate([c]) == {"c": 2}  # b was used least recently
    assert slots.activate([a, c]) == {"a": 1, "c": 2}
    slots.forget("a")
    assert slots.activate([b]) == {"b": 1}  # a forgotten slot is free first
    # a rank-2 adapter in a rank-4 slot: padded with zeros; B pre-scaled
    q = b.modules[(0, "q_proj")]
    torch.testing.assert_close(slots.a[0]["qkv_proj"][1, :2], q.lora_a)
    assert not slots.a[0]["qkv_proj"][1, 2:4].any()
    torch.testing.assert_close(slots.b[0]["qkv_proj"][1, :8, :2], q.lora_b * q.scaling)
    assert not slots.b[0]["qkv_proj"][1, 8:12].any()  # b has no k_proj


def test_lora_modules_parse_as_vllm_writes_them():
    assert parse_lora_modules(["a=/x", "b=/y"]) == (("a", "/x"), ("b", "/y"))
    assert parse_lora_modules("a=/x,b=/y") == parse_lora_modules(["a=/x b=/y"])
    assert parse_lora_modules({"a": "/x"}) == (("a", "/x"),)
    with pytest.raises(ValueError, match="^lora_modules: the name 'a' is given twice"):
        parse_lora_modules(["a=/x", "a=/y"])
    with pytest.raises(ValueError, match="^max_lora_rank: "):
        LoRAConfig(max_lora_rank=0)
    assert LoRAConfig(max_loras=3).max_cpu_loras == 3


def _scheduler(max_loras: int) -> Scheduler:
    kv = KVCacheManager(64, 4, enable_prefix_caching=False)
    return Scheduler(kv_cache_manager=kv, max_num_batched_tokens=64, max_num_seqs=8,
                     max_model_len=1024, max_loras=max_loras)


def _lora_request(req_id: str, lora: str | None, max_tokens: int = 6, **kwargs):
    request = make_request(req_id, 4, max_tokens=max_tokens, **kwargs)
    request.lora_name = lora
    return request


def test_a_step_never_runs_more_than_max_loras_adapters():
    scheduler = _scheduler(max_loras=2)
    runner = FakeRunner(scheduler)
    for i, lora in enumerate(["a", "b", "c", None, "a", "c", "b", None]):
        scheduler.add_request(_lora_request(f"r{i}", lora, max_tokens=3 + i % 3))
    order = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        loras = {scheduler.requests[r].lora_name for r in out.num_scheduled_tokens} - {None}
        assert len(loras) <= 2
        order += [r.req_id for r in out.new_requests]
        scheduler.update_from_output(out, runner.execute(out))
    # base requests and those of adapters in the step pass the one that waits for a slot
    assert order.index("r3") < order.index("r2") and order.index("r4") < order.index("r2")
    assert sorted(order) == sorted(f"r{i}" for i in range(8))


def test_a_waiting_adapter_is_not_starved_by_a_stream_of_others():
    scheduler = _scheduler(max_loras=1)
    runner = FakeRunner(scheduler)
    scheduler.add_request(_lora_request("a0", "a", max_tokens=4))
    scheduler.add_request(_lora_request("b0", "b", max_tokens=2))
    admitted_b = None
    for step in range(200):  # "a" requests keep coming, one a step
        scheduler.add_request(_lora_request(f"a{step + 1}", "a", max_tokens=4))
        out = scheduler.schedule()
        if "b0" in out.num_scheduled_tokens and admitted_b is None:
            admitted_b = step
        scheduler.update_from_output(out, runner.execute(out))
        if admitted_b is not None:
            break
    # passed over for LORA_MAX_SKIPPED_STEPS steps, then the running "a"s drain and b runs
    assert admitted_b is not None and admitted_b <= LORA_MAX_SKIPPED_STEPS + 8
