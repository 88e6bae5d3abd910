// Fused per-token ops of a decoder layer: RMSNorm, SiLU-and-mul, and NeoX rotary embedding.
//
// Each reads its input once and writes its output once, where the PyTorch references take
// three to six passes (casts, powers, means, halves concatenated). Intermediates are rounded
// to the tensor's dtype where the references round them, so bf16 results match theirs up to
// the order of a sum. References: engine_worker/layers/{norm,activation,rotary}.py.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#include "vec.h"

namespace quire {
namespace {

// fp32 -> T -> fp32: the rounding a PyTorch op in dtype T applies to its result.
template <typename T>
inline __m512 round_as(__m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    alignas(64) T tmp[16];
    vec::store16(x, tmp);
    alignas(64) float back[16];
    vec::to_float(tmp, back, 16);
    return _mm512_load_ps(back);
  }
}

template <typename T>
inline __m512 load16(const T* p) {
  alignas(64) float tmp[16];
  vec::to_float(p, tmp, 16);
  return _mm512_load_ps(tmp);
}

// out = weight * round(x / rms(x)), per row of [rows, hidden]
template <typename T>
void rms_norm_typed(T* out, const T* x, const T* weight, int64_t rows, int64_t hidden,
                    int64_t x_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * x_stride;
      __m512 sq = _mm512_setzero_ps();
      for (int64_t c = 0; c < hidden; c += 16) {
        const __m512 v = load16(row + c);
        sq = _mm512_fmadd_ps(v, v, sq);
      }
      const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(sq) / float(hidden) + eps);
      const __m512 f = _mm512_set1_ps(inv);
      for (int64_t c = 0; c < hidden; c += 16) {
        const __m512 normed = round_as<T>(_mm512_mul_ps(load16(row + c), f));
        vec::store16(_mm512_mul_ps(load16(weight + c), normed), out + r * hidden + c);
      }
    }
  });
}

// out[:, i] = round(silu(gate[:, i])) * up[:, i], with x = [gate | up]
template <typename T>
void silu_and_mul_typed(T* out, const T* x, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * width;
      const T* up = gate + width;
      for (int64_t c = 0; c < width; c += 16) {
        const __m512 g = load16(gate + c);
        const __m512 e = vec::exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 act = round_as<T>(_mm512_div_ps(g, _mm512_add_ps(one, e)));
        vec::store16(_mm512_mul_ps(act, load16(up + c)), out + r * width + c);
      }
    }
  });
}

// In place on x [tokens, heads, head_dim] (any token stride): NeoX halves rotated by the
// position's angles; cos and sin are [max_position, head_dim] fp32, halves equal.
template <typename T>
void rotate(T* x, int64_t token_stride, int64_t heads, int64_t head_dim, int64_t t,
            const float* c, const float* s) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* v = x + t * token_stride + h * head_dim;
    for (int64_t i = 0; i < half; i += 16) {
      const __m512 x1 = load16(v + i), x2 = load16(v + half + i);
      const __m512 ci = _mm512_loadu_ps(c + i), si = _mm512_loadu_ps(s + i);
      vec::store16(_mm512_fmsub_ps(x1, ci, _mm512_mul_ps(x2, si)), v + i);
      vec::store16(_mm512_fmadd_ps(x2, ci, _mm512_mul_ps(x1, si)), v + half + i);
    }
  }
}

template <typename T>
void rope_typed(at::Tensor& q, at::Tensor& k, const int64_t* positions, const float* cos,
                const float* sin, int64_t head_dim) {
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  at::parallel_for(0, q.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + positions[t] * head_dim;
      const float* s = sin + positions[t] * head_dim;
      rotate(qp, q.stride(0), q.size(1), head_dim, t, c, s);
      rotate(kp, k.stride(0), k.size(1), head_dim, t, c, s);
    }
  });
}

}  // namespace

#define QUIRE_DISPATCH(dtype, name, ...)                                         \
  switch (dtype) {                                                               \
    case at::kFloat: { using T = float; __VA_ARGS__; break; }                    \
    case at::kBFloat16: { using T = at::BFloat16; __VA_ARGS__; break; }          \
    case at::kHalf: { using T = at::Half; __VA_ARGS__; break; }                  \
    default: TORCH_CHECK(false, name ": unsupported dtype ", dtype);            \
  }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 16 == 0,
              "rms_norm: x [rows, hidden] with unit stride, hidden a multiple of 16");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.dtype() == x.dtype(), "rms_norm: weight [hidden] in x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  QUIRE_DISPATCH(x.scalar_type(), "rms_norm",
                 rms_norm_typed<T>(out.data_ptr<T>(), x.data_ptr<T>(), weight.data_ptr<T>(),
                                   x.size(0), x.size(1), x.stride(0), float(eps)));
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 32 == 0,
              "silu_and_mul: contiguous x [rows, 2 * width], width a multiple of 16");
  const int64_t width = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), width}, x.options());
  QUIRE_DISPATCH(x.scalar_type(), "silu_and_mul",
                 silu_and_mul_typed<T>(out.data_ptr<T>(), x.data_ptr<T>(), x.size(0), width));
  return out;
}

void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& positions,
                      const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t d = q.size(2);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.size(2) == d && q.size(0) == k.size(0),
              "rotary_embedding: q, k [tokens, heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d && k.stride(2) == 1 && k.stride(1) == d,
              "rotary_embedding: heads of q and k must be packed");
  TORCH_CHECK(d % 32 == 0 && q.dtype() == k.dtype(), "rotary_embedding: head_dim % 32 == 0");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dtype() == at::kFloat &&
                  sin.dtype() == at::kFloat && cos.size(1) == d,
              "rotary_embedding: fp32 cos and sin [max_position, head_dim]");
  TORCH_CHECK(positions.dtype() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == q.size(0), "rotary_embedding: int64 positions [tokens]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary_embedding: position out of range");
  QUIRE_DISPATCH(q.scalar_type(), "rotary_embedding",
                 rope_typed<T>(q, k, pos, cos.data_ptr<float>(), sin.data_ptr<float>(), d));
}

TORCH_LIBRARY_FRAGMENT(QUIRE_NS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, "
        "Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(QUIRE_NS, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
}

}  // namespace quire
