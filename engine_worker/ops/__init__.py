"""Compiled kernels (``csrc/``) registered as torch ops, one namespace per CPU variant
(``torch.ops.quire_avx512``, ``torch.ops.quire_avx2``); ``cpu_ops()`` is the one in use.

Each op has a pure-PyTorch reference beside its caller; the compiled build is optional and
everything runs without it.
"""

from engine_worker.ops.cpu_build import (EMULATED_VARIANTS, VARIANTS, CpuKernelChoice,
                                         build_variant, cpu_kernel_choice, cpu_ops,
                                         cpu_ops_unavailable_reason, kernel_code, load_cpu_ops,
                                         use_cpu_isa)
from engine_worker.ops.cpu_isa import available_isas, cpu_flags, cpu_isa, isa_for_flags

__all__ = ["EMULATED_VARIANTS", "VARIANTS", "CpuKernelChoice", "available_isas",
           "build_variant", "cpu_flags", "cpu_isa", "cpu_kernel_choice", "cpu_ops",
           "cpu_ops_unavailable_reason", "isa_for_flags", "kernel_code", "load_cpu_ops",
           "use_cpu_isa"]
