"""``python -m engine_worker.ops``: build every CPU kernel variant the compiler can build into
the Quire cache (an image built on one node then runs on every CPU type)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from engine_worker.ops.build import BuildFailed
from engine_worker.ops.cpu_build import VARIANTS, build_variant
from engine_worker.ops.cpu_isa import available_isas


def build_each(variants, *, retry_failed: bool = False) -> int:
    """Builds each variant (a ``VARIANTS`` name or a ``CpuVariant``) into the Quire cache,
    printing its library and build time, or why it was not built (on stderr); -> how many
    were not built."""
    failed = 0
    for variant in variants:
        name = variant if isinstance(variant, str) else variant.name
        start = time.monotonic()
        try:
            path = build_variant(variant, retry_failed=retry_failed)
        except BuildFailed as exc:
            failed += 1
            print(f"{name}: not built: {exc}", file=sys.stderr, flush=True)
            continue
        print(f"{name}: {path} ({time.monotonic() - start:.0f} s)", flush=True)
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build every CPU kernel variant the compiler "
                                     "can build into the Quire cache.")
    parser.add_argument("--isa", action="append", choices=list(VARIANTS),
                        help="build only this variant (repeatable)")
    parser.add_argument("--retry-failed", action="store_true",
                        help="build again where an earlier build failed")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"this CPU runs: {', '.join(available_isas()) or 'none'}")
    isas = ns.isa or list(VARIANTS)
    return 1 if build_each(isas, retry_failed=ns.retry_failed) == len(isas) else 0


if __name__ == "__main__":
    sys.exit(main())
