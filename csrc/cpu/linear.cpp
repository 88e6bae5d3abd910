// bf16 linear for few rows (decode at small batch): out[M, N] = x[M, K] @ w[N, K]^T (+ bias).
//
// At small M a linear layer is a stream over its weights, so the speed is memory bandwidth.
// Each thread streams a contiguous band of weight rows once, and every row it loads is used
// by all M inputs before moving on (AVX-512 BF16 dot products, fp32 accumulation, one
// rounding to bf16 at the end, as torch's own bf16 matmul rounds).
//
// Reference: torch.nn.functional.linear; tests compare the two.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "ops.h"
#include "vec.h"

namespace quire {
namespace {

#ifdef __AVX512BF16__

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
    for (int m = 0; m < M; ++m) {
      const __m128 sums = vec::sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
      alignas(16) float v[4];
      _mm_store_ps(v, sums);
      for (int r = 0; r < kGroup; ++r) {
        const int64_t n = g * kGroup + r;
        out[m * N + n] = at::BFloat16(bias ? v[r] + float(bias[n]) : v[r]);
      }
    }
  }
}

}  // namespace

at::Tensor skinny_linear_packed(const at::Tensor& x, const at::Tensor& wp,
                                const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(wp.dim() == 4 && wp.size(2) == kGroup && wp.size(3) == 32 && wp.is_contiguous(),
              "skinny_linear_packed: a weight from pack_skinny");
  const int64_t M = x.size(0), K = wp.size(1) * 32, N = wp.size(0) * kGroup;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16 && M >= 1 &&
                  M <= kMaxRows, "skinny_linear_packed: x [1..8, K] bf16");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({M, N}, x.options());
  at::Tensor bias_keep;
  const at::BFloat16* b = bias_data(bias, N, bias_keep);
  auto* xp = xc.data_ptr<at::BFloat16>();
  auto* wptr = wp.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t groups = N / kGroup;
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    with_rows(M, [&](auto m) {
      packed_band<decltype(m)::value>(xp, wptr, b, op, K, N, g0, g1);
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

#else

at::Tensor skinny_linear(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "skinny_linear: built without AVX-512 BF16");
}
at::Tensor pack_skinny(const at::Tensor&) {
  TORCH_CHECK(false, "pack_skinny: built without AVX-512 BF16");
}

}  // namespace

at::Tensor skinny_linear_packed(const at::Tensor&, const at::Tensor&,
                                const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "skinny_linear_packed: built without AVX-512 BF16");
}

#endif

TORCH_LIBRARY_FRAGMENT(quire, m) {
  m.def("skinny_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("pack_skinny(Tensor w) -> Tensor");
  m.def("skinny_linear_packed(Tensor x, Tensor wp, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(quire, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
  m.impl("pack_skinny", &pack_skinny);
  m.impl("skinny_linear_packed", &skinny_linear_packed);
}

}  // namespace quire
