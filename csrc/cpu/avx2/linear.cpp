// bf16 weights under fp32 activations for CPUs without bf16 arithmetic (AVX2):
//   out[M, N] = x[M, K] @ w[N, K]^T (+ bias), x, bias and out fp32, w bf16.
//
// A bf16 value is the top half of an fp32, so widening is a 16-bit shift; the products and sums
// are fp32 FMAs, so the result is the fp32 matmul of the bf16 weight's values (x @ w.float().T)
// up to summation order. Decode is bound by memory bandwidth: half the bytes of an fp32 weight
// is close to half the time. torch's own bf16 matmul is emulated on such CPUs and far slower.
//
// Layout (pack_bf16w): panels of 16 output columns, each K-major: [N / 16][K][16]. For every k
// a panel holds the 16 weights one broadcast x[m][k] multiplies (two vectors), so the
// micro-kernel keeps RB rows x 16 columns of accumulators in registers with no horizontal
// sums, and each thread streams its band of panels as one sequential read.
//   few rows (decode):  each panel is read once, widened in registers, for all M rows;
//   many rows (prefill): a few panels at a time are widened once into an fp32 copy that every
//                        block of 6 rows then reuses, rows in tiles that stay in L2 while they
//                        pass over those panels; parallel over panels either way.
//
// Reference: x @ w.float().T + bias; tests compare the two.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "ops.h"

namespace QUIRE_NS {
namespace {

constexpr int W = Vec::kWidth;
constexpr int kCols = 16;       // output columns per panel
constexpr int kRowBlock = 6;    // rows per micro-kernel call: 12 accumulators
constexpr int64_t kWidenAbove = kRowBlock;  // more rows than this: widen each panel once
constexpr int64_t kPanelTileBytes = 256 << 10;  // widened panels shared by every row tile
constexpr int64_t kRowTileBytes = 128 << 10;    // rows of x passing over a panel tile
constexpr int64_t kSliceK = 256;  // K per micro-kernel pass there: 16 KB of panel, in L1

// acc[r] (16 columns as two vectors) = sum over k of x[r][k] * panel[k][0..16), for RB rows.
// TP: bf16 (widened as loaded) or fp32 (a widened copy). Up to two rows, the even and odd k
// go to separate accumulators: enough independent FMA chains to hide the FMA latency.
template <int RB, typename TP>
inline void micro(const float* x, int64_t ldx, const TP* panel, int64_t K, Vec (&acc)[RB][2]) {
  constexpr bool kTwoChains = RB <= 2;
  Vec a[RB][2], b[RB][2];
  for (int r = 0; r < RB; ++r) a[r][0] = a[r][1] = b[r][0] = b[r][1] = Vec::zero();
  int64_t k = 0;
  if constexpr (kTwoChains) {
    for (; k + 2 <= K; k += 2) {
      const TP* p = panel + k * kCols;
      const Vec w0 = Vec::load(p), w1 = Vec::load(p + W);
      const Vec w2 = Vec::load(p + kCols), w3 = Vec::load(p + kCols + W);
      for (int r = 0; r < RB; ++r) {
        const Vec x0 = Vec::broadcast(x[r * ldx + k]), x1 = Vec::broadcast(x[r * ldx + k + 1]);
        a[r][0] = simd::fma(x0, w0, a[r][0]);
        a[r][1] = simd::fma(x0, w1, a[r][1]);
        b[r][0] = simd::fma(x1, w2, b[r][0]);
        b[r][1] = simd::fma(x1, w3, b[r][1]);
      }
    }
  }
  for (; k < K; ++k) {
    const TP* p = panel + k * kCols;
    const Vec w0 = Vec::load(p), w1 = Vec::load(p + W);
    for (int r = 0; r < RB; ++r) {
      const Vec xb = Vec::broadcast(x[r * ldx + k]);
      a[r][0] = simd::fma(xb, w0, a[r][0]);
      a[r][1] = simd::fma(xb, w1, a[r][1]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    acc[r][0] = kTwoChains ? a[r][0] + b[r][0] : a[r][0];
    acc[r][1] = kTwoChains ? a[r][1] + b[r][1] : a[r][1];
  }
}

// RB rows of x against one panel -> out[r][n0 .. n0 + 16) (+ bias); with `add`, onto what
// out holds (a later slice of K).
template <int RB, typename TP>
inline void rows_panel(const float* x, int64_t ldx, const TP* panel, int64_t K,
                       const float* bias, float* out, int64_t ldo, bool add) {
  Vec acc[RB][2];
  micro<RB>(x, ldx, panel, K, acc);
  const Vec b0 = bias ? Vec::load(bias) : Vec::zero();
  const Vec b1 = bias ? Vec::load(bias + W) : Vec::zero();
  for (int r = 0; r < RB; ++r) {
    float* o = out + r * ldo;
    (acc[r][0] + (add ? Vec::load(o) : b0)).store(o);
    (acc[r][1] + (add ? Vec::load(o + W) : b1)).store(o + W);
  }
}

// All M rows against one panel, kRowBlock at a time.
template <typename TP>
void all_rows(const float* x, int64_t ldx, int64_t M, const TP* panel, int64_t K,
              const float* bias, float* out, int64_t ldo, bool add = false) {
  int64_t m = 0;
  for (; m + kRowBlock <= M; m += kRowBlock)
    rows_panel<kRowBlock>(x + m * ldx, ldx, panel, K, bias, out + m * ldo, ldo, add);
  const float* xm = x + m * ldx;
  float* om = out + m * ldo;
  switch (M - m) {
    case 5: rows_panel<5>(xm, ldx, panel, K, bias, om, ldo, add); break;
    case 4: rows_panel<4>(xm, ldx, panel, K, bias, om, ldo, add); break;
    case 3: rows_panel<3>(xm, ldx, panel, K, bias, om, ldo, add); break;
    case 2: rows_panel<2>(xm, ldx, panel, K, bias, om, ldo, add); break;
    case 1: rows_panel<1>(xm, ldx, panel, K, bias, om, ldo, add); break;
    default: break;
  }
}

}  // namespace

at::Tensor pack_bf16w(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(0) % kCols == 0 &&
                  w.size(1) >= 1,
              "pack_bf16w: a bf16 weight [N, K], N a multiple of 16");
  const int64_t N = w.size(0), K = w.size(1);
  // [N / 16][K][16]: panel p holds rows 16p..16p+15 of w, one k after another
  return w.contiguous().view({N / kCols, kCols, K}).permute({0, 2, 1}).contiguous();
}

at::Tensor linear_bf16w(const at::Tensor& x, const at::Tensor& packed_w,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed_w.dim() == 3 && packed_w.size(2) == kCols && packed_w.is_contiguous() &&
                  packed_w.scalar_type() == at::kBFloat16,
              "linear_bf16w: a weight from pack_bf16w");
  const int64_t num_panels = packed_w.size(0), K = packed_w.size(1), N = num_panels * kCols;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kFloat,
              "linear_bf16w: x must be fp32 [M, K] with the weight's K");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor bias_c;
  const float* bp = nullptr;
  if (bias.has_value()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.scalar_type() == at::kFloat && bias_c.numel() == N,
                "linear_bf16w: bias must be fp32 [N]");
    bp = bias_c.data_ptr<float>();
  }
  const int64_t M = x.size(0), ldx = xc.stride(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const float* xp = xc.data_ptr<float>();
  const at::BFloat16* wp = packed_w.data_ptr<at::BFloat16>();
  float* op = out.data_ptr<float>();
  if (M <= kWidenAbove) {
    at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p)
        all_rows(xp, ldx, M, wp + p * K * kCols, K, bp ? bp + p * kCols : nullptr,
                 op + p * kCols, N);
    });
    return out;
  }
  // Many rows: tiles of panels widened once (kPanelTileBytes of fp32), each passed over by
  // tiles of rows small enough (kRowTileBytes of x) to stay in L2 across the panel tile.
  const int64_t panel_floats = K * kCols;
  const int64_t panels_per_tile = std::max<int64_t>(1, kPanelTileBytes / (4 * panel_floats));
  const int64_t row_tile =
      std::max<int64_t>(kRowBlock, kRowTileBytes / (4 * K) / kRowBlock * kRowBlock);
  at::parallel_for(0, num_panels, 1, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> widened;
    widened.resize(std::min(panels_per_tile, p1 - p0) * panel_floats);
    for (int64_t pt = p0; pt < p1; pt += panels_per_tile) {
      const int64_t pe = std::min(p1, pt + panels_per_tile);
      const at::BFloat16* src = wp + pt * panel_floats;
      for (int64_t i = 0; i < (pe - pt) * panel_floats; i += W)
        Vec::load(src + i).store(widened.data() + i);
      for (int64_t m0 = 0; m0 < M; m0 += row_tile) {
        const int64_t rows = std::min(row_tile, M - m0);
        for (int64_t p = pt; p < pe; ++p)
          for (int64_t k0 = 0; k0 < K; k0 += kSliceK)  // a slice of panel and rows in L1
            all_rows(xp + m0 * ldx + k0, ldx, rows,
                     widened.data() + (p - pt) * panel_floats + k0 * kCols,
                     std::min(kSliceK, K - k0), bp ? bp + p * kCols : nullptr,
                     op + m0 * N + p * kCols, N, k0 > 0);
      }
    }
  });
  return out;
}

int64_t packed_out_features(const at::Tensor& w) {
  return w.scalar_type() == at::kBFloat16 && w.dim() == 3 ? w.size(0) * w.size(2) : 0;
}

std::optional<at::Tensor> packed_linear(const at::Tensor& x, const at::Tensor& w,
                                        const std::optional<at::Tensor>& bias) {
  if (w.scalar_type() != at::kBFloat16 || w.dim() != 3) return std::nullopt;
  return linear_bf16w(x, w, bias);
}

TORCH_LIBRARY_FRAGMENT(QUIRE_NS, m) {
  m.def("pack_bf16w(Tensor w) -> Tensor");
  m.def("linear_bf16w(Tensor x, Tensor packed_w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(QUIRE_NS, CPU, m) {
  m.impl("pack_bf16w", &pack_bf16w);
  m.impl("linear_bf16w", &linear_bf16w);
}

}  // namespace QUIRE_NS
