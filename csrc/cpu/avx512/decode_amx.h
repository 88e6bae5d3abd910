// Decode attention with the scores on AMX tiles (Intel Sapphire Rapids and later), bf16 Q and
// cache; softmax and P @ V stay on the AVX-512 BF16 vectors of decode_bf16.h.
//
// A decode's scores are a handful of query rows (the heads of one GQA group) against every
// cached key. With vector dot products each key row costs a dot product per query row and a
// horizontal sum (decode_bf16::scores: about half the kernel's instructions, and with the K/V
// in cache most of its time). On tiles the 16 keys of a chunk are one matrix product
// S^T = K Q^T per 32 dimensions:
//   A tile: the 16 key rows of one kv head, straight from the cache (a block's slots lie
//           `slot stride` bytes apart; a chunk that is not 16 contiguous slots, or is the
//           sequence's last and partly filled, is copied to a scratch tile first, zero rows
//           past the sequence's end);
//   B tile: the group's query rows as dimension pairs (VNNI layout), [16 pairs][4 heads],
//           built once per decode;
//   C tile: [16 keys][4 heads] fp32, stored (256 bytes) and turned into one 16-key vector per
//           head by permutes.
// At most 4 query heads per kv head (the C tile's 4 columns: SmolLM2's 3, Llama 3's 4); wider
// groups keep the vector kernel. Each call configures the tiles and releases them after.
#pragma once

#include "prefill_amx.h"

#if defined(QUIRE_AMX_ATTENTION)

#include "decode_bf16.h"

namespace QUIRE_NS::decode_amx {

constexpr int kMaxGroup = 4;  // query heads per kv head: the C tile's columns

// Whether a decode of this shape runs here: the prefill's switch and tiles (prefill_amx).
inline bool takes(int64_t group, int64_t d) {
  return group <= kMaxGroup && d % 32 == 0 && d <= 256 && prefill_amx::enabled();
}

// One kv head's query rows as B tiles: z (32 dimensions each), dimension pair i, head c.
struct QueryTiles {
  alignas(64) uint32_t b[decode_bf16::kMaxZ][16][kMaxGroup];
};

// Row j of the 16 x 4 fp32 tile c (keys x heads) -> s[g][j] for g < group.
template <int GA>
inline void columns(const float* c, int group, __m512 (&s)[GA]) {
  const __m512 z0 = _mm512_load_ps(c), z1 = _mm512_load_ps(c + 16);
  const __m512 z2 = _mm512_load_ps(c + 32), z3 = _mm512_load_ps(c + 48);
  // keys 0-7 (from z0:z1) or 8-15 (z2:z3) of heads a (lanes 0-7) and b (lanes 8-15)
  const __m512i pick01 = _mm512_set_epi32(29, 25, 21, 17, 13, 9, 5, 1,
                                          28, 24, 20, 16, 12, 8, 4, 0);
  const __m512i pick23 = _mm512_add_epi32(pick01, _mm512_set1_epi32(2));
  const __m512i lo = _mm512_set_epi32(23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  const __m512 l01 = _mm512_permutex2var_ps(z0, pick01, z1);
  const __m512 h01 = _mm512_permutex2var_ps(z2, pick01, z3);
  s[0] = _mm512_permutex2var_ps(l01, lo, h01);
  if (group > 1) s[1] = _mm512_permutex2var_ps(l01, hi, h01);
  if (group > 2) {
    const __m512 l23 = _mm512_permutex2var_ps(z0, pick23, z1);
    const __m512 h23 = _mm512_permutex2var_ps(z2, pick23, z3);
    s[2] = _mm512_permutex2var_ps(l23, lo, h23);
    if (group > 3) s[3] = _mm512_permutex2var_ps(l23, hi, h23);
  }
}

// As decode_bf16::attend (same arguments, same walk of the keys, all kv heads together), the
// scores on tiles.
template <int G, int NZ>
QUIRE_AMX_TARGET void attend(const at::BFloat16* q, at::BFloat16* out, int group_rt, int nz_rt,
                             int num_kv, int64_t seq_len, float scale,
                             const at::BFloat16* keys, const at::BFloat16* values,
                             const int64_t* offsets) {
  using Rows = decode_bf16::Rows<G, NZ>;
  alignas(64) static const at::BFloat16 zeros[256] = {};
  const int group = G > 0 ? G : group_rt, nz = NZ > 0 ? NZ : nz_rt;
  const int64_t d = 32 * nz;
  const int64_t rows_stride = group * d;
  thread_local std::vector<Rows> heads;
  thread_local std::vector<QueryTiles> qt;
  if (int(heads.size()) < num_kv) heads.resize(num_kv);
  if (int(qt.size()) < num_kv) qt.resize(num_kv);
  for (int h = 0; h < num_kv; ++h) {
    heads[h].start(q + h * rows_stride, group_rt, nz_rt);
    const uint32_t* qh = reinterpret_cast<const uint32_t*>(q + h * rows_stride);
    for (int z = 0; z < nz; ++z)
      for (int i = 0; i < 16; ++i)
        for (int c = 0; c < kMaxGroup; ++c)
          qt[h].b[z][i][c] = c < group ? qh[c * d / 2 + 16 * z + i] : 0u;
  }
  prefill_amx::TileConfig cfg;
  cfg.rows[0] = 16, cfg.colsb[0] = 4 * kMaxGroup;  // C: keys x heads, fp32
  cfg.rows[1] = 16, cfg.colsb[1] = 64;             // A: keys x 32 dimensions, bf16
  cfg.rows[2] = 16, cfg.colsb[2] = 4 * kMaxGroup;  // B: dimension pairs x heads
  _tile_loadconfig(&cfg);
  alignas(64) at::BFloat16 copied[16 * 256];  // a chunk's key rows of one head, [16][d]
  alignas(64) float c[16 * kMaxGroup];
  const int64_t row_bytes = num_kv * d * 2;
  for (int64_t pos = 0; pos < seq_len; pos += 16) {
    const int count = int(std::min<int64_t>(16, seq_len - pos));
    // the chunk's 16 slots evenly spaced (one block's, or adjacent blocks'): tiles read them
    // in place
    bool in_place = count == 16;
    const int64_t step = in_place ? offsets[pos + 1] - offsets[pos] : 0;
    for (int j = 2; in_place && j < 16; ++j) in_place = offsets[pos + j] - offsets[pos] == j * step;
    for (int h = 0; h < num_kv; ++h) {
      {  // this head's share of the next chunk's slot rows (K and V): asked for a head at a
         // time, not all 192 lines at once (more than a core's outstanding misses, which
         // then queued ahead of the chunk's own loads); inline (as a function it ran slower)
        const int64_t lo = h * row_bytes / num_kv, hi = (h + 1) * row_bytes / num_kv;
        for (int64_t p = pos + 16, e = std::min(seq_len, p + 16); p < e; ++p)
          for (int64_t b = lo & ~63; b < hi; b += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(keys + offsets[p]) + b, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(values + offsets[p]) + b, _MM_HINT_T0);
          }
      }
      const at::BFloat16* base;
      int64_t stride;
      if (in_place) {
        base = keys + offsets[pos] + h * d;
        stride = step * int64_t(sizeof(at::BFloat16));
      } else {
        for (int j = 0; j < 16; ++j) {
          const at::BFloat16* src = j < count ? keys + offsets[pos + j] + h * d : zeros;
          std::memcpy(copied + j * d, src, d * sizeof(at::BFloat16));
        }
        base = copied;
        stride = d * int64_t(sizeof(at::BFloat16));
      }
      _tile_zero(0);
      for (int z = 0; z < nz; ++z) {
        _tile_loadd(1, base + 32 * z, stride);
        _tile_loadd(2, qt[h].b[z], 4 * kMaxGroup);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, c, 4 * kMaxGroup);
      __m512 s[Rows::GA];
      columns(c, group, s);
      const at::BFloat16* vrow[16];
      for (int j = 0; j < 16; ++j) vrow[j] = j < count ? values + offsets[pos + j] + h * d : zeros;
      heads[h].add_scores(s, decode_bf16::RowPtrs{vrow}, count, scale);
    }
  }
  _tile_release();
  for (int h = 0; h < num_kv; ++h) heads[h].finish(out + h * rows_stride);
}

struct Tiles {
  static constexpr int kMaxGroup = decode_amx::kMaxGroup;
  template <int G, int NZ>
  static void run(const decode_bf16::DecodeArgs& a) {
    attend<G, NZ>(a.q, a.out, a.group, a.nz, a.num_kv, a.seq_len, a.scale, a.keys, a.values,
                  a.offsets);
  }
};

// As decode_bf16::dispatch, for a group of at most 4 (takes()).
inline void dispatch(const at::BFloat16* q, at::BFloat16* out, int group, int64_t d, int num_kv,
                     int64_t seq_len, float scale, const at::BFloat16* keys,
                     const at::BFloat16* values, const int64_t* offsets) {
  decode_bf16::dispatch_shape<Tiles>(
      {q, out, group, int(d / 32), num_kv, seq_len, scale, keys, values, offsets});
}

}  // namespace QUIRE_NS::decode_amx

#endif  // QUIRE_AMX_ATTENTION
