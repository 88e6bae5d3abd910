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
def cpuinfo_fields() -> dict[str, str]:
    """/proc/cpuinfo's fields, each as its first line gives it (the first processor's, on x86
    Linux), read once; empty where there is no such file (another OS)."""
    try:
        text = CPUINFO.read_text(errors="replace")
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this CPU (x86 Linux: the first ``flags`` line of
    /proc/cpuinfo); empty where the CPU reports none (another OS or architecture)."""
    return frozenset(cpuinfo_fields().get("flags", "").split())


def cpu_model_name() -> str:
    return cpuinfo_fields().get("model name") or platform.processor() or platform.machine()


def cpu_vendor_family() -> tuple[str, int]:
    """This CPU's vendor and family as /proc/cpuinfo gives them (``vendor_id``, ``cpu
    family``): ("AuthenticAMD", 26) on a Zen 5; ("", -1) where it says nothing."""
    fields = cpuinfo_fields()
    family = fields.get("cpu family", "")
    return fields.get("vendor_id", ""), int(family) if family.isdigit() else -1


def full_width_bf16(vendor: str, family: int, flags: frozenset[str] | set[str]) -> bool:
    """Whether AVX-512 BF16 dot products run on a full 512-bit datapath here: AMD from Zen 5
    (family 26; Zen 4, family 25, splits each 512-bit operation in two halves). There oneDNN's
    bf16 matmul on a de-quantized twin outruns the int8 kernel of a Q8_0 weight at a prefill's
    rows, and a k-quant weight's de-quantizing on every call past a decode's rows, as AMX
    tiles do on an Intel CPU; Q4_0 / Q4_1's grouped int8 kernel is faster at every row count
    (backends/cpu.CpuOps._twin_pays)."""
    return vendor == "AuthenticAMD" and family >= 26 and "avx512_bf16" in flags


def cpu_isa() -> str | None:
    """The best kernel variant this CPU runs: ``"avx512"`` (AVX-512 F/BW/VL/DQ and BF16),
    else ``"avx2"`` (AVX2, FMA, F16C), else None (the PyTorch reference ops run)."""
    return isa_for_flags(cpu_flags())


def available_isas() -> tuple[str, ...]:
    """Every variant this CPU runs, best first: what the kernel tests run over."""
    return runnable_isas(cpu_flags())
