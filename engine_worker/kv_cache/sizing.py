"""How many KV blocks fit in the memory budget."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

DEFAULT_CPU_FRACTION = 0.25  # of MemAvailable, when no budget is given
DEFAULT_GPU_FRACTION = 0.9  # of free device memory after the weights are loaded


def bytes_per_block(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype_bytes: int) -> int:
    """K and V for ``block_size`` tokens in every layer."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype_bytes


def num_blocks_for_budget(*, budget_bytes: int, block_bytes: int) -> int:
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes: {budget_bytes} bytes hold no block "
                         f"(one block needs {block_bytes} bytes)")
    return num_blocks


def kv_budget_bytes(*, kv_cache_memory_bytes: int | None, memory_utilization: float | None,
                    available_bytes: int, on_gpu: bool) -> int:
    if kv_cache_memory_bytes is not None:
        return kv_cache_memory_bytes
    fraction = memory_utilization or (DEFAULT_GPU_FRACTION if on_gpu else DEFAULT_CPU_FRACTION)
    return int(available_bytes * fraction)
