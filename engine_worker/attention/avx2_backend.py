"""Paged attention through the AVX2 kernel set (``csrc/cpu/avx2``, ``torch.ops.quire_avx2``).

The same varlen call as the AVX-512 backend, for CPUs with AVX2 and FMA. Under fp32 queries
the cache may be bf16 or fp16 (half the bytes a decode reads), widened inside the kernel.
The reference it is tested against is ``TorchAttentionBackend``.
"""

from __future__ import annotations

import torch

from engine_worker.attention.metadata import AttentionMetadata
from engine_worker.attention.torch_backend import TorchAttentionBackend


def avx2_kernel_supports(head_dim: int) -> bool:
    return head_dim % 16 == 0 and head_dim <= 512


class Avx2PagedAttentionBackend:
    """Stateless; one instance serves every layer. Needs the AVX2 kernel set loaded. Head
    sizes the kernel does not take (not a multiple of 16) go to the reference."""

    name = "cpu_avx2"

    def __init__(self) -> None:
        self._reference = TorchAttentionBackend()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        if not avx2_kernel_supports(q.shape[-1]):
            return self._reference.forward(q, k, v, kv_cache, meta, scale)
        torch.ops.quire_avx2.write_kv(kv_cache, k, v, meta.slot_mapping)
        q = q.contiguous()
        out = torch.empty_like(q)
        torch.ops.quire_avx2.paged_attention(out, q, kv_cache, meta.block_tables,
                                             meta.query_start_loc, meta.seq_lens, scale)
        return out
