"""Compiled kernels (``csrc/``) registered as torch ops under ``torch.ops.quire``.

Each op has a pure-PyTorch reference beside its caller; the compiled build is optional and
everything runs without it.
"""

from engine_worker.ops.cpu_build import cpu_ops_unavailable_reason, load_cpu_ops

__all__ = ["cpu_ops_unavailable_reason", "load_cpu_ops"]
