"""Device and dtype selection: the one place that asks what hardware we run on."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

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


def select_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bf16 where the hardware runs it natively, else fp32."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32


def available_memory_bytes(device: torch.device) -> int:
    """Free memory now: device memory on CUDA, MemAvailable of the host on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def allocate_zeroed(shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU it comes from calloc (numpy), so pages are mapped lazily and
    a multi-GiB KV cache costs nothing until used; ``torch.zeros`` would write every byte."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * (torch.finfo(dtype).bits // 8)
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def select_kernels(name: str, device: torch.device) -> str:
    """``auto`` -> ``cpu`` (the compiled kernels) on a CPU where they build, else ``torch``."""
    from engine_worker.ops import cpu_ops_unavailable_reason, load_cpu_ops

    if name == "torch":
        return name
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"kernels: 'cpu' runs on the CPU only, the device is {device}")
        reason = cpu_ops_unavailable_reason()
        if reason is not None:
            raise ValueError(f"kernels: 'cpu' requested but unavailable: {reason}")
        return name
    return "cpu" if device.type == "cpu" and load_cpu_ops() else "torch"
