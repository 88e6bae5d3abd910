"""Compile the Triton kernels ahead of time for real GPUs, without one.

``triton.compile`` with a ``GPUTarget`` runs the whole pipeline down to a cubin with the ptxas
shipped in the triton wheel, so shape and constraint errors the CPU interpreter cannot see
(``tl.dot`` with a dimension under 16, register spills, shared memory over the limit) show up
here. ``cuobjdump -res-usage`` (also in the wheel) reports registers, spills and shared memory.

    python -m engine_worker.attention.triton_aot --arch 80 90

Also the layer's small-op kernels (``backends/triton_ops.py``: RMSNorm with and without the
residual add, SiLU-and-mul, RoPE), at the hidden and head sizes of ``OP_VARIANTS``.

Run it in a process without ``TRITON_INTERPRET`` (the interpreter replaces ``@triton.jit``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine_worker.attention.triton_backend import attention_launch

# Shared memory a block may use, by compute capability (bytes): A100 163 KiB, H100 227 KiB.
SHARED_LIMIT_BYTES = {80: 166912, 90: 232448}
_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_STRIDES = ("stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head", "stride_c_block",
            "stride_c_slot", "stride_c_head", "stride_bt_seq")


@dataclass(frozen=True, slots=True)
class Variant:
    dtype: str  # "float16" | "bfloat16" | "float32"
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    has_prefill: bool


@dataclass(frozen=True, slots=True)
class CompiledVariant:
    arch: int
    variant: Variant
    registers: int
    spilled_bytes: int  # local memory per thread: spills (and stack)
    shared_bytes: int
    num_warps: int


VARIANTS = tuple(
    Variant(dtype, heads, kv_heads, head_dim, block_size, prefill)
    for dtype in ("float16", "bfloat16", "float32")
    for heads, kv_heads, head_dim in ((32, 8, 128), (9, 3, 64), (16, 16, 80))
    for block_size, prefill in ((16, True), (256, False))
)


def _signature(dtype: str) -> dict[str, str]:
    t = "*" + _TYPES[getattr(torch, dtype)]
    sig = {"out_ptr": t, "q_ptr": t, "k_cache_ptr": t, "v_cache_ptr": t,
           "block_tables_ptr": "*i32", "query_start_loc_ptr": "*i64", "seq_lens_ptr": "*i64",
           "scale": "fp32", "num_seqs": "i32"}
    sig.update({name: "i64" for name in _STRIDES})
    return sig


def _resources(cubin: bytes) -> tuple[int, int, int]:
    """(registers, local bytes, shared bytes) of the kernel in a cubin."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    fields = dict(re.findall(r"(REG|LOCAL|SHARED):(\d+)", text))
    return int(fields["REG"]), int(fields.get("LOCAL", 0)), int(fields.get("SHARED", 0))


def compile_variant(variant: Variant, arch: int) -> CompiledVariant:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine_worker.attention.triton_kernels import paged_attention_kernel

    launch = attention_launch(getattr(torch, variant.dtype), variant.num_heads,
                              variant.num_kv_heads, variant.head_dim, variant.block_size,
                              variant.has_prefill, interpret=False)
    constexprs = launch.constexprs()
    signature = _signature(variant.dtype) | {name: "constexpr" for name in constexprs}
    kernel = triton.compile(ASTSource(fn=paged_attention_kernel, signature=signature,
                                      constexprs=constexprs),
                            target=GPUTarget("cuda", arch, 32))
    registers, local, shared_static = _resources(kernel.asm["cubin"])
    shared = max(shared_static, kernel.metadata.shared)
    return CompiledVariant(arch, variant, registers, local, shared, kernel.metadata.num_warps)


@dataclass(frozen=True, slots=True)
class OpVariant:
    """One launch of a small-op kernel: ``op`` is ``rms_norm``, ``add_rms_norm``,
    ``silu_and_mul`` or ``rope``; ``size`` the hidden size (norms), the width (SiLU) or
    ``(heads, kv_heads, head_dim)`` (RoPE)."""

    op: str
    dtype: str
    size: int | tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class CompiledOp:
    arch: int
    variant: OpVariant
    registers: int
    spilled_bytes: int
    shared_bytes: int
    num_warps: int


OP_VARIANTS = tuple(
    OpVariant(op, dtype, size)
    for dtype in ("float16", "bfloat16", "float32")
    for op, sizes in (("rms_norm", (576, 4096, 8192)), ("add_rms_norm", (576, 4096, 8192)),
                      ("silu_and_mul", (1536,)), ("rope", ((9, 3, 64), (32, 8, 128))))
    for size in sizes
)


def _op_launch(variant: OpVariant):
    """(kernel, signature, constexprs, num_warps) of a small-op variant."""
    from engine_worker.backends import triton_ops as ops

    t = "*" + _TYPES[getattr(torch, variant.dtype)]
    if variant.op in ("rms_norm", "add_rms_norm"):
        block, warps = ops.norm_launch(variant.size)
        sig = {"out_ptr": t, "x_ptr": t, "res_in_ptr": t, "res_out_ptr": t, "w_ptr": t,
               "stride_out": "i32", "stride_x": "i32", "stride_res_in": "i32",
               "stride_res_out": "i32", "n_cols": "i32", "eps": "fp32"}
        constexprs = {"ADD_RESIDUAL": variant.op == "add_rms_norm", "BLOCK": block}
        return ops.rms_norm_kernel, sig, constexprs, warps
    if variant.op == "silu_and_mul":
        sig = {"out_ptr": t, "x_ptr": t, "stride_out": "i32", "stride_x": "i32", "width": "i32"}
        return ops.silu_and_mul_kernel, sig, {"BLOCK": ops.SILU_BLOCK}, 4
    heads, kv_heads, head_dim = variant.size
    sig = {"q_ptr": t, "k_ptr": t, "positions_ptr": "*i64", "cos_ptr": "*fp32",
           "sin_ptr": "*fp32", "stride_q_tok": "i32", "stride_q_head": "i32",
           "stride_k_tok": "i32", "stride_k_head": "i32", "stride_cos": "i32"}
    return ops.rope_kernel, sig, ops.rope_launch(heads, kv_heads, head_dim), 4


def compile_op(variant: OpVariant, arch: int) -> CompiledOp:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel_fn, signature, constexprs, warps = _op_launch(variant)
    signature = signature | {name: "constexpr" for name in constexprs}
    kernel = triton.compile(ASTSource(fn=kernel_fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    registers, local, shared_static = _resources(kernel.asm["cubin"])
    shared = max(shared_static, kernel.metadata.shared)
    return CompiledOp(arch, variant, registers, local, shared, kernel.metadata.num_warps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    parser.add_argument("--json", action="store_true", help="one JSON object per variant")
    args = parser.parse_args(argv)
    for arch in args.arch:
        for variant in VARIANTS:
            result = compile_variant(variant, arch)
            if args.json:
                print(json.dumps(asdict(result)), flush=True)
            else:
                v = variant
                print(f"sm_{arch} {v.dtype:8} heads {v.num_heads}/{v.num_kv_heads} "
                      f"d{v.head_dim} block {v.block_size} {'prefill' if v.has_prefill else 'decode'}"
                      f": {result.registers} regs, {result.spilled_bytes} B local, "
                      f"{result.shared_bytes} B shared, {result.num_warps} warps", flush=True)
        for op in OP_VARIANTS:
            result = compile_op(op, arch)
            if args.json:
                print(json.dumps(asdict(result)), flush=True)
            else:
                print(f"sm_{arch} {op.dtype:8} {op.op} {op.size}: {result.registers} regs, "
                      f"{result.spilled_bytes} B local, {result.shared_bytes} B shared, "
                      f"{result.num_warps} warps", flush=True)


if __name__ == "__main__":
    main()
