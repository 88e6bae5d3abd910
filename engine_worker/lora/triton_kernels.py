"""Triton kernels of the batched LoRA pair for the GPU path (bgmv-style: one program per token
and output tile, the token's adapter slot read inside the kernel, so one launch serves every
adapter of the step and the host never reads the device).

    shrink: h[t, r] = sum_k A[slot[t], r, k] * x[t, k]     grid (T, cdiv(R, BLOCK_R))
    expand: y[t, n] += sum_r B[slot[t], n, r] * h[t, r]    grid (T, cdiv(N, BLOCK_N))

Tokens whose slot is 0 or less (the base model) write zeros (shrink) or return at once
(expand), so ``h`` needs no zero-fill launch of its own. Products are summed in fp32
with ``tl.sum`` (no ``tl.dot``: a token's row is one vector, and the ranks are small). The
reference is ``engine_worker/lora/ops.py``; tests run these kernels under TRITON_INTERPRET=1
on the CPU against it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, h_ptr, K, R,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot <= 0:
        tl.store(h_ptr + t * R + rows, acc.to(h_ptr.dtype.element_ty), mask=rows < R)
        return
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * K + cols, mask=cols < K, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * R * K + rows[:, None] * K + cols[None, :],
                    mask=(rows[:, None] < R) & (cols[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + t * R + rows, acc.to(h_ptr.dtype.element_ty), mask=rows < R)


@triton.jit
def _expand_kernel(y_ptr, h_ptr, b_ptr, slots_ptr, N, R, y_stride,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    if slot <= 0:
        return
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        ranks = r0 + tl.arange(0, BLOCK_R)
        h = tl.load(h_ptr + t * R + ranks, mask=ranks < R, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + slot * N * R + outs[:, None] * R + ranks[None, :],
                    mask=(outs[:, None] < N) & (ranks[None, :] < R), other=0.0).to(tl.float32)
        acc += tl.sum(b * h[None, :], axis=1)
    y = tl.load(y_ptr + t * y_stride + outs, mask=outs < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * y_stride + outs, (y + acc).to(y_ptr.dtype.element_ty), mask=outs < N)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor,
                block_r: int = 16, block_k: int = 64) -> torch.Tensor:
    """h [T, R] (rows of base tokens zero). A ``torch.ops.quire_triton`` custom op with a fake
    implementation, so the "no host reads" check (FakeTensorMode) sees through it."""
    x, a = x.contiguous(), a.contiguous()
    h = torch.empty(x.shape[0], a.shape[1], dtype=x.dtype, device=x.device)
    _shrink_op(h, x, a, token_slots, block_r, block_k)
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
                block_n: int = 64, block_r: int = 16) -> None:
    """y [T, N] += h @ B[slot].T per token, in place (rows of base tokens untouched)."""
    assert y.stride(1) == 1, "y's rows must be contiguous"
    _expand_op(y, h.contiguous(), b.contiguous(), token_slots, block_n, block_r)


@torch.library.custom_op("quire_triton::lora_shrink", mutates_args=("h",))
def _shrink_op(h: torch.Tensor, x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor,
               block_r: int, block_k: int) -> None:
    tokens, rank, k = x.shape[0], a.shape[1], a.shape[2]
    if tokens:
        _shrink_kernel[(tokens, triton.cdiv(rank, block_r))](
            x, a, token_slots, h, k, rank, BLOCK_R=block_r, BLOCK_K=block_k)


@_shrink_op.register_fake
def _(h, x, a, token_slots, block_r, block_k) -> None:
    return None


@torch.library.custom_op("quire_triton::lora_expand", mutates_args=("y",))
def _expand_op(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
               block_n: int, block_r: int) -> None:
    tokens, n, rank = y.shape[0], b.shape[1], b.shape[2]
    if tokens:
        _expand_kernel[(tokens, triton.cdiv(n, block_n))](
            y, h, b, token_slots, n, rank, y.stride(0), BLOCK_N=block_n, BLOCK_R=block_r)


@_expand_op.register_fake
def _(y, h, b, token_slots, block_n, block_r) -> None:
    return None
