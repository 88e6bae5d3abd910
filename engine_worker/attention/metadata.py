"""Per-step attention metadata, built by the model runner and passed down explicitly.

The step's tokens are flat and ordered: all decode tokens first (one per request), then the
prefill chunks, each contiguous::

    tokens:  [d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]
              decodes    prefill 0    prefill 1

KV cache layout, per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V).
Token slot ``s`` lives in block ``s // block_size`` at offset ``s % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One request's prefill chunk: ``query_len`` tokens at positions
    ``[context_len, context_len + query_len)``; all earlier positions are already cached."""

    query_start: int
    query_len: int
    context_len: int
    block_table: torch.Tensor  # [num_blocks_of_request] int64


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """The decode / prefill split serves the reference backend; the varlen view (every request
    in step order, decodes included) serves the kernels, as flash-attention's varlen API."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V go
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_num_blocks] int64, padded with 0
    decode_seq_lens: torch.Tensor  # [num_decodes] int64: tokens in the cache incl. the new one
    decode_max_seq_len: int
    prefills: tuple[PrefillChunk, ...]
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64: request i's tokens are [q[i], q[i+1])
    seq_lens: torch.Tensor  # [num_seqs] int64: cached tokens after this step, new ones included
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
