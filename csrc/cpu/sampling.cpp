// What the sampler asks of every row of a step's logits, vectorised over the vocabulary.
//
// argmax_rows: each row's index of its largest value, as torch.argmax(dim=-1) gives it (the
// first of equal maxima; a NaN counts as the largest, so the first NaN where there is one).
// torch's CPU argmax walks a row one value at a time, about 3.5 ms for 64 x 49,152 fp32 logits
// on two cores, a greedy step's whole sampling cost; two vector passes, the maximum and then
// the first lane that holds it, take a tenth of that. Reference: torch.argmax
// (engine_worker/sampler.py).
//
// draw_rows: one token per row from softmax(logits / temperature), no truncation, by inverse
// CDF with the row's one uniform: the first token whose running sum of exp((x - max) / T)
// passes u times the row's total (running sums in float64, over blocks of kDrawBlock tokens
// first). The same draw as the sampler's PyTorch path (engine_worker/sampling_draw.py, which
// the rows with top-k, top-p or min-p take), in two passes over the row instead of a softmax
// written out and read back three times: ~0.6 ms for 64 x 49,152 logits on two cores against
// ~3.4 ms. Weights are left unnormalised (the draw does not depend on the scale); a weight
// whose exponent is below -87 is 0, as fp32's softmax underflows there, so a token of logit
// -inf (a grammar's mask, a ban) is never drawn, nor one of logit NaN; a row with +inf logits
// takes the first of them, a row of -inf only (or at temperature 0) is skipped (id 0).
//
// draw_top_p_rows: the same for rows truncated by top-p alone, as the sampler's tensor ops draw
// them (engine_worker/sampling_draw.py: pivot rounds, each with its own uniform, then a floor
// from a sort for a row they did not settle), one row at a time with its weights held in L2
// across the rounds where the tensor ops write and read [rows, vocab] a few times a round:
// 0.6 ms for 64 x 49,152 logits at top-p 0.9 on the 2-core Zen 4 against 5.2-5.4 ms.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <cmath>
#include <limits>
#include <vector>

#include "ops.h"

namespace QUIRE_NS {
namespace {

constexpr int W = Vec::kWidth;

int64_t first_nan(const float* x, int64_t n) {
  for (int64_t c = 0; c < n; ++c)
    if (std::isnan(x[c])) return c;
  return -1;
}

// The row's largest value leaving NaNs out, and in nan whether it holds one.
float row_max(const float* x, int64_t n, bool& nan) {
  const Vec lowest = Vec::broadcast(-std::numeric_limits<float>::infinity());
  Vec m0 = lowest, m1 = lowest, m2 = lowest, m3 = lowest;  // four chains: max's latency
  unsigned nan_bits = 0;
  int64_t c = 0;
  for (; c + 4 * W <= n; c += 4 * W) {
    const Vec a = Vec::load(x + c), b = Vec::load(x + c + W);
    const Vec d = Vec::load(x + c + 2 * W), e = Vec::load(x + c + 3 * W);
    nan_bits |= simd::nan_lanes(a) | simd::nan_lanes(b) | simd::nan_lanes(d) |
                simd::nan_lanes(e);
    // max(new, running): where the new lane is a NaN, max gives its second operand, so a
    // NaN never enters the running maximum (natively and in SIMDe's emulation alike)
    m0 = simd::max(a, m0);
    m1 = simd::max(b, m1);
    m2 = simd::max(d, m2);
    m3 = simd::max(e, m3);
  }
  for (; c + W <= n; c += W) {
    const Vec a = Vec::load(x + c);
    nan_bits |= simd::nan_lanes(a);
    m0 = simd::max(a, m0);
  }
  float best = simd::reduce_max(simd::max(simd::max(m0, m1), simd::max(m2, m3)));
  for (; c < n; ++c) {
    nan_bits |= std::isnan(x[c]) ? 1u : 0u;
    if (x[c] > best) best = x[c];
  }
  nan = nan_bits != 0;
  return best;
}

int64_t argmax_row(const float* x, int64_t n) {
  bool nan = false;
  const float best = row_max(x, n, nan);
  if (nan) return first_nan(x, n);
  const Vec target = Vec::broadcast(best);
  int64_t c = 0;
  for (; c + W <= n; c += W) {
    const unsigned hit = simd::equal_lanes(Vec::load(x + c), target);
    if (hit) return c + __builtin_ctz(hit);
  }
  for (; c < n; ++c)
    if (x[c] == best) return c;
  return 0;  // not reached: best is one of the row's values
}

constexpr int64_t kDrawBlock = 256;  // a multiple of every set's lane count

// Lane i of the result: exp((x_i - top) / T), 0 where that exponent is below -87 or x_i -inf.
inline Vec weights_of(Vec x, Vec top, Vec inv_t) {
  const Vec z = (x - top) * inv_t;
  return simd::where_at_least(z, -87.f, simd::exp(z));
}

// The weights of x[start, end) into w (end - start <= kDrawBlock); their sum. A part vector at
// the end is read through a copy padded with -inf (weight 0).
float block_weights(const float* x, int64_t start, int64_t end, Vec top, Vec inv_t, float* w) {
  Vec acc = Vec::zero();
  int64_t c = start;
  for (; c + W <= end; c += W) {
    const Vec v = weights_of(Vec::load(x + c), top, inv_t);
    v.store(w + (c - start));
    acc = acc + v;
  }
  if (c < end) {
    constexpr float kMasked = -std::numeric_limits<float>::infinity();
    alignas(64) float tail[W];
    for (int i = 0; i < W; ++i) tail[i] = c + i < end ? x[c + i] : kMasked;
    const Vec v = weights_of(Vec::load(tail), top, inv_t);
    alignas(64) float out[W];
    v.store(out);
    for (int64_t i = 0; c + i < end; ++i) w[c - start + i] = out[i];
    acc = acc + v;
  }
  return simd::reduce_add(acc);
}

// A row whose draw is decided by its extremes: -1 where it is not, else the token (0 for a row
// of -inf only, every token masked; the first +inf where it has one: all the mass is there).
// top: the row's largest value leaving NaNs out (a NaN logit's weight is 0: never drawn).
int64_t decided_by_extremes(const float* x, int64_t n, float& top) {
  bool nan = false;
  top = row_max(x, n, nan);
  if (top == -std::numeric_limits<float>::infinity()) return 0;
  if (top == std::numeric_limits<float>::infinity()) {
    for (int64_t c = 0; c < n; ++c)
      if (x[c] == top) return c;
  }
  return -1;
}

// The inverse CDF's first level: the block holding the first running sum strictly above the
// target u * total, the target kept strictly below the total (a token of weight 0 is never
// drawn: its running sum equals the one before it); rest: the target less the blocks before.
int64_t choose_block(const std::vector<double>& sums, double total, double u, double& rest) {
  const double target = std::min(u * total, std::nextafter(total, 0.0));
  const int64_t num_blocks = int64_t(sums.size());
  int64_t b = 0;
  double before = 0;
  for (; b < num_blocks - 1 && before + sums[b] <= target; ++b) before += sums[b];
  rest = target - before;
  return b;
}

// The second level: the index in the block's weights w[0, count) (those >= floor counted) of
// the first running sum strictly above rest, kept below the block's sum.
int64_t pick_in_block(const float* w, int64_t count, float floor, double rest) {
  double inside = 0;
  for (int64_t i = 0; i < count; ++i) inside += w[i] >= floor ? w[i] : 0.f;
  rest = std::min(std::max(rest, 0.0), std::nextafter(inside, 0.0));
  double running = 0;
  for (int64_t i = 0; i < count; ++i) {
    running += w[i] >= floor ? w[i] : 0.f;
    if (running > rest) return i;
  }
  return count - 1;  // not reached: rest is below the block's sum
}

int64_t draw_row(const float* x, int64_t n, float temperature, double u,
                 std::vector<double>& block_sums) {
  float top;
  if (const int64_t token = decided_by_extremes(x, n, top); token >= 0) return token;
  const Vec topv = Vec::broadcast(top), inv_t = Vec::broadcast(1.f / temperature);
  alignas(64) float w[kDrawBlock];
  const int64_t num_blocks = (n + kDrawBlock - 1) / kDrawBlock;
  block_sums.resize(num_blocks);
  double total = 0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    block_sums[b] = block_weights(x, b * kDrawBlock, std::min(n, (b + 1) * kDrawBlock), topv,
                                  inv_t, w);
    total += block_sums[b];
  }
  double rest;
  const int64_t start = choose_block(block_sums, total, u, rest) * kDrawBlock;
  const int64_t end = std::min(n, start + kDrawBlock);
  block_weights(x, start, end, topv, inv_t, w);  // the weights are >= 0: floor 0 keeps them all
  return start + pick_in_block(w, end - start, 0.f, rest);
}

// ---- top-p: the sampler's pivot rounds (engine_worker/sampling_draw.py) on one row at a time

// The sum of w[start, end) over the tokens with w >= floor (a block's sum, in fp32).
float block_at_least(const float* w, int64_t start, int64_t end, float floor) {
  Vec acc = Vec::zero();
  int64_t c = start;
  for (; c + W <= end; c += W) {
    const Vec v = Vec::load(w + c);
    acc = acc + simd::where_at_least(v, floor, v);
  }
  float sum = simd::reduce_add(acc);
  for (; c < end; ++c) sum += w[c] >= floor ? w[c] : 0.f;
  return sum;
}

// The token drawn from the weights w >= floor with uniform u; sums: their block sums.
int64_t draw_at_least(const float* w, int64_t n, const std::vector<double>& sums, float floor,
                      double u) {
  double total = 0;
  for (const double b : sums) total += b;
  double rest;
  const int64_t start = choose_block(sums, total, u, rest) * kDrawBlock;
  return start + pick_in_block(w + start, std::min(n, start + kDrawBlock) - start, floor, rest);
}

// The block sums of the weights w >= floor into sums; their total.
double sums_at_least(const float* w, int64_t n, float floor, std::vector<double>& sums) {
  double total = 0;
  for (int64_t b = 0; b < int64_t(sums.size()); ++b) {
    sums[b] = block_at_least(w, b * kDrawBlock, std::min(n, (b + 1) * kDrawBlock), floor);
    total += sums[b];
  }
  return total;
}

// One token from softmax(x / T) restricted to top-p's set (the tokens that the tokens strictly
// more likely than them weigh less than top_p of), as sampling_draw.draw_tokens draws it: each
// round draws x from the tokens above a pivot with uniform u[round] and keeps it if the tokens
// strictly more likely than x weigh less than the budget, else raises the pivot to x's weight;
// after `rounds` rounds the set's floor comes from a sort and u[rounds] draws above it. The
// weights stay unnormalised, in scratch w (n floats, read from L2 by every round).
int64_t draw_top_p_row(const float* x, int64_t n, float temperature, float top_p,
                       const double* u, int64_t u_step, int64_t rounds, std::vector<float>& w,
                       std::vector<double>& sums, std::vector<double>& kept_sums) {
  float top;
  if (const int64_t token = decided_by_extremes(x, n, top); token >= 0) return token;
  const Vec topv = Vec::broadcast(top), inv_t = Vec::broadcast(1.f / temperature);
  const int64_t num_blocks = (n + kDrawBlock - 1) / kDrawBlock;
  w.resize(num_blocks * kDrawBlock);
  sums.resize(num_blocks);
  double total = 0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    sums[b] = block_weights(x, b * kDrawBlock, std::min(n, (b + 1) * kDrawBlock), topv, inv_t,
                            w.data() + b * kDrawBlock);
    total += sums[b];
  }
  const double budget = top_p < 1.f ? double(top_p) * total
                                    : std::numeric_limits<double>::infinity();
  float floor = 0.f;  // the pivot's next float up: the tokens strictly above it
  for (int64_t r = 0; r < rounds; ++r) {
    const int64_t token = draw_at_least(w.data(), n, sums, floor, u[r * u_step]);
    const float above = std::nextafter(w[token], std::numeric_limits<float>::infinity());
    kept_sums.resize(num_blocks);
    if (sums_at_least(w.data(), n, above, kept_sums) < budget) return token;
    floor = above;
    sums.swap(kept_sums);
  }
  // the rounds did not settle: top-p's floor from the weights in descending order, the mass
  // strictly before each position in float64 (ties with the last kept token all stay)
  std::vector<float> ordered(w.begin(), w.begin() + n);
  std::sort(ordered.begin(), ordered.end(), std::greater<float>());
  double before = 0;
  int64_t num_kept = 0;
  for (; num_kept < n && before < budget; ++num_kept) before += ordered[num_kept];
  const float kept_floor = ordered[std::max<int64_t>(num_kept, 1) - 1];
  sums_at_least(w.data(), n, kept_floor, sums);
  return draw_at_least(w.data(), n, sums, kept_floor, u[rounds * u_step]);
}

}  // namespace

at::Tensor draw_top_p_rows(const at::Tensor& x, const at::Tensor& temperature,
                           const at::Tensor& top_p, const at::Tensor& u, int64_t rounds) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "draw_top_p_rows: fp32 x [rows, n] with unit stride and n > 0");
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == x.size(0) &&
                  temperature.dtype() == at::kFloat && temperature.is_contiguous() &&
                  top_p.dim() == 1 && top_p.size(0) == x.size(0) &&
                  top_p.dtype() == at::kFloat && top_p.is_contiguous(),
              "draw_top_p_rows: fp32 temperature and top_p [rows]");
  TORCH_CHECK(rounds >= 0 && u.dim() == 2 && u.size(0) == x.size(0) &&
                  u.size(1) >= rounds + 1 && u.dtype() == at::kDouble,
              "draw_top_p_rows: float64 u [rows, rounds + 1] and rounds >= 0");
  at::Tensor out = at::zeros({x.size(0)}, x.options().dtype(at::kLong));
  const float* base = x.data_ptr<float>();
  const float* temp = temperature.data_ptr<float>();
  const float* p = top_p.data_ptr<float>();
  const double* uu = u.data_ptr<double>();
  int64_t* idx = out.data_ptr<int64_t>();
  const int64_t n = x.size(1), stride = x.stride(0);
  at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w;
    std::vector<double> sums, kept_sums;
    for (int64_t r = begin; r < end; ++r)
      if (temp[r] > 0.f)
        idx[r] = draw_top_p_row(base + r * stride, n, temp[r], p[r], uu + r * u.stride(0),
                                u.stride(1), rounds, w, sums, kept_sums);
  });
  return out;
}

at::Tensor draw_rows(const at::Tensor& x, const at::Tensor& temperature, const at::Tensor& u) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "draw_rows: fp32 x [rows, n] with unit stride and n > 0");
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == x.size(0) &&
                  temperature.dtype() == at::kFloat && temperature.is_contiguous(),
              "draw_rows: fp32 temperature [rows]");
  TORCH_CHECK(u.dim() == 1 && u.size(0) == x.size(0) && u.dtype() == at::kDouble,
              "draw_rows: float64 u [rows]");
  at::Tensor out = at::zeros({x.size(0)}, x.options().dtype(at::kLong));
  const float* base = x.data_ptr<float>();
  const float* temp = temperature.data_ptr<float>();
  const at::Tensor uc = u.contiguous();
  const double* uu = uc.data_ptr<double>();
  int64_t* idx = out.data_ptr<int64_t>();
  const int64_t n = x.size(1), stride = x.stride(0);
  at::parallel_for(0, x.size(0), 4, [&](int64_t begin, int64_t end) {
    std::vector<double> block_sums;
    for (int64_t r = begin; r < end; ++r)
      if (temp[r] > 0.f) idx[r] = draw_row(base + r * stride, n, temp[r], uu[r], block_sums);
  });
  return out;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: fp32 x [rows, n] with unit stride and n > 0");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const float* base = x.data_ptr<float>();
  int64_t* idx = out.data_ptr<int64_t>();
  const int64_t n = x.size(1), stride = x.stride(0);
  at::parallel_for(0, x.size(0), 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) idx[r] = argmax_row(base + r * stride, n);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(QUIRE_NS, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("draw_rows(Tensor x, Tensor temperature, Tensor u) -> Tensor");
  m.def("draw_top_p_rows(Tensor x, Tensor temperature, Tensor top_p, Tensor u, int rounds) -> "
        "Tensor");
}

TORCH_LIBRARY_IMPL(QUIRE_NS, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("draw_rows", &draw_rows);
  m.impl("draw_top_p_rows", &draw_top_p_rows);
}

}  // namespace QUIRE_NS
