"""Triton kernels for the small ops of a decoder layer: RMSNorm (alone, and fused with the
residual add before it, vLLM's ``fused_add_rms_norm``), SiLU-and-mul, and NeoX rotary
embedding in place on q and k.

On a GPU each of these is one launch where the reference (``layers.norm`` /
``layers.activation`` / ``layers.rotary``) runs several elementwise, reduce and cat kernels; a
decode step of a small model is mostly such launches. Every kernel reads in the tensor's
dtype, computes in fp32 and rounds where the reference rounds (the normalised row before the
weight, the SiLU before the product), so the results match it to the dtype's last bits.

Graph-safe: the grids come from host-side shapes only and nothing reads a device value on the
host (positions are loaded inside the rotary kernel). The kernels run as torch custom ops
(``torch.ops.quire_triton.*``) writing into their mutated arguments, whose fake
implementations let ``FakeTensorMode`` (tests/unit/model_runner/test_graphs.py) see through
them. Launch choices (block and warps) are functions of the shape, shared with
``attention/triton_aot.py``, which compiles the kernels for sm_80 / sm_90 without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine_worker.layers.activation import silu_and_mul as reference_silu_and_mul
from engine_worker.layers.norm import rms_norm as reference_rms_norm
from engine_worker.layers.rotary import apply_rope as reference_rope

# columns of the gate/up product one SiLU-and-mul program covers
SILU_BLOCK = 1024


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def norm_launch(hidden_size: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of one RMSNorm program, which owns a whole row."""
    block = _pow2(hidden_size)
    return block, min(max(block // 512, 1), 8)


def rope_launch(num_q_heads: int, num_k_heads: int, head_dim: int) -> dict[str, int]:
    """The rotary kernel's constexprs: one program rotates one token's q and k heads."""
    return dict(NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HALF=head_dim // 2,
                BLOCK_HQ=_pow2(num_q_heads), BLOCK_HK=_pow2(num_k_heads),
                BLOCK_D=_pow2(head_dim // 2))


@triton.jit
def rms_norm_kernel(out_ptr, x_ptr, res_in_ptr, res_out_ptr, w_ptr,
                    stride_out, stride_x, stride_res_in, stride_res_out, n_cols, eps,
                    ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One row: (with ADD_RESIDUAL: ``res_out = x + res_in``, rounded, then that row is the
    input) ``out = w * round(input * rsqrt(mean(input^2) + eps))``. ``res_in`` and
    ``res_out`` may be one tensor: each element is loaded and stored by the same thread."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        r = tl.load(res_in_ptr + row * stride_res_in + cols, mask=mask, other=0.0)
        s = (x + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, s, mask=mask)
        x = s.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.rsqrt(mean_square + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols,
             (normed.to(tl.float32) * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_and_mul_kernel(out_ptr, x_ptr, stride_out, stride_x, width, BLOCK: tl.constexpr):
    """``out[:, c] = round(silu(x[:, c])) * x[:, width + c]`` over one row's column block."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _rotate_heads(base_ptr, stride_head, cos, sin, NUM_HEADS: tl.constexpr,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_HEADS) & (d[None, :] < HALF)
    first = base_ptr + heads[:, None] * stride_head + d[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    # NeoX: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
    tl.store(first, (x1 * cos[None, :] - x2 * sin[None, :]).to(base_ptr.dtype.element_ty),
             mask=mask)
    tl.store(first + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(base_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def rope_kernel(q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr,
                stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_cos,
                NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token's q and k heads rotated in place by its position's row of the fp32 tables
    (``[max_position, head_dim]``, both halves equal: the first half is read)."""
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    cos = tl.load(cos_ptr + pos * stride_cos + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + d, mask=d < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + tok * stride_q_tok, stride_q_head, cos, sin, NUM_Q_HEADS, HALF,
                  BLOCK_HQ, BLOCK_D)
    _rotate_heads(k_ptr + tok * stride_k_tok, stride_k_head, cos, sin, NUM_K_HEADS, HALF,
                  BLOCK_HK, BLOCK_D)


# ---- launches (custom ops: they write into their mutated arguments) ----

@torch.library.custom_op("quire_triton::rms_norm", mutates_args=("out", "residual"))
def _rms_norm_op(out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                 weight: torch.Tensor, eps: float) -> None:
    # residual, where given, is updated in place: residual += x, and out = norm(residual)
    rows, hidden = x.shape
    if rows == 0:
        return
    block, warps = norm_launch(hidden)
    res = x if residual is None else residual
    rms_norm_kernel[(rows,)](out, x, res, res, weight, out.stride(0), x.stride(0),
                             res.stride(0), res.stride(0), hidden, eps,
                             ADD_RESIDUAL=residual is not None, BLOCK=block, num_warps=warps)


@_rms_norm_op.register_fake
def _(out, x, residual, weight, eps) -> None:
    return None


@torch.library.custom_op("quire_triton::silu_and_mul", mutates_args=("out",))
def _silu_and_mul_op(out: torch.Tensor, x: torch.Tensor) -> None:
    rows, width = out.shape
    if rows == 0:
        return
    silu_and_mul_kernel[(rows, triton.cdiv(width, SILU_BLOCK))](
        out, x, out.stride(0), x.stride(0), width, BLOCK=SILU_BLOCK, num_warps=4)


@_silu_and_mul_op.register_fake
def _(out, x) -> None:
    return None


@torch.library.custom_op("quire_triton::rope", mutates_args=("q", "k"))
def _rope_op(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> None:
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    rope_kernel[(num_tokens,)](q, k, positions, cos, sin, q.stride(0), q.stride(1),
                               k.stride(0), k.stride(1), cos.stride(0),
                               **rope_launch(num_q_heads, k.shape[1], head_dim), num_warps=4)


@_rope_op.register_fake
def _(positions, q, k, cos, sin) -> None:
    return None


# ---- the backend's ops (the reference where a tensor's layout is not the kernel's) ----

def _rows(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [num_tokens, hidden_size] -> a new [num_tokens, hidden_size]
    if not _rows(x) or weight.dtype != x.dtype or not weight.is_contiguous():
        return reference_rms_norm(x, weight, eps)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    torch.ops.quire_triton.rms_norm(out, x, None, weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """``residual += x`` in place (rounded to its dtype, as ``residual + x`` would be), and
    RMSNorm of the sum as a new tensor: one launch for the pre-norm layer's add and norm."""
    if not (_rows(x) and _rows(residual)) or weight.dtype != x.dtype \
            or residual.dtype != x.dtype or not weight.is_contiguous():
        residual.add_(x)
        return reference_rms_norm(residual, weight, eps)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    torch.ops.quire_triton.rms_norm(out, x, residual, weight, eps)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [num_tokens, 2 * intermediate_size] -> [num_tokens, intermediate_size]
    if not _rows(gate_up) or gate_up.shape[1] % 2:
        return reference_silu_and_mul(gate_up)
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    torch.ops.quire_triton.silu_and_mul(out, gate_up)
    return out


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q and k (views into the step's fused QKV output), which it returns."""
    # q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or q.shape[-1] % 2 or cos.stride(-1) != 1 \
            or sin.stride() != cos.stride() or sin.dtype != cos.dtype or k.dtype != q.dtype:
        return reference_rope(positions, q, k, cos, sin)
    torch.ops.quire_triton.rope(positions, q, k, cos, sin)
    return q, k
