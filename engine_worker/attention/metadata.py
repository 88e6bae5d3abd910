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

    def token_range(self, start: int, end: int) -> AttentionMetadata:
        """The metadata of the step's tokens ``[start, end)`` alone, as a step of its own: a
        request cut by the range keeps the part inside it, whose context is everything
        before (as a chunked prefill's is), so the pieces run one after another attend
        exactly as the whole step does. For pipeline micro-batches (models/llama.py)."""
        q_loc, lens = self.query_start_loc.tolist(), self.seq_lens.tolist()
        keep, starts, seq_lens = [], [0], []
        for i, (q0, q1) in enumerate(zip(q_loc, q_loc[1:])):
            a, b = max(q0, start), min(q1, end)
            if a < b:
                keep.append(i)
                starts.append(starts[-1] + b - a)
                seq_lens.append(lens[i] - (q1 - b))
        decodes = [i for i in keep if i < self.num_decode_tokens]
        d0, d1 = (decodes[0], decodes[-1] + 1) if decodes else (0, 0)
        prefills = []
        for chunk in self.prefills:
            c0, c1 = chunk.query_start, chunk.query_start + chunk.query_len
            a, b = max(c0, start), min(c1, end)
            if a < b:
                prefills.append(PrefillChunk(query_start=a - start, query_len=b - a,
                                             context_len=chunk.context_len + a - c0,
                                             block_table=chunk.block_table))
        device = self.seq_lens.device
        rows = torch.tensor(keep, dtype=torch.long, device=device)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[start:end], num_decode_tokens=len(decodes),
            decode_block_tables=self.decode_block_tables[d0:d1],
            decode_seq_lens=self.decode_seq_lens[d0:d1],
            decode_max_seq_len=max((lens[i] for i in decodes), default=0),
            prefills=tuple(prefills),
            query_start_loc=torch.tensor(starts, dtype=self.query_start_loc.dtype,
                                         device=device),
            seq_lens=torch.tensor(seq_lens, dtype=self.seq_lens.dtype, device=device),
            block_tables=self.block_tables.index_select(0, rows).contiguous())
