"""The proposer registry: ``speculative_config.method`` -> the proposer it builds."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_worker.spec_decode.config import SpeculativeConfig
from engine_worker.spec_decode.ngram import NgramProposer
from engine_worker.spec_decode.speculator import Proposer, Speculator, step_token_limit
from engine_worker.spec_decode.suffix import SuffixProposer

if TYPE_CHECKING:  # torch only where a draft model runs
    import torch

    from engine_worker.spec_decode.draft_model import DraftShape

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TargetFacts:
    """What a proposer may need of the engine it drafts for (the draft model's method loads
    and checks its model against these)."""

    device: torch.device
    dtype: torch.dtype
    backend: object  # the engine's kernels (backends.base.Backend)
    shape: DraftShape  # the target's vocabulary, block size and max_model_len
    num_kv_blocks: int  # the target's KV cache blocks
    tokenizer_digest: str = ""


def _ngram(config: SpeculativeConfig, target: TargetFacts | None) -> Proposer:
    return NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)


def _suffix(config: SpeculativeConfig, target: TargetFacts | None) -> Proposer:
    return SuffixProposer(max_depth=config.suffix_decoding_max_tree_depth,
                          max_outputs=config.suffix_decoding_max_cached_requests)


def _draft_model(config: SpeculativeConfig, target: TargetFacts | None) -> Proposer:
    """The draft loaded like the target (same device, dtype and kernels), checked against it,
    with a cache for ``disable_by_batch_size + 1`` requests of max_model_len tokens."""
    assert target is not None, "the draft_model method needs the target's facts"
    from engine_worker.platform import allocate_zeroed
    from engine_worker.progress import progress
    from engine_worker.spec_decode.draft_model import (DraftKVCache, DraftModelProposer,
                                                       DraftShape, check_draft)
    from engine_worker.weights.loader import load_model, read_hf_config
    from engine_worker.weights.resolve import resolve_model_dir
    from quire.tokenizer_digest import tokenizer_dir_digest

    model_dir = resolve_model_dir(config.model)
    draft_len = int(read_hf_config(model_dir).get("max_position_embeddings") or 2048)
    vocab = int(read_hf_config(model_dir).get("vocab_size") or 0)
    bs = target.shape.block_size
    check_draft(target.shape, DraftShape(vocab_size=vocab, block_size=bs,
                                         max_model_len=draft_len))
    if target.tokenizer_digest and (model_dir / "tokenizer.json").is_file() and \
            tokenizer_dir_digest(model_dir) != target.tokenizer_digest:
        logger.warning("speculative_config.model: the draft's tokenizer files differ from the "
                       "target's; proposals will be accepted only where the ids mean the same")
    with progress(logger, f"Loading the draft model {model_dir.name}"):
        loaded = load_model(model_dir, dtype=target.dtype, device=target.device,
                            backend=target.backend, max_model_len=target.shape.max_model_len)
    cfg = loaded.model.cfg
    check_draft(target.shape, DraftShape(vocab_size=cfg.vocab_size, block_size=bs,
                                         max_model_len=loaded.max_model_len))
    per_request = -(-(target.shape.max_model_len + config.num_speculative_tokens) // bs)
    num_blocks = max(1, min(target.num_kv_blocks, (config.disable_by_batch_size + 1) * per_request))
    # one tensor a layer: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]
    kv_caches = [allocate_zeroed((2, num_blocks, bs, cfg.num_kv_heads, cfg.head_dim),
                                 target.dtype, target.device) for _ in range(cfg.num_layers)]
    return DraftModelProposer(loaded.model, DraftKVCache(kv_caches, bs), target.device)


PROPOSERS: dict[str, Callable[[SpeculativeConfig, TargetFacts | None], Proposer]] = {
    "ngram": _ngram,
    "suffix": _suffix,
    "draft_model": _draft_model,
}


def build_speculator(config: SpeculativeConfig | None, device_type: str = "cpu",
                     target: TargetFacts | None = None) -> Speculator | None:
    """The scheduler's speculator for ``config`` (None when speculation is off), with the
    step token limit of ``device_type`` (see ``speculator``). ``target``: the engine's facts,
    which the draft_model method needs."""
    if config is None:
        return None
    make = PROPOSERS.get(config.method)
    if make is None:
        raise ValueError(f"speculative_config.method: {config.method!r} is not available in "
                         f"this build (available: {sorted(PROPOSERS)})")
    return Speculator(config, make(config, target),
                      step_token_limit=step_token_limit(device_type))
