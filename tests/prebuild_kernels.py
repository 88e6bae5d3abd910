"""``python -m tests.prebuild_kernels``: builds into the Quire cache every CPU kernel set the
suite loads on this machine: the engine's sets this CPU runs, then, on a CPU without AVX-512,
the AVX-512 set emulated through SIMDe (``conftest._emulated_avx512``; its compile is the
suite's slowest step on a 2-core Zen 3, about three minutes).

CI runs it in the background, niced, beside the suite's first modules, whose engines leave
cores idle while they start and wait; a test that needs a set still being built waits on the
build's lock, as it would for a build of its own. Nothing changes for a run without it: the
suite builds what is missing itself. Exit status 1 where a set fails to build (the suite
would skip that set's tests with the reason), with the reason on stderr."""

from __future__ import annotations

import sys
import time

from engine_worker.ops.build import BuildFailed
from engine_worker.ops.cpu_build import VARIANTS, build_variant, cannot_run_reason
from tests.conftest import _emulated_avx512


def sets_to_build() -> list:
    """The variants the suite loads here, the engine's own first (its first engines need
    them), then the emulated AVX-512 set where the real one cannot run."""
    runnable = [v for v in VARIANTS.values() if cannot_run_reason(v) is None]
    if cannot_run_reason(VARIANTS["avx512"]) is not None:
        runnable.append(_emulated_avx512())
    return runnable


def main() -> int:
    failed = 0
    for variant in sets_to_build():
        start = time.monotonic()
        try:
            path = build_variant(variant)
        except BuildFailed as exc:
            failed += 1
            print(f"{variant.name}: not built: {exc}", file=sys.stderr, flush=True)
            continue
        print(f"{variant.name}: {path} ({time.monotonic() - start:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
