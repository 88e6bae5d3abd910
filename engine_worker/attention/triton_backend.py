"""Paged attention through the Triton kernels (``triton_kernels.py``): the GPU default.

One cache-write launch and one attention launch per layer, whatever mix of decodes and prefill
chunks the step holds. Launch shapes come from host-side facts only (tensor shapes and the
metadata's host ints), so a step never waits on the device to size a grid. Under
``TRITON_INTERPRET=1`` the same kernels run on CPU tensors, which is how the tests check them
without a GPU. The reference is ``TorchAttentionBackend``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine_worker.attention.metadata import AttentionMetadata


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def interpreting() -> bool:
    """True where Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True, slots=True)
class AttentionLaunch:
    """The constexpr choices of one attention launch; also what the AOT compile test builds."""

    group: int  # query heads per kv head
    head_dim: int
    block_size: int
    block_m: int  # rows of a query tile: BLOCK_Q tokens x the padded group
    tile_n: int  # keys per inner iteration
    upcast: bool  # compute in fp32 (bf16 under the interpreter)
    ieee: bool  # fp32 dots in IEEE precision

    @property
    def group_p(self) -> int:
        return _pow2(self.group)

    @property
    def block_q(self) -> int:
        return self.block_m // self.group_p

    def constexprs(self) -> dict[str, int | bool]:
        return {"GROUP": self.group, "GROUP_P": self.group_p, "BLOCK_Q": self.block_q,
                "HEAD_DIM": self.head_dim, "HEAD_DIM_P": _pow2(max(self.head_dim, 16)),
                "BLOCK_SIZE": self.block_size, "TILE_N": self.tile_n, "UPCAST": self.upcast,
                "IEEE": self.ieee}


def attention_launch(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                     block_size: int, has_prefill: bool, interpret: bool) -> AttentionLaunch:
    """Tiles: 16 rows (the smallest ``tl.dot``) for decode-only steps, 64 with prefill on a GPU;
    keys in tiles of 32 under the interpreter (each iteration costs ~10 ms there), 64 on a GPU."""
    group = num_heads // num_kv_heads
    block_m = max(64 if has_prefill and not interpret else 16, _pow2(group))
    return AttentionLaunch(
        group=group, head_dim=head_dim, block_size=block_size, block_m=block_m,
        tile_n=32 if interpret else 64,
        upcast=dtype == torch.float32 or (interpret and dtype == torch.bfloat16),
        ieee=dtype == torch.float32)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, heads, head_dim]; each token's heads * head_dim values adjacent
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def triton_write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Store the step's new keys and values at their slots (negative slots are skipped)."""
    from engine_worker.attention.triton_kernels import write_kv_kernel

    # kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; k, v: [num_tokens, kv, d]
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    # the kernel reads a token's heads as one row: views into the fused QKV output qualify
    # as they are (no copy kernel), anything else is copied
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    row = k.shape[1] * k.shape[2]
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    write_kv_kernel[(num_tokens,)](
        key_cache, value_cache, k, v, slot_mapping, k.stride(0), v.stride(0),
        key_cache.stride(0), key_cache.stride(1), ROW=row, ROW_P=_pow2(row),
        BLOCK_SIZE=kv_cache.shape[2])


class TritonAttentionBackend:
    """Stateless; one instance serves every layer. The kernels are called as torch custom ops
    (``torch.ops.quire_triton.*``) whose fake implementations let ``FakeTensorMode`` and graph
    capture see through them."""

    name = "triton"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        torch.ops.quire_triton.write_kv(kv_cache, k, v, meta.slot_mapping)
        out = q.new_empty(q.shape)  # contiguous, whatever q's strides
        # the kernel takes q's token and head strides: a view into the QKV output needs no copy
        q = q if q.stride(2) == 1 else q.contiguous()
        torch.ops.quire_triton.paged_attention(out, q, kv_cache, meta.block_tables,
                                               meta.query_start_loc, meta.seq_lens, scale,
                                               bool(meta.prefills))
        return out


def paged_attention(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, has_prefill: bool = True) -> None:
    """Varlen paged attention of the step's queries into ``out`` (same shape as ``q``)."""
    from engine_worker.attention.triton_kernels import paged_attention_kernel

    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    launch = attention_launch(q.dtype, num_heads, num_kv_heads, head_dim, block_size,
                              has_prefill, interpreting())
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    assert q.stride(2) == 1 and out.stride(2) == 1 and key_cache.stride(3) == 1
    grid = (num_tokens // launch.block_q + num_seqs, num_kv_heads)
    paged_attention_kernel[grid](
        out, q, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
        scale, num_seqs, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        **launch.constexprs())


# The kernels as torch custom ops: the fake implementations (they only write into their
# mutated arguments, so there is nothing to compute) are what FakeTensorMode runs.
@torch.library.custom_op("quire_triton::write_kv", mutates_args=("kv_cache",))
def _write_kv_op(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    triton_write_kv(kv_cache, k, v, slot_mapping)


@_write_kv_op.register_fake
def _(kv_cache, k, v, slot_mapping) -> None:
    return None


@torch.library.custom_op("quire_triton::paged_attention", mutates_args=("out",))
def _paged_attention_op(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, has_prefill: bool) -> None:
    paged_attention(out, q, kv_cache, block_tables, query_start_loc, seq_lens, scale,
                    has_prefill)


@_paged_attention_op.register_fake
def _(out, q, kv_cache, block_tables, query_start_loc, seq_lens, scale, has_prefill) -> None:
    return None
