"""``python -m tests.prebuild_kernels``: builds into the Quire cache the CPU kernel sets the
suite builds besides the engine's own (the best set this CPU runs, which the suite's first
engines build at once): on a CPU without AVX-512, the AVX-512 set emulated through SIMDe
(``conftest._emulated_avx512``; about three minutes of a 2-core Zen 3) and the real AVX-512
set, which a test compiles without loading; on an AVX-512 one, the AVX2 set.

CI runs it niced in the background beside the suite, so that these compiles take what cores
the suite's tests leave idle rather than each stopping the first test that needs it; a test
that needs a set still being built waits on the build's lock, as it would for a build of its
own. Nothing changes for a run without it: the suite builds what is missing itself. Exit
status 1 where a set fails to build, with the reason on stderr (the suite would skip that
set's tests with the reason)."""

from __future__ import annotations

import sys

from engine_worker.ops.__main__ import build_each
from engine_worker.ops.cpu_build import VARIANTS
from engine_worker.ops.cpu_isa import available_isas
from tests.conftest import _emulated_avx512


def sets_to_build() -> list:
    """The variants, in the order the suite first needs them: the emulated AVX-512 set where
    the real one cannot run (the end-to-end tests load it), then every real set but the
    engine's own (a unit test compiles each)."""
    runnable = available_isas()
    wanted = [] if "avx512" in runnable else [_emulated_avx512()]
    own = runnable[0] if runnable else None
    return wanted + [v for name, v in VARIANTS.items() if name != own]


def main() -> int:
    return 1 if build_each(sets_to_build()) else 0


if __name__ == "__main__":
    sys.exit(main())
