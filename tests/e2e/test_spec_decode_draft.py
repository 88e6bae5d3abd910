"""The draft-model method end to end: greedy fp32 output is token-identical with and without a
draft (a smaller random Llama sharing the vocabulary, and the target as its own draft, whose
drafts are all accepted), alone, in mixed batches, with prefix caching, chunked prefill,
preemption and n > 1; a draft the target cannot verify is an error at start naming both
values."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from engine_worker import LLM, SamplingParams
from engine_worker.spec_decode.draft_model import DraftModelProposer
from tests.conftest import build_tiny_model
from tests.e2e.test_spec_decode import MAX_TOKENS, PROMPTS, _params, _tokens

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, embedded_model_dir):
    """One layer, hidden 32, 2 heads on 1 KV head: smaller than the target in every way but
    the vocabulary."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), embedded_model_dir,
                            num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, seed=1)


def _spec(model, k=4) -> dict:
    return {"model": str(model), "num_speculative_tokens": k, "disable_by_batch_size": 64}


def _llm(model_dir, spec=None, **kw) -> LLM:
    llm = LLM(str(model_dir), dtype="float32", speculative_config=spec,
              **({"kv_cache_memory_bytes": 1 << 24} | kw))
    if spec is not None:  # every request of a mixed batch drafts (not only the CPU's 8 tokens)
        llm.engine._scheduler.speculator.step_token_limit = 1 << 16
    return llm


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    return _tokens(_llm(tiny_model_dir))


def _spec_stats(llm):
    return llm.engine.stats().scheduler.spec_decoding


def _draft_cache(llm):
    proposer = llm.engine._scheduler.speculator.proposer
    assert isinstance(proposer, DraftModelProposer)
    return proposer.cache


def test_self_draft_is_identical_and_accepts_every_draft(tiny_model_dir, expected):
    llm = _llm(tiny_model_dir, _spec(tiny_model_dir))
    assert llm.info.speculative_config and '"method": "draft_model"' in \
        llm.info.speculative_config
    assert _tokens(llm) == expected  # one mixed batch
    stats = _spec_stats(llm)
    # the same weights in the same dtype: only a near-tie computed by two kernel paths (one
    # query of k + 1 tokens vs k single-token steps) could differ
    assert stats.num_draft_tokens > 100
    assert stats.num_accepted_tokens >= 0.98 * stats.num_draft_tokens
    assert stats.num_accepted_tokens_per_pos[-1] > 0
    for prompt, params, want in zip(PROMPTS[:3], _params(), expected):  # alone
        assert _tokens(llm, [prompt], [params]) == [want]
    cache = _draft_cache(llm)
    assert not cache.sequences and cache.num_free_blocks == cache.num_blocks  # all given back
    kv = llm.engine.stats().kv_cache
    assert kv.num_free_blocks == kv.num_blocks


def test_small_draft_is_identical_batched_and_with_prefix_caching(tiny_model_dir, draft_dir,
                                                                 expected):
    llm = _llm(tiny_model_dir, _spec(draft_dir))
    assert _tokens(llm) == expected
    first = _spec_stats(llm)
    assert first.num_drafts > 0
    # adaptivity: the random draft is mostly rejected, so requests verify fewer than k drafts
    assert first.num_draft_tokens < 0.6 * 4 * first.num_drafts
    assert _tokens(llm) == expected  # again: the prompts hit the target's prefix cache
    assert llm.engine.stats().kv_cache.prefix_cache_hits > 0
    assert _spec_stats(llm).num_drafts > first.num_drafts


@pytest.mark.parametrize("engine_kw", [
    {"max_num_batched_tokens": 8},  # chunked prefill; drafts compete for the 8 tokens
    # 14 blocks of 16 tokens for requests needing up to 7: preemption is forced
    {"kv_cache_memory_bytes": 14 * 3 * 2 * 16 * 2 * 16 * 4},
], ids=["chunked", "preempted"])
@pytest.mark.parametrize("draft", ["self", "small"])
def test_draft_is_identical_chunked_and_preempted(tiny_model_dir, draft_dir, expected,
                                                  engine_kw, draft):
    llm = _llm(tiny_model_dir, _spec(tiny_model_dir if draft == "self" else draft_dir),
               **engine_kw)
    assert _tokens(llm) == expected
    stats = llm.engine.stats()
    assert stats.scheduler.spec_decoding.num_drafts > 0
    if draft == "self":
        assert stats.scheduler.spec_decoding.num_accepted_tokens > 0
    if "kv_cache_memory_bytes" in engine_kw:
        assert stats.scheduler.num_preemptions > 0
    assert stats.kv_cache.num_free_blocks == stats.kv_cache.num_blocks


def test_draft_n2_and_logprobs_match(tiny_model_dir, draft_dir):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, n=2, logprobs=2)
              for m in MAX_TOKENS]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    want = _llm(tiny_model_dir).generate(prompts, params, use_tqdm=False)
    for spec in (_spec(tiny_model_dir), _spec(draft_dir, k=2)):
        llm = _llm(tiny_model_dir, spec)
        got = llm.generate(prompts, params, use_tqdm=False)
        for w, g in zip(want, got):
            for wc, gc in zip(w.outputs, g.outputs):
                assert gc.token_ids == wc.token_ids
                assert gc.cumulative_logprob == pytest.approx(wc.cumulative_logprob, abs=1e-3)
        assert _spec_stats(llm).num_drafts > 0


def test_a_small_draft_cache_evicts_and_stays_identical(tiny_model_dir, expected):
    """A draft cache sized for two requests of max_model_len (disable_by_batch_size 1) serving
    seven:
    requests take each other's draft blocks and recompute their context."""
    spec = dict(_spec(tiny_model_dir), disable_by_batch_size=1)
    llm = _llm(tiny_model_dir, spec, max_model_len=128)
    assert _draft_cache(llm).num_blocks == 2 * 9  # two requests of 128 + 4 tokens
    speculator = llm.engine._scheduler.speculator  # now drafts at any batch size
    speculator.config = dataclasses.replace(speculator.config, disable_by_batch_size=64)
    assert _tokens(llm) == expected
    assert _spec_stats(llm).num_accepted_tokens > 0


def _edited_copy(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_draft_of_another_vocabulary_or_shorter_context_is_refused_at_start(
        tmp_path, tiny_model_dir, draft_dir):
    other_vocab = _edited_copy(draft_dir, tmp_path / "vocab", vocab_size=32000)
    with pytest.raises(ValueError, match=r"speculative_config\.model: .*32000 tokens, "
                                         r"the target's 49152"):
        _llm(tiny_model_dir, _spec(other_vocab))
    short = _edited_copy(draft_dir, tmp_path / "short", max_position_embeddings=128)
    with pytest.raises(ValueError, match=r"speculative_config\.model: .*at most 128 tokens, "
                                         r"the target 1024"):
        _llm(tiny_model_dir, _spec(short))
    _llm(tiny_model_dir, _spec(short), max_model_len=128)  # fits once the target is capped


def test_seeded_sampling_is_token_identical_with_a_draft(tiny_model_dir, draft_dir):
    """Greedy drafts are a point-mass q: a seeded sampled request keeps its tokens (position i
    takes the i-th draw of its stream, and a draft is accepted exactly when that draw picks
    it), whatever the draft proposed."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=30, seed=11 + i, max_tokens=m,
                             ignore_eos=True, presence_penalty=0.2)
              for i, m in enumerate(MAX_TOKENS)]
    want = _tokens(_llm(tiny_model_dir), params=params)
    llm = _llm(tiny_model_dir, _spec(tiny_model_dir))
    assert _tokens(llm, params=params) == want
    # drafts were verified (the random model's sampled tokens are rarely its argmax: few are
    # accepted, and adaptivity keeps the proposals short)
    assert _spec_stats(llm).num_drafts > 0
