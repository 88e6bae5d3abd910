"""CPU memory for the KV cache and the streamed weights: lazily mapped, huge-page aligned."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from engine_worker.platform import HUGE_PAGE_BYTES, allocate_zeroed, to_huge_pages

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_allocate_zeroed_gives_zeros_on_a_huge_page_boundary(dtype):
    shape = (2, 37, 16, 3, 64)
    t = allocate_zeroed(shape, dtype, CPU)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not t.any()
    t[1, 36, 15] = 3  # writable, and the last element is inside the mapping
    assert t.sum().item() == 3 * 3 * 64


def test_allocations_do_not_share_memory():
    a = allocate_zeroed((1000,), torch.float32, CPU)
    b = allocate_zeroed((1000,), torch.float32, CPU)
    a.fill_(1)
    assert not b.any()


def test_to_huge_pages_copies():
    src = torch.randn(300, 64).bfloat16()
    out = to_huge_pages(src)
    assert torch.equal(out, src) and out.data_ptr() != src.data_ptr()
    assert out.data_ptr() % HUGE_PAGE_BYTES == 0


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text()
                    or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="this kernel gives no transparent huge pages")
def test_touched_memory_is_on_huge_pages():
    def anon_huge_kib() -> int:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
        return 0

    before = anon_huge_kib()
    t = allocate_zeroed((64 << 20,), torch.uint8, CPU)
    t.fill_(1)  # fault it in
    assert anon_huge_kib() - before >= 32 << 10  # at least half of the 64 MiB
