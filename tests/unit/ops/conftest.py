"""``cpu_kernels``: runs a kernel test once per instruction-set variant (``use_cpu_variant`` in
tests/conftest.py), with that variant's ops and backend, and engines built in the test
running that variant (on an AVX-512 machine, the AVX2 kernels too; on a CPU without AVX-512,
the AVX-512 set's code through SIMDe's portable intrinsics, ``avx512_emulated``, so either
machine type checks both sets' numerics). Skipped with the reason where this CPU cannot run a
variant (the flags it lacks) or the variant does not build (the builder's reason); that a
variant compiles on any x86 host is test_kernel_build.py's.

``@pytest.mark.cpu_ops("name", ...)``: the ops a test calls; a variant without them (the AVX2
set has no exponent-coded skinny matmul, for one) skips it, naming what it lacks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from engine_worker.backends import BACKENDS, Backend
from engine_worker.ops import CpuKernels
from tests.conftest import CPU_BACKEND_OF_ISA, CPU_VARIANT_NAMES, use_cpu_variant


@dataclass(frozen=True, slots=True)
class KernelsUnderTest:
    """One variant's loaded kernels and the backend the registry makes from them."""

    kernels: CpuKernels
    backend: Backend

    @property
    def ops(self) -> Any:
        """The variant's op namespace (``torch.ops.quire_<name>``)."""
        return self.kernels.ops

    @property
    def isa(self) -> str:
        """Whose code runs: ``avx512_emulated`` is ``avx512``."""
        return self.kernels.isa


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_ops(*names): CPU kernel ops the test calls; "
                            "variants without them skip it")


@pytest.fixture(params=CPU_VARIANT_NAMES)
def cpu_kernels(request, monkeypatch) -> KernelsUnderTest:
    kernels = use_cpu_variant(monkeypatch, request.param)
    needed = [name for marker in request.node.iter_markers("cpu_ops") for name in marker.args]
    missing = [name for name in needed if not kernels.has(name)]
    if missing:
        pytest.skip(f"the {request.param} kernels have no {', '.join(missing)}")
    backend = BACKENDS[CPU_BACKEND_OF_ISA[kernels.isa]].resolve(torch.device("cpu"))
    return KernelsUnderTest(kernels, backend)
