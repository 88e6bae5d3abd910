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

import pytest

from tests.conftest import CPU_VARIANT_NAMES, use_cpu_variant


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_ops(*names): CPU kernel ops the test calls; "
                            "variants without them skip it")


@pytest.fixture(params=CPU_VARIANT_NAMES)
def cpu_kernels(request, monkeypatch):
    under_test = use_cpu_variant(monkeypatch, request.param)
    needed = [name for marker in request.node.iter_markers("cpu_ops") for name in marker.args]
    missing = [name for name in needed if not under_test.kernels.has(name)]
    if missing:
        pytest.skip(f"the {request.param} kernels have no {', '.join(missing)}")
    return under_test
