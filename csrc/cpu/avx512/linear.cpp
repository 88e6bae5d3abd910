// bf16 linear for few rows (decode at small batch): out[M, N] = x[M, K] @ w[N, K]^T (+ bias).
//
// At small M a linear layer is a stream over its weights, so the speed is memory bandwidth.
// Each thread streams a contiguous band of weight rows once, and every row it loads is used
// by all M inputs before moving on (AVX-512 BF16 dot products, fp32 accumulation, one
// rounding to bf16 at the end, as torch's own bf16 matmul rounds).
//
// Reference: torch.nn.functional.linear; tests compare the two.
//
// Two streamed layouts: plain bf16 (pack_skinny), and the same bits exponent-coded, a
// lossless 12-bit form that decode reads a quarter fewer bytes of (pack_coded, below).

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#include "ops.h"

namespace QUIRE_NS {
namespace {

constexpr int64_t kMaxRows = 8;

// f(std::integral_constant<int, M>{}) for the row count M (1 to 8): the kernels unroll over M.
template <typename F>
void with_rows(int64_t M, F f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// The bias as a pointer (null without one); `keep` holds the contiguous copy alive.
const at::BFloat16* bias_data(const std::optional<at::Tensor>& bias, int64_t N,
                              at::Tensor& keep) {
  if (!bias.has_value()) return nullptr;
  keep = bias->contiguous();
  TORCH_CHECK(keep.scalar_type() == at::kBFloat16 && keep.numel() == N,
              "skinny_linear: bias [N] in bf16");
  return keep.data_ptr<at::BFloat16>();
}

inline __m512bh load_bh(const at::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

// R weight rows at a time, each dotted with all M inputs: M * R accumulators.
template <int M, int R>
void band(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias,
          at::BFloat16* out, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    __m512 acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      __m512bh wv[R];
      for (int r = 0; r < R; ++r) wv[r] = load_bh(w + (n + r) * K + k);
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = load_bh(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) {
        float v = _mm512_reduce_add_ps(acc[m][r]);
        if (bias) v += float(bias[n + r]);
        out[m * N + n + r] = at::BFloat16(v);
      }
  }
  if (n < n1) band<M, 1>(x, w, bias, out, K, N, n, n1);
}

// The weight laid out for streaming: row groups of kGroup, and within a group, for each
// 32-wide slice of K, the group's rows side by side: [N / kGroup][K / 32][kGroup][32].
// A thread then reads one sequential stream instead of kGroup interleaved ones.
constexpr int64_t kGroup = 4;

at::Tensor pack_skinny(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) % 32 == 0 &&
                  w.size(0) % kGroup == 0,
              "pack_skinny: bf16 [N, K], N a multiple of 4, K of 32");
  const int64_t N = w.size(0), K = w.size(1);
  return w.contiguous().view({N / kGroup, kGroup, K / 32, 32}).permute({0, 2, 1, 3}).contiguous();
}

// The group's M x 4 dot products, each summed across its lanes, + bias, rounded once to bf16.
template <int M>
inline void store_group(__m512 (&acc)[M][kGroup], const at::BFloat16* bias, at::BFloat16* out,
                        int64_t N, int64_t g) {
  for (int m = 0; m < M; ++m) {
    const __m128 sums = simd::sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
    alignas(16) float v[4];
    _mm_store_ps(v, sums);
    for (int r = 0; r < kGroup; ++r) {
      const int64_t n = g * kGroup + r;
      out[m * N + n] = at::BFloat16(bias ? v[r] + float(bias[n]) : v[r]);
    }
  }
}

template <int M>
void packed_band(const at::BFloat16* x, const at::BFloat16* wp, const at::BFloat16* bias,
                 at::BFloat16* out, int64_t K, int64_t N, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    const at::BFloat16* w = wp + g * kGroup * K;
    __m512 acc[M][kGroup];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < kGroup; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32, w += kGroup * 32) {
      __m512bh wv[kGroup];
      for (int r = 0; r < kGroup; ++r) wv[r] = load_bh(w + r * 32);
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = load_bh(x + m * K + k);
        for (int r = 0; r < kGroup; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
      }
    }
    store_group<M>(acc, bias, out, N, g);
  }
}

// ---------------------------------------------------------------- the exponent-coded layout
//
// A bf16 weight is sign (1 bit), exponent (8) and mantissa (7). Trained weights use few
// exponents per row (SmolLM2: 6 to 16 of the 256), so a row's exponents go into a 16-entry
// table and each weight keeps a 4-bit index into it: 12 bits a weight instead of 16, the same
// bits after decoding. Decode is bandwidth-bound, so a quarter fewer bytes is up to a quarter
// less time; the decoding (a vpermw table lookup and a ternary-logic merge per 32 weights)
// runs in the shadow of the loads. A matrix with a row of more than 16 exponents stays plain.
//
// Per group of kGroup = 4 rows, kCodedHeader + K / 32 * kCodedSlice bytes:
//   header: each row's table, 16 words of (exponent << 7), 32 bytes a row;
//   per 32-wide slice of K: 128 bytes of (sign << 7 | mantissa), laid out so that unpacking a
//   64-byte register with itself (vpunpck{l,h}bw) yields rows 0 and 1 (then 2 and 3) as
//   words (b << 8 | b); then 64 bytes of codes, word i holding weight i's code of row q in
//   bits 4q..4q+3 (vpermw reads bits 0-4 of each index; the table is repeated in entries
//   16-31, so bit 4 does not matter).
// Decoded word: (b << 8 | b) & 0x807F keeps the sign at bit 15 and the mantissa in bits
// 0-6; OR the table's exponent << 7. Exactly the plain layout's 32 weights, in its order, so
// the dot products (and their roundings) are the plain kernel's.
constexpr int64_t kCodedHeader = 4 * 32, kCodedSlice = 192;

int64_t coded_group_bytes(int64_t K) { return kCodedHeader + K / 32 * kCodedSlice; }

at::Tensor pack_coded(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) % 32 == 0 &&
                  w.size(0) % kGroup == 0,
              "pack_coded: bf16 [N, K], N a multiple of 4, K of 32");
  const at::Tensor wc = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), groups = N / kGroup;
  const auto* bits = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  at::Tensor out = at::empty({groups, coded_group_bytes(K)}, w.options().dtype(at::kByte));
  uint8_t* op = out.data_ptr<uint8_t>();
  std::atomic<bool> fits{true};
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1 && fits.load(std::memory_order_relaxed); ++g) {
      uint8_t* gp = op + g * coded_group_bytes(K);
      uint8_t code[kGroup][256];
      for (int64_t q = 0; q < kGroup; ++q) {
        const uint16_t* row = bits + (g * kGroup + q) * K;
        bool used[256] = {};
        for (int64_t i = 0; i < K; ++i) used[(row[i] >> 7) & 0xFF] = true;
        uint16_t table[16] = {};
        int n = 0;
        for (int e = 0; e < 256; ++e) {
          if (!used[e]) continue;
          if (n == 16) {
            fits = false;
            return;
          }
          table[n] = uint16_t(e << 7);
          code[q][e] = uint8_t(n++);
        }
        std::memcpy(gp + 32 * q, table, sizeof(table));
      }
      for (int64_t s = 0; s < K / 32; ++s) {
        uint8_t* slice = gp + kCodedHeader + s * kCodedSlice;
        uint16_t codes[32] = {};
        for (int64_t q = 0; q < kGroup; ++q)
          for (int64_t i = 0; i < 32; ++i) {
            const uint16_t v = bits[(g * kGroup + q) * K + s * 32 + i];
            slice[(q / 2) * 64 + 16 * (i / 8) + 8 * (q % 2) + i % 8] =
                uint8_t(((v >> 8) & 0x80) | (v & 0x7F));
            codes[i] |= uint16_t(code[q][(v >> 7) & 0xFF] << (4 * q));
          }
        std::memcpy(slice + 128, codes, sizeof(codes));
      }
    }
  });
  return fits ? out : at::empty({0}, out.options());
}

template <int M>
void coded_band(const at::BFloat16* x, const uint8_t* wc, const at::BFloat16* bias,
                at::BFloat16* out, int64_t K, int64_t N, int64_t g0, int64_t g1) {
  const __m512i keep = _mm512_set1_epi32(0x807F807F);  // sign and mantissa of (b << 8 | b)
  const int64_t group_bytes = coded_group_bytes(K);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* p = wc + g * group_bytes;
    __m512i table[kGroup];
    for (int r = 0; r < kGroup; ++r)
      table[r] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * r)));
    p += kCodedHeader;
    __m512 acc[M][kGroup];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < kGroup; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32, p += kCodedSlice) {
      const __m512i s01 = _mm512_loadu_si512(p), s23 = _mm512_loadu_si512(p + 64);
      const __m512i codes = _mm512_loadu_si512(p + 128);
      // (A & B) | C is ternary-logic 0xEA
      const __m512i wv[kGroup] = {
          _mm512_ternarylogic_epi32(_mm512_unpacklo_epi8(s01, s01), keep,
                                    _mm512_permutexvar_epi16(codes, table[0]), 0xEA),
          _mm512_ternarylogic_epi32(_mm512_unpackhi_epi8(s01, s01), keep,
                                    _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), table[1]), 0xEA),
          _mm512_ternarylogic_epi32(_mm512_unpacklo_epi8(s23, s23), keep,
                                    _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 8), table[2]), 0xEA),
          _mm512_ternarylogic_epi32(_mm512_unpackhi_epi8(s23, s23), keep,
                                    _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 12), table[3]), 0xEA)};
      for (int m = 0; m < M; ++m) {
        const __m512bh xv = load_bh(x + m * K + k);
        for (int r = 0; r < kGroup; ++r)
          acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, (__m512bh)wv[r]);
      }
    }
    store_group<M>(acc, bias, out, N, g);
  }
}

}  // namespace

at::Tensor skinny_linear_packed(const at::Tensor& x, const at::Tensor& wp,
                                const std::optional<at::Tensor>& bias) {
  const bool coded = wp.scalar_type() == at::kByte;
  TORCH_CHECK(wp.is_contiguous() &&
                  (coded ? wp.dim() == 2 && (wp.size(1) - kCodedHeader) % kCodedSlice == 0
                         : wp.dim() == 4 && wp.size(2) == kGroup && wp.size(3) == 32),
              "skinny_linear_packed: a weight from pack_skinny or pack_coded");
  const int64_t M = x.size(0), N = wp.size(0) * kGroup;
  const int64_t K = coded ? (wp.size(1) - kCodedHeader) / kCodedSlice * 32 : wp.size(1) * 32;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16 && M >= 1 &&
                  M <= kMaxRows, "skinny_linear_packed: x [1..8, K] bf16");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  at::Tensor bias_keep;
  const at::BFloat16* b = bias_data(bias, N, bias_keep);
  auto* xp = xc.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const void* w = wp.data_ptr();
  at::parallel_for(0, N / kGroup, 16, [&](int64_t g0, int64_t g1) {
    with_rows(M, [&](auto m) {
      constexpr int kM = decltype(m)::value;
      if (coded)
        coded_band<kM>(xp, static_cast<const uint8_t*>(w), b, op, K, N, g0, g1);
      else
        packed_band<kM>(xp, static_cast<const at::BFloat16*>(w), b, op, K, N, g0, g1);
    });
  });
  return out;
}

namespace {

template <int M>
void run_rows(const at::BFloat16* x, const at::BFloat16* w, const at::BFloat16* bias,
              at::BFloat16* out, int64_t K, int64_t N) {
  constexpr int R = M <= 2 ? 4 : 2;
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    band<M, R>(x, w, bias, out, K, N, n0, n1);
  });
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "skinny_linear: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "skinny_linear: bf16 only");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "skinny_linear: 1 to 8 rows");
  TORCH_CHECK(x.size(1) % 32 == 0, "skinny_linear: K must be a multiple of 32");
  TORCH_CHECK(w.is_contiguous(), "skinny_linear: contiguous weight");
  const at::Tensor xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  at::Tensor bias_keep;
  const at::BFloat16* b = bias_data(bias, N, bias_keep);
  auto* xp = xc.data_ptr<at::BFloat16>();
  auto* wp = w.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  with_rows(M, [&](auto m) { run_rows<decltype(m)::value>(xp, wp, b, op, K, N); });
  return out;
}

}  // namespace

int64_t packed_out_features(const at::Tensor& w) {
  if (w.scalar_type() == at::kBFloat16 && w.dim() == 4) return w.size(0) * w.size(2);
  return 0;  // pack_coded's bytes: not read here
}

std::optional<at::Tensor> packed_linear(const at::Tensor& x, const at::Tensor& w,
                                        const std::optional<at::Tensor>& bias) {
  const bool packed = (w.scalar_type() == at::kByte && w.dim() == 2) ||
                      (w.scalar_type() == at::kBFloat16 && w.dim() == 4);
  if (!packed || x.size(0) > kMaxRows) return std::nullopt;
  return skinny_linear_packed(x, w, bias);
}

TORCH_LIBRARY_FRAGMENT(QUIRE_NS, m) {
  m.def("skinny_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("pack_skinny(Tensor w) -> Tensor");
  m.def("pack_coded(Tensor w) -> Tensor");
  m.def("skinny_linear_packed(Tensor x, Tensor wp, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(QUIRE_NS, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
  m.impl("pack_skinny", &pack_skinny);
  m.impl("pack_coded", &pack_coded);
  m.impl("skinny_linear_packed", &skinny_linear_packed);
}

}  // namespace QUIRE_NS
