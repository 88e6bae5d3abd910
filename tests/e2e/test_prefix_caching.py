"""Prefix caching, block sharing and KV events on a real (tiny) model."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine_worker import LLM, BeamSearchParams, SamplingParams
from engine_worker.config import EngineArgs
from engine_worker.engine import LLMEngine
from quire.kv_events import KVCacheMirror

SYSTEM = list(range(2000, 2040))  # 40 shared tokens: 2 full blocks of 16 and a partial one
PROMPTS = [SYSTEM + list(range(3000 + 10 * i, 3000 + 10 * i + 5 + i)) for i in range(8)]


def _llm(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), dtype="float32", **({"kv_cache_memory_bytes": 1 << 24} | kwargs))


def _generate(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_outputs_identical_with_and_without_caching(tiny_model_dir, seeded):
    params = [SamplingParams(temperature=0.8 if seeded else 0, seed=i if seeded else None,
                             max_tokens=20, ignore_eos=True) for i in range(len(PROMPTS))]
    off = _llm(tiny_model_dir, enable_prefix_caching=False)
    on = _llm(tiny_model_dir)
    # the first wave fills the cache, the second reads it (and a fully cached prompt too)
    ref = [o.outputs[0].token_ids for o in _generate(off, PROMPTS + PROMPTS[:2], params + params[:2])]
    first = _generate(on, PROMPTS[:1], params[:1])
    second = _generate(on, PROMPTS + PROMPTS[:2], params + params[:2])
    assert first[0].outputs[0].token_ids == ref[0]
    assert [o.outputs[0].token_ids for o in second] == ref
    assert [o.num_cached_tokens for o in second[:3]] == [32, 32, 32]
    assert off.engine.stats().kv_cache.prefix_cache_hits == 0
    stats = on.engine.stats().kv_cache
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries > stats.prefix_cache_hits


def test_fully_cached_prompt_recomputes_only_its_last_token(tiny_model_dir):
    prompt = list(range(4000, 4048))  # exactly 3 blocks
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    llm = _llm(tiny_model_dir)
    cold = _generate(llm, [prompt], params)[0]
    warm = _generate(llm, [prompt], params)[0]
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 47
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    # The warm run computes the last token alone, the cold one inside a 48-token prefill: other
    # reduction orders, so fp32 logprobs agree to about 1e-5, not bit for bit (rounding both
    # to 4 places failed across a rounding boundary: -8.2711 vs -8.271).
    for a, b in zip(cold.outputs[0].logprobs, warm.outputs[0].logprobs):
        assert a.keys() == b.keys()
        assert all(b[t].logprob == pytest.approx(a[t].logprob, abs=1e-4) for t in a)
    # the cached copy was not overwritten: a third run still hits and still agrees
    again = _generate(llm, [prompt], params)[0]
    assert again.num_cached_tokens == 47 and again.outputs[0].token_ids == cold.outputs[0].token_ids


def test_cache_salt_isolates_tenants(tiny_model_dir):
    llm = _llm(tiny_model_dir)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a = llm.generate({"prompt_token_ids": PROMPTS[0], "cache_salt": "tenant-a"}, params,
                     use_tqdm=False)[0]
    b = llm.generate({"prompt_token_ids": PROMPTS[0], "cache_salt": "tenant-b"}, params,
                     use_tqdm=False)[0]
    a2 = llm.generate({"prompt_token_ids": PROMPTS[0], "cache_salt": "tenant-a"}, params,
                      use_tqdm=False)[0]
    plain = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)[0]
    assert (a.num_cached_tokens, b.num_cached_tokens, a2.num_cached_tokens,
            plain.num_cached_tokens) == (0, 0, 32, 0)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValueError, match="^cache_salt:"):
        llm.generate({"prompt_token_ids": PROMPTS[0], "cache_salt": ""}, params)


def _peak_blocks(engine: LLMEngine, prompt, params_list) -> int:
    for i, params in enumerate(params_list):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    peak = 0
    while engine.has_unfinished_requests():
        stats = engine.step().stats.kv_cache
        peak = max(peak, stats.num_blocks - stats.num_free_blocks)
    return peak


def test_parallel_samples_hold_the_prompt_once(tiny_model_dir):
    """n=8 samples of a 1,000-token prompt share its blocks (copy-on-write on the partial
    last block) instead of holding 8 copies."""
    prompt = [(7 * i) % 40000 + 100 for i in range(1000)]  # 62 full blocks + 8 tokens
    args = dict(model=str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24,
                enable_prefix_caching=False, max_num_batched_tokens=2048)
    shared = LLMEngine.from_engine_args(EngineArgs(**args))
    peak_shared = _peak_blocks(shared, prompt, [SamplingParams(
        n=8, temperature=1.0, seed=0, max_tokens=8, ignore_eos=True)])
    separate = LLMEngine.from_engine_args(EngineArgs(**args))
    peak_separate = _peak_blocks(separate, prompt, [SamplingParams(
        temperature=1.0, seed=i, max_tokens=8, ignore_eos=True) for i in range(8)])
    prompt_blocks = -(-1000 // 16)  # 63
    assert peak_separate >= 8 * prompt_blocks
    # the prompt once, plus per sample at most its copied partial block and one new block
    assert peak_shared <= prompt_blocks + 8 * 2
    assert shared.stats().kv_cache.num_free_blocks == shared.info.num_kv_blocks


def test_parallel_samples_match_separate_seeded_requests(tiny_model_dir):
    llm = _llm(tiny_model_dir)
    prompt = PROMPTS[3]
    forked = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        n=4, temperature=1.0, seed=10, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    for i, completion in enumerate(forked.outputs):
        alone = _generate(llm, [prompt], SamplingParams(temperature=1.0, seed=10 + i,
                                                         max_tokens=12, ignore_eos=True))[0]
        assert completion.token_ids == alone.outputs[0].token_ids


def test_kv_events_rebuild_the_cache_exactly(tiny_model_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(tiny_model_dir), dtype="float32", kv_cache_memory_bytes=20 * 3 * 2 * 16 * 2 * 16 * 4))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    mirror = KVCacheMirror.from_snapshot(engine.kv_cache_snapshot())
    late = None
    for wave in range(3):  # 20 blocks, so later waves evict earlier blocks
        for i, prompt in enumerate(PROMPTS[wave * 3:wave * 3 + 3] or PROMPTS[:3]):
            engine.add_request(f"w{wave}-{i}", {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            for batch in engine.step().kv_event_batches:
                assert mirror.apply(batch)
                if late is not None:
                    assert late.apply(batch)
            if wave == 1 and late is None:
                late = KVCacheMirror.from_snapshot(engine.kv_cache_snapshot())
    truth = engine.kv_cache_snapshot().block_hashes
    assert truth and mirror.block_hashes == truth and late.block_hashes == truth
    assert engine.reset_prefix_cache()
    (cleared,) = engine.step().kv_event_batches  # the next step carries it
    assert mirror.apply(cleared) and mirror.block_hashes == set()


def test_beam_search_matches_transformers(tiny_model_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                           dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    llm = _llm(tiny_model_dir)
    prompts = [[5, 100, 200, 300, 400], list(range(1000, 1030))]
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                              BeamSearchParams(beam_width=4, max_tokens=20, ignore_eos=True))
    for prompt, output in zip(prompts, outputs):
        ref = hf.generate(torch.tensor([prompt]), num_beams=4, num_return_sequences=4,
                          do_sample=False, max_new_tokens=20, pad_token_id=0,
                          output_scores=True, return_dict_in_generate=True)
        assert [b.tokens[len(prompt):] for b in output.sequences] == \
            [s[len(prompt):].tolist() for s in ref.sequences]
        assert [b.score(len(prompt), 1.0) for b in output.sequences] == \
            pytest.approx(ref.sequences_scores.tolist(), abs=1e-4)
    assert llm.engine.stats().kv_cache.prefix_cache_hits > 0  # beams shared their blocks


def test_a_failed_step_publishes_nothing(tiny_model_dir, monkeypatch):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), dtype="float32",
                                                   kv_cache_memory_bytes=1 << 22))
    engine.add_request("doomed", {"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(temperature=0, max_tokens=4))

    def broken_forward(*args, **kwargs):  # fault injection into the real model
        raise RuntimeError("injected device failure")

    monkeypatch.setattr(engine.runner, "model", broken_forward)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    snapshot = engine.kv_cache_snapshot()
    # nothing findable and no event at all: no batch was ever sealed
    assert snapshot.block_hashes == frozenset() and snapshot.seq == 0
    from engine_worker.engine import EngineDeadError

    with pytest.raises(EngineDeadError, match="injected device failure"):
        engine.step()  # a failed engine refuses further work instead of serving garbage
    with pytest.raises(EngineDeadError):
        engine.add_request("next", {"prompt_token_ids": [1, 2]}, SamplingParams())
