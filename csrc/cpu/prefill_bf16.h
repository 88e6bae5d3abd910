// Prefill attention on bf16 Q/K/V with AVX-512 BF16 dot products: a tile of query positions
// of one kv head (its GQA group's rows) against the keys, 16 at a time, online softmax.
//
// Prefill is compute-bound, so each chunk of 16 keys is re-laid out once for every row of the
// tile to reuse:
//   keys as bf16 pairs over dimensions, key-major within a pair: kp[c][j] = (k_j[2c], k_j[2c+1]),
//     so one vdpbf16ps with a broadcast query pair adds two dimensions to 16 scores at once;
//   values as pairs over keys: the 16-bit interleave of rows j and j+1 (as in decode_bf16.h),
//     so one vdpbf16ps with a broadcast probability pair adds two keys to 16 dimensions.
// The interleave permutes dimensions within 128-bit lanes; lane_dim() undoes it on the way out.
#pragma once

#ifdef __AVX512BF16__

#include <immintrin.h>

#include <cstring>
#include <vector>

#include "decode_bf16.h"
#include "vec.h"

namespace quire::prefill_bf16 {

using decode_bf16::lane_dim;

struct Chunk {
  alignas(64) uint32_t kp[128][16];    // [d / 2][16 keys]
  alignas(64) __m512i vlo[8][8];       // [key pair][d / 32]
  alignas(64) __m512i vhi[8][8];
};

// Lay out keys and values at `rows` (count of them, the rest zero) for the tile.
inline void pack_chunk(const at::BFloat16* const* krow, const at::BFloat16* const* vrow,
                       int count, int64_t d, Chunk& c) {
  const int64_t pairs = d / 2;
  for (int j = 0; j < 16; ++j) {
    const uint32_t* k = reinterpret_cast<const uint32_t*>(krow[j]);
    for (int64_t i = 0; i < pairs; ++i) c.kp[i][j] = j < count ? k[i] : 0u;
  }
  for (int jp = 0; jp < 8; ++jp)
    for (int64_t z = 0; z < d / 32; ++z) {
      const __m512i v0 = _mm512_loadu_si512(vrow[2 * jp] + 32 * z);
      const __m512i v1 = _mm512_loadu_si512(vrow[2 * jp + 1] + 32 * z);
      c.vlo[jp][z] = _mm512_unpacklo_epi16(v0, v1);
      c.vhi[jp][z] = _mm512_unpackhi_epi16(v0, v1);
    }
}

// RB query rows (bf16, [RB][d] at stride q_stride) against one packed chunk.
template <int RB>
inline void rows_step(const at::BFloat16* const* q, const Chunk& c, int count, int64_t d,
                      float scale, const int64_t* visible, float* m, float* l, float* acc_lo,
                      float* acc_hi) {
  __m512 even[RB], odd[RB];
  for (int r = 0; r < RB; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d / 2; i += 2) {
    const __m512bh k0 = (__m512bh)_mm512_load_si512(c.kp[i]);
    const __m512bh k1 = (__m512bh)_mm512_load_si512(c.kp[i + 1]);
    for (int r = 0; r < RB; ++r) {
      const uint32_t* qp = reinterpret_cast<const uint32_t*>(q[r]);
      even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_set1_epi32(int(qp[i])), k0);
      odd[r] = _mm512_dpbf16_ps(odd[r], (__m512bh)_mm512_set1_epi32(int(qp[i + 1])), k1);
    }
  }
  alignas(64) uint32_t pairs[RB][8];
  float alpha[RB];
  for (int r = 0; r < RB; ++r) {
    const __mmask16 live = __mmask16((1u << visible[r]) - 1u);
    if (!live) {
      alpha[r] = 1.f;
      std::memset(pairs[r], 0, sizeof(pairs[r]));
      continue;
    }
    const __m512 s = _mm512_mul_ps(_mm512_add_ps(even[r], odd[r]), _mm512_set1_ps(scale));
    const __m512 p = vec::softmax_weights(s, live, m[r], l[r], alpha[r]);
    const __m256bh pb = _mm512_cvtneps_pbh(p);
    std::memcpy(pairs[r], &pb, 32);
  }
  const int num_pairs = (count + 1) / 2;
  const int64_t half = d / 2;  // floats per row in each of acc_lo and acc_hi
  for (int64_t z = 0; z < d / 32; ++z) {
    __m512 lo[RB], hi[RB];
    for (int r = 0; r < RB; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      lo[r] = _mm512_mul_ps(_mm512_loadu_ps(acc_lo + r * half + 16 * z), a);
      hi[r] = _mm512_mul_ps(_mm512_loadu_ps(acc_hi + r * half + 16 * z), a);
    }
    for (int jp = 0; jp < num_pairs; ++jp) {
      const __m512bh vl = (__m512bh)c.vlo[jp][z], vh = (__m512bh)c.vhi[jp][z];
      for (int r = 0; r < RB; ++r) {
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(int(pairs[r][jp]));
        lo[r] = _mm512_dpbf16_ps(lo[r], vl, pp);
        hi[r] = _mm512_dpbf16_ps(hi[r], vh, pp);
      }
    }
    for (int r = 0; r < RB; ++r) {
      _mm512_storeu_ps(acc_lo + r * half + 16 * z, lo[r]);
      _mm512_storeu_ps(acc_hi + r * half + 16 * z, hi[r]);
    }
  }
}

// One tile: positions first_pos .. first_pos + num_pos - 1 of one kv head, `group` heads each;
// q_row(i, g) and out_row(i, g) give the bf16 rows; key p's rows are keys / values + offsets[p].
template <typename QAt, typename OutAt>
void attend_tile(QAt q_row, OutAt out_row, int64_t num_pos, int64_t group, int64_t d,
                 int64_t first_pos, float scale, const at::BFloat16* keys,
                 const at::BFloat16* values, const int64_t* offsets) {
  alignas(64) static const at::BFloat16 zeros[256] = {};
  const int64_t num_rows = num_pos * group;
  thread_local std::vector<float> state;
  state.assign(num_rows * (d + 2), 0.f);
  float* acc_lo = state.data();                // [num_rows][d / 32][16], permuted lanes
  float* acc_hi = acc_lo + num_rows * d / 2;   // the same for the hi halves
  float* m = acc_lo + num_rows * d;
  float* l = m + num_rows;
  for (int64_t r = 0; r < num_rows; ++r) m[r] = -INFINITY;
  thread_local Chunk chunk;
  const at::BFloat16* qrows[4];
  const int64_t last_pos = first_pos + num_pos - 1;
  for (int64_t pos = 0; pos <= last_pos; pos += 16) {
    const int count = int(std::min<int64_t>(16, last_pos + 1 - pos));
    const at::BFloat16* krow[16];
    const at::BFloat16* vrow[16];
    for (int j = 0; j < 16; ++j) {
      krow[j] = j < count ? keys + offsets[pos + j] : zeros;
      vrow[j] = j < count ? values + offsets[pos + j] : zeros;
    }
    pack_chunk(krow, vrow, count, d, chunk);
    const int64_t first_row = std::max<int64_t>(0, (pos - first_pos) * group);
    int64_t r = first_row;
    auto step = [&](auto rb) {
      constexpr int RB = decltype(rb)::value;
      int64_t visible[RB];
      for (int t = 0; t < RB; ++t) {
        const int64_t row_pos = first_pos + (r + t) / group;
        visible[t] = std::clamp<int64_t>(row_pos + 1 - pos, 0, count);
        qrows[t] = q_row((r + t) / group, (r + t) % group);
      }
      rows_step<RB>(qrows, chunk, count, d, scale, visible, m + r, l + r,
                    acc_lo + r * (d / 2), acc_hi + r * (d / 2));
    };
    for (; r + 4 <= num_rows; r += 4) step(std::integral_constant<int, 4>{});
    for (; r < num_rows; ++r) step(std::integral_constant<int, 1>{});
  }
  for (int64_t r = 0; r < num_rows; ++r) {
    at::BFloat16* out = out_row(r / group, r % group);
    const float inv = 1.f / l[r];
    for (int64_t z = 0; z < d / 32; ++z)
      for (int i = 0; i < 16; ++i) {
        out[lane_dim(int(z), false, i)] = at::BFloat16(acc_lo[r * (d / 2) + 16 * z + i] * inv);
        out[lane_dim(int(z), true, i)] = at::BFloat16(acc_hi[r * (d / 2) + 16 * z + i] * inv);
      }
  }
}

}  // namespace quire::prefill_bf16

#endif  // __AVX512BF16__
