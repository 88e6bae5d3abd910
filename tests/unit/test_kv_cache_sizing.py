"""KV-cache sizing arithmetic, with numbers: the CPU's fraction of available memory and the
GPU's profiled budget (total x utilization - weights - peak activations - CUDA graphs -
memory outside torch)."""

from __future__ import annotations

import pytest

from engine_worker.kv_cache.sizing import (
    GIB,
    MemoryProfile,
    bytes_per_block,
    kv_budget_bytes,
    num_blocks_for_budget,
    profiled_kv_budget_bytes,
)

# SmolLM2-135M in bf16, blocks of 16 tokens: 30 layers x K,V x 3 heads x 64 x 2 bytes a token
SMOLLM2_BLOCK = bytes_per_block(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64,
                                dtype_bytes=2)


def _h100(**changes) -> MemoryProfile:
    fields = {"total_bytes": 80 * GIB, "weights_bytes": 16 * GIB,
              "peak_activation_bytes": 3 * GIB, "non_torch_bytes": GIB + GIB // 2,
              "cuda_graph_bytes": GIB // 2}
    return MemoryProfile(**(fields | changes))


def test_block_bytes():
    assert SMOLLM2_BLOCK == 16 * 23_040


def test_the_profiled_budget_is_what_the_rest_leaves_of_the_fraction():
    # 80 x 0.9 = 72 GiB; 16 + 3 + 1.5 + 0.5 = 21 GiB of it used: 51 GiB for the KV cache
    assert profiled_kv_budget_bytes(_h100(), 0.9) == 51 * GIB
    assert profiled_kv_budget_bytes(_h100(), None) == 51 * GIB  # 0.9 by default
    assert profiled_kv_budget_bytes(_h100(), 0.5) == 19 * GIB
    # graph memory is counted: without graphs (enforce_eager) the cache gets it
    assert profiled_kv_budget_bytes(_h100(cuda_graph_bytes=0), 0.9) == 51 * GIB + GIB // 2
    assert num_blocks_for_budget(budget_bytes=51 * GIB, block_bytes=SMOLLM2_BLOCK) == \
        51 * GIB // (16 * 23_040) == 148_548


def test_no_room_left_names_the_field_and_the_shares():
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization: 0.25 of 80.00 GiB leaves "
                                         r"no room .*weights 16.00 GiB, activations 3.00 GiB"):
        profiled_kv_budget_bytes(_h100(), 0.25)
    with pytest.raises(ValueError, match="^gpu_memory_utilization"):
        profiled_kv_budget_bytes(_h100(), 21 / 80)  # exactly used up: nothing left


def test_the_shares_are_said_at_start():
    assert _h100().describe(0.9, 51 * GIB) == (
        "80.0 GiB x 0.90: weights 16.00, activations 3.00, CUDA graphs 0.50, other 1.50, "
        "KV cache 51.00 GiB")


def test_cpu_budget_is_a_fraction_of_available_memory():
    assert kv_budget_bytes(kv_cache_memory_bytes=None, memory_utilization=None,
                           available_bytes=8 * GIB, on_gpu=False) == 2 * GIB
    assert kv_budget_bytes(kv_cache_memory_bytes=None, memory_utilization=0.5,
                           available_bytes=8 * GIB, on_gpu=False) == 4 * GIB
    assert kv_budget_bytes(kv_cache_memory_bytes=12345, memory_utilization=0.5,
                           available_bytes=8 * GIB, on_gpu=True) == 12345


# ---- several engines on one host (issue 32) --------------------------------------------------

def test_a_given_budget_above_what_is_available_is_refused_naming_both():
    with pytest.raises(ValueError) as err:
        kv_budget_bytes(kv_cache_memory_bytes=9 * GIB, memory_utilization=None,
                        available_bytes=8 * GIB, on_gpu=False)
    assert str(err.value) == (
        "kv_cache_memory_bytes: 9.00 GiB (9663676416 bytes) is more than this host (or its "
        "cgroup, in a container) has available: 8.00 GiB (8589934592 bytes)")
    with pytest.raises(ValueError, match=r"^kv_cache_memory_bytes: 9.00 GiB .* the GPU has "
                                         r"free: 8.00 GiB"):
        kv_budget_bytes(kv_cache_memory_bytes=9 * GIB, memory_utilization=None,
                        available_bytes=8 * GIB, on_gpu=True)
    assert kv_budget_bytes(kv_cache_memory_bytes=8 * GIB, memory_utilization=None,
                           available_bytes=8 * GIB, on_gpu=False) == 8 * GIB


def test_engines_on_one_host_share_the_fraction_one_would_take():
    from engine_worker.kv_cache.sizing import share_per_engine

    # 24 GiB available: one engine alone takes 6 GiB (0.25); four take 1.5 GiB each
    assert share_per_engine(available_bytes=24 * GIB, memory_utilization=None,
                            num_engines=4) == 6 * GIB // 4
    assert share_per_engine(available_bytes=24 * GIB, memory_utilization=0.5,
                            num_engines=2) == 6 * GIB


def test_budgets_given_for_several_engines_are_checked_together():
    from engine_worker.kv_cache.sizing import check_engines_fit

    check_engines_fit(kv_cache_memory_bytes=6 * GIB, num_engines=4, available_bytes=24 * GIB)
    with pytest.raises(ValueError) as err:
        check_engines_fit(kv_cache_memory_bytes=7 * GIB, num_engines=4,
                          available_bytes=24 * GIB)
    assert str(err.value) == (
        "kv_cache_memory_bytes: 4 engines x 7.00 GiB = 28.00 GiB (30064771072 bytes) is more "
        "than this host (or its cgroup, in a container) has available: 24.00 GiB "
        "(25769803776 bytes)")
