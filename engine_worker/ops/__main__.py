"""``python -m engine_worker.ops``: build every CPU kernel variant the compiler can build into
the Quire cache (an image built on one node then runs on every CPU type)."""

from __future__ import annotations

import argparse
import logging
import sys

from engine_worker.ops.build import BuildFailed
from engine_worker.ops.cpu_build import VARIANTS, build_variant
from engine_worker.ops.cpu_isa import available_isas


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
    failed = 0
    for isa in ns.isa or list(VARIANTS):
        try:
            print(f"{isa}: {build_variant(isa, retry_failed=ns.retry_failed)}")
        except BuildFailed as exc:
            failed += 1
            print(f"{isa}: not built: {exc}", file=sys.stderr)
    return 1 if failed == len(ns.isa or VARIANTS) else 0


if __name__ == "__main__":
    sys.exit(main())
