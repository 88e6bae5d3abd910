"""``cpu_isa``: runs a kernel test once per instruction-set variant, with ``ops.cpu_ops()``
and engines built in the test using that variant (on an AVX-512 machine, the AVX2 kernels
too). Skipped with the reason where this CPU cannot run a variant (the flags it lacks) or the
variant does not build (the builder's reason); that a variant compiles on any x86 host is
test_kernel_build.py's.

``@pytest.mark.cpu_ops("name", ...)``: the ops a test calls; a variant without them (the AVX2
set has no exponent-coded skinny matmul, for one) skips it, naming what it lacks."""

from __future__ import annotations

import pytest

from engine_worker.ops import VARIANTS, cpu_ops_unavailable_reason, use_cpu_isa


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_ops(*names): CPU kernel ops the test calls; "
                            "variants without them skip it")


@pytest.fixture(params=list(VARIANTS))
def cpu_isa(request):
    isa = request.param
    reason = cpu_ops_unavailable_reason(isa)
    if reason is not None:
        pytest.skip(f"CPU kernels: {reason}")
    needed = [name for marker in request.node.iter_markers("cpu_ops") for name in marker.args]
    with use_cpu_isa(isa) as ops:
        missing = [name for name in needed if not hasattr(ops, name)]
        if missing:
            pytest.skip(f"the {isa} kernels have no {', '.join(missing)}")
        yield isa
