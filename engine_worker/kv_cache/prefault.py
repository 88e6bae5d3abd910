"""The KV cache's pages faulted in at start (``kv_cache_prefault``), as vLLM's zero-filled
cache is.

On the CPU the cache is an anonymous mapping on transparent huge pages
(``platform.allocate_zeroed``), mapped lazily: a multi-GiB cache costs nothing at start, and
each page is zeroed (for a huge page, found or compacted) by the first step that writes a block
in it. The block pool hands out the least recently used block first, so an engine walks its
whole cache once before it reuses a block, and until then every step pays for fresh pages in
its own time. Measured on the Intel Xeon here (2 cores under KVM): embedding 63,251 tokens
(1.46 GiB of K/V) spent 2.0-2.4 s of each 25-28 s turn in the kernel, 0.03 s once the cache was
populated. vLLM allocates its cache with ``torch.zeros`` and so pays this at start, once.

So a server (``quire engine``, ``quire up``, the chart: ``kv_cache_prefault`` defaults true
there) populates the cache before it reports ready, with ``MADV_POPULATE_WRITE`` (Linux 5.14;
it faults pages in without writing them) from as many threads as the engine steps with, in
windows of blocks in the order the pool hands them out. It stops where the host would keep less
than ``KEEP_AVAILABLE_BYTES`` available (several engines on one host must not commit it all);
the rest then faults in as steps first use it, and the start block says so. A script's ``LLM``
keeps the lazy cache (it starts in a second and may never fill its cache); it may ask for
``kv_cache_prefault=True``. Where the kernel has no such advice the pages are written with
zeros instead (the cache is empty at start, so nothing is lost).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from engine_worker.host_memory import host_available_bytes

MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14 and later
WINDOW_BYTES = 256 << 20  # one window: the same blocks in every layer's K and V
KEEP_AVAILABLE_BYTES = 4 << 30
LAZY = "mapped lazily: pages fault in as steps first use them (kv_cache_prefault off)"


def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def block_windows(kv_caches: Sequence[torch.Tensor],
                  window_bytes: int = WINDOW_BYTES) -> list[list[torch.Tensor]]:
    """The caches (one a layer: ``[2, num_blocks, ...]``, K then V) as windows of blocks, first
    blocks first: each window is a list of contiguous views, the same blocks of every layer's
    K and V, about ``window_bytes`` in all."""
    halves = [half for t in kv_caches if t.numel() > 0 for half in t.unbind(0)]
    if not halves:
        return []
    num_blocks = halves[0].shape[0]
    block_bytes = sum(h[0].numel() * h.element_size() for h in halves)
    step = max(1, window_bytes // max(1, block_bytes))
    return [[h[b:b + step] for h in halves] for b in range(0, num_blocks, step)]


def _populate(view: torch.Tensor, madvise: Callable[[int, int, int], int]) -> bool:
    """Fault ``view``'s pages in; False where the kernel lacks the advice (then nothing done)."""
    start = view.data_ptr()
    aligned = start - start % mmap.PAGESIZE
    length = start + view.numel() * view.element_size() - aligned
    if madvise(aligned, length, MADV_POPULATE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS):
        return False
    raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")


def prefault_kv_cache(kv_caches: Sequence[torch.Tensor], num_threads: int, *,
                      available: Callable[[], int] = host_available_bytes,
                      keep_available: int = KEEP_AVAILABLE_BYTES,
                      window_bytes: int = WINDOW_BYTES) -> str:
    """Fault the CPU cache tensors' pages in, first blocks first; the start block's line."""
    cpu = [t for t in kv_caches if t.device.type == "cpu"]
    windows = block_windows(cpu, window_bytes)
    if not windows:
        return ""
    total = sum(t.numel() * t.element_size() for t in cpu)
    madvise = _madvise()
    how = "MADV_POPULATE_WRITE" if madvise is not None else "zeros written (no madvise here)"
    done, began = 0, time.monotonic()
    stopped = ""
    with ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="quire-kv-prefault") as pool:
        for window in windows:
            size = sum(v.numel() * v.element_size() for v in window)
            if available() - size < keep_available:
                stopped = (f", then stopped where the host would keep less than "
                           f"{keep_available / 2**30:.0f} GiB available: the rest faults in "
                           f"as steps first use it")
                break
            if madvise is not None and not all(pool.map(lambda v: _populate(v, madvise),
                                                        window)):
                madvise, how = None, "zeros written (the kernel has no MADV_POPULATE_WRITE)"
            if madvise is None:
                for v in window:
                    v.zero_()  # torch's own threads; the cache holds nothing yet
            done += size
    seconds = time.monotonic() - began
    return (f"faulted in at start, {done / 2**30:.2f} of {total / 2**30:.2f} GiB in "
            f"{seconds:.1f} s ({how}, {max(1, num_threads)} threads){stopped}")
