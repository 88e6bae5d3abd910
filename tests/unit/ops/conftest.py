"""``cpu_isa``: runs a kernel test once per instruction-set variant this CPU runs (on an
AVX-512 machine, the AVX2 kernels too), with ``ops.cpu_ops()`` and engines built in the test
using that variant. Skipped, with the builder's reason, where a variant cannot be built."""

from __future__ import annotations

import pytest

from engine_worker.ops import available_isas, cpu_ops_unavailable_reason, use_cpu_isa


@pytest.fixture(params=available_isas() or [None], ids=lambda isa: isa or "no-isa")
def cpu_isa(request):
    isa = request.param
    reason = cpu_ops_unavailable_reason(isa)
    if reason is not None:
        pytest.skip(f"CPU kernels: {reason}")
    with use_cpu_isa(isa):
        yield isa
