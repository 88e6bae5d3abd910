"""Device and dtype selection: the one place that asks what hardware we run on."""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from engine_worker.host_memory import host_available_bytes

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def select_device(name: str) -> torch.device:
    """``auto`` -> CUDA when torch sees a GPU, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} requested but torch sees no CUDA device")
    return device


def cpu_supports_bf16() -> bool:
    """True on CPUs with native bf16 matmul (AVX-512 BF16 or AMX), where bf16 is ~7x fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# Backends that keep bf16 weights and widen them to fp32 inside their kernels: on a CPU with
# no bf16 arithmetic they stream half the bytes of fp32 and never touch torch's emulated
# bf16 matmul, so bf16 is their fastest dtype.
BF16_WEIGHT_BACKENDS = frozenset({"cpu-avx2"})


def select_dtype(name: str, device: torch.device, backend: str | None = None) -> torch.dtype:
    """``auto`` -> bf16 where the hardware runs it natively or ``backend`` widens bf16
    weights in its kernels, else fp32."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if cpu_supports_bf16() or backend in BF16_WEIGHT_BACKENDS:
        return torch.bfloat16
    return torch.float32


def available_memory_bytes(device: torch.device) -> int:
    """Free memory now: device memory on CUDA; on CPU, the host's MemAvailable or what the
    process's cgroup still allows, whichever is smaller."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available_bytes()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without stalling the host on the GPU. A plain ``.to(cuda)``
    from pageable memory synchronizes the stream, which waits out every kernel queued
    before it; from pinned memory a ``non_blocking`` copy is queued in stream order instead.
    On the CPU, ``t`` itself."""
    if device.type != "cuda":
        return t if t.device == device else t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Device tensors on the host with one wait: every copy is queued into pinned memory,
    then the stream is synchronized once. The one place a step reads the device; on the CPU
    the tensors themselves."""
    if not torch.cuda.is_initialized():  # then no tensor is on a GPU (a device per tensor,
        return list(tensors)             # looked at on cold caches, cost ~12 us a CPU step)
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    if not devices:
        return list(tensors)
    host = [t.to("cpu", non_blocking=True) for t in tensors]
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    return host


HUGE_PAGE_BYTES = 2 << 20


# glibc's malloc hands a freed block larger than its mmap threshold back to the kernel (the
# threshold starts at 128 KiB and rises with the blocks freed, to 32 MiB at most) and trims
# the heap's free top past its trim threshold. A step's activations are such blocks (one
# 2,048-token prefill's MLP output is 12 MiB), so they could come back as fresh pages every
# step, each 4 KiB page a fault and a zeroing: embedding 63,251 tokens in 2,048-token steps
# took 2.9 million page faults and 24.9 s, against 0.38 million and 15.7 s with the
# thresholds fixed as here (Intel Xeon, 2 threads; silu_and_mul's and the matmuls' output
# writes were where the faults landed). vLLM's CPU images preload tcmalloc for the same reason.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MALLOC_MMAP_THRESHOLD = 32 << 20  # the most glibc accepts
MALLOC_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> str:
    """Has glibc's malloc keep freed blocks up to 32 MiB in the heap and 1 GiB of free heap
    top (see above), for the whole process; once is enough. Returns one line for the start
    block; where the C library is not glibc it says so and logs a warning."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is not None and mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD) == 1 \
            and mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD) == 1:
        return (f"glibc malloc keeps freed blocks up to {MALLOC_MMAP_THRESHOLD >> 20} MiB and "
                f"{MALLOC_TRIM_THRESHOLD >> 20} MiB of free heap (a step's buffers are reused, "
                f"not faulted in again)")
    line = ("the C library's malloc as it is (no glibc mallopt): a step's large buffers may "
            "come back as fresh pages each step, slower on a CPU")
    logger.warning("Host malloc: %s", line)
    return line


def allocate_zeroed(shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU it is an anonymous mapping, so pages are mapped (and zeroed)
    lazily and a multi-GiB KV cache costs nothing until used (``torch.zeros`` would write
    every byte), and it starts on a 2 MiB boundary and asks Linux for transparent huge pages.

    Huge pages matter on CPUs: the decode kernels stream the weights and the KV cache through
    the TLB, and with 4 KiB pages every 4 KiB costs a page walk (a nested one in a VM). On the
    2-core EPYC VM here a 256 MiB read of non-zero data on both cores runs at ~20 GB/s on 4 KiB
    pages and ~32 GB/s on huge pages. Where the kernel gives none (THP ``never``) this is plain
    memory."""
    if device.type != "cpu" or 0 in shape:  # (another pipeline stage's layer: no heads)
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    # room to start the tensor on a huge-page boundary wherever the mapping lands
    # private: a shared anonymous mapping is shmem, which THP's "madvise" mode leaves alone
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux only
        region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    skip = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[skip:skip + nbytes].view(dtype).view(shape)


# Weights smaller than a huge page share regions of this size, one after another (64-byte
# aligned, as the kernels' vector loads like): on a mapping of its own each took a 2 MiB page
# for itself once touched, so SmolLM2's 121 native Q4_1 weights (96.5 MB) held 235 MB resident
# (measured on a Zen 4, 2026-12-03).
SMALL_REGION_BYTES = 32 << 20
_SMALL_ALIGN = 64


class SmallRegions:
    """Bump allocation of small CPU copies in shared huge-page regions. A region lives as long
    as any tensor in it (each is a view of it); the allocator keeps only the one it fills."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._region: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` (< a huge page) of uninitialised uint8, 64-byte aligned."""
        with self._lock:
            start = -(-self._used // _SMALL_ALIGN) * _SMALL_ALIGN
            if self._region is None or start + nbytes > self._region.numel():
                self._region = allocate_zeroed((SMALL_REGION_BYTES,), torch.uint8,
                                               torch.device("cpu"))
                start = 0
            self._used = start + nbytes
            return self._region[start:start + nbytes]


_SMALL_WEIGHTS = SmallRegions()


def to_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t`` on transparent huge pages (see ``allocate_zeroed``): a huge-page
    aligned mapping of its own, or, smaller than a huge page, a place in a region shared with
    other small ones."""
    nbytes = t.numel() * t.element_size()
    if nbytes >= HUGE_PAGE_BYTES or nbytes == 0:
        out = allocate_zeroed(tuple(t.shape), t.dtype, torch.device("cpu"))
    else:
        out = _SMALL_WEIGHTS.take(nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out

