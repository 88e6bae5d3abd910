"""Paged attention through the compiled CPU kernels (``csrc/cpu``, AVX-512 or AVX2; OpenMP).

One varlen call per layer covers the step's decodes and prefill chunks together, reading K/V
in place through the block tables: no gather of the context into a padded copy, no mask
tensors. The reference it is tested against is ``TorchAttentionBackend``.
"""

from __future__ import annotations

import torch

from engine_worker.attention.metadata import AttentionMetadata
from engine_worker.attention.torch_backend import TorchAttentionBackend
from engine_worker.ops import cpu_ops


def kernel_supports(head_dim: int) -> bool:
    return head_dim % 16 == 0 and head_dim <= 512


class CpuPagedAttentionBackend:
    """Stateless; one instance serves every layer. Needs ``engine_worker.ops.load_cpu_ops()``.
    Head sizes the kernel does not take (not a multiple of 16) go to the reference."""

    name = "cpu"

    def __init__(self) -> None:
        self._reference = TorchAttentionBackend()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        if not kernel_supports(q.shape[-1]):
            return self._reference.forward(q, k, v, kv_cache, meta, scale)
        cpu_ops().write_kv(kv_cache, k, v, meta.slot_mapping)
        q = q.contiguous()
        out = torch.empty_like(q)
        cpu_ops().paged_attention(out, q, kv_cache, meta.block_tables, meta.query_start_loc,
                                  meta.seq_lens, scale)
        return out
