"""Triton kernels for the GPU step: varlen paged attention and the K/V cache write.

One attention launch covers the whole step, decodes and prefill chunks together, in
flash-attention's varlen layout (``query_start_loc``, ``seq_lens``, block tables).

Work split. A program owns one kv head and a *query tile*: ``BLOCK_Q`` consecutive query
tokens of one sequence times every query head of that kv head's GQA group, flattened into
``BLOCK_M = BLOCK_Q * GROUP_P`` rows (``GROUP_P`` the group size rounded up to a power of two),
so each key tile it loads serves the whole group::

    row r of the tile  ->  query token  q_block * BLOCK_Q + r // GROUP_P
                           query head   kv_head * GROUP + r % GROUP_P   (rows past GROUP idle)

Which sequence a program serves is found *inside* the kernel, by a binary search over
``query_start_loc``: sequence ``s`` owns programs ``[qsl[s] // BLOCK_Q + s, qsl[s+1] // BLOCK_Q
+ s + 1)``, at least ``ceil(query_len / BLOCK_Q)`` of them (programs past the sequence's last
tile return at once). The grid is therefore ``num_tokens // BLOCK_Q + num_seqs`` programs per
kv head, known on the host without reading any device tensor: no host synchronisation.

Keys are walked in tiles of ``TILE_N`` logical positions, independent of the KV block size
(each position's slot comes from the block table), with an online softmax (running max ``m``,
sum ``l`` and an fp32 accumulator). Query row ``i`` of a sequence sits at position
``seq_len - query_len + i`` and sees keys up to and including it.

The reference is ``engine_worker/backends/reference.py``; tests run these kernels under
``TRITON_INTERPRET=1`` on the CPU against it, and compile them for sm_80 / sm_90.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """The sequence whose query tiles include program ``pid`` (largest s with
    qsl[s] // BLOCK_Q + s <= pid)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale, num_seqs,
    stride_q_tok, stride_q_head,  # q and out share one layout: [num_tokens, num_heads, head_dim]
    stride_o_tok, stride_o_head,
    stride_c_block, stride_c_slot, stride_c_head,  # caches: [num_blocks, block_size, kv, d]
    stride_bt_seq,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per program
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # KV block size (tokens)
    TILE_N: tl.constexpr,  # keys per inner iteration
    UPCAST: tl.constexpr,  # compute the dots in fp32 (the interpreter has no bf16 arithmetic)
    IEEE: tl.constexpr,  # fp32 dots in IEEE precision, not TF32
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    query_len = q_end - q_begin
    q_block = pid - (q_begin // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + rows // GROUP_P  # [BLOCK_M] token index within the sequence
    head = kv_head * GROUP + rows % GROUP_P
    row_ok = (q_tok < query_len) & (rows % GROUP_P < GROUP)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM

    # [BLOCK_M, HEAD_DIM_P]
    q_offs = (q_begin + q_tok)[:, None] * stride_q_tok + head[:, None] * stride_q_head + \
        dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)

    # the last position any row of this tile sees, plus one
    last_tok = tl.minimum((q_block + 1) * BLOCK_Q, query_len)
    num_keys = context_len + last_tok
    q_pos = context_len + q_tok  # [BLOCK_M] each row's own position
    table = block_tables_ptr + seq * stride_bt_seq

    for start in range(0, num_keys, TILE_N):
        pos = start + tl.arange(0, TILE_N)  # [TILE_N] logical key positions
        key_ok = pos < num_keys
        block = tl.load(table + pos // BLOCK_SIZE, mask=key_ok, other=0)
        slot_offs = block.to(tl.int64) * stride_c_block + (pos % BLOCK_SIZE) * stride_c_slot + \
            kv_head * stride_c_head
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        # [TILE_N, HEAD_DIM_P]
        k = tl.load(k_cache_ptr + slot_offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + slot_offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale  # [BLOCK_M, TILE_N] fp32
        visible = (pos[None, :] <= q_pos[:, None]) & key_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # rows with nothing visible yet keep m = -inf; keep their arithmetic finite
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if IEEE:
            acc += tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_offs = (q_begin + q_tok)[:, None] * stride_o_tok + head[:, None] * stride_o_head + \
        dims[None, :]
    tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def write_kv_kernel(
    k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, slot_mapping_ptr,
    stride_k_tok, stride_v_tok,  # k, v: [num_tokens, num_kv_heads, head_dim], heads contiguous
    stride_c_block, stride_c_slot,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    ROW_P: tl.constexpr,  # ROW rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,
):
    """One program per new token: its K and V rows into their cache slot. A negative slot
    (a padded row of a captured batch) writes nothing."""
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    cols = tl.arange(0, ROW_P)
    ok = cols < ROW
    dst = (slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_slot + cols
    k = tl.load(k_ptr + tok * stride_k_tok + cols, mask=ok)
    v = tl.load(v_ptr + tok * stride_v_tok + cols, mask=ok)
    tl.store(k_cache_ptr + dst, k, mask=ok)
    tl.store(v_cache_ptr + dst, v, mask=ok)
