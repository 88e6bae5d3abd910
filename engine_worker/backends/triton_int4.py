"""The ``triton`` backend's linear layers: AWQ / GPTQ weights (the int4 group layout of
``weights.int4_layouts``, int32 [N, G, group / 8 + 1]) through the Triton 4-bit kernel
(``triton_int4_kernel.py``), every other weight through ``F.linear`` (cuBLAS on a GPU).

Launch choices are host facts only (shapes and dtypes, ``int4_launch``); under the interpreter
tiles are small (each iteration costs ~10 ms there). bf16 is computed
in fp32 under the interpreter, whose bf16 arithmetic is wrong (FIELD-NOTES).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine_worker.attention.triton_backend import interpreting
from engine_worker.weights.int4_layouts import is_int4_groups


# From here on a launch de-quantizes the whole weight (one Triton pass, in x's dtype) and runs
# cuBLAS on it. Measured on an H100 (300 x 4096 @ 4096 x 4096, fp16): the fused kernel's
# 64 x 64 tiles 235 us, de-quantize + cuBLAS 53 us, cuBLAS on a dense fp16 weight 23 us; below,
# the fused kernel streams the 4-bit weight (decode: 40 us for one row, dense fp16 28 us)
DENSE_ROWS = 32


@dataclass(frozen=True, slots=True)
class Int4Launch:
    """The constexpr choices of one launch; also what the AOT compile builds."""

    group: int
    block_m: int
    block_n: int
    block_k: int
    has_bias: bool
    ieee: bool  # fp32 x: IEEE dots (never TF32)

    def constexprs(self) -> dict[str, int | bool]:
        return {"GROUP": self.group, "BLOCK_M": self.block_m, "BLOCK_N": self.block_n,
                "BLOCK_K": self.block_k, "HAS_BIAS": self.has_bias, "IEEE": self.ieee}


def int4_launch(num_rows: int, group: int, dtype: torch.dtype, has_bias: bool,
                interpret: bool) -> Int4Launch:
    """A whole group a K step for decode (one scale load a row; 128 at most; 64 for more
    rows), 32 under the interpreter;
    decode-sized batches in one 16-row tile over 32-column tiles (more programs than SMs for
    a 4096-wide layer), more rows in 64 x 64 tiles."""
    small = num_rows <= 16 or interpret
    widest = 128 if small else 64  # a 64 x 128 code tile alone fills the registers
    block_k = 32 if interpret else max(d for d in (32, 64, widest) if group % d == 0)
    return Int4Launch(group=group, block_m=16 if small else 64, block_n=32 if small else 64,
                      block_k=block_k, has_bias=has_bias, ieee=dtype == torch.float32)


@dataclass(frozen=True, slots=True)
class Int4GroupsWeight:
    """A weight in the int4 group layout, as the kernel reads it, and its group size."""

    packed: torch.Tensor  # int32 [N, G, group / 8 + 1]
    group: int

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * self.group


def int4_dequantize(weight: Int4GroupsWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as values [N, K] in ``dtype`` (each (code - zero) * scale in fp32, rounded)."""
    from engine_worker.backends.triton_int4_kernel import int4_dequantize_kernel

    n, k = weight.out_features, weight.in_features
    out = torch.empty((n, k), dtype=dtype, device=weight.packed.device)
    block_k = 32 if interpreting() else max(d for d in (32, 64, 128) if weight.group % d == 0)
    block_n = 32
    int4_dequantize_kernel[(triton_cdiv(n, block_n), k // block_k)](
        weight.packed, out, n, k, GROUP=weight.group, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def int4_linear(x: torch.Tensor, weight: Int4GroupsWeight,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (fp16 / bf16 / fp32) @ W^T (+ bias) -> [M, N] in x's dtype."""
    from engine_worker.backends.triton_int4_kernel import int4_linear_kernel

    interpret = interpreting()
    if x.shape[0] >= DENSE_ROWS and not interpret:
        return F.linear(x, int4_dequantize(weight, x.dtype), bias)
    out_dtype = x.dtype
    if interpret and x.dtype == torch.bfloat16:
        x = x.float()
    x = x.contiguous()
    m, k = x.shape
    if k != weight.in_features:
        raise ValueError(f"int4 linear: x has {k} columns, the weight {weight.in_features}")
    n = weight.out_features
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.to(out_dtype)
    launch = int4_launch(m, weight.group, x.dtype, bias is not None, interpret)
    grid = (triton_cdiv(n, launch.block_n), triton_cdiv(m, launch.block_m))
    int4_linear_kernel[grid](x, weight.packed, bias if bias is not None else out, out, m, n, k,
                             x.stride(0), out.stride(0), **launch.constexprs())
    return out.to(out_dtype)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pack_weight(weight: torch.Tensor, dense: torch.Tensor | None = None
                ) -> Int4GroupsWeight | None:
    """Once per weight at load: the int4 group layout as the kernel takes it, else None."""
    if not is_int4_groups(weight):
        return None
    return Int4GroupsWeight(weight.detach().contiguous(), (weight.shape[2] - 1) * 8)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: Any) -> torch.Tensor:
    # x: [num_tokens, in_features] -> [num_tokens, out_features]
    if isinstance(packed, Int4GroupsWeight):
        return int4_linear(x, packed, bias)
    return F.linear(x, weight, bias)
