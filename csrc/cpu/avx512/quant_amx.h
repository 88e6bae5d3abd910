// GGUF Q4_0 / Q4_1 linears of bf16 rows on AMX tiles (Intel Sapphire Rapids and later), for
// the rows between a decode's few (the int8 kernel, quant_linear.cpp) and a long prefill's
// many (oneDNN on the weight's bf16 tile twin):
//   out[M, N] = x[M, K] (bf16) @ dequant(w)[N, K]^T, fp32 sums, bf16 or fp32 out.
//
// Past 8 rows an AMX CPU multiplied a bf16 twin of each 4-bit weight (backends/cpu_linear.py,
// GgufBlocks.tile_twin): the same values the de-quantized path holds, 16 bits a weight. On a
// 2-core Xeon with AMX (family 6, model 167) a batched decode step's linears then took 18 ms
// at 9 rows and 32 ms at 64 (a step's layers less their attention), about 14 GB/s of twin:
// oneDNN's tiles at a few rows wait on the bytes, not the products. Here the 4-bit blocks
// stream instead (a third of the bytes) and become tiles on the way:
//   - a unit of 16 weight rows (the repacked layout's, unit_of_group) is de-quantized once a
//     call, block by block, into B tiles in L1/L2 (VNNI layout: [16 pairs of k][16 rows]
//     bf16 pairs), by the formula dequant_block uses (fma(q, d, offset) in fp32, rounded to
//     nearest even): the values of the twin, bit for bit;
//   - A tiles are x's rows as they lie in memory (16 rows x 32 k a tile, the row stride x's);
//   - four C tiles take 64 rows of x at a time against the unit; C is out's rows as they are.
// So a product is the twin's x @ w^T with fp32 sums in another order (oneDNN's blocking is its
// own): equal within fp32 summation over bf16 products, which the tests check against the
// de-quantized reference.
// Not compiled into the emulated AVX-512 set (no tiles there): quant_linear.cpp asks
// QUIRE_AMX_QUANT.
#pragma once

#if defined(QUIRE_AMX_ATTENTION)

#define QUIRE_AMX_QUANT 1

namespace QUIRE_NS::quant_amx {

constexpr int64_t kUnitRows = 16;  // weight rows a unit: a B tile's 16 pairs a row

// Whether the tiles take Q4 calls (where the CPU has them and unless turned off: the
// quant_tiles op, for tests and A/B runs).
inline std::atomic<bool>& wanted() {
  static std::atomic<bool> on{true};
  return on;
}
inline bool enabled() { return wanted().load(std::memory_order_relaxed) && amx_tiles_usable(); }

// The block types the tiles take: their bytes a block of 32 weights. (Q8_0 was tried: its
// tied logits table, 49152 x 576, ran slower here than oneDNN on its twin from 16 rows up,
// 2.0-6.3 ms against 1.6-4.2 at 16-128 rows; the int8 kernel wins below that.)
enum class Kind { kQ4_0, kQ4_1 };
template <Kind T>
constexpr int64_t kBlockBytes = T == Kind::kQ4_1 ? 20 : 18;

// Four B rows from 16 values of each of the weight rows' chunk c (lanes: 4 rows 4c + l / 4 x
// 4 weights l % 4, as int32 q), de-quantized as fma(q, d, offset) in fp32 and rounded to
// bf16: pairs `pair` and `pair + 1` (weights 2 pair .. 2 pair + 3 of every row).
inline void four_weights_a_row(const __m512i (&q)[4], const __m512 (&dv)[4],
                               const __m512 (&ov)[4], uint32_t* bt, int pair) {
  // dword e of a chunk pair's bf16: row e / 2, weights pair e % 2: the even e (pair 0) of both
  // halves into one B row, the odd into the next
  const __m512i even =
      _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  __m512 f[4];
  for (int c = 0; c < 4; ++c) f[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q[c]), dv[c], ov[c]);
  const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]);  // rows 0-7
  const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]);  // rows 8-15
  _mm512_store_si512(bt + 16 * pair, _mm512_permutex2var_epi32(lo, even, hi));
  _mm512_store_si512(bt + 16 * (pair + 1), _mm512_permutex2var_epi32(lo, odd, hi));
}

// Block b of a unit (16 rows; `blk` its block: [16 d][16 m (Q4_1)][4 runs of 64 bytes, row
// r's file bytes 4j .. 4j + 3 at 4r in run j: weights 4j + t in the low nibbles, 16 + 4j + t
// in the high]) as a B tile: 16 rows (pair i: k = 2i, 2i + 1) of 16 bf16 pairs (weight row
// n), the values dequant_block gives.
template <Kind T>
inline void dequant_unit_block(const uint8_t* blk, uint32_t* bt) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
  const __m512 off =
      T == Kind::kQ4_1
          ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)))
          : _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
  const uint8_t* qs = blk + (T == Kind::kQ4_1 ? 64 : 32);
  __m512 dv[4], ov[4];
  for (int c = 0; c < 4; ++c) {
    const __m512i idx = _mm512_add_epi32(
        _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                          2),
        _mm512_set1_epi32(4 * c));
    dv[c] = _mm512_permutexvar_ps(idx, d);
    ov[c] = _mm512_permutexvar_ps(idx, off);
  }
  auto chunk = [](const uint8_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  };
  const __m512i low = _mm512_set1_epi32(0x0F);
  for (int j = 0; j < 4; ++j) {
    const uint8_t* run = qs + 64 * j;
    // each byte widened once (from memory), its two nibbles taken in the int32 lanes
    __m512i lo[4], hi[4];
    for (int c = 0; c < 4; ++c) {
      const __m512i b = _mm512_cvtepu8_epi32(chunk(run + 16 * c));
      lo[c] = _mm512_and_si512(b, low);
      hi[c] = _mm512_srli_epi32(b, 4);
    }
    four_weights_a_row(lo, dv, ov, bt, 2 * j);      // weights 4j + t
    four_weights_a_row(hi, dv, ov, bt, 8 + 2 * j);  // weights 16 + 4j + t
  }
}

// Tiles: 0-3 C (16 rows x 16 fp32), 4-5 A (16 rows of x x 32 bf16), 6 B.
inline const prefill_amx::TileConfig& tile_config() {
  static const prefill_amx::TileConfig cfg = [] {
    prefill_amx::TileConfig c;
    for (int t = 0; t < 7; ++t) {
      c.rows[t] = 16;
      c.colsb[t] = 64;
    }
    return c;
  }();
  return cfg;
}

inline void store_row(float* o, const float* c) { std::memcpy(o, c, 16 * sizeof(float)); }
inline void store_row(at::BFloat16* o, const float* c) {
  const auto h = _mm512_cvtneps_pbh(_mm512_load_ps(c));
  std::memcpy(o, &h, sizeof(h));
}

// MT C tiles (16 rows of x each from `a`, rows `lda` elements apart) against the unit's nb
// B tiles at bt; the rows' results into out (rows `ldo` apart), `rows` of the last tile.
template <int MT, typename O>
QUIRE_AMX_TARGET inline void unit_rows(const at::BFloat16* const* a, int64_t lda,
                                       const uint32_t* bt, int64_t nb, O* out, int64_t ldo,
                                       int64_t last_rows) {
  alignas(64) float c[16][16];
  _tile_zero(0);
  if constexpr (MT > 1) _tile_zero(1);
  if constexpr (MT > 2) _tile_zero(2);
  if constexpr (MT > 3) _tile_zero(3);
  const int64_t stride = lda * int64_t(sizeof(at::BFloat16));
  for (int64_t b = 0; b < nb; ++b) {
    _tile_loadd(6, bt + 256 * b, 64);
    _tile_loadd(4, a[0] + 32 * b, stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (MT > 1) {
      _tile_loadd(5, a[1] + 32 * b, stride);
      _tile_dpbf16ps(1, 5, 6);
    }
    if constexpr (MT > 2) {
      _tile_loadd(4, a[2] + 32 * b, stride);
      _tile_dpbf16ps(2, 4, 6);
    }
    if constexpr (MT > 3) {
      _tile_loadd(5, a[3] + 32 * b, stride);
      _tile_dpbf16ps(3, 5, 6);
    }
  }
  auto put = [&](int t) {
    const int64_t rows = t == MT - 1 ? last_rows : 16;
    for (int64_t r = 0; r < rows; ++r) store_row(out + (16 * t + r) * ldo, c[r]);
  };
  _tile_stored(0, c, 64);
  put(0);
  if constexpr (MT > 1) {
    _tile_stored(1, c, 64);
    put(1);
  }
  if constexpr (MT > 2) {
    _tile_stored(2, c, 64);
    put(2);
  }
  if constexpr (MT > 3) {
    _tile_stored(3, c, 64);
    put(3);
  }
}

// Units [u0, u1) of w (16 rows each; repacked, every row in a unit of 16) against x [M, K]:
// out[:, 16u .. 16u + 16). x's last M % 16 rows go through a zero-padded tile of the thread's
// own (an A tile is 16 rows; a fresh tensor a call cost about 12 us of a 9-row call).
template <Kind T, typename O>
QUIRE_AMX_TARGET void units(const at::BFloat16* x, int64_t M, int64_t K, const uint8_t* w,
                            int64_t N, O* out, int64_t u0, int64_t u1) {
  const int64_t nb = K / 32, unit_bytes = kUnitRows * nb * kBlockBytes<T>;
  thread_local prefill_amx::Grown<uint32_t> scratch;
  thread_local prefill_amx::Grown<at::BFloat16> tail_rows;
  uint32_t* const bt = scratch.get(nb * 256);
  const at::BFloat16* tail = nullptr;
  if (const int64_t rest = M % 16) {
    at::BFloat16* t = tail_rows.get(16 * K);
    std::memcpy(t, x + (M - rest) * K, rest * K * sizeof(at::BFloat16));
    std::memset(static_cast<void*>(t + rest * K), 0, (16 - rest) * K * sizeof(at::BFloat16));
    tail = t;
  }
  _tile_loadconfig(&tile_config());
  for (int64_t u = u0; u < u1; ++u) {
    const uint8_t* unit = w + u * unit_bytes;
    for (int64_t b = 0; b < nb; ++b)
      dequant_unit_block<T>(unit + b * kUnitRows * kBlockBytes<T>, bt + 256 * b);
    if (u + 1 < u1)  // the next unit's bytes come in while this one's products run
      prefetch_bytes(unit + unit_bytes, unit_bytes);
    for (int64_t m0 = 0; m0 < M; m0 += 64) {
      const int64_t rows = std::min<int64_t>(64, M - m0);
      const int mt = int((rows + 15) / 16);
      const int64_t last_rows = rows - 16 * (mt - 1);
      const at::BFloat16* a[4];
      for (int t = 0; t < mt; ++t) {
        const int64_t r = m0 + 16 * t;
        a[t] = r + 16 <= M ? x + r * K : tail;
      }
      O* o = out + m0 * N + kUnitRows * u;
      switch (mt) {
        case 1: unit_rows<1>(a, K, bt, nb, o, N, last_rows); break;
        case 2: unit_rows<2>(a, K, bt, nb, o, N, last_rows); break;
        case 3: unit_rows<3>(a, K, bt, nb, o, N, last_rows); break;
        default: unit_rows<4>(a, K, bt, nb, o, N, last_rows); break;
      }
    }
  }
  _tile_release();
}

}  // namespace QUIRE_NS::quant_amx

#endif  // QUIRE_AMX_ATTENTION
