"""The draft-model method's pieces without a model: the start check (both values named) and
the draft's own paged cache (block ids, least recently drafted evicted first)."""

from __future__ import annotations

import pytest
import torch

from engine_worker.spec_decode.config import SpeculativeConfig
from engine_worker.spec_decode.draft_model import DraftKVCache, DraftShape, check_draft


def test_a_draft_the_target_cannot_verify_is_refused_naming_both_values():
    target = DraftShape(vocab_size=49152, block_size=16, max_model_len=2048)
    check_draft(target, DraftShape(49152, 16, 8192))  # a longer context is fine
    with pytest.raises(ValueError, match=r"^speculative_config\.model: .* 32000 tokens, "
                                         r"the target's 49152"):
        check_draft(target, DraftShape(32000, 16, 2048))
    with pytest.raises(ValueError, match=r"^speculative_config\.model: .* 32 tokens, "
                                         r"the target's 16"):
        check_draft(target, DraftShape(49152, 32, 2048))
    with pytest.raises(ValueError, match=r"at most 1024 tokens, the target 2048; lower "
                                         r"max_model_len to 1024"):
        check_draft(target, DraftShape(49152, 16, 1024))


def test_the_config_takes_a_draft_models_path_as_vllm_does():
    cfg = SpeculativeConfig.parse('{"model": "/m/draft", "num_speculative_tokens": 3}')
    assert (cfg.method, cfg.model) == ("draft_model", "/m/draft")
    with pytest.raises(ValueError, match=r"speculative_config\.model: the draft_model method"):
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 3})


def _cache(num_blocks: int, block_size: int = 4) -> DraftKVCache:
    return DraftKVCache([torch.zeros(2, num_blocks, block_size, 1, 2)], block_size)


def test_the_draft_cache_hands_out_blocks_and_evicts_the_least_recently_drafted():
    cache = _cache(6)
    cache.sequence("a")
    assert cache.reserve("a", 5) and cache.sequences["a"].block_ids == [0, 1]
    cache.sequence("b")
    assert cache.reserve("b", 8) and cache.sequences["b"].block_ids == [2, 3]
    assert cache.reserve("a", 6) and cache.sequences["a"].block_ids == [0, 1]  # enough already
    cache.sequence("c")
    assert cache.reserve("c", 4) and cache.sequences["c"].block_ids == [4]
    cache.sequence("a")  # a drafts again: b is now the least recently drafted
    # b is evicted; its blocks (the latest freed) are handed out first
    assert cache.reserve("c", 12) and cache.sequences["c"].block_ids == [4, 2, 3]
    assert list(cache.sequences) == ["c", "a"] and cache.num_free_blocks == 1
    assert not cache.reserve("a", 4 * 7)  # more than the whole cache
    cache.free("a")
    cache.free("c")
    assert cache.num_free_blocks == 6 and not cache.sequences
