"""Which instruction-set variant of the CPU kernels this CPU runs, from the flags it reports.

Each variant of ``csrc/cpu`` is built with explicit instruction-set flags (never
``-march=native``), so an image built on one node runs on another; the variant loaded is the
best one the CPU *running* the engine supports. The choice is a pure function of the CPU's
flag set (``isa_for_flags``), tested without the hardware.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

# Best first: the flags (as /proc/cpuinfo spells them) a variant's code needs at run time.
ISA_REQUIRED_FLAGS: dict[str, frozenset[str]] = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                         "avx512_vnni"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
}

CPUINFO = Path("/proc/cpuinfo")


def isa_for_flags(flags: frozenset[str] | set[str]) -> str | None:
    """The best variant a CPU with these flags runs, or None where none fits."""
    runnable = runnable_isas(flags)
    return runnable[0] if runnable else None


def runnable_isas(flags: frozenset[str] | set[str]) -> tuple[str, ...]:
    """Every variant a CPU with these flags runs, best first (an AVX-512 CPU runs both)."""
    return tuple(isa for isa, needed in ISA_REQUIRED_FLAGS.items() if needed <= flags)


def missing_flags(isa: str, flags: frozenset[str] | set[str]) -> list[str]:
    return sorted(ISA_REQUIRED_FLAGS[isa] - flags)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this CPU (x86 Linux: the first ``flags`` line of
    /proc/cpuinfo); empty where the CPU reports none (another OS or architecture)."""
    try:
        text = CPUINFO.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@functools.cache
def cpu_model_name() -> str:
    try:
        for line in CPUINFO.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_isa() -> str | None:
    """The best kernel variant this CPU runs: ``"avx512"`` (AVX-512 F/BW/VL/DQ and BF16),
    else ``"avx2"`` (AVX2, FMA, F16C), else None (the PyTorch reference ops run)."""
    return isa_for_flags(cpu_flags())


def available_isas() -> tuple[str, ...]:
    """Every variant this CPU runs, best first: what the kernel tests run over."""
    return runnable_isas(cpu_flags())
