"""Compile the Triton 4-bit linear kernel ahead of time for real GPUs, without one (as
``attention/triton_aot.py`` does for attention): what the interpreter cannot see (a ``tl.dot``
dimension under 16, register spills, shared memory over the limit) shows up here.

    python -m engine_worker.backends.triton_int4_aot --arch 80 90

Run it in a process without ``TRITON_INTERPRET`` (the interpreter replaces ``@triton.jit``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch

from engine_worker.attention.triton_aot import _TYPES, _resources
from engine_worker.backends.triton_int4 import DENSE_ROWS, int4_launch


@dataclass(frozen=True, slots=True)
class Int4Variant:
    dtype: str  # "float16" | "bfloat16" | "float32"
    group: int
    # decides the launch: up to 16 the fused kernel's decode tiles, then its 64-row tiles, from
    # triton_int4.DENSE_ROWS the de-quantize kernel (then cuBLAS)
    num_rows: int


@dataclass(frozen=True, slots=True)
class CompiledInt4Variant:
    arch: int
    variant: Int4Variant
    registers: int
    spilled_bytes: int
    shared_bytes: int
    num_warps: int


VARIANTS = tuple(Int4Variant(dtype, group, rows)
                 for dtype in ("float16", "bfloat16", "float32")
                 for group in (128, 32)
                 for rows in (1, 24, 256))


def _signature(dtype: str) -> dict[str, str]:
    t = "*" + _TYPES[getattr(torch, dtype)]
    return {"x_ptr": t, "w_ptr": "*i32", "bias_ptr": t, "out_ptr": t, "M": "i32", "N": "i32",
            "K": "i32", "stride_xm": "i64", "stride_om": "i64"}


def compile_variant(variant: Int4Variant, arch: int) -> CompiledInt4Variant:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine_worker.backends.triton_int4_kernel import (int4_dequantize_kernel,
                                                           int4_linear_kernel)

    dtype = getattr(torch, variant.dtype)
    if variant.num_rows >= DENSE_ROWS:
        fn = int4_dequantize_kernel
        constexprs = {"GROUP": variant.group, "BLOCK_N": 32,
                      "BLOCK_K": max(d for d in (32, 64, 128) if variant.group % d == 0)}
        t = "*" + _TYPES[dtype]
        signature = {"w_ptr": "*i32", "out_ptr": t, "N": "i32", "K": "i32"}
    else:
        fn = int4_linear_kernel
        constexprs = int4_launch(variant.num_rows, variant.group, dtype, has_bias=True,
                                 interpret=False).constexprs()
        signature = _signature(variant.dtype)
    signature |= {name: "constexpr" for name in constexprs}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", arch, 32))
    registers, local, shared_static = _resources(kernel.asm["cubin"])
    shared = max(shared_static, kernel.metadata.shared)
    return CompiledInt4Variant(arch, variant, registers, local, shared,
                               kernel.metadata.num_warps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    parser.add_argument("--json", action="store_true", help="one JSON object per variant")
    args = parser.parse_args(argv)
    for arch in args.arch:
        for variant in VARIANTS:
            r = compile_variant(variant, arch)
            if args.json:
                print(json.dumps(asdict(r)), flush=True)
            else:
                v = variant
                print(f"sm_{arch} {v.dtype:8} group {v.group:3} rows {v.num_rows:3}: "
                      f"{r.registers} regs, {r.spilled_bytes} B local, {r.shared_bytes} B "
                      f"shared, {r.num_warps} warps", flush=True)


if __name__ == "__main__":
    main()
