"""Compiled kernels (``csrc/``) registered as torch ops, one namespace per CPU variant
(``torch.ops.quire_avx512``, ``torch.ops.quire_avx2``). ``load(variant)`` gives a variant's
kernels as an object (``CpuKernels``), or why it cannot run here (``Unavailable``); the
backend registry decides which variant an engine runs.

Each op has a pure-PyTorch reference beside its caller; the compiled build is optional and
everything runs without it.
"""

from engine_worker.ops.cpu_build import (VARIANTS, CpuKernels, CpuVariant, Unavailable,
                                         build_variant, cannot_run_reason, load)
from engine_worker.ops.cpu_isa import available_isas, cpu_flags, cpu_isa, isa_for_flags

__all__ = ["VARIANTS", "CpuKernels", "CpuVariant", "Unavailable", "available_isas",
           "build_variant", "cannot_run_reason", "cpu_flags", "cpu_isa", "isa_for_flags",
           "load"]
