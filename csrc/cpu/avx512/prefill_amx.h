// Prefill attention on AMX tiles (Intel Sapphire Rapids and later): bf16 Q/K/V, one kv head's
// GQA rows of a tile of query positions against every key they see, online softmax.
//
// With AVX-512 BF16 dot products (prefill_bf16.h) the two matmuls of attention are what a
// prefill waits on: on a 2-core Xeon with AMX they ran at 60-100 GFLOP/s, against 160-360 for
// torch's flash attention on the same shapes (SmolLM2's 9 query / 3 kv heads of 64, prompts of
// 256 to 2,048 tokens). On tiles the matmuls take a few per cent of that time and the softmax
// (an exp per score, on AVX-512) is what is left, so:
//   - rows go 16 at a time (a tile's rows), keys 64 at a time (four 16-key score tiles), so the
//     softmax bookkeeping (max, sum, rescale) is paid once per 64 keys;
//   - S = Q K^T: A tiles are the rows' queries (copied once per item, [rows][d] bf16), B tiles
//     the keys as dimension pairs, key-major in a row ([block][d / 2][64 keys] uint32, the
//     VNNI layout tdpbf16ps reads);
//   - P V: A tiles are the probabilities (bf16 [16][64]), B tiles the values as key pairs
//     ([block][32 key pairs][d] uint32), into zeroed C tiles stored to a scratch block; the
//     vectors then fold it into the fp32 accumulators, O = O * alpha + P V, with the rescale
//     where a row's max moved. (Loading O into the C tiles instead, right after the vectors
//     rescaled it, stalled each block on the stores: a tile load does not take forwarded
//     stores. It was a third of the kernel's samples in a perf profile.)
//   - B tiles alternate between two registers, so a load need not wait for the product
//     before it to finish reading the last one.
// Each thread configures its tiles (palette 1: eight tiles of 16 rows x 64 bytes) per item and
// releases them after. Linux grants the tile state per process: amx_tiles_usable() asks once.
// Not compiled into the emulated AVX-512 set (tests on AVX2 machines), which has no tiles.
#pragma once

#if !defined(QUIRE_AVX512_EMULATED)

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>

#include "simd.h"

#define QUIRE_AMX_ATTENTION 1
#define QUIRE_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))

namespace QUIRE_NS {

bool amx_tiles_usable();  // quant_linear.cpp

namespace prefill_amx {

constexpr int kRows = 16;  // query rows per tile
constexpr int kKeys = 64;  // keys per block: four 16-key score tiles
// query positions per work item: enough rows that packing the keys it sees is paid back
constexpr int64_t kPositionsPerItem = 128;

// Whether prefill attention runs on tiles: where the CPU has them and unless turned off (the
// attention_tiles op, for tests and A/B runs).
inline std::atomic<bool>& wanted() {
  static std::atomic<bool> on{true};
  return on;
}
inline bool enabled() { return wanted().load(std::memory_order_relaxed) && amx_tiles_usable(); }
// Whether a bf16 prefill of head_dim d runs here (d a multiple of 64, at most 256).
inline bool takes(int64_t d) { return d % 64 == 0 && d <= 256 && enabled(); }

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// A buffer that grows and is never cleared: std::vector's resize writes every element it
// adds, which items of alternating sizes paid again and again (3 % of a prefill's samples).
template <typename T>
class Grown {
 public:
  T* get(int64_t n) {
    if (n > capacity_) {
      data_.reset(static_cast<T*>(::operator new[](n * sizeof(T), std::align_val_t(64))));
      capacity_ = n;
    }
    return data_.get();
  }
  T* data() const { return data_.get(); }

 private:
  struct Free {
    void operator()(T* p) const { ::operator delete[](p, std::align_val_t(64)); }
  };
  std::unique_ptr<T, Free> data_;
  int64_t capacity_ = 0;
};

struct Scratch {
  Grown<uint32_t> k;      // [block][d / 2][kKeys]
  Grown<uint32_t> v;      // [block][kKeys / 2][d]
  Grown<at::BFloat16> q;  // [rows rounded up to 16][d]
  alignas(64) float o[kRows][256];   // the accumulators, [16][d]
  alignas(64) float pv[kRows][256];  // one block's P V, [16][d]
  alignas(64) float s[kRows][kKeys];
  alignas(64) at::BFloat16 p[kRows][kKeys];
};

// Keys [0, num_keys) of one kv head (rows at keys / values + offsets[p]) into the B layouts,
// keys past num_keys zero.
inline void pack(const at::BFloat16* keys, const at::BFloat16* values, const int64_t* offsets,
                 int64_t num_keys, int64_t d, Scratch& w) {
  alignas(64) static const at::BFloat16 zeros[256] = {};
  const int64_t blocks = (num_keys + kKeys - 1) / kKeys, pairs = d / 2;
  uint32_t* const k_packed = w.k.get(blocks * pairs * kKeys);
  uint32_t* const v_packed = w.v.get(blocks * (kKeys / 2) * d);
  // dimension pair i of 32 keys of a dimension group: [i][key] from [key][i]
  const __m512i lo_idx = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i hi_idx = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  for (int64_t b = 0; b < blocks; ++b) {
    uint32_t* kb = k_packed + b * pairs * kKeys;
    uint32_t* vb = v_packed + b * (kKeys / 2) * d;
    const at::BFloat16* krow[kKeys];
    const at::BFloat16* vrow[kKeys];
    for (int j = 0; j < kKeys; ++j) {
      const int64_t p = b * kKeys + j;
      krow[j] = p < num_keys ? keys + offsets[p] : zeros;
      vrow[j] = p < num_keys ? values + offsets[p] : zeros;
    }
    for (int j = 0; j < kKeys; ++j) {
      const uint32_t* k = reinterpret_cast<const uint32_t*>(krow[j]);
      for (int64_t i = 0; i < pairs; ++i) kb[i * kKeys + j] = k[i];
    }
    // key pair jp: the 16-bit interleave of keys 2jp and 2jp + 1, dimensions in order
    for (int jp = 0; jp < kKeys / 2; ++jp)
      for (int64_t c = 0; c < d; c += 32) {
        const __m512i v0 = _mm512_loadu_si512(vrow[2 * jp] + c);
        const __m512i v1 = _mm512_loadu_si512(vrow[2 * jp + 1] + c);
        const __m512i lo = _mm512_unpacklo_epi16(v0, v1), hi = _mm512_unpackhi_epi16(v0, v1);
        _mm512_storeu_si512(vb + jp * d + c, _mm512_permutex2var_epi64(lo, lo_idx, hi));
        _mm512_storeu_si512(vb + jp * d + c + 16, _mm512_permutex2var_epi64(lo, hi_idx, hi));
      }
  }
}

using simd::exp2_neg;

// The softmax step of 16 rows over one block's scores (w.s, unscaled): probabilities into w.p
// (bf16), running max m (of the scores in base 2) and sum l; each row's factor for its
// accumulators into alpha (1 where the max stayed).
// pos[r]: the last key row r sees; key0: the block's first key. In passes over all 16 rows
// (maxima, then the exps, then the rescale) so that the rows' exp chains overlap and no branch
// waits on a row's max.
inline void softmax_block(Scratch& w, const int64_t* pos, int64_t key0, float scale, float* m,
                          float* l, float* alpha_out) {
  constexpr int V = kKeys / 16;
  // in base 2: scores times scale * log2(e), so each probability is one exp2_neg
  const __m512 vscale = _mm512_set1_ps(scale * 1.44269504088896341f);
  alignas(64) float m_new[kRows];
  __mmask16 live[kRows][V];
  for (int r = 0; r < kRows; ++r) {
    const int64_t visible = pos[r] + 1 - key0;  // rows with none keep their max (and p = 0)
    __m512 mx = _mm512_set1_ps(m[r]);
    for (int i = 0; i < V; ++i) {
      live[r][i] = simd::lanes_below(visible - 16 * i);
      mx = _mm512_mask_max_ps(mx, live[r][i], mx,
                              _mm512_mul_ps(_mm512_load_ps(w.s[r] + 16 * i), vscale));
    }
    m_new[r] = _mm512_reduce_max_ps(mx);
  }
  const __m512 m_old = _mm512_loadu_ps(m), m_now = _mm512_load_ps(m_new);
  // exp(m_old - m_new): 0 on the first block (m_old -inf), 1 where the max stayed
  const __m512 alpha = exp2_neg(_mm512_sub_ps(m_old, m_now));
  alignas(64) float sums[kRows];
  for (int r = 0; r < kRows; ++r) {
    const __m512 mv = _mm512_set1_ps(m_new[r]);
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; i < V; i += 2) {
      const __m512 x0 = _mm512_mul_ps(_mm512_load_ps(w.s[r] + 16 * i), vscale);
      const __m512 x1 = _mm512_mul_ps(_mm512_load_ps(w.s[r] + 16 * i + 16), vscale);
      const __m512 p0 = _mm512_maskz_mov_ps(live[r][i], exp2_neg(_mm512_sub_ps(x0, mv)));
      const __m512 p1 = _mm512_maskz_mov_ps(live[r][i + 1], exp2_neg(_mm512_sub_ps(x1, mv)));
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
      _mm512_store_si512(w.p[r] + 16 * i, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    sums[r] = _mm512_reduce_add_ps(sum);
  }
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), alpha, _mm512_load_ps(sums)));
  _mm512_storeu_ps(m, m_now);
  _mm512_storeu_ps(alpha_out, alpha);
}

// O = O * alpha + P V, row by row (w.o, w.pv: [16][d])
inline void fold_block(Scratch& w, const float* alpha, int64_t d) {
  for (int r = 0; r < kRows; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int64_t c = 0; c < d; c += 16)
      _mm512_store_ps(w.o[r] + c, _mm512_fmadd_ps(_mm512_load_ps(w.o[r] + c), a,
                                                  _mm512_load_ps(w.pv[r] + c)));
  }
}

// Tiles 0..3 += tile 4 (loaded by the caller) times the B tiles at b, b + 16, b + 32, b + 48
// (16 pair columns each; rows `stride` bytes apart), loaded into tiles 5 and 6 in turn.
QUIRE_AMX_TARGET inline void times_four_b(const uint32_t* b, int64_t stride) {
  _tile_loadd(5, b, stride);
  _tile_loadd(6, b + 16, stride);
  _tile_dpbf16ps(0, 4, 5);
  _tile_dpbf16ps(1, 4, 6);
  _tile_loadd(5, b + 32, stride);
  _tile_loadd(6, b + 48, stride);
  _tile_dpbf16ps(2, 4, 5);
  _tile_dpbf16ps(3, 4, 6);
}

// Rows [r0, r0 + 16) of the item (w.q) against keys [0, pos[15]]: O / l into out[r].
QUIRE_AMX_TARGET inline void rows_tile(Scratch& w, int64_t r0, const int64_t* pos,
                                       at::BFloat16* const* out, int num_out, int64_t d,
                                       float scale) {
  alignas(64) float m[kRows], l[kRows], alpha[kRows];
  std::fill(m, m + kRows, -INFINITY);
  std::fill(l, l + kRows, 0.f);
  for (int r = 0; r < kRows; ++r) std::fill(w.o[r], w.o[r] + d, 0.f);
  const int64_t pairs = d / 2;
  const at::BFloat16* q = w.q.data() + r0 * d;
  const int64_t last = pos[kRows - 1];  // rows ascend by position
  for (int64_t b = 0; b * kKeys <= last; ++b) {
    // S = Q K^T: tiles 0..3 the scores of keys 16c..16c+15, 4 the queries, 5 and 6 the keys
    const uint32_t* kb = w.k.data() + b * pairs * kKeys;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < d; c += 32) {
      _tile_loadd(4, q + c, d * 2);
      times_four_b(kb + (c / 2) * kKeys, kKeys * 4);
    }
    _tile_stored(0, &w.s[0][0], kKeys * 4);
    _tile_stored(1, &w.s[0][16], kKeys * 4);
    _tile_stored(2, &w.s[0][32], kKeys * 4);
    _tile_stored(3, &w.s[0][48], kKeys * 4);
    softmax_block(w, pos, b * kKeys, scale, m, l, alpha);
    // P V, 64 dimensions at a time: tiles 0..3 the products, 4 P, 5 and 6 the values
    const uint32_t* vb = w.v.data() + b * (kKeys / 2) * d;
    for (int64_t c = 0; c < d; c += 64) {
      float* pv = &w.pv[0][c];
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int ks = 0; ks < kKeys / 32; ++ks) {
        _tile_loadd(4, &w.p[0][32 * ks], kKeys * 2);
        times_four_b(vb + (16 * ks) * d + c, d * 4);
      }
      _tile_stored(0, pv, sizeof w.pv[0]);
      _tile_stored(1, pv + 16, sizeof w.pv[0]);
      _tile_stored(2, pv + 32, sizeof w.pv[0]);
      _tile_stored(3, pv + 48, sizeof w.pv[0]);
    }
    fold_block(w, alpha, d);
  }
  for (int r = 0; r < num_out; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    const float* o = w.o[r];
    for (int64_t c = 0; c < d; c += 16)
      simd::Vec(_mm512_mul_ps(_mm512_loadu_ps(o + c), inv)).store(out[r] + c);
  }
}

// One tile of positions first_pos .. first_pos + num_pos - 1 of one kv head, `group` heads
// each; q_row(i, g) and out_row(i, g) give the bf16 rows; key p's rows are keys / values +
// offsets[p]. head_dim a multiple of 64, at most 256.
template <typename QAt, typename OutAt>
QUIRE_AMX_TARGET void attend_tile(QAt q_row, OutAt out_row, int64_t num_pos, int64_t group,
                                  int64_t d, int64_t first_pos, float scale,
                                  const at::BFloat16* keys, const at::BFloat16* values,
                                  const int64_t* offsets) {
  thread_local Scratch w;
  pack(keys, values, offsets, first_pos + num_pos, d, w);
  const int64_t num_rows = num_pos * group;
  const int64_t padded = (num_rows + kRows - 1) / kRows * kRows;
  at::BFloat16* const qs = w.q.get(padded * d);
  thread_local Grown<int64_t> pos_buffer;
  thread_local Grown<at::BFloat16*> out_buffer;
  int64_t* const pos = pos_buffer.get(padded);
  at::BFloat16** const out = out_buffer.get(padded);
  for (int64_t r = 0; r < padded; ++r) {  // rows by position, then head: causal limits rise
    if (r < num_rows) {
      std::memcpy(qs + r * d, q_row(r / group, r % group), d * 2);
      out[r] = out_row(r / group, r % group);
      pos[r] = first_pos + r / group;
    } else {  // padding: zero queries at the last position, never written out
      std::memset(qs + r * d, 0, d * 2);
      out[r] = nullptr;
      pos[r] = first_pos + num_pos - 1;
    }
  }
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.rows[t] = kRows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  for (int64_t r0 = 0; r0 < padded; r0 += kRows)
    rows_tile(w, r0, pos + r0, out + r0,
              int(std::min<int64_t>(kRows, num_rows - r0)), d, scale);
  _tile_release();
}

}  // namespace prefill_amx
}  // namespace QUIRE_NS

#endif  // !QUIRE_AVX512_EMULATED
