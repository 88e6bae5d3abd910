"""Regenerate the committed Python stubs from proto/ (needs the dev extra: grpcio-tools).

    python -m quire.codegen            # rewrite quire/v1/*_pb2*.py in place
    python -m quire.codegen --check    # exit 1 if the committed stubs differ from fresh ones
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"


def generate(out_dir: Path) -> list[Path]:
    """Write stubs for every proto under proto/ into out_dir (as out_dir/quire/v1/...)."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")
    return sorted(p for p in out_dir.rglob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quire.codegen")
    parser.add_argument("--check", action="store_true")
    ns = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = []
        for path in fresh:
            committed = REPO / path.relative_to(tmp)
            if not committed.exists() or not filecmp.cmp(path, committed, shallow=False):
                stale.append(committed)
                if not ns.check:
                    committed.parent.mkdir(parents=True, exist_ok=True)
                    committed.write_bytes(path.read_bytes())
    if ns.check and stale:
        print("stubs differ from proto/: " + ", ".join(map(str, stale))
              + "\nrun: python -m quire.codegen", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
