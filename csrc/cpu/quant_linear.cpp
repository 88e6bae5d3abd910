// Linear layers over GGUF's legacy block-quantized weights, kept as the file stores them:
//   out[M, N] = x[M, K] @ dequant(w)[N, K]^T (+ bias), x and out fp32 or bf16.
//
// A weight is uint8 [N, K / 32, block_bytes]: row n's blocks of 32 weights in order, each block
// exactly as ggml lays it out, and block_bytes names the type (no other field is needed):
//   Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles       w = d * (q - 8),  q in 0..15
//   Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes nibbles  w = d * q + m,    q in 0..15
//   Q8_0 (34 bytes): fp16 d, 32 int8                   w = d * q
// Byte j of the nibbles holds weight j in its low half and weight j + 16 in its high half.
// The k-quants (Q4_K_M and the like) come in super-blocks of 256 weights, [N, K / 256, bytes]:
//   Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of
//                     nibbles; sub-block j (32 weights): w = d * sc_j * q - dmin * m_j
//   Q5_K (176 bytes): as Q4_K plus 32 bytes of fifth bits (q in 0..31)
//   Q6_K (210 bytes): 128 bytes of low nibbles, 64 of two-bit highs, sixteen int8 scales (one
//                     per 16 weights), fp16 d; w = d * sc_i * (q - 32), q in 0..63
// Repacked, each super-block's eight sub-blocks become blocks of 32 shaped as Q4_1's (nibbles
// in the order above; Q5_K's fifth bits as a 32-bit mask a block, Q6_K's highs two bits a
// weight, eight bytes a block) after its scales unpacked to bytes: Q4_K 148 bytes, Q5_K 180,
// Q6_K 210. One super-block is then exactly the legacy kernel's group of eight blocks: one
// vector of d * sc_j * d_x, one of dmin * m_j * d_x * sum(q_x), and Q4_1's inner loop (Q6_K:
// signed quants, its two scales a block multiplied in the integer pair sums).
//
// Repacked (repack_gguf, once at load; int8 [N, K / 32, block_bytes], the same bytes a row,
// regrouped): row n is [d of every block (fp16)] [m of every block (Q4_1)] [every block's
// quants]. Eight blocks' scales then come in one load and one conversion, and each block's
// inner loop is only its quants: about half the instructions a block of the file's layout
// takes (what decode costs where the cores, not memory, are the limit). Either layout is
// taken; the file's is repacked on the fly (tests), the loader's weights come repacked.
// Q4_0, Q4_1 and Q8_0 go further: whole groups of eight rows are interleaved block by block
// (dot_group), so a block's integer sums for eight rows fill one register and are converted
// and scaled once, not once a row (Zen 3, SmolLM2's 30 layers of Q4_1 linears at M = 1 read
// from memory: 9.1 ms row by row, 5.2 ms grouped; Zen 4, its Q8_0 logits projection, 49152 x
// 576: 2.7 ms row by row, 11 GB/s and bound by the cores, before Q8_0 was grouped too); rows
// past the last group of eight stay row by row.
//
// Few rows (decode, M <= kDecodeRows): bound by the bytes of weight streamed, so the weight is
// read as it is (4.5 to 8.5 bits a weight instead of 16) and never widened to floats. Each row of
// x is quantized to int8 per block of 32 as ggml's Q8_0 (d_x = max|x| / 127, x ~ d_x * q_x,
// round to nearest even), and every block is an integer dot product (maddubs + madd, or VNNI's
// vpdpbusd, exact in int32) scaled once: sum_blocks d_w d_x (q_w . q_x) (+ m_w d_x sum(q_x) for Q4_1, - 8 d_w ...
// for Q4_0). The only error against de-quantize-then-matmul in fp32 is x's rounding to int8:
// |out - ref| <= sum_k |w_k| d_x(k) / 2 (plus fp32 summation order); tests check that bound.
// Threads split the output rows; a thread reads its rows' bytes once for all M rows of x.
//
// More rows (batched decode, prefill): compute-bound. Q4_0 / Q4_1 / Q8_0 in a bf16 model stay
// on the int8 path at every size (int8_rows_limit; up to 64 rows where oneDNN has AMX tiles):
// dot_group keeps rows of x in registers (8 with VNNI, 5 on AVX2) and adds four u8 x s8
// products a lane with one vpdpbusd (with VNNI; dot_group_pair: two groups, 16 weight rows, a
// 512-bit register) or a maddubs into int16 (AVX2), x's rows in tiles of 128 against each
// thread's groups.
// Q8_0's signed weights take x offset to unsigned (q_x + 128) so that each load is one
// vpdpbusd, less 128 x the block's weight sums.
// Otherwise (an fp32 model, the k-quants) the weight is de-quantized into x's dtype (one pass,
// parallel over rows, into a buffer kept across calls: dequantized_scratch) and the matmul is
// torch's (oneDNN) on that.
//
// The integer dot products are 256-bit (AVX2; AVX-512 VNNI's 256-bit vpdpbusd in the AVX-512
// set, which is also built with -mavx2), and 512-bit in the AVX-512 set's dot_group_pair.
//
// References: gguf.quants.dequantize (the format), then x @ w.T in fp32; tests compare.

#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops.h"
#if defined(QUIRE_ISA_AVX512) && !defined(QUIRE_AVX512_EMULATED)
#include "avx512/quant_amx.h"  // Q4 rows on AMX tiles (defines QUIRE_AMX_QUANT)
#endif

// AVX-512 VNNI with VL (the AVX-512 set requires both): vpdpbusd on 256-bit registers adds
// four u8 x s8 products a lane into int32 in one instruction, where AVX2 needs maddubs (int16
// pairs) and an add, then a madd to widen.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QUIRE_HAS_VNNI 1
#else
#define QUIRE_HAS_VNNI 0
#endif
// ... and on 512-bit registers (the AVX-512 set; emulated there in the tests-only variant)
#if QUIRE_HAS_VNNI && defined(__AVX512F__)
#define QUIRE_HAS_VNNI512 1
#else
#define QUIRE_HAS_VNNI512 0
#endif

namespace QUIRE_NS {
namespace {

constexpr int64_t kBlock = 32;
// Up to here: int8 dot products on the weight as stored. Each row of x costs about what one
// row does (the weight's blocks are unpacked per row), against a fixed de-quantization of the
// whole weight on the other path: measured on a Zen 3 core (Q4_1, SmolLM2's 1536 x 576), 4
// rows 175 us, 5 rows 229 us here against 559 us de-quantized, 8 rows 357 against 557, 16 rows
// about even (736 / 740). 8 keeps a speculative step (a request and its 4 to 7 drafts) and a
// batch of up to 8 decoding requests on this path.
constexpr int64_t kDecodeRows = 8;

enum class QType { kQ4_0, kQ4_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K };

// Rows of x up to which a call stays on the int8 dot products (past it: de-quantize, then a
// float matmul). With VNNI, Q4_0 / Q4_1 / Q8_0's grouped kernel (dot_group_pair: each weight
// load unpacked once for eight rows of x, one vpdpbusd per 4 x 16 products) outruns
// de-quantize + oneDNN's bf16 matmul at every size: vpdpbusd adds twice the products a cycle
// that vdpbf16ps does (a loop of either measured on a Zen 4 core: 234 and 117 GMAC/s).
// Zen 4, 2 threads, SmolLM2's four linears of a layer in Q4_1 (3.5M weights, bf16 x) against
// oneDNN's bf16 matmul on a packed de-quantized copy (a twin; the de-quantizing not counted;
// scripts/quant_linear_bench.py): 8 rows 0.156 ms against 0.239, 64 rows 1.01 against 1.17,
// 256 rows 3.36 against 4.42, 4096 rows 53.7 against 67.9 (250-270 GMAC/s against 190-214);
// its tied Q8_0 logits table (49152 x 576) 1.23-1.41x the packed table from 64 to 4096 rows.
// (Before the kernel took 16 rows a register, read each pair of groups as one stream and
// converted its bf16 results with vcvtneps2bf16: 206 GMAC/s, level with oneDNN at 512 rows
// and behind it past them.)
// Only in a bf16 model: an fp32 model asks for fp32 numerics, and on the compute-bound path it
// gets them (past the decode rows, the exact de-quantized weights), as before; bf16 carries 8
// bits of mantissa, so rounding x to int8 per block of 32 costs less (llama.cpp rounds x to
// int8 per block of 32 at every size). The AVX2 set runs a bf16 model's stack in fp32 (no
// bf16 arithmetic there), so its callers name the model's dtype (quant_linear's `numerics`).
// Without VNNI (AVX2: maddubs + add into int16, a madd to widen once a block) the grouped
// kernel still outruns the alternative there, the weight de-quantized once into bf16 panels
// and multiplied in fp32 by linear_bf16w (a Zen 4 running the AVX2 set, 2 threads, a layer's
// four Q4_1 linears, fp32 x; scripts/quant_linear_bench.py --variant avx2): 16 rows 0.61 ms
// against 0.94, 64 rows 2.32 against 3.27, 256 rows 9.4 against 11.6, 1024 rows 36.4 against
// 45.7 (93-100 GMAC/s against 60-79); the Q8_0 logits table 1.12-1.42x from 16 to 1024 rows.
// With AMX (Intel Sapphire Rapids and later), oneDNN's bf16 matmul runs on tiles and the
// crossover moves down to a batch of decode rows: measured on a 2-core Xeon with AMX (family 6
// model 207), SmolLM2's four linears of a layer in Q4_1, 2 threads, int8 against oneDNN's
// packed bf16 + de-quantizing into the kept buffer (1.8 ms): M = 64 2.3 ms against 0.9 + 1.8,
// 128 4.5 against 1.4 + 1.8, 512 18.5 against 6.7 + 1.8; one thread (de-quantizing 3.8 ms):
// 64 3.4 against 0.8 + 3.8, 128 9.1 against 2.4 + 3.8, 512 36.9 against 9.7 + 3.8. A batch of
// up to 64 decoding requests stays on the int8 kernel; prefill chunks go to the tiles. (Those
// figures predate dot_group_pair.)
constexpr int64_t kVnniRows = std::numeric_limits<int64_t>::max();
constexpr int64_t kAmxRows = 64;
// Q4_0 / Q4_1 rows of a bf16 model from kTileMinRows + 1 to kTileRows take the AMX kernel that
// de-quantizes the blocks into tiles on the way (avx512/quant_amx.h, tile_rows_limit) where
// the CPU has tiles, instead of oneDNN on the weight's bf16 twin; from 9 rows to
// kTileMinRows the int8 kernel. A 2-core Xeon with AMX (family 6, model 167), 30 layers of
// SmolLM2's four Q4_1 linears cycled so that they come from memory as in a step (medians of 7),
// tiles / int8 / twin: 9 rows 9.1 / 5.8 / 15.4 ms, 16 rows 8.7 / 7.8 / 15.4, 24 rows 11.7 /
// 11.1 / 17.3, 32 rows 12.1 / 13.2 / 18.3, 64 rows 14.0 / 23.9 / 20.2; another run, tiles /
// twin: 96 rows 23.0 / 27.3, 128 rows 25.7 / 27.6, 192 rows 33.0 / 33.4, 256 rows 40.0 / 38.9.
constexpr int64_t kTileMinRows = 24;
constexpr int64_t kTileRows = 128;
inline int64_t int8_rows_limit(QType t, at::ScalarType numerics) {
  const bool grouped = t == QType::kQ4_0 || t == QType::kQ4_1 || t == QType::kQ8_0;
  if (!(grouped && numerics == at::kBFloat16)) return kDecodeRows;
  return QUIRE_HAS_VNNI && amx_tiles_usable() ? kAmxRows : kVnniRows;
}

// The type of a weight's blocks, by their bytes as the file has them (uint8) or repacked
// (int8: the k-quants' unpacked scales take a few bytes more).
QType qtype_of(int64_t block_bytes, bool repacked) {
  switch (block_bytes) {
    case 18: return QType::kQ4_0;
    case 20: return QType::kQ4_1;
    case 34: return QType::kQ8_0;
    case 210: return QType::kQ6_K;
    case 144: if (!repacked) return QType::kQ4_K; break;
    case 176: if (!repacked) return QType::kQ5_K; break;
    case 148: if (repacked) return QType::kQ4_K; break;
    case 180: if (repacked) return QType::kQ5_K; break;
    default: break;
  }
  TORCH_CHECK(false, "quantized weight: blocks of ", block_bytes, " bytes (",
              repacked ? "repacked" : "as stored", ") are none of Q4_0 (18), Q4_1 (20), "
              "Q8_0 (34), Q4_K (144), Q5_K (176), Q6_K (210)");
}

// f(std::integral_constant<QType, T>{}) for the weight's type: the kernels unroll over it.
template <typename F>
void with_qtype(QType t, F f) {
  switch (t) {
    case QType::kQ4_0: f(std::integral_constant<QType, QType::kQ4_0>{}); break;
    case QType::kQ4_1: f(std::integral_constant<QType, QType::kQ4_1>{}); break;
    case QType::kQ8_0: f(std::integral_constant<QType, QType::kQ8_0>{}); break;
    case QType::kQ4_K: f(std::integral_constant<QType, QType::kQ4_K>{}); break;
    case QType::kQ5_K: f(std::integral_constant<QType, QType::kQ5_K>{}); break;
    case QType::kQ6_K: f(std::integral_constant<QType, QType::kQ6_K>{}); break;
  }
}

template <QType T>
constexpr bool kIsK = T == QType::kQ4_K || T == QType::kQ5_K || T == QType::kQ6_K;
// weights a block (a super-block for the k-quants) and its bytes repacked
template <QType T>
constexpr int64_t kValues = kIsK<T> ? 256 : 32;
template <QType T>
constexpr int64_t kBytes = T == QType::kQ4_0 ? 18 : T == QType::kQ4_1 ? 20 : T == QType::kQ8_0 ? 34
                           : T == QType::kQ4_K ? 148 : T == QType::kQ5_K ? 180 : 210;

int64_t values_per_block(QType t) {
  return t == QType::kQ4_K || t == QType::kQ5_K || t == QType::kQ6_K ? 256 : kBlock;
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return _cvtsh_ss(h);
}

// The 32 nibbles of a Q4 block as bytes 0..15, in weight order.
inline __m256i nibbles(__m128i t) {
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}
inline __m256i nibbles(const uint8_t* qs) {
  return nibbles(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
}

// 8 int32 partial sums of u[i] * s[i] (u unsigned, s signed bytes), as floats: exact, each
// pair's sum is at most 2 * 128 * 127 in magnitude (maddubs saturates only past 32767).
inline __m256 dot_u8_i8(__m256i u, __m256i s) {
  const __m256i pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows of x [M, K] (fp32, contiguous) as ggml's Q8_0: q [M * K] int8, and per block its scale
// d and d * sum(q) (what a Q4_1 block's offset and a Q4_0 block's -8 multiply).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, dsum;
};

// Eight of x's values as fp32 (bf16 widened: its bits are fp32's upper half).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Eight outputs stored as O (bf16: rounded to nearest even, as at::BFloat16 does).
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__) && !defined(QUIRE_AVX512_EMULATED)
  // vcvtneps2bf16: round to nearest even (a scalar loop here cost 0.5 of the 3.5 ms of a
  // 256-row call, Zen 4)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), (__m128i)_mm256_cvtneps_pbh(v));
  return;
#endif
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  for (int i = 0; i < 8; ++i) p[i] = at::BFloat16(t[i]);
}

// into r, whose vectors keep their capacity from call to call (a thread's one QuantizedRows:
// quant_linear_into), so a decode step's 121 calls allocate nothing here
template <typename X>
void quantize_rows(const X* x, int64_t M, int64_t K, QuantizedRows& r) {
  const int64_t num_blocks = M * K / kBlock;
  r.q.resize(M * K);
  r.d.resize(num_blocks);
  r.dsum.resize(num_blocks);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  // blocks are independent: many rows (a prefill) split over the threads
  at::parallel_for(0, num_blocks, 512, [&](int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const X* xb = x + b * kBlock;
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float max_abs = _mm_cvtss_f32(m);
    const float d = max_abs / 127.f;
    const __m256 inv = _mm256_set1_ps(max_abs > 0.f ? 127.f / max_abs : 0.f);
    __m256i i[4];
    for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  // even
    // packs work per 128-bit lane: the permute puts the 8 groups of 4 back in order
    const __m256i q16a = _mm256_packs_epi32(i[0], i[1]), q16b = _mm256_packs_epi32(i[2], i[3]);
    const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b),
                                                   _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.q.data() + b * kBlock), q8);
    const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q8),
                                           _mm256_set1_epi16(1));
    const int sum_q = int(hsum(_mm256_cvtepi32_ps(sums)));
    r.d[b] = d;
    r.dsum[b] = d * float(sum_q);
  }
  });
}

// Where a repacked row keeps its parts: nb blocks' scales (fp16), their offsets (Q4_1, fp16),
// then the quants, 16 (Q4) or 32 (Q8_0) bytes a block.
template <QType T>
struct RowLayout {
  static constexpr int64_t kQuantBytes = T == QType::kQ8_0 ? 32 : 16;
  static const uint8_t* scales(const uint8_t* row) { return row; }
  static const uint8_t* mins(const uint8_t* row, int64_t nb) { return row + 2 * nb; }
  static const uint8_t* quants(const uint8_t* row, int64_t nb) {
    return row + (T == QType::kQ4_1 ? 4 : 2) * nb;
  }
};

// The weights of one block's quants against x's block y, as 8 float partial sums.
template <QType T>
inline __m256 block_dot(const uint8_t* q, __m256i y) {
  if constexpr (T == QType::kQ8_0) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    // signed x signed through maddubs: |w| times y with w's sign
    return dot_u8_i8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w));
  } else {
    return dot_u8_i8(nibbles(q), y);  // Q4_0's -8 goes into the offsets
  }
}

inline __m256 halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// R repacked weight rows (row_bytes apart) dotted with one quantized row of x: out[0 .. R).
// Eight blocks at a time: their scales d_w * d_x as one vector each row (and the offsets'
// share, m_w * d_x * sum(q_x), or -8 d_w * ... for Q4_0, as one FMA), then each block's
// integer dot product times its lane of that vector.
template <QType T, int R>
inline void dot_rows(const uint8_t* w, int64_t row_bytes, int64_t nb, const int8_t* xq,
                     const float* xd, const float* xdsum, float* out) {
  using L = RowLayout<T>;
  __m256 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm256_setzero_ps();
  alignas(32) float scale[R][8];
  int64_t b0 = 0;
  for (; b0 + 8 <= nb; b0 += 8) {
    const __m256 dx = _mm256_loadu_ps(xd + b0);
    for (int r = 0; r < R; ++r) {
      const uint8_t* row = w + r * row_bytes;
      const __m256 dw = halves8(L::scales(row) + 2 * b0);
      _mm256_store_ps(scale[r], _mm256_mul_ps(dw, dx));
      if constexpr (T == QType::kQ4_1)
        off[r] = _mm256_fmadd_ps(halves8(L::mins(row, nb) + 2 * b0),
                                 _mm256_loadu_ps(xdsum + b0), off[r]);
      else if constexpr (T == QType::kQ4_0)
        off[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(-8.f)),
                                 _mm256_loadu_ps(xdsum + b0), off[r]);
    }
    for (int j = 0; j < 8; ++j) {
      const int64_t b = b0 + j;
      const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));
      for (int r = 0; r < R; ++r) {
        const __m256 dot = block_dot<T>(L::quants(w + r * row_bytes, nb) + b * L::kQuantBytes, y);
        acc[r] = _mm256_fmadd_ps(dot, _mm256_broadcast_ss(&scale[r][j]), acc[r]);
      }
    }
  }
  float tail[R] = {};
  for (; b0 < nb; ++b0) {  // the last nb % 8 blocks, one at a time
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b0 * kBlock));
    for (int r = 0; r < R; ++r) {
      const uint8_t* row = w + r * row_bytes;
      const float d = half_at(L::scales(row) + 2 * b0);
      const __m256 dot = block_dot<T>(L::quants(row, nb) + b0 * L::kQuantBytes, y);
      acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d * xd[b0]), acc[r]);
      if constexpr (T == QType::kQ4_1) tail[r] += half_at(L::mins(row, nb) + 2 * b0) * xdsum[b0];
      else if constexpr (T == QType::kQ4_0) tail[r] -= 8.f * d * xdsum[b0];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + hsum(off[r]) + tail[r];
}


// ---- the k-quants, repacked: one super-block of 256 weights is eight blocks of 32 ----------

// Where a repacked super-block keeps its parts.
template <QType T>
struct SuperBlock {
  // Q4_K / Q5_K: d, dmin (fp16), eight scales and eight mins (bytes), 8 x 16 bytes of nibbles,
  // Q5_K then eight 32-bit masks of fifth bits. Q6_K: d, sixteen int8 scales, 8 x 16 bytes of
  // low nibbles, 8 x 8 bytes of two-bit highs.
  static constexpr int64_t kScales = T == QType::kQ6_K ? 2 : 4;
  static constexpr int64_t kMins = 12;
  static constexpr int64_t kQuants = T == QType::kQ6_K ? 18 : 20;
  static constexpr int64_t kHighs = kQuants + 128;
};

// 32 bytes: 0x10 where bit i of the four bytes at p is set (weight i's fifth bit), else 0.
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t x;
  std::memcpy(&x, p, sizeof(x));
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                            0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(int(x)), shuffle);
  // byte i keeps only bit i % 8 clear in the mask: all ones exactly where that bit is set
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)),
                          _mm256_set1_epi8(0x10));
}

// 32 bytes (high << 4) from a Q6_K block's eight bytes of highs: byte j holds the two high
// bits of weights j, j + 8, j + 16, j + 24 in its bits 0-1, 2-3, 4-5, 6-7.
inline __m256i high_pairs(const uint8_t* p) {
  int64_t x;
  std::memcpy(&x, p, sizeof(x));
  const __m256i v = _mm256_srlv_epi64(_mm256_set1_epi64x(x), _mm256_set_epi64x(6, 4, 2, 0));
  return _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi8(3)), 4);  // < 4: stays in byte
}

// Block j's quants as bytes in weight order: 0..15 (Q4_K), 0..31 (Q5_K), -32..31 (Q6_K).
template <QType T>
inline __m256i k_quants(const uint8_t* sb, int j) {
  using S = SuperBlock<T>;
  const __m256i low = nibbles(sb + S::kQuants + 16 * j);
  if constexpr (T == QType::kQ4_K) return low;
  if constexpr (T == QType::kQ5_K) return _mm256_or_si256(low, fifth_bits(sb + S::kHighs + 4 * j));
  return _mm256_sub_epi8(_mm256_or_si256(low, high_pairs(sb + S::kHighs + 8 * j)),
                         _mm256_set1_epi8(32));
}

// Q6_K block j's two scales as int16 lanes: 8 of sc[2j] (weights 0..15), 8 of sc[2j + 1].
inline __m256i scale_pair(const uint8_t* sc) {
  int16_t two;
  std::memcpy(&two, sc, sizeof(two));
  const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(two),
                                          _mm_set_epi64x(0x0101010101010101, 0));
  return _mm256_cvtepi8_epi16(spread);
}

// Block j of super-block sb against x's block y, as 8 float partial sums (Q6_K's scales in).
template <QType T>
inline __m256 k_block_dot(const uint8_t* sb, int j, __m256i y) {
  const __m256i q = k_quants<T>(sb, j);
  if constexpr (T == QType::kQ6_K) {
    // |q| * (y with q's sign), pair sums <= 2 * 32 * 127, times scales <= 128: exact in int32
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(y, q));
    const __m256i scaled = _mm256_madd_epi16(
        pairs, scale_pair(sb + SuperBlock<T>::kScales + 2 * j));
    return _mm256_cvtepi32_ps(scaled);
  } else {
    return dot_u8_i8(q, y);
  }
}

inline __m256 bytes8(const uint8_t* p) {  // eight unsigned bytes as floats
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
      reinterpret_cast<const __m128i*>(p))));
}

// dot_rows for the k-quants: a super-block's eight scales (d * sc_j * d_x) as one vector,
// Q4_K / Q5_K's mins as one FMA (dmin * m_j * d_x * sum(q_x), subtracted at the end).
template <QType T, int R>
inline void dot_rows_k(const uint8_t* w, int64_t row_bytes, int64_t nsb, const int8_t* xq,
                       const float* xd, const float* xdsum, float* out) {
  using S = SuperBlock<T>;
  __m256 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm256_setzero_ps();
  alignas(32) float scale[R][8];
  for (int64_t s = 0; s < nsb; ++s) {
    const __m256 dx = _mm256_loadu_ps(xd + 8 * s);
    for (int r = 0; r < R; ++r) {
      const uint8_t* sb = w + r * row_bytes + s * kBytes<T>;
      const __m256 d = _mm256_set1_ps(half_at(sb));
      if constexpr (T == QType::kQ6_K) {
        _mm256_store_ps(scale[r], _mm256_mul_ps(d, dx));
      } else {
        _mm256_store_ps(scale[r], _mm256_mul_ps(_mm256_mul_ps(d, bytes8(sb + S::kScales)), dx));
        const __m256 dmin = _mm256_set1_ps(half_at(sb + 2));
        off[r] = _mm256_fmadd_ps(_mm256_mul_ps(dmin, bytes8(sb + S::kMins)),
                                 _mm256_loadu_ps(xdsum + 8 * s), off[r]);
      }
    }
    for (int j = 0; j < 8; ++j) {
      const __m256i y = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(xq + (8 * s + j) * kBlock));
      for (int r = 0; r < R; ++r) {
        const __m256 dot = k_block_dot<T>(w + r * row_bytes + s * kBytes<T>, j, y);
        acc[r] = _mm256_fmadd_ps(dot, _mm256_broadcast_ss(&scale[r][j]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) - hsum(off[r]);
}

// Block b of a repacked k-quant row as fp32 into out[0 .. 32), in gguf's order of operations
// ((d * sc) * q - dmin * m; Q6_K (d * sc) * (q - 32)): the same floats as its dequantize.
template <QType T>
inline void dequant_block_k(const uint8_t* row, int64_t b, float* out) {
  using S = SuperBlock<T>;
  const uint8_t* sb = row + (b / 8) * kBytes<T>;
  const int j = int(b % 8);
  const __m256i q = k_quants<T>(sb, j);
  const float d = half_at(sb);
  const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
  for (int i = 0; i < 4; ++i) {
    const __m128i eight = _mm_srli_si128(halves[i / 2], 8 * (i % 2));
    if constexpr (T == QType::kQ6_K) {
      const int8_t sc = int8_t(sb[S::kScales + 2 * j + i / 2]);
      const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight));
      _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(_mm256_set1_ps(d * float(sc)), v));
    } else {
      const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight));
      const float dsc = d * float(sb[S::kScales + j]);
      const float dm = half_at(sb + 2) * float(sb[S::kMins + j]);
      _mm256_storeu_ps(out + 8 * i, _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(dsc), v),
                                                  _mm256_set1_ps(dm)));
    }
  }
}

// One super-block from the file's layout (ggml's block_q4_K / q5_K / q6_K) into SuperBlock's.
template <QType T>
void repack_super_block(const uint8_t* in, uint8_t* o) {
  using S = SuperBlock<T>;
  uint8_t q[256];
  if constexpr (T == QType::kQ6_K) {
    const uint8_t *ql = in, *qh = in + 128;
    for (int h = 0; h < 2; ++h, ql += 64, qh += 32)
      for (int l = 0; l < 32; ++l) {
        uint8_t* v = q + 128 * h + l;
        v[0] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
        v[32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
        v[64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
        v[96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
      }
    std::memcpy(o, in + 208, 2);  // d
    std::memcpy(o + S::kScales, in + 192, 16);
  } else {
    const uint8_t* sc = in + 4;  // ggml's get_scale_min_k4
    for (int j = 0; j < 8; ++j) {
      o[S::kScales + j] = j < 4 ? sc[j] & 63 : (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
      o[S::kMins + j] = j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
    std::memcpy(o, in, 4);  // d, dmin
    const uint8_t* qh = in + 16;  // Q5_K
    const uint8_t* qs = T == QType::kQ5_K ? in + 48 : in + 16;
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        q[64 * c + l] = qs[32 * c + l] & 0xF;
        q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        if constexpr (T == QType::kQ5_K) {
          q[64 * c + l] |= ((qh[l] >> (2 * c)) & 1) << 4;
          q[64 * c + 32 + l] |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
        }
      }
  }
  for (int b = 0; b < 8; ++b) {
    const uint8_t* v = q + 32 * b;
    for (int i = 0; i < 16; ++i) o[S::kQuants + 16 * b + i] = (v[i] & 0xF) | ((v[i + 16] & 0xF) << 4);
    if constexpr (T == QType::kQ5_K) {
      uint32_t bits = 0;
      for (int i = 0; i < 32; ++i) bits |= uint32_t((v[i] >> 4) & 1) << i;
      std::memcpy(o + S::kHighs + 4 * b, &bits, sizeof(bits));
    } else if constexpr (T == QType::kQ6_K) {
      for (int j = 0; j < 8; ++j) {
        uint8_t byte = 0;
        for (int k = 0; k < 4; ++k) byte |= ((v[8 * k + j] >> 4) & 3) << (2 * k);
        o[S::kHighs + 8 * b + j] = byte;
      }
    }
  }
}

// Q4_0 / Q4_1 rows in groups of eight (repack: the first N - N % 8 rows; the rest stay row by
// row). Group g's block b is [8 scales (fp16)] [8 offsets (fp16, Q4_1)] [128 quant bytes],
// the quant bytes as 4 runs of 32: run j holds each row r's file bytes qs[4j .. 4j + 4) at
// 4r. Their low nibbles are weights 4j .. 4j + 3 of every row, the high ones 16 + 4j ..: so
// one 32-byte load is 8 rows x 4 weights twice, against x's 4 bytes broadcast, and one
// block's products for all 8 rows add up in the 8 lanes of one register (16-bit pair sums,
// exact: 8 of at most 2 * 15 * 127), converted and scaled once per block for all 8 rows
// instead of once per row (ggml's repacked 8-row kernels do the same).
constexpr int64_t kGroupRows = 8;

template <QType T>
constexpr bool kGrouped = T == QType::kQ4_0 || T == QType::kQ4_1 || T == QType::kQ8_0;

// The bytes before a block's quants in a unit of U rows: U scales (+ U offsets, Q4_1), fp16.
template <QType T>
constexpr int64_t group_head(int64_t U) { return (T == QType::kQ4_1 ? 4 : 2) * U; }
// A group's block holds its eight rows' quants as loads of 32 bytes, four bytes of each row a
// load (bytes 4j .. 4j + 3 of rows 0 .. 7 in load j): Q4's 16 nibble bytes a row in 4 loads
// (each unpacked into two), Q8_0's 32 int8 a row in 8.
template <QType T>
constexpr int kGroupLoads = T == QType::kQ8_0 ? 8 : 4;

// The rows that are read together (a unit): on the AVX-512 set groups come in pairs (2p,
// 2p + 1) of sixteen rows laid out as one group of sixteen (dot_group_pair: each 64-byte run
// one 512-bit load, its lanes the sixteen rows; the scales of a block one 256-bit load); a
// last odd group, and every group elsewhere, is a unit of eight. A unit's block b of U rows
// is [U scales] [U offsets, Q4_1] [kGroupLoads runs of 4U bytes, row r's at 4r], its blocks
// U * block bytes apart from its first row's place. (Two groups' blocks read as two 256-bit
// halves cost an insert a load, a fifth of the one-row kernel's vector instructions; before
// that, the pair's blocks interleaved at 160 bytes so that it read one sequential stream:
// two streams 2.9 KB apart, SmolLM2's Q4_1 rows, made a decode step's 30 layers 1.8x slower
// from memory on a Zen 4, each pair's second stream starting cold.)
struct GroupUnit {
  int64_t first_row, rows;
};
inline GroupUnit unit_of_group(int64_t g, int64_t num_whole) {
  if (QUIRE_HAS_VNNI512 && g < num_whole - num_whole % 2)
    return {(g - g % 2) * kGroupRows, 2 * kGroupRows};
  return {g * kGroupRows, kGroupRows};
}

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

// sum + u . s four bytes a lane: with VNNI one vpdpbusd into int32 lanes; else maddubs into
// int16 pairs (exact: a block's 8 adds of at most 2 * 15 * 127 stay below 32767)
inline __m256i add_dot4(__m256i sum, __m256i u, __m256i s) {
#if QUIRE_HAS_VNNI
  return _mm256_dpbusd_epi32(sum, u, s);
#else
  return _mm256_add_epi16(sum, _mm256_maddubs_epi16(u, s));
#endif
}

// sum + w . s four bytes a lane into int32 lanes for signed w (Q8_0): |w| against s with
// w's sign (|w| <= 128, |s| <= 127: maddubs' pairs stay below 32767; with VNNI one vpdpbusd)
inline __m256i add_dot4_signed(__m256i sum, __m256i w, __m256i s) {
  const __m256i u = _mm256_sign_epi8(w, w), signed_s = _mm256_sign_epi8(s, w);
#if QUIRE_HAS_VNNI
  return _mm256_dpbusd_epi32(sum, u, signed_s);
#else
  return _mm256_add_epi32(
      sum, _mm256_madd_epi16(_mm256_maddubs_epi16(u, signed_s), _mm256_set1_epi16(1)));
#endif
}

// An empty asm that takes v in a register and gives it back, so that GCC adds each product
// into its sum where the source does. Without it, on AVX2 (where add_dot4's int16 adds are
// free to reorder), GCC computed a block's 32 maddubs products for four rows of x first and
// added them later, most of them kept on the stack: 106 stack accesses in the Q4_1 loop, 1
// with it. (On the value, not on sum[m]: an asm operand on an array element kept the array
// in memory.)
template <typename V>
inline void keep_in_register(V& v) {
#if !QUIRE_HAS_VNNI
  asm("" : "+x"(v));
#endif
}

// add_dot4's sums as 8 floats, one a lane
inline __m256 sums_as_floats(__m256i sum) {
#if QUIRE_HAS_VNNI
  return _mm256_cvtepi32_ps(sum);
#else
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(sum, _mm256_set1_epi16(1)));
#endif
}

// out[m * ldo + r] (r < 8) = group's rows dotted with x rows m < MM (quantized, K apart);
// the group's blocks block_step bytes apart (a unit of eight: unit_of_group).
// `prefetch_next`: as dot_group_pair's (the next group's bytes, on a unit's first pass).
template <QType T, int MM, typename O>
inline void dot_group(const uint8_t* g, int64_t block_step, int64_t nb, const int8_t* xq,
                      int64_t K, const float* xd, const float* xdsum, O* out, int64_t ldo,
                      bool prefetch_next = false) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[MM];
  for (int m = 0; m < MM; ++m) acc[m] = _mm256_setzero_ps();
  const int64_t group_bytes = nb * block_step;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = g + b * block_step;
    if (prefetch_next) prefetch_bytes(blk + group_bytes, block_step);
    const uint8_t* qs = blk + group_head<T>(kGroupRows);
    __m256i sum[MM];
    for (int m = 0; m < MM; ++m) sum[m] = _mm256_setzero_si256();
    if constexpr (T == QType::kQ8_0) {
#if QUIRE_HAS_VNNI
      // x comes offset to unsigned (q_x + 128, decode_units' x_unsigned), so each load is one
      // vpdpbusd a row of x with w as the signed side: sum (q_x + 128) w - 128 sum w, the
      // second sum once a block for all rows of x (exact in int32: 32 products of at most
      // 255 * 128 a lane)
      const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
      __m256i w128 = _mm256_setzero_si256();
      for (int j = 0; j < kGroupLoads<T>; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
        w128 = _mm256_dpbusd_epi32(w128, bias, v);
        for (int m = 0; m < MM; ++m)
          sum[m] = _mm256_dpbusd_epi32(sum[m], bcast4(xq + m * K + b * kBlock + 4 * j), v);
      }
      for (int m = 0; m < MM; ++m) sum[m] = _mm256_sub_epi32(sum[m], w128);
#else
      for (int j = 0; j < kGroupLoads<T>; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
        for (int m = 0; m < MM; ++m) {
          __m256i s = add_dot4_signed(sum[m], v, bcast4(xq + m * K + b * kBlock + 4 * j));
          keep_in_register(s);
          sum[m] = s;
        }
      }
#endif
      const __m256 dw = halves8(blk);
      for (int m = 0; m < MM; ++m)  // int32 sums on both instruction sets
        acc[m] = _mm256_fmadd_ps(
            dw, _mm256_mul_ps(_mm256_cvtepi32_ps(sum[m]), _mm256_set1_ps(xd[m * nb + b])),
            acc[m]);
      continue;
    }
    for (int j = 0; j < kGroupLoads<T>; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * j));
      const __m256i lo = _mm256_and_si256(v, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      for (int m = 0; m < MM; ++m) {
        const int8_t* y = xq + m * K + b * kBlock;
        __m256i s = add_dot4(sum[m], lo, bcast4(y + 4 * j));
        s = add_dot4(s, hi, bcast4(y + 16 + 4 * j));
        keep_in_register(s);
        sum[m] = s;
      }
    }
    const __m256 dw = halves8(blk);
    const __m256 mw = T == QType::kQ4_1 ? halves8(blk + 16) : _mm256_setzero_ps();
    for (int m = 0; m < MM; ++m) {
      const __m256 dot = sums_as_floats(sum[m]);
      const float dx = xd[m * nb + b], dsum = xdsum[m * nb + b];
      if constexpr (T == QType::kQ4_1) {
        acc[m] = _mm256_fmadd_ps(dw, _mm256_mul_ps(dot, _mm256_set1_ps(dx)), acc[m]);
        acc[m] = _mm256_fmadd_ps(mw, _mm256_set1_ps(dsum), acc[m]);
      } else {  // Q4_0: d_w (d_x q_w . q_x - 8 d_x sum(q_x))
        acc[m] = _mm256_fmadd_ps(
            dw, _mm256_fmadd_ps(dot, _mm256_set1_ps(dx), _mm256_set1_ps(-8.f * dsum)), acc[m]);
      }
    }
  }
  for (int m = 0; m < MM; ++m) store8(out + m * ldo, acc[m]);
}

#if QUIRE_HAS_VNNI512
// A unit of sixteen rows (two groups: unit_of_group) in 512-bit registers: each 64-byte load is
// four bytes of each of the sixteen rows, so one vpdpbusd adds 4 x 16 products and a block's
// sums for the 16 rows are converted and scaled once. Against dot_group on two groups: half
// the instructions for the same products (the broadcasts of x, the unpacking, the scaling),
// which is what limits the grouped kernel where the cores, not memory, are the bound (Zen 4,
// 2 threads, a layer's four Q4_1 linears, bf16 x: see kVnniRows).
inline __m512i load64(const uint8_t* p) { return _mm512_loadu_si512(p); }

inline __m512 halves16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i bcast4x16(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// bf16: vcvtneps2bf16 rounds to nearest even, as at::BFloat16 does
inline void store16(at::BFloat16* p, __m512 v) {
  const auto h = _mm512_cvtneps_pbh(v);
  std::memcpy(p, &h, sizeof(h));
}

// out[m * ldo + r] (r < 16) = a unit of sixteen rows dotted with x rows m < MM: dot_group's
// arithmetic, lane for lane. At one or two rows of x (decode: bound by these instructions
// where memory is fast) the high nibbles are masked in place (v & 0xF0, sixteen times their
// value) into sums of their own, shifted back once a block (exact: the sums are multiples
// of 16, at most 4 x 4 x 240 x 127 a lane): one instruction a load instead of two. At more
// rows the shift is shared by the rows of x and the second sums would cost registers.
// `prefetch_next`: ask for the bytes that follow the unit (the next unit's) as its blocks are
// read, a block's worth at a time. A caller passing over a unit more than once (more rows of x
// than fit in registers) sets it on the first pass: the second pass re-reads the unit from L1
// and breaks the sequential stream the hardware prefetcher follows, so without it each unit's
// first pass waited on memory (SmolLM2's tied Q8_0 table, 2 threads, Zen 5, from cache: 8
// rows of x 0.55 ms, 9 rows 1.19 ms, 43 % of the samples on the weight loads).
template <QType T, int MM, typename O>
inline void dot_group_pair(const uint8_t* unit, int64_t nb, const int8_t* xq, int64_t K,
                           const float* xd, const float* xdsum, O* out, int64_t ldo,
                           bool prefetch_next = false) {
  constexpr int64_t kRows = 2 * kGroupRows, kStride = kRows * kBytes<T>;
  constexpr bool kSplitHigh = MM <= 2;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i high = _mm512_set1_epi8(static_cast<char>(0xF0));
  __m512 acc[MM];
  for (int m = 0; m < MM; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t unit_bytes = nb * kStride;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = unit + b * kStride;
    if (prefetch_next) prefetch_bytes(blk + unit_bytes, kStride);
    const uint8_t* qs = blk + group_head<T>(kRows);
    __m512i sum[MM], sum_high[MM];
    for (int m = 0; m < MM; ++m) sum[m] = sum_high[m] = _mm512_setzero_si512();
    const __m512 dw = halves16(blk);
    if constexpr (T == QType::kQ8_0) {  // x offset to unsigned, as in dot_group
      const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
      __m512i w128 = _mm512_setzero_si512();
      for (int j = 0; j < kGroupLoads<T>; ++j) {
        const __m512i v = load64(qs + 64 * j);
        w128 = _mm512_dpbusd_epi32(w128, bias, v);
        for (int m = 0; m < MM; ++m)
          sum[m] = _mm512_dpbusd_epi32(sum[m], bcast4x16(xq + m * K + b * kBlock + 4 * j), v);
      }
      for (int m = 0; m < MM; ++m)
        acc[m] = _mm512_fmadd_ps(
            dw, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum[m], w128)),
                              _mm512_set1_ps(xd[m * nb + b])),
            acc[m]);
      continue;
    }
    for (int j = 0; j < kGroupLoads<T>; ++j) {
      const __m512i v = load64(qs + 64 * j);
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = kSplitHigh ? _mm512_and_si512(v, high)
                                    : _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int m = 0; m < MM; ++m) {
        const int8_t* y = xq + m * K + b * kBlock;
        sum[m] = _mm512_dpbusd_epi32(sum[m], lo, bcast4x16(y + 4 * j));
        __m512i& sh = kSplitHigh ? sum_high[m] : sum[m];
        sh = _mm512_dpbusd_epi32(sh, hi, bcast4x16(y + 16 + 4 * j));
      }
    }
    if constexpr (kSplitHigh)
      for (int m = 0; m < MM; ++m)
        sum[m] = _mm512_add_epi32(sum[m], _mm512_srai_epi32(sum_high[m], 4));
    const __m512 mw = T == QType::kQ4_1 ? halves16(blk + 2 * kRows) : _mm512_setzero_ps();
    for (int m = 0; m < MM; ++m) {
      const __m512 dot = _mm512_cvtepi32_ps(sum[m]);
      const float dx = xd[m * nb + b], dsum = xdsum[m * nb + b];
      if constexpr (T == QType::kQ4_1) {
        acc[m] = _mm512_fmadd_ps(dw, _mm512_mul_ps(dot, _mm512_set1_ps(dx)), acc[m]);
        acc[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(dsum), acc[m]);
      } else {
        acc[m] = _mm512_fmadd_ps(
            dw, _mm512_fmadd_ps(dot, _mm512_set1_ps(dx), _mm512_set1_ps(-8.f * dsum)), acc[m]);
      }
    }
  }
  for (int m = 0; m < MM; ++m) store16(out + m * ldo, acc[m]);
}
#endif

// Row r of a unit's block (U rows): its quant bytes in the file's order (16 of Q4's nibble
// bytes in the low half, or Q8_0's 32).
template <QType T>
inline __m256i group_row_quants(const uint8_t* blk, int64_t U, int64_t r) {
  const uint8_t* qs = blk + group_head<T>(U) + 4 * r;
  int32_t part[8] = {};
  for (int j = 0; j < kGroupLoads<T>; ++j) std::memcpy(&part[j], qs + 4 * U * j, sizeof(int32_t));
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(part));
}

constexpr int kRowGroup = 4;  // weight rows sharing each load of x's block

// Rows of x whose sums dot_group keeps in registers at once: 8 with AVX-512's 32 vector
// registers (8 int32 sums + 8 float accumulators + the unpacked weights), else 5 of 16
// (5 sums + 5 accumulators + a load's low and high nibbles, the mask, x's broadcast, madd's
// ones). On a Zen 3 (2 threads, a layer's four Q4_1 linears, scripts/quant_linear_bench.py
// --variant avx2), 256 rows of x: 122 GMAC/s at 4 rows spilling sums to the stack (before
// keep_in_register), 153 at 4 rows in registers, 161 at 5 or 6; the Q8_0 logits table 87
// GMAC/s at 4 or 5 rows, 82 at 6.
constexpr int kXRowsInRegs = QUIRE_HAS_VNNI ? 8 : 5;
// Rows of x a tile (the grouped kernel's outer loop): 128 x K int8 bytes (74 KB at K = 576)
constexpr int64_t kXRowTile = 128;

// f(std::integral_constant<int, count>) for a count in 1 .. Max known only at run time.
template <int Max, typename F>
inline void with_count(int count, F&& f) {
  if constexpr (Max >= 1) {
    if (count == Max) f(std::integral_constant<int, Max>{});
    else with_count<Max - 1>(count, std::forward<F>(f));
  }
}

// out [M, N] = x's quantized rows xq against w's N rows, as units of weight rows: `schedule`
// (num_units, grain, run) runs run(u0, u1) over every unit once, on whichever threads it
// chooses (int8_rows_into: at::parallel_for; a running team: quant_linear_team).
template <QType T, typename O, typename S>
void decode_units(const QuantizedRows& xq, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                  O* out, S&& schedule) {
  const int64_t num_blocks = K / kBlock, row_bytes = K / kValues<T> * kBytes<T>;
  const int64_t num_groups = (N + kRowGroup - 1) / kRowGroup;
  // the kernel for R rows: the k-quants' runs over super-blocks, the others' over blocks
  auto rows_dot = [&](auto rows, const uint8_t* wr, const int8_t* q, const float* d,
                      const float* ds, float* o) {
    constexpr int R = decltype(rows)::value;
    if constexpr (kIsK<T>)
      dot_rows_k<T, R>(wr, row_bytes, K / kValues<T>, q, d, ds, o);
    else
      dot_rows<T, R>(wr, row_bytes, num_blocks, q, d, ds, o);
  };
  if constexpr (kGrouped<T>) {
    const int64_t num_whole = N / kGroupRows;
    // Q8_0 with VNNI: dot_group takes x as unsigned bytes (q_x + 128: the sign bit flipped)
    const int8_t* xq_group = xq.q.data();
#if QUIRE_HAS_VNNI
    std::vector<int8_t> x_unsigned;
    if constexpr (T == QType::kQ8_0) {
      x_unsigned.resize(xq.q.size());
      for (size_t i = 0; i < x_unsigned.size(); ++i)
        x_unsigned[i] = static_cast<int8_t>(xq.q[i] ^ 0x80);
      xq_group = x_unsigned.data();
    }
#endif
    // work units: pairs of groups (the AVX-512 set: unit_of_group), then the groups alone,
    // then the rows past the last group
    const int64_t num_pairs = QUIRE_HAS_VNNI512 ? num_whole / 2 : 0;
    const int64_t num_units = num_whole - num_pairs + (N % kGroupRows ? 1 : 0);
    schedule(num_units, num_pairs ? 1 : 2, [&](int64_t u0, int64_t u1) {
      // x's rows a tile at a time, each tile against all of this thread's groups (their
      // bytes stay in L2 across tiles; a tile's int8 rows stay in L1/L2 across groups)
      for (int64_t m0 = 0; m0 < M; m0 += kXRowTile) {
        const int64_t m1 = std::min(M, m0 + kXRowTile);
        for (int64_t u = u0; u < u1; ++u) {
          const bool pair = u < num_pairs;
          const int64_t g = pair ? 2 * u : u + num_pairs, n = g * kGroupRows;
          if (g < num_whole) {
            const GroupUnit unit = unit_of_group(g, num_whole);
            const int64_t offset = unit.first_row * row_bytes, block_step = unit.rows * kBytes<T>;
            // kXRowsInRegs rows of x at a time, then the rest (dot_group keeps MM rows' sums
            // in registers and unpacks each weight load once for them)
            // more than one pass over the unit: the first asks for the next unit's bytes
            const bool passes = m1 - m0 > kXRowsInRegs;
            auto rows_of_x = [&](auto mm, int64_t m) {
              const float* d = xq.d.data() + m * num_blocks;
              const float* ds = xq.dsum.data() + m * num_blocks;
#if QUIRE_HAS_VNNI512
              if (pair) {
                dot_group_pair<T, decltype(mm)::value, O>(w + offset, num_blocks,
                                                          xq_group + m * K, K, d, ds,
                                                          out + m * N + n, N, passes && m == m0);
                return;
              }
#endif
              dot_group<T, decltype(mm)::value, O>(w + offset, block_step, num_blocks,
                                                   xq_group + m * K, K, d, ds, out + m * N + n,
                                                   N, passes && m == m0);
            };
            int64_t m = m0;
            for (; m + kXRowsInRegs <= m1; m += kXRowsInRegs)
              rows_of_x(std::integral_constant<int, kXRowsInRegs>{}, m);
            if (m < m1) with_count<kXRowsInRegs - 1>(int(m1 - m), [&](auto mm) { rows_of_x(mm, m); });
            continue;
          }
          for (int64_t r = n; r < N; ++r)  // the rows past the last group, row by row
            for (int64_t m = m0; m < m1; ++m) {
              float one;
              rows_dot(std::integral_constant<int, 1>{}, w + r * row_bytes, xq.q.data() + m * K,
                       xq.d.data() + m * num_blocks, xq.dsum.data() + m * num_blocks, &one);
              out[m * N + r] = O(one);
            }
        }
      }
    });
    return;
  }
  schedule(num_groups, 8, [&](int64_t g0, int64_t g1) {
    float tmp[kRowGroup];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n = g * kRowGroup, rows = std::min<int64_t>(kRowGroup, N - n);
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* q = xq.q.data() + m * K;
        const float* d = xq.d.data() + m * num_blocks;
        const float* ds = xq.dsum.data() + m * num_blocks;
        if (rows == kRowGroup) {
          rows_dot(std::integral_constant<int, kRowGroup>{}, w + n * row_bytes, q, d, ds, tmp);
        } else {
          for (int64_t r = 0; r < rows; ++r)
            rows_dot(std::integral_constant<int, 1>{}, w + (n + r) * row_bytes, q, d, ds,
                     tmp + r);
        }
        for (int64_t r = 0; r < rows; ++r) out[m * N + n + r] = O(tmp[r]);
      }
    }
  });
}

// A block's 32 quants (bytes, weight order) as fp32 d * q + offset into out[0 .. 32).
template <QType T>
inline void dequant_values(__m256i bytes, float d, float offset, float* out) {
  const __m256 dv = _mm256_set1_ps(d), ov = _mm256_set1_ps(offset);
  const __m128i halves[2] = {_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1)};
  for (int i = 0; i < 4; ++i) {
    const __m128i eight = _mm_srli_si128(halves[i / 2], 8 * (i % 2));
    const __m256i wide = T == QType::kQ8_0 ? _mm256_cvtepi8_epi32(eight)
                                           : _mm256_cvtepu8_epi32(eight);
    _mm256_storeu_ps(out + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(wide), dv, ov));
  }
}

// Block b of row n of a repacked weight (nb blocks a row) as fp32 into out[0 .. 32).
template <QType T>
inline void dequant_block(const uint8_t* w, int64_t N, int64_t nb, int64_t n, int64_t b,
                          float* out) {
  using L = RowLayout<T>;
  const int64_t row_bytes = nb * kBytes<T>;
  if constexpr (kGrouped<T>) {
    if (n < N - N % kGroupRows) {  // in a unit of eight or sixteen (unit_of_group)
      const GroupUnit unit = unit_of_group(n / kGroupRows, N / kGroupRows);
      const uint8_t* blk = w + unit.first_row * row_bytes + b * unit.rows * kBytes<T>;
      const int64_t r = n - unit.first_row;
      const float d = half_at(blk + 2 * r);
      const __m256i quants = group_row_quants<T>(blk, unit.rows, r);
      if constexpr (T == QType::kQ8_0) {
        dequant_values<T>(quants, d, 0.f, out);
      } else {
        const float offset = T == QType::kQ4_1 ? half_at(blk + 2 * (unit.rows + r)) : -8.f * d;
        dequant_values<T>(nibbles(_mm256_castsi256_si128(quants)), d, offset, out);
      }
      return;
    }
  }
  const uint8_t* row = w + n * row_bytes;
  const float d = half_at(L::scales(row) + 2 * b);
  const uint8_t* q = L::quants(row, nb) + b * L::kQuantBytes;
  const __m256i bytes = T == QType::kQ8_0
                            ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))
                            : nibbles(q);
  const float offset = T == QType::kQ4_1   ? half_at(L::mins(row, nb) + 2 * b)
                       : T == QType::kQ4_0 ? -8.f * d
                                           : 0.f;
  dequant_values<T>(bytes, d, offset, out);
}

template <QType T, typename O>
void dequantize_into(const uint8_t* w, int64_t N, int64_t K, O* out) {
  const int64_t num_blocks = K / kBlock, row_bytes = K / kValues<T> * kBytes<T>;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    alignas(64) float tmp[kBlock];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < num_blocks; ++b) {
        if constexpr (kIsK<T>)
          dequant_block_k<T>(w + n * row_bytes, b, tmp);
        else
          dequant_block<T>(w, N, num_blocks, n, b, tmp);
        O* o = out + n * K + b * kBlock;
        if constexpr (std::is_same_v<O, float>) {
          std::memcpy(o, tmp, sizeof(tmp));
        } else {
          for (int j = 0; j < kBlock; j += Vec::kWidth) Vec::load(tmp + j).store(o + j);
        }
      }
  });
}

// The file's layout (uint8) regrouped (int8, same shape): Q4_0 / Q4_1 / Q8_0 in groups of
// eight rows (dot_group), the rest row by row as RowLayout says.
at::Tensor repack(const at::Tensor& w) {
  const int64_t N = w.size(0), nb = w.size(1), B = w.size(2);
  const QType type = qtype_of(B, false);
  if (type == QType::kQ4_K || type == QType::kQ5_K || type == QType::kQ6_K) {
    at::Tensor out;
    with_qtype(type, [&](auto t) {
      constexpr QType T = decltype(t)::value;
      if constexpr (kIsK<T>) {
        out = at::empty({N, nb, kBytes<T>}, w.options().dtype(at::kChar));
        const uint8_t* src = w.data_ptr<uint8_t>();
        uint8_t* dst = reinterpret_cast<uint8_t*>(out.data_ptr<int8_t>());
        at::parallel_for(0, N * nb, 256, [&](int64_t i0, int64_t i1) {
          for (int64_t i = i0; i < i1; ++i)
            repack_super_block<T>(src + i * B, dst + i * kBytes<T>);
        });
      }
    });
    return out;
  }
  const int64_t head = B == 20 ? 4 : 2, quant_bytes = B - head;
  at::Tensor out = at::empty(w.sizes(), w.options().dtype(at::kChar));
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = reinterpret_cast<uint8_t*>(out.data_ptr<int8_t>());
  // whole groups of eight rows in the units dot_group and dot_group_pair read
  // (unit_of_group), the rest row by row
  const int64_t grouped = N - N % kGroupRows;
  at::parallel_for(0, grouped / kGroupRows, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const GroupUnit unit = unit_of_group(g, grouped / kGroupRows);
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* o = dst + unit.first_row * nb * B + b * unit.rows * B;
        for (int64_t n = g * kGroupRows; n < (g + 1) * kGroupRows; ++n) {
          const uint8_t* blk = src + (n * nb + b) * B;
          const int64_t r = n - unit.first_row, U = unit.rows;
          std::memcpy(o + 2 * r, blk, 2);  // d
          if (head == 4) std::memcpy(o + 2 * U + 2 * r, blk + 2, 2);  // m
          for (int64_t j = 0; j < quant_bytes / 4; ++j)  // kGroupLoads: 4 (Q4) or 8 (Q8_0)
            std::memcpy(o + head * U + 4 * U * j + 4 * r, blk + head + 4 * j, 4);
        }
      }
    }
  });
  at::parallel_for(grouped, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = src + n * nb * B;
      uint8_t* o = dst + n * nb * B;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = row + b * B;
        std::memcpy(o + 2 * b, blk, 2);  // d
        if (head == 4) std::memcpy(o + 2 * nb + 2 * b, blk + 2, 2);  // m
        std::memcpy(o + head * nb + b * quant_bytes, blk + head, quant_bytes);
      }
    }
  });
  return out;
}

// The weight repacked: as given where it is (int8), else regrouped now (uint8, the file's).
at::Tensor repacked(const at::Tensor& w, const char* name) {
  TORCH_CHECK((w.scalar_type() == at::kByte || w.scalar_type() == at::kChar) && w.dim() == 3 &&
                  w.is_contiguous(),
              name, ": a quantized weight is contiguous [N, K / 32 (K / 256: k-quants), block bytes], uint8 as the "
              "GGUF file lays it out or int8 from repack_gguf");
  qtype_of(w.size(2), w.scalar_type() == at::kChar);
  return w.scalar_type() == at::kChar ? w : repack(w);
}

}  // namespace

bool amx_tiles_usable() {
  static const bool usable = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    // CPUID.(EAX=7, ECX=0):EDX bit 22 AMX-BF16, bit 24 AMX-TILE, bit 25 AMX-INT8
    const unsigned amx = (1u << 22) | (1u << 24) | (1u << 25);
    if ((d & amx) != amx) return false;
#if defined(__linux__) && defined(SYS_arch_prctl)
    // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA (18): refused by kernels before 5.16
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) == 0;
#else
    return false;
#endif
  }();
  return usable;
}

bool is_quantized_weight(const at::Tensor& w) {
  return (w.scalar_type() == at::kByte || w.scalar_type() == at::kChar) && w.dim() == 3;
}

at::Tensor repack_gguf(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kByte, "repack_gguf: the file's blocks, uint8");
  return repacked(w, "repack_gguf");
}

// [N, K]: the dense shape of a repacked weight
std::array<int64_t, 2> dense_shape(const at::Tensor& w) {
  return {w.size(0), w.size(1) * values_per_block(qtype_of(w.size(2), true))};
}

// The repacked weight w de-quantized into out (fp32 or bf16 [N, K], contiguous).
void dequantize_weight_into(const at::Tensor& w, at::Tensor& out) {
  const QType type = qtype_of(w.size(2), true);
  const auto [N, K] = dense_shape(w);
  const at::ScalarType dtype = out.scalar_type();
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr<int8_t>());
  with_qtype(type, [&](auto t) {
    constexpr QType T = decltype(t)::value;
    if (dtype == at::kFloat)
      dequantize_into<T>(wp, N, K, out.data_ptr<float>());
    else
      dequantize_into<T>(wp, N, K, out.data_ptr<at::BFloat16>());
  });
}

// A many-row call's de-quantized weight goes into one buffer kept across calls (per thread:
// the engine loop's), grown to the largest weight seen. A fresh tensor of tens of MB pays its
// page faults on every call: measured on a Zen 4 (2 threads), the embedded model's Q8_0
// logits projection (49152 x 576, 56 MB in bf16) took 29.6 ms to de-quantize into a new
// tensor, of which a plain 56 MB copy into a new tensor is 22.3 ms and into a reused one 4.6.
at::Tensor dequantized_scratch(const at::Tensor& w, at::ScalarType dtype) {
  thread_local at::Tensor buffer;
  const auto [N, K] = dense_shape(w);
  const int64_t bytes = N * K * int64_t(c10::elementSize(dtype));
  if (!buffer.defined() || buffer.numel() < bytes) {
    buffer = at::Tensor();  // the old one goes first: the two never live together
    buffer = at::empty({bytes}, w.options().dtype(at::kByte));
  }
  at::Tensor out = buffer.narrow(0, 0, bytes).view(dtype).view({N, K});
  dequantize_weight_into(w, out);
  return out;
}

at::Tensor dequantize_weight(const at::Tensor& w_in, at::ScalarType dtype) {
  const at::Tensor w = repacked(w_in, "dequantize_weight");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "dequantize_weight: into fp32 or bf16");
  at::Tensor out = at::empty(dense_shape(w), w.options().dtype(dtype));
  dequantize_weight_into(w, out);
  return out;
}

namespace {

// out [M, N] (contiguous, bf16 or fp32) = x (contiguous [M, K], bf16 or fp32) @ w^T on the int8
// dot products: x quantized per block of 32 into the thread's one QuantizedRows, then
// decode_units on the units as `schedule` hands them out (int8_rows_into: at::parallel_for)
template <typename S>
void int8_rows_scheduled(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, QType type,
                         const S& schedule) {
  thread_local QuantizedRows xq;
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (x.scalar_type() == at::kBFloat16)
    quantize_rows(x.data_ptr<at::BFloat16>(), M, K, xq);
  else
    quantize_rows(x.data_ptr<float>(), M, K, xq);
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr<int8_t>());
  with_qtype(type, [&](auto t) {
    constexpr QType T = decltype(t)::value;
    if (out.scalar_type() == at::kBFloat16)
      decode_units<T>(xq, M, K, wp, N, out.data_ptr<at::BFloat16>(), schedule);
    else
      decode_units<T>(xq, M, K, wp, N, out.data_ptr<float>(), schedule);
  });
}

void int8_rows_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, QType type) {
  int8_rows_scheduled(out, x, w, type, [](int64_t units, int64_t grain, const auto& run) {
    at::parallel_for(0, units, grain, run);
  });
}

// A team member's units of a linear (decode_units' schedule): its own contiguous share first
// (one stream a member, as parallel_for's), `grain` units at a time from the front; then the
// other members' remaining units from their ends, one grain at a time, until none is left.
// A share's word is exhausted when a member leaves a linear, so the next linear's store
// cannot race with a taker (the barrier between linears orders them).
inline uint64_t unit_range(int64_t first, int64_t end) {
  return uint64_t(first) << 32 | uint64_t(end);
}

// One grain of a share's remaining units, from its front or its end: [first, end) taken,
// or an empty range where none is left.
std::pair<int64_t, int64_t> take_units(std::atomic<uint64_t>& share, int64_t grain,
                                       bool front) {
  for (uint64_t cur = share.load(std::memory_order_acquire);;) {
    const int64_t first = int64_t(cur >> 32), end = int64_t(cur & 0xFFFFFFFFu);
    if (first >= end) return {0, 0};
    const int64_t n = std::min(grain, end - first);
    const uint64_t rest = front ? unit_range(first + n, end) : unit_range(first, end - n);
    if (share.compare_exchange_weak(cur, rest, std::memory_order_acq_rel,
                                    std::memory_order_acquire))
      return front ? std::pair{first, first + n} : std::pair{end - n, end};
  }
}

template <typename F>
void team_units(QuantTeam& team, int member, int size, int64_t units, int64_t grain,
                const F& run) {
  std::atomic<uint64_t>& mine = team.shares[member].units;
  mine.store(unit_range(units * member / size, units * (member + 1) / size),
             std::memory_order_release);
  for (int k = 0; k < size; ++k) {  // k = 0: this member's own share, then the others'
    std::atomic<uint64_t>& share = team.shares[(member + k) % size].units;
    for (auto [u0, u1] = take_units(share, grain, k == 0); u0 < u1;
         std::tie(u0, u1) = take_units(share, grain, k == 0))
      run(u0, u1);
  }
}

std::optional<QType> int8_type_for(const at::Tensor& w, int64_t M, at::ScalarType dtype,
                                   std::optional<at::ScalarType> numerics) {
  if (w.scalar_type() != at::kChar || w.dim() != 3 || !w.is_contiguous()) return std::nullopt;
  const QType type = qtype_of(w.size(2), true);
  if (M == 0 || (dtype != at::kFloat && dtype != at::kBFloat16) ||
      M > int8_rows_limit(type, numerics.value_or(dtype)))
    return std::nullopt;
  return type;
}

}  // namespace

void QuantTeam::barrier(int size) {
  if (size <= 1) return;
  const int seen = phase.load(std::memory_order_acquire);
  if (arrived.fetch_add(1, std::memory_order_acq_rel) == size - 1) {
    arrived.store(0, std::memory_order_relaxed);
    phase.store(seen + 1, std::memory_order_release);
    return;
  }
  // spin (a decode linear is some microseconds); past ~1 ms, a member is likely off its core
  // (more threads than free cores): yield it the core
  for (int spins = 0; phase.load(std::memory_order_acquire) == seen; ++spins) {
    _mm_pause();
    if (spins >= 1 << 14) sched_yield();
  }
}

// Rows of bf16 x up to which a Q4_0 / Q4_1 call runs on AMX tiles
// (avx512/quant_amx.h; 0: never): where the CPU has them, the weight's rows all lie in units of
// 16, and the tiles are not turned off (quant_tiles). Past it oneDNN multiplies the weight's
// bf16 tile twin, blocked for a long prefill's rows. See kTileRows.
int64_t tile_rows_limit(QType type, int64_t N) {
#if defined(QUIRE_AMX_QUANT)
  if ((type == QType::kQ4_0 || type == QType::kQ4_1) && N % quant_amx::kUnitRows == 0 &&
      quant_amx::enabled())
    return kTileRows;
#else
  (void)type;
  (void)N;
#endif
  return 0;
}

// out [M, N] (bf16 or fp32) = x (bf16 [M, K], contiguous) @ dequant(w)^T on the tiles
void tile_rows_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, QType type) {
#if defined(QUIRE_AMX_QUANT)
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(w.data_ptr<int8_t>());
  using quant_amx::Kind;
  auto run = [&](auto kind, auto* o) {
    constexpr Kind T = decltype(kind)::value;
    at::parallel_for(0, N / quant_amx::kUnitRows, 4, [&](int64_t u0, int64_t u1) {
      quant_amx::units<T>(xp, M, K, wp, N, o, u0, u1);
    });
  };
  auto with_out = [&](auto kind) {
    if (out.scalar_type() == at::kBFloat16) run(kind, out.data_ptr<at::BFloat16>());
    else run(kind, out.data_ptr<float>());
  };
  if (type == QType::kQ4_1) with_out(std::integral_constant<Kind, Kind::kQ4_1>{});
  else with_out(std::integral_constant<Kind, Kind::kQ4_0>{});
#else
  (void)out, (void)x, (void)w, (void)type;
  TORCH_CHECK(false, "quant_linear: this kernel set has no AMX tiles");
#endif
}

bool quant_linear_into_takes(const at::Tensor& w, int64_t rows, int64_t in_features,
                             at::ScalarType dtype, std::optional<at::ScalarType> numerics) {
  const std::optional<QType> type = int8_type_for(w, rows, dtype, numerics);
  return type && w.size(1) * values_per_block(*type) == in_features;
}

void quant_linear_team(at::Tensor& out, const at::Tensor& x, const at::Tensor& w,
                       QuantTeam& team, int member, int size) {
  int8_rows_scheduled(out, x, w, qtype_of(w.size(2), true),
                      [&](int64_t units, int64_t grain, const auto& run) {
                        team_units(team, member, size, units, grain, run);
                      });
}

bool quant_linear_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& w,
                       std::optional<at::ScalarType> numerics) {
  if (x.dim() != 2 || !x.is_contiguous() ||
      !quant_linear_into_takes(w, x.size(0), x.size(1), x.scalar_type(), numerics))
    return false;
  const QType type = qtype_of(w.size(2), true);
  const int64_t N = w.size(0), M = x.size(0);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == M && out.size(1) == N &&
                  out.scalar_type() == x.scalar_type(),
              "quant_linear_into: out must be contiguous [M, N] in x's dtype");
  int8_rows_into(out, x, w, type);
  return true;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w_in,
                        const std::optional<at::Tensor>& bias,
                        std::optional<at::ScalarType> numerics) {
  const at::Tensor w = repacked(w_in, "quant_linear");
  const QType type = qtype_of(w.size(2), true);
  const int64_t N = w.size(0), K = w.size(1) * values_per_block(type);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_linear: x must be fp32 or bf16 [M, K] with the weight's K = ", K);
  const int64_t M = x.size(0);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  // a bf16 model's Q4 rows past kTileMinRows on AMX tiles, else the int8 dot products
  const bool tiles = bf16 && numerics.value_or(at::kBFloat16) == at::kBFloat16 &&
                     M > kTileMinRows && M <= tile_rows_limit(type, N);
  if (!tiles && M > int8_rows_limit(type, numerics.value_or(x.scalar_type())))
    return at::linear(x, dequantized_scratch(w, x.scalar_type()), bias);
  // bf16 is read and written as it is (no fp32 copies a call: a few us of SmolLM2's 121
  // calls a decode step); with a bias the sum stays fp32 up to one rounding, as before
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty(
      {M, N}, x.options().dtype(bf16 && !bias.has_value() ? at::kBFloat16 : at::kFloat));
  if (M == 0) return out.to(x.scalar_type());
  if (tiles)
    tile_rows_into(out, xc, w, type);
  else
    int8_rows_into(out, xc, w, type);
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "quant_linear: bias must be [N]");
    out.add_(bias->to(at::kFloat).view({1, N}));
  }
  return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
}

int64_t quant_int8_rows(const at::Tensor& w, at::ScalarType numerics) {
  TORCH_CHECK(is_quantized_weight(w), "quant_int8_rows: a quantized weight [N, K / 32, bytes]");
  return int8_rows_limit(qtype_of(w.size(2), w.scalar_type() == at::kChar), numerics);
}

int64_t quant_tile_rows(const at::Tensor& w) {
  TORCH_CHECK(is_quantized_weight(w), "quant_tile_rows: a quantized weight [N, K / 32, bytes]");
  return tile_rows_limit(qtype_of(w.size(2), w.scalar_type() == at::kChar), w.size(0));
}

bool quant_tiles(std::optional<bool> want) {
#if defined(QUIRE_AMX_QUANT)
  if (want.has_value()) quant_amx::wanted().store(*want);
  return quant_amx::enabled();
#else
  (void)want;
  return false;
#endif
}

TORCH_LIBRARY_FRAGMENT(QUIRE_NS, m) {
  // the most rows of bf16 x a call with this weight takes from its blocks on AMX tiles (the
  // int8 kernel up to kTileMinRows, the tiles past it: avx512/quant_amx.h; 0: none here)
  m.def("quant_tile_rows(Tensor w) -> int");
  // whether Q4 linears run on AMX tiles here; `want` turns that on or off (tests, A/B runs)
  m.def("quant_tiles(bool? want=None) -> bool", &quant_tiles);
  // the most rows of x a call with this weight keeps on the int8 dot products, in a model
  // computing in `numerics` (x's dtype, or the model's where x is wider: quant_linear)
  m.def("quant_int8_rows(Tensor w, ScalarType numerics) -> int");
  // whether oneDNN's matmuls run on AMX tiles here (and so where quant_int8_rows draws its line)
  m.def("amx_tiles() -> bool", &amx_tiles_usable);
  m.def("quant_linear(Tensor x, Tensor w, Tensor? bias, ScalarType? numerics=None) -> Tensor");
  m.def("dequantize_weight(Tensor w, ScalarType dtype) -> Tensor");
  m.def("repack_gguf(Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(QUIRE_NS, CPU, m) {
  m.impl("quant_int8_rows", &quant_int8_rows);
  m.impl("quant_tile_rows", &quant_tile_rows);
  m.impl("quant_linear", &quant_linear);
  m.impl("dequantize_weight", &dequantize_weight);
  m.impl("repack_gguf", &repack_gguf);
}

}  // namespace QUIRE_NS
