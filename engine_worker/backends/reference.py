"""The ``torch`` backend: plain PyTorch, on any device torch supports. The reference every
other backend is tested against, and itself tested against Hugging Face token for token.

The elementwise references live beside their modules (``layers.norm.rms_norm``,
``layers.activation.silu_and_mul``, ``layers.rotary.apply_rope``); the matmul and paged
attention are here. Decodes are batched into one gathered matmul; each prefill chunk runs
through ``scaled_dot_product_attention`` over its cached context plus itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine_worker.attention.metadata import AttentionMetadata
from engine_worker.backends.base import Backend
from engine_worker.layers.activation import silu_and_mul
from engine_worker.layers.norm import rms_norm
from engine_worker.layers.rotary import apply_rope


def torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 packed: Any = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def no_packing(weight: torch.Tensor, dense: torch.Tensor | None = None) -> None:
    return None


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the step's new keys and values at their slots."""
    # kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; k, v: [num_tokens, kv, d]
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


class TorchAttentionBackend:
    """Stateless; one instance serves every layer."""

    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        write_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        num_decodes = meta.num_decode_tokens
        if num_decodes:
            out[:num_decodes] = self._decode(q[:num_decodes], kv_cache, meta, scale)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], kv_cache, chunk.context_len,
                                      chunk.block_table, scale)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        num_seqs, num_heads, head_dim = q.shape
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        num_blocks = -(-meta.decode_max_seq_len // block_size)
        tables = meta.decode_block_tables[:, :num_blocks]
        max_len = num_blocks * block_size
        # [num_seqs, max_len, num_kv_heads, head_dim]
        keys = kv_cache[0][tables].view(num_seqs, max_len, num_kv_heads, head_dim)
        values = kv_cache[1][tables].view(num_seqs, max_len, num_kv_heads, head_dim)
        group = num_heads // num_kv_heads
        # [num_seqs, num_kv_heads, group, head_dim] @ [num_seqs, num_kv_heads, head_dim, max_len]
        qg = q.view(num_seqs, num_kv_heads, group, head_dim)
        scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)).float() * scale
        pad = torch.arange(max_len, device=q.device)[None, :] >= meta.decode_seq_lens[:, None]
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        # [num_seqs, num_kv_heads, group, head_dim]
        out = torch.matmul(probs, values.permute(0, 2, 1, 3))
        return out.reshape(num_seqs, num_heads, head_dim)

    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 context_len: int, block_table: torch.Tensor, scale: float) -> torch.Tensor:
        query_len = q.shape[0]
        if context_len == 0:
            keys, values, mask, causal = k, v, None, True
        else:
            block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
            seq_len = context_len + query_len
            blocks = block_table[: -(-seq_len // block_size)]
            keys = kv_cache[0][blocks].view(-1, num_kv_heads, head_dim)[:seq_len]
            values = kv_cache[1][blocks].view(-1, num_kv_heads, head_dim)[:seq_len]
            # query i sits at position context_len + i and sees keys 0..context_len + i
            key_pos = torch.arange(seq_len, device=q.device)
            query_pos = torch.arange(context_len, seq_len, device=q.device)
            mask, causal = key_pos[None, :] <= query_pos[:, None], False
        # SDPA wants [batch, heads, tokens, head_dim]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)


REFERENCE = Backend(
    name="torch", description="reference ops", linear=torch_linear, pack_weight=no_packing,
    rms_norm=rms_norm, silu_and_mul=silu_and_mul, rope=apply_rope,
    attention=TorchAttentionBackend())
