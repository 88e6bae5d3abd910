"""How many KV blocks fit in the memory budget.

On a CPU the budget is a fraction of the host's available memory. On a GPU it comes from a
profile (``model_runner.profiling``): the engine may use ``gpu_memory_utilization`` of the
device's total memory, and the KV cache gets what is left of that after the weights, the
peak activations of the largest step, the CUDA graphs and the memory outside torch's
allocator (the CUDA context, libraries' workspaces, other processes), as vLLM sizes it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DEFAULT_CPU_FRACTION = 0.25  # of MemAvailable, when no budget is given
DEFAULT_GPU_FRACTION = 0.9  # of the device's total memory, when no budget is given

GIB = 1 << 30


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB ({num_bytes} bytes)"


def share_per_engine(*, available_bytes: int, memory_utilization: float | None,
                     num_engines: int) -> int:
    """Each engine's KV budget when ``num_engines`` share one host's CPU memory: the fraction
    one engine would take, divided among them (each engine alone would take it all)."""
    fraction = memory_utilization or DEFAULT_CPU_FRACTION
    return int(available_bytes * fraction) // num_engines


def check_engines_fit(*, kv_cache_memory_bytes: int, num_engines: int,
                      available_bytes: int) -> None:
    """ValueError naming both numbers when ``num_engines`` caches of ``kv_cache_memory_bytes``
    each do not fit in what the host has available."""
    total = kv_cache_memory_bytes * num_engines
    if total > available_bytes:
        raise ValueError(f"kv_cache_memory_bytes: {num_engines} engines x "
                         f"{kv_cache_memory_bytes / GIB:.2f} GiB = {_gib(total)} is more than "
                         f"this host (or its cgroup, in a container) has available: "
                         f"{_gib(available_bytes)}")


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
    """The budget given, or ``memory_utilization`` (default: by device) of what is available.
    A budget given above what is available is refused (ValueError naming both numbers): the
    cache is mapped lazily, so it would start and then run out of memory as it fills."""
    if kv_cache_memory_bytes is not None:
        if kv_cache_memory_bytes > available_bytes:
            where = "the GPU has free" if on_gpu else \
                "this host (or its cgroup, in a container) has available"
            raise ValueError(f"kv_cache_memory_bytes: {_gib(kv_cache_memory_bytes)} is more "
                             f"than {where}: {_gib(available_bytes)}")
        return kv_cache_memory_bytes
    fraction = memory_utilization or (DEFAULT_GPU_FRACTION if on_gpu else DEFAULT_CPU_FRACTION)
    return int(available_bytes * fraction)


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """Device memory as profiled at start, in bytes."""

    total_bytes: int  # the device's memory
    weights_bytes: int  # what torch held before the profile: weights, rotary tables, ...
    peak_activation_bytes: int  # the largest step's and the sampler's peak, above the weights
    non_torch_bytes: int  # in use outside torch's allocator: CUDA context, workspaces, others
    cuda_graph_bytes: int = 0  # the captured graphs' pool and input buffers

    @property
    def used_bytes(self) -> int:
        """Everything but the KV cache."""
        return (self.weights_bytes + self.peak_activation_bytes + self.non_torch_bytes
                + self.cuda_graph_bytes)

    def describe(self, memory_utilization: float | None, kv_bytes: int) -> str:
        """``79.1 GiB x 0.90: weights 15.0, activations 2.1, CUDA graphs 0.4, other 0.6,
        KV cache 53.1 GiB`` (``None``: the default fraction, as the budget takes it)."""
        if memory_utilization is None:
            memory_utilization = DEFAULT_GPU_FRACTION
        parts = (("weights", self.weights_bytes), ("activations", self.peak_activation_bytes),
                 ("CUDA graphs", self.cuda_graph_bytes), ("other", self.non_torch_bytes),
                 ("KV cache", kv_bytes))
        return (f"{self.total_bytes / GIB:.1f} GiB x {memory_utilization:.2f}: "
                + ", ".join(f"{name} {n / GIB:.2f}" for name, n in parts) + " GiB")


def profiled_kv_budget_bytes(profile: MemoryProfile, memory_utilization: float | None) -> int:
    """KV cache bytes = total x utilization - weights - peak activations - CUDA graphs - memory
    outside torch. Raises ValueError (naming ``gpu_memory_utilization``) when nothing is left."""
    fraction = DEFAULT_GPU_FRACTION if memory_utilization is None else memory_utilization
    budget = int(profile.total_bytes * fraction) - profile.used_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {fraction} of {profile.total_bytes / GIB:.2f} GiB leaves "
            f"no room for the KV cache: weights {profile.weights_bytes / GIB:.2f} GiB, "
            f"activations {profile.peak_activation_bytes / GIB:.2f} GiB, CUDA graphs "
            f"{profile.cuda_graph_bytes / GIB:.2f} GiB and {profile.non_torch_bytes / GIB:.2f} "
            "GiB outside torch already use it (raise it, lower max_num_batched_tokens or "
            "max_num_seqs, or pass enforce_eager)")
    return budget
