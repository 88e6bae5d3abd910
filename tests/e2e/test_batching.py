"""Continuous batching changes nothing about outputs: alone, batched, chunked prefill and
preemption all give the same tokens; every block comes back; waste stays in last blocks."""

from __future__ import annotations

import pytest

from engine_worker import LLM, SamplingParams
from engine_worker.engine import LLMEngine
from engine_worker.config import EngineArgs

PROMPTS = [list(range(100 + i, 100 + i + n)) for i, n in enumerate([3, 40, 17, 90, 1, 33, 64, 8])]
MAX_TOKENS = [24, 8, 40, 16, 30, 12, 20, 35]


def _params(seeded: bool) -> list[SamplingParams]:
    if seeded:
        return [SamplingParams(temperature=0.9, top_p=0.9, seed=1000 + i, max_tokens=m,
                               ignore_eos=True) for i, m in enumerate(MAX_TOKENS)]
    return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]


def _run(model_dir, prompts, params, **engine_kwargs):
    llm = LLM(str(model_dir), dtype="float32", **({"kv_cache_memory_bytes": 1 << 24}
                                                  | engine_kwargs))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_same_tokens_alone_batched_chunked_and_preempted(tiny_model_dir, seeded):
    params = _params(seeded)
    llm, batched = _run(tiny_model_dir, PROMPTS, params)
    alone = [llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0].outputs[0].token_ids
             for p, sp in zip(PROMPTS, params)]
    assert batched == alone
    llm, chunked = _run(tiny_model_dir, PROMPTS, params, max_num_batched_tokens=8)
    assert chunked == alone
    # the 90-token prompt first, in steps of 100 tokens: it waits a step for the 3-token one
    order = [3, 0, 1, 2, 4, 5, 6, 7]
    llm, short_first = _run(tiny_model_dir, [PROMPTS[i] for i in order],
                            [params[i] for i in order], short_prompts_first=True,
                            max_num_batched_tokens=100)
    assert llm.engine.stats().scheduler.num_prompts_passed > 0
    assert short_first == [alone[i] for i in order]
    # 14 blocks of 16 tokens for 8 requests needing up to 7 blocks each: preemption is forced.
    block_bytes = 3 * 2 * 16 * 2 * 16 * 4  # layers * (K, V) * block * kv_heads * head_dim * fp32
    llm, preempted = _run(tiny_model_dir, PROMPTS, params, kv_cache_memory_bytes=14 * block_bytes)
    assert llm.info.num_kv_blocks == 14
    assert llm.engine.stats().scheduler.num_preemptions > 0
    assert preempted == alone
    assert llm.engine.stats().kv_cache.num_free_blocks == 14


def test_a_short_prompt_beside_a_long_one_answers_a_step_earlier(tiny_model_dir):
    """The real engine with the servers' default: the short prompt's first token comes from a
    step the long prompt is not in, and the long one's from the next."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), dtype="float32",
                                                   kv_cache_memory_bytes=1 << 22,
                                                   short_prompts_first=True))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("long", {"prompt_token_ids": PROMPTS[3]}, params)  # 90 tokens
    engine.add_request("short", {"prompt_token_ids": PROMPTS[0]}, params)  # 3 tokens
    first = [[out.request_id for out in engine.step().outputs] for _ in range(2)]
    assert first == [["short"], ["short", "long"]]
    assert engine.stats().scheduler.num_prompts_passed == 1


def test_every_block_returns_after_finish_and_abort(tiny_model_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), dtype="float32",
                                                   kv_cache_memory_bytes=1 << 22))
    total = engine.info.num_kv_blocks
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": p},
                           SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.stats().kv_cache.num_free_blocks < total
    engine.abort_request(["r0", "r3", "r5"])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            if out.finished:
                finished[out.request_id] = out.outputs[0].finish_reason
    assert finished == {f"r{i}": ("abort" if i in (0, 3, 5) else "length") for i in range(8)}
    stats = engine.stats().kv_cache
    assert stats.num_free_blocks == total and stats.num_allocated_slots == 0


def test_memory_is_wasted_only_in_last_blocks(tiny_model_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), dtype="float32",
                                                   kv_cache_memory_bytes=1 << 22))
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": p},
                           SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    seen_running = 0
    num_tokens = {}  # per running request, from its outputs: prompt and sampled tokens
    while engine.has_unfinished_requests():
        result = engine.step()
        for out in result.outputs:
            num_tokens[out.request_id] = len(out.prompt_token_ids) + len(
                out.outputs[0].token_ids)
            if out.finished:
                del num_tokens[out.request_id]
        stats, running = result.stats.kv_cache, result.stats.scheduler.num_running
        seen_running = max(seen_running, running)
        assert 0 <= stats.num_allocated_slots - stats.num_used_slots < 16 * max(running, 1)
        if len(num_tokens) == running:  # every holder of blocks has sampled
            # each holds the blocks of its cached tokens (all but the last sampled), no more
            assert stats.num_allocated_slots == 16 * sum(-(-(n - 1) // 16)
                                                          for n in num_tokens.values()), \
                "a request holds more blocks than it needs"
    assert seen_running == len(PROMPTS)


def test_late_request_joins_running_batch(tiny_model_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), dtype="float32",
                                                   kv_cache_memory_bytes=1 << 22))
    long_params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine.add_request("early", {"prompt_token_ids": PROMPTS[1]}, long_params)
    for _ in range(5):
        engine.step()
    engine.add_request("late", {"prompt_token_ids": PROMPTS[2]},
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    order = []
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            if out.finished:
                order.append(out.request_id)
    # the late request was batched with the running one and finished first
    assert order == ["late", "early"]


def test_impossible_requests_are_rejected_at_once(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=128,
              kv_cache_memory_bytes=3 * 2 * 16 * 2 * 16 * 4 * 4)  # 4 blocks = 64 tokens
    with pytest.raises(ValueError, match=r"^prompt: 200 tokens"):
        llm.generate({"prompt_token_ids": [5] * 200}, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"^prompt: the request needs"):
        llm.generate({"prompt_token_ids": [5] * 100}, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"^max_tokens: the request needs"):
        llm.generate({"prompt_token_ids": [5] * 40}, SamplingParams(max_tokens=60))
    # the engine keeps serving, and nothing leaked
    out = llm.generate({"prompt_token_ids": [5] * 10}, SamplingParams(max_tokens=5,
                                                                      ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5
    assert llm.engine.stats().kv_cache.num_free_blocks == 4
    assert not llm.engine.has_unfinished_requests()
