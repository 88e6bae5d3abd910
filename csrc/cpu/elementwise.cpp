// Fused per-token ops of a decoder layer: RMSNorm (alone, or after the residual add), the
// residual add, SiLU-and-mul, NeoX rotary embedding (in place, or q into a tensor of its own), in
// fp32, bf16 or fp16 (computed in fp32), on the vector layer (vec.h).
//
// Each reads its input once and writes its output once. Intermediates are rounded to the
// tensor's dtype where the PyTorch references round them, so bf16 / fp16 results match theirs
// up to the order of a sum. References: engine_worker/layers/{norm,activation,rotary}.py.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "ops.h"

namespace QUIRE_NS {
namespace {

constexpr int W = Vec::kWidth;

// One row's RMSNorm: out = weight * round(row / rms(row)), where value(c) gives the row's
// vector at column c (loading it, or making and storing it first). The sum of squares runs in
// two chains (half the FMA latency), the order every caller shares, so their results agree
// to the bit.
template <typename T, typename F>
inline void norm_row(T* out, const T* row, const T* weight, int64_t hidden, float eps,
                     F value) {
  Vec sq0 = Vec::zero(), sq1 = Vec::zero();
  int64_t c = 0;
  for (; c + 2 * W <= hidden; c += 2 * W) {
    const Vec a = value(c), b = value(c + W);
    sq0 = simd::fma(a, a, sq0);
    sq1 = simd::fma(b, b, sq1);
  }
  for (; c < hidden; c += W) {
    const Vec a = value(c);
    sq0 = simd::fma(a, a, sq0);
  }
  const float inv = 1.f / std::sqrt(simd::reduce_add(sq0 + sq1) / float(hidden) + eps);
  const Vec f = Vec::broadcast(inv);
  for (c = 0; c < hidden; c += W) {
    const Vec normed = simd::round_as<T>(Vec::load(row + c) * f);
    (Vec::load(weight + c) * normed).store(out + c);
  }
}

// out = weight * round(x / rms(x)), per row of [rows, hidden]
template <typename T>
void rms_norm_typed(T* out, const T* x, const T* weight, int64_t rows, int64_t hidden,
                    int64_t x_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * x_stride;
      norm_row(out + r * hidden, row, weight, hidden, eps,
               [&](int64_t c) { return Vec::load(row + c); });
    }
  });
}

// h = round(h + x), then out = weight * round(h / rms(h)), per row: the residual add and the
// norm after it in one pass over memory (the row is still in L1 for the norm's second loop),
// each rounding where torch's add_ and rms_norm round
template <typename T>
void add_rms_norm_typed(T* out, T* h, const T* x, const T* weight, int64_t rows,
                        int64_t hidden, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = h + r * hidden;
      const T* add = x + r * hidden;
      norm_row(out + r * hidden, row, weight, hidden, eps, [&](int64_t c) {
        const Vec sum = simd::round_as<T>(Vec::load(row + c) + Vec::load(add + c));
        sum.store(row + c);
        return sum;
      });
    }
  });
}

// out = round(a + b), elementwise over contiguous [n]
template <typename T>
void add_typed(T* out, const T* a, const T* b, int64_t n) {
  at::parallel_for(0, n / W, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * W; i < end * W; i += W)
      (Vec::load(a + i) + Vec::load(b + i)).store(out + i);
  });
}

// out[:, i] = round(silu(gate[:, i])) * up[:, i], with x = [gate | up]. silu(g) = g / (1 +
// exp(-g)) as g times a reciprocal (a division was the loop's slowest instruction), exp's
// argument held at 80 so the reciprocal's argument stays finite (past it silu(g) is g * e^g,
// far below any bf16 / fp16 rounding of the product).
template <typename T>
void silu_and_mul_typed(T* out, const T* x, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    const Vec one = Vec::broadcast(1.f), most = Vec::broadcast(80.f);
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * width;
      const T* up = gate + width;
      for (int64_t c = 0; c < width; c += W) {
        const Vec g = Vec::load(gate + c);
        const Vec e = simd::exp(simd::min(Vec::zero() - g, most));
        const Vec act = simd::round_as<T>(g * simd::reciprocal(one + e));
        (act * Vec::load(up + c)).store(out + r * width + c);
      }
    }
  });
}

// Token t of src [tokens, heads, head_dim] (any token stride) into token t of dst (its own
// token stride; dst may be src): NeoX halves rotated by the position's angles c and s (fp32
// [head_dim], halves equal).
template <typename T>
void rotate(T* dst, int64_t dst_stride, const T* src, int64_t src_stride, int64_t heads,
            int64_t head_dim, int64_t t, const float* c, const float* s) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* v = src + t * src_stride + h * head_dim;
    T* o = dst + t * dst_stride + h * head_dim;
    for (int64_t i = 0; i < half; i += W) {
      const Vec x1 = Vec::load(v + i), x2 = Vec::load(v + half + i);
      const Vec ci = Vec::load(c + i), si = Vec::load(s + i);
      simd::fms(x1, ci, x2 * si).store(o + i);
      simd::fma(x2, ci, x1 * si).store(o + half + i);
    }
  }
}

// k in place; q from q_src into q_dst (the same tensor for in place)
template <typename T>
void rope_typed(at::Tensor& q_dst, const at::Tensor& q_src, at::Tensor& k,
                const int64_t* positions, const float* cos, const float* sin, int64_t head_dim) {
  T* qd = q_dst.data_ptr<T>();
  const T* qs = q_src.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  at::parallel_for(0, q_src.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + positions[t] * head_dim;
      const float* s = sin + positions[t] * head_dim;
      rotate(qd, q_dst.stride(0), qs, q_src.stride(0), q_src.size(1), head_dim, t, c, s);
      rotate(kp, k.stride(0), kp, k.stride(0), k.size(1), head_dim, t, c, s);
    }
  });
}

}  // namespace

// The *_into forms write into the caller's out (contiguous, x's shape and dtype: the layer
// stack's decode buffers, made once a step); the others allocate it.
void rms_norm_into(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % W == 0,
              "rms_norm: x [rows, hidden] with unit stride, hidden a multiple of ", W);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.dtype() == x.dtype(), "rms_norm: weight [hidden] in x's dtype");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && out.dtype() == x.dtype(),
              "rms_norm: out contiguous, shaped and typed as x");
  QUIRE_DISPATCH(x.scalar_type(), "rms_norm",
                 rms_norm_typed<T>(out.data_ptr<T>(), x.data_ptr<T>(), weight.data_ptr<T>(),
                                   x.size(0), x.size(1), x.stride(0), float(eps)));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  rms_norm_into(out, x, weight, eps);
  return out;
}

void silu_and_mul_into(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % (2 * W) == 0,
              "silu_and_mul: contiguous x [rows, 2 * width], width a multiple of ", W);
  const int64_t width = x.size(1) / 2;
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == x.size(0) &&
                  out.size(1) == width && out.dtype() == x.dtype(),
              "silu_and_mul: out contiguous [rows, width] in x's dtype");
  QUIRE_DISPATCH(x.scalar_type(), "silu_and_mul",
                 silu_and_mul_typed<T>(out.data_ptr<T>(), x.data_ptr<T>(), x.size(0), width));
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  silu_and_mul_into(out, x);
  return out;
}

void add_rms_norm_into(at::Tensor& out, at::Tensor& h, const at::Tensor& x,
                       const at::Tensor& weight, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && x.sizes() == h.sizes() &&
                  x.is_contiguous() && x.dtype() == h.dtype() && h.size(1) % W == 0,
              "add_rms_norm: contiguous h and x [rows, hidden] in one dtype, hidden a "
              "multiple of ", W);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == h.size(1) &&
                  weight.dtype() == h.dtype(), "add_rms_norm: weight [hidden] in h's dtype");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == h.sizes() && out.dtype() == h.dtype(),
              "add_rms_norm: out contiguous, shaped and typed as h");
  QUIRE_DISPATCH(h.scalar_type(), "add_rms_norm",
                 add_rms_norm_typed<T>(out.data_ptr<T>(), h.data_ptr<T>(), x.data_ptr<T>(),
                                       weight.data_ptr<T>(), h.size(0), h.size(1),
                                       float(eps)));
}

at::Tensor add_rms_norm(at::Tensor& h, const at::Tensor& x, const at::Tensor& weight,
                        double eps) {
  at::Tensor out = at::empty_like(h);
  add_rms_norm_into(out, h, x, weight, eps);
  return out;
}

void add_into(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(out.is_contiguous() && a.is_contiguous() && b.is_contiguous() &&
                  a.sizes() == out.sizes() && b.sizes() == out.sizes() &&
                  a.dtype() == out.dtype() && b.dtype() == out.dtype() &&
                  out.numel() % W == 0,
              "add_into: contiguous out, a and b of one shape and dtype, a multiple of ", W,
              " elements");
  QUIRE_DISPATCH(out.scalar_type(), "add_into",
                 add_typed<T>(out.data_ptr<T>(), a.data_ptr<T>(), b.data_ptr<T>(),
                              out.numel()));
}

void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& positions,
                      const at::Tensor& cos, const at::Tensor& sin) {
  rotary_embedding_into(q, q, k, positions, cos, sin);
}

void rotary_embedding_into(at::Tensor& q_out, const at::Tensor& q, at::Tensor& k,
                           const at::Tensor& positions, const at::Tensor& cos,
                           const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.size(2) == q.size(2) && q.size(0) == k.size(0),
              "rotary_embedding: q, k [tokens, heads, head_dim]");
  const int64_t d = q.size(2);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d && k.stride(2) == 1 && k.stride(1) == d,
              "rotary_embedding: heads of q and k must be packed");
  TORCH_CHECK(q_out.sizes() == q.sizes() && q_out.dtype() == q.dtype() &&
                  q_out.stride(2) == 1 && q_out.stride(1) == q.size(2),
              "rotary_embedding: q_out shaped and typed as q, heads packed");
  TORCH_CHECK(d % (2 * W) == 0 && q.dtype() == k.dtype(),
              "rotary_embedding: q and k in one dtype, head_dim a multiple of ", 2 * W);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dtype() == at::kFloat &&
                  sin.dtype() == at::kFloat && cos.size(1) == d && sin.sizes() == cos.sizes(),
              "rotary_embedding: fp32 cos and sin [max_position, head_dim]");
  TORCH_CHECK(positions.dtype() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == q.size(0), "rotary_embedding: int64 positions [tokens]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary_embedding: position out of range");
  QUIRE_DISPATCH(q.scalar_type(), "rotary_embedding",
                 rope_typed<T>(q_out, q, k, pos, cos.data_ptr<float>(), sin.data_ptr<float>(),
                               d));
}

TORCH_LIBRARY_FRAGMENT(QUIRE_NS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) h, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_into(Tensor(a!) out, Tensor a, Tensor b) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, "
        "Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(QUIRE_NS, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("add_into", &add_into);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
}

}  // namespace QUIRE_NS
