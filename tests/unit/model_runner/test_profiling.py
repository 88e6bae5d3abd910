"""The start-up memory profile on a CPU: the dummy step at the scheduler's limits runs through
the real model and sampler, its readings come from an injected ``MemoryReader`` (in the order
the arithmetic needs them), and it leaves the engine exactly as it was: KV cache, blocks,
requests and random streams. On a GPU the readings are torch.cuda's: tests/gpu."""

from __future__ import annotations

import pytest
import torch

from engine_worker import LLM, SamplingParams
from engine_worker.kv_cache.sizing import MemoryProfile
from engine_worker.model_runner.profiling import _dummy_states, profile_memory

GIB = 1 << 30


class _ScriptedMemory:
    """Readings as a GPU would give them; every call is recorded in ``events``."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def synchronize(self):
        self.events.append("synchronize")

    def empty_cache(self):
        self.events.append("empty_cache")

    def reset_peak(self):
        self.events.append("reset_peak")

    def allocated_bytes(self):
        self.events.append("allocated")
        return 16 * GIB

    def peak_allocated_bytes(self):
        self.events.append("peak")
        return 19 * GIB

    def reserved_bytes(self):
        self.events.append("reserved")
        return 20 * GIB

    def free_and_total_bytes(self):
        self.events.append("free_and_total")
        return 58 * GIB, 80 * GIB


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", kernels="torch", max_model_len=128,
               kv_cache_memory_bytes=1 << 22, max_num_batched_tokens=300, max_num_seqs=16)


def test_the_dummy_step_is_long_prefills_up_to_max_model_len():
    states, lengths = _dummy_states(300, 128, 16, SamplingParams())
    assert lengths == [128, 128, 44]
    assert [len(s.block_ids) for s in states] == [8, 8, 3]
    assert all(set(s.block_ids) == {0} for s in states)  # the scratch cache's one block


def test_profile_reads_the_peak_around_the_dummy_step(llm, monkeypatch):
    model = llm.engine.runner.model
    events: list[str] = []
    forward, compute_logits = model.forward, model.compute_logits

    def spy_forward(input_ids, *args):
        events.append(f"forward {input_ids.shape[0]} tokens")
        return forward(input_ids, *args)

    def spy_logits(hidden):
        events.append(f"logits {hidden.shape[0]} rows")
        return compute_logits(hidden)

    monkeypatch.setattr(model, "forward", spy_forward)
    monkeypatch.setattr(model, "compute_logits", spy_logits)
    profile = profile_memory(model, _ScriptedMemory(events), num_tokens=300, num_seqs=16,
                             max_model_len=128, block_size=16, device=torch.device("cpu"))
    # weights: all torch held before; activations: the peak above them; outside torch:
    # total - free - reserved = 80 - 58 - 20
    assert profile == MemoryProfile(total_bytes=80 * GIB, weights_bytes=16 * GIB,
                                    peak_activation_bytes=3 * GIB, non_torch_bytes=2 * GIB)
    assert events == ["synchronize", "empty_cache", "reset_peak", "allocated",
                      "forward 300 tokens", "logits 16 rows",
                      "synchronize", "peak", "free_and_total", "reserved", "empty_cache"]


def test_the_profile_leaves_the_engine_as_it_was(llm):
    engine, runner = llm.engine, llm.engine.runner
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.9, max_tokens=5, ignore_eos=True)]
    prompts = [{"prompt_token_ids": list(range(7, 7 + n))} for n in (40, 21)]
    llm.generate(prompts, params, use_tqdm=False)  # a cache with content, cached blocks
    caches = [c.clone() for c in runner.kv_caches]
    stats, snapshot = engine.stats(), engine.kv_cache_snapshot()
    generator = runner.default_generator.get_state()
    requests = dict(runner.requests)
    profile_memory(runner.model, _ScriptedMemory([]), num_tokens=300, num_seqs=16,
                   max_model_len=128, block_size=16, device=torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(runner.kv_caches, caches))
    assert engine.stats() == stats and engine.kv_cache_snapshot() == snapshot
    assert torch.equal(runner.default_generator.get_state(), generator)
    assert runner.requests == requests


def test_the_engine_profiles_at_its_scheduler_limits(llm, monkeypatch):
    """What ``LLMEngine`` runs on CUDA before it sizes the cache, run here on its CPU model
    with the readings scripted (graphs are off on a CPU, so none are measured)."""
    import engine_worker.engine as engine_module

    engine = llm.engine
    events: list[str] = []
    monkeypatch.setattr(engine_module, "CudaMemory", lambda device: _ScriptedMemory(events))
    model = engine.runner.model
    forward = model.forward

    def spy_forward(input_ids, *args):
        events.append(f"forward {input_ids.shape[0]}")
        return forward(input_ids, *args)

    monkeypatch.setattr(model, "forward", spy_forward)
    profile = engine._profile_memory(model)
    assert "forward 300" in events  # max_num_batched_tokens
    assert profile.cuda_graph_bytes == 0 and profile.peak_activation_bytes == 3 * GIB
    # no gpu_memory_utilization given: described with the default share the budget takes
    assert profile.describe(engine.config.cache.gpu_memory_utilization, 10 * GIB) == (
        "80.0 GiB x 0.90: weights 16.00, activations 3.00, CUDA graphs 0.00, other 2.00, "
        "KV cache 10.00 GiB")
    assert engine.info.memory_profile is None and engine.info.memory is None  # sized on a CPU
