// Prefill attention on bf16 Q/K/V with AVX-512 BF16 dot products: a tile of query positions
// of one kv head (its GQA group's rows) against the keys they see, online softmax.
//
// Prefill is compute-bound. The keys and values the tile sees are laid out once per tile, in
// chunks of 32 keys, for every row to stream:
//   keys as bf16 pairs over dimensions, key-major within a pair: k[c][i][j] = (k_j[2i], k_j[2i+1]),
//     so one vdpbf16ps with a broadcast query pair adds two dimensions to 16 scores at once;
//   values as pairs over keys: the 16-bit interleave of rows j and j+1 (as in decode_bf16.h),
//     so one vdpbf16ps with a broadcast probability pair adds two keys to 16 dimensions.
// Rows then go a few at a time (6 at head_dim 64) through every chunk with their output
// accumulators in registers, never stored between chunks; 32 keys a chunk halve the softmax
// bookkeeping (max, sum, rescale) per key against 16.
// The interleave permutes dimensions within 128-bit lanes; store_slice() undoes it at the end.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "decode_bf16.h"
#include "vec.h"

namespace QUIRE_NS::prefill_bf16 {

constexpr int kKeys = 32;  // keys per chunk: two zmm of scores per query row
// How far (base 2) a score may pass a row's softmax reference before the reference moves.
constexpr float kSlack = 8.f;
// Query positions per work item, as on AMX tiles: each item lays out every key it sees, so
// 32 positions spent a fifth of the work packing (2-core Zen 5, 16 prompts of 512 tokens,
// SmolLM2's heads: 18.4 ms against 14.6 with 128, the same output bit for bit).
constexpr int64_t kPositionsPerItem = 128;

// The keys and values a tile sees, laid out once per tile for every row of it to stream:
//   k: [chunk][d / 2][32 keys] dimension pairs (uint32), missing keys 0;
//   v: [chunk][16 key pairs][d / 32][lo, hi] interleaved rows of keys 2j and 2j + 1.
struct Packed {
  std::vector<uint32_t> k;
  std::vector<__m512i> v;
};

inline void pack(const at::BFloat16* keys, const at::BFloat16* values, const int64_t* offsets,
                 int64_t num_keys, int64_t d, Packed& pk) {
  alignas(64) static const at::BFloat16 zeros[256] = {};
  const int64_t chunks = (num_keys + kKeys - 1) / kKeys, pairs = d / 2, nz = d / 32;
  pk.k.resize(chunks * pairs * kKeys);
  pk.v.resize(chunks * (kKeys / 2) * nz * 2);
  for (int64_t c = 0; c < chunks; ++c) {
    uint32_t* kc = pk.k.data() + c * pairs * kKeys;
    __m512i* vc = pk.v.data() + c * (kKeys / 2) * nz * 2;
    const at::BFloat16* vrow[kKeys];
    for (int j = 0; j < kKeys; ++j) {
      const int64_t p = c * kKeys + j;
      const uint32_t* k = reinterpret_cast<const uint32_t*>(p < num_keys ? keys + offsets[p]
                                                                         : zeros);
      for (int64_t i = 0; i < pairs; ++i) kc[i * kKeys + j] = k[i];
      vrow[j] = p < num_keys ? values + offsets[p] : zeros;
    }
    for (int jp = 0; jp < kKeys / 2; ++jp)
      for (int64_t z = 0; z < nz; ++z) {
        const __m512i v0 = _mm512_loadu_si512(vrow[2 * jp] + 32 * z);
        const __m512i v1 = _mm512_loadu_si512(vrow[2 * jp + 1] + 32 * z);
        vc[(jp * nz + z) * 2] = _mm512_unpacklo_epi16(v0, v1);
        vc[(jp * nz + z) * 2 + 1] = _mm512_unpackhi_epi16(v0, v1);
      }
  }
}

// RB query rows against every key they see, their accumulators held in registers from the
// first chunk to the last: per chunk, scores (Q K^T), an online-softmax step, P @ V.
// q[r] / out[r]: the rows (bf16 [D]); pos[r]: the last key row r sees.
template <int D, int RB>
void rows_block(const at::BFloat16* const* q, at::BFloat16* const* out, const int64_t* pos,
                float scale, const Packed& pk) {
  constexpr int NZ = D / 32, PAIRS = D / 2;
  __m512 lo[RB][NZ], hi[RB][NZ];
  // per row: the reference m of its probabilities (base 2) and their per-lane partial sums
  float m[RB];
  __m512 l[RB];
  int64_t last = 0;
  for (int r = 0; r < RB; ++r) {
    for (int z = 0; z < NZ; ++z) lo[r][z] = hi[r][z] = _mm512_setzero_ps();
    m[r] = -INFINITY;
    l[r] = _mm512_setzero_ps();
    last = std::max(last, pos[r]);
  }
  // in base 2: scores times scale * log2(e), so each probability is one exp2_neg
  const __m512 vscale = _mm512_set1_ps(scale * 1.44269504088896341f);
  for (int64_t c = 0; c * kKeys <= last; ++c) {
    const uint32_t* kc = pk.k.data() + c * PAIRS * kKeys;
    // two chains per score vector (even and odd dimension pairs) hide the dot product latency
    __m512 s0[RB], s1[RB], t0[RB], t1[RB];
    for (int r = 0; r < RB; ++r) s0[r] = s1[r] = t0[r] = t1[r] = _mm512_setzero_ps();
    for (int i = 0; i < PAIRS; i += 2) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kc + i * kKeys);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kc + i * kKeys + 16);
      const __m512bh k2 = (__m512bh)_mm512_loadu_si512(kc + (i + 1) * kKeys);
      const __m512bh k3 = (__m512bh)_mm512_loadu_si512(kc + (i + 1) * kKeys + 16);
      for (int r = 0; r < RB; ++r) {
        const uint32_t* qp = reinterpret_cast<const uint32_t*>(q[r]);
        const __m512bh qa = (__m512bh)_mm512_set1_epi32(int(qp[i]));
        const __m512bh qb = (__m512bh)_mm512_set1_epi32(int(qp[i + 1]));
        s0[r] = _mm512_dpbf16_ps(s0[r], qa, k0);
        s1[r] = _mm512_dpbf16_ps(s1[r], qa, k1);
        t0[r] = _mm512_dpbf16_ps(t0[r], qb, k2);
        t1[r] = _mm512_dpbf16_ps(t1[r], qb, k3);
      }
    }
    alignas(64) uint32_t pairs[RB][16];
    for (int r = 0; r < RB; ++r) {
      const int64_t visible = pos[r] + 1 - c * kKeys;
      const __mmask16 live0 = simd::lanes_below(visible), live1 = simd::lanes_below(visible - 16);
      const __m512 ninf = _mm512_set1_ps(-INFINITY);
      const __m512 a = _mm512_mask_mul_ps(ninf, live0, _mm512_add_ps(s0[r], t0[r]), vscale);
      const __m512 b = _mm512_mask_mul_ps(ninf, live1, _mm512_add_ps(s1[r], t1[r]), vscale);
      // The reference moves only when a score passes it by more than kSlack: probabilities
      // up to 2^kSlack are exact enough in fp32 and bf16 alike, and most chunks then skip
      // the horizontal max and the rescale (the first chunk always takes them: m = -inf).
      const __m512 top = _mm512_max_ps(a, b);
      if (_mm512_cmp_ps_mask(top, _mm512_set1_ps(m[r] + kSlack), _CMP_GT_OQ)) {
        const float m_new = _mm512_reduce_max_ps(top);
        const __m512 av = _mm512_set1_ps(std::exp2(m[r] - m_new));  // 0 on the first chunk
        for (int z = 0; z < NZ; ++z) {
          lo[r][z] = _mm512_mul_ps(lo[r][z], av);
          hi[r][z] = _mm512_mul_ps(hi[r][z], av);
        }
        l[r] = _mm512_mul_ps(l[r], av);
        m[r] = m_new;
      }
      const __m512 mv = _mm512_set1_ps(m[r]);
      const __m512 p0 = _mm512_maskz_mov_ps(live0, simd::exp2_neg(_mm512_sub_ps(a, mv)));
      const __m512 p1 = _mm512_maskz_mov_ps(live1, simd::exp2_neg(_mm512_sub_ps(b, mv)));
      l[r] = _mm512_add_ps(l[r], _mm512_add_ps(p0, p1));
      const __m512bh pb = _mm512_cvtne2ps_pbh(p1, p0);  // keys 0..15 low, 16..31 high
      _mm512_store_si512(pairs[r], (__m512i)pb);
    }
    const __m512i* vc = pk.v.data() + c * (kKeys / 2) * NZ * 2;
    for (int jp = 0; jp < kKeys / 2; ++jp) {
      __m512bh pp[RB];
      for (int r = 0; r < RB; ++r) pp[r] = (__m512bh)_mm512_set1_epi32(int(pairs[r][jp]));
      for (int z = 0; z < NZ; ++z) {
        const __m512bh vl = (__m512bh)vc[(jp * NZ + z) * 2];
        const __m512bh vh = (__m512bh)vc[(jp * NZ + z) * 2 + 1];
        for (int r = 0; r < RB; ++r) {
          lo[r][z] = _mm512_dpbf16_ps(lo[r][z], vl, pp[r]);
          hi[r][z] = _mm512_dpbf16_ps(hi[r][z], vh, pp[r]);
        }
      }
    }
  }
  for (int r = 0; r < RB; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(l[r]));
    for (int z = 0; z < NZ; ++z)
      decode_bf16::store_slice(lo[r][z], hi[r][z], inv, out[r] + 32 * z);
  }
}

// Rows as many at a time as the score and output accumulators allow without starving the
// dot products' chains (2-core Zen 5, 16 prompts of 512 tokens: head_dim 64 at 6 rows 8.5 ms
// against 10.0 at 4; head_dim 128 at 4 rows 31.5 against 42.8 at 2; head_dim 256 at 2 rows
// 9.6 against 14.8 at 1, 256-token prompts); the rest in half blocks, then one by one.
template <int D>
void rows_all(int64_t num_rows, const at::BFloat16* const* q, at::BFloat16* const* out,
              const int64_t* pos, float scale, const Packed& pk) {
  constexpr int RB = D <= 64 ? 6 : D <= 128 ? 4 : 2, HALF = RB / 2;
  int64_t r = 0;
  for (; r + RB <= num_rows; r += RB) rows_block<D, RB>(q + r, out + r, pos + r, scale, pk);
  if constexpr (HALF > 1) {
    for (; r + HALF <= num_rows; r += HALF)
      rows_block<D, HALF>(q + r, out + r, pos + r, scale, pk);
  }
  for (; r < num_rows; ++r) rows_block<D, 1>(q + r, out + r, pos + r, scale, pk);
}

// One tile: positions first_pos .. first_pos + num_pos - 1 of one kv head, `group` heads each;
// q_row(i, g) and out_row(i, g) give the bf16 rows; key p's rows are keys / values + offsets[p].
template <typename QAt, typename OutAt>
void attend_tile(QAt q_row, OutAt out_row, int64_t num_pos, int64_t group, int64_t d,
                 int64_t first_pos, float scale, const at::BFloat16* keys,
                 const at::BFloat16* values, const int64_t* offsets) {
  thread_local Packed pk;
  pack(keys, values, offsets, first_pos + num_pos, d, pk);
  const int64_t num_rows = num_pos * group;
  thread_local std::vector<const at::BFloat16*> q;
  thread_local std::vector<at::BFloat16*> out;
  thread_local std::vector<int64_t> pos;
  q.resize(num_rows);
  out.resize(num_rows);
  pos.resize(num_rows);
  for (int64_t r = 0; r < num_rows; ++r) {  // rows by position, then head: causal limits rise
    q[r] = q_row(r / group, r % group);
    out[r] = out_row(r / group, r % group);
    pos[r] = first_pos + r / group;
  }
  switch (d) {
    case 32: rows_all<32>(num_rows, q.data(), out.data(), pos.data(), scale, pk); break;
    case 64: rows_all<64>(num_rows, q.data(), out.data(), pos.data(), scale, pk); break;
    case 96: rows_all<96>(num_rows, q.data(), out.data(), pos.data(), scale, pk); break;
    case 128: rows_all<128>(num_rows, q.data(), out.data(), pos.data(), scale, pk); break;
    case 160: rows_all<160>(num_rows, q.data(), out.data(), pos.data(), scale, pk); break;
    case 192: rows_all<192>(num_rows, q.data(), out.data(), pos.data(), scale, pk); break;
    case 224: rows_all<224>(num_rows, q.data(), out.data(), pos.data(), scale, pk); break;
    default: rows_all<256>(num_rows, q.data(), out.data(), pos.data(), scale, pk); break;
  }
}

}  // namespace QUIRE_NS::prefill_bf16
