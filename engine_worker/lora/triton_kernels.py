"""Triton kernels of the batched LoRA pair for the GPU path (bgmv-style: one program per token
and output tile, the token's adapter slot read inside the kernel, so one launch serves every
adapter of the step and the host never reads the device).

    shrink: h[t, r] = sum_k A[slot[t], r, k] * x[t, k]     grid (T, cdiv(R, BLOCK_R))
    expand: y[t, n] += sum_r B[slot[t], n, r] * h[t, r]    grid (T, cdiv(N, BLOCK_N))

Tokens whose slot is 0 or less (the base model) return at once. Products are summed in fp32
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
    if slot <= 0:
        return
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
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
    x, a = x.contiguous(), a.contiguous()
    tokens, rank, k = x.shape[0], a.shape[1], a.shape[2]
    h = torch.zeros(tokens, rank, dtype=x.dtype, device=x.device)
    if tokens:
        _shrink_kernel[(tokens, triton.cdiv(rank, block_r))](
            x, a, token_slots, h, k, rank, BLOCK_R=block_r, BLOCK_K=block_k)
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
                block_n: int = 64, block_r: int = 16) -> None:
    assert y.stride(1) == 1, "y's rows must be contiguous"
    h, b = h.contiguous(), b.contiguous()
    tokens, n, rank = y.shape[0], b.shape[1], b.shape[2]
    if tokens:
        _expand_kernel[(tokens, triton.cdiv(n, block_n))](
            y, h, b, token_slots, n, rank, y.stride(0), BLOCK_N=block_n, BLOCK_R=block_r)
