// The two halves of a Llama decoder layer on either side of attention, each one op call:
//
//   norm_qkv_rope:  x -> RMSNorm -> QKV projection -> RoPE on q and k       -> q, k, v
//   residual_mlp:   x, attn -> x + o_proj(attn) = h -> h + down(silu(gate) * up)(RMSNorm(h))
//
// They run the same kernels the per-op path runs, in the same order with the same roundings,
// so their results are bit-identical to it; what goes is the Python and dispatcher time
// between ops, about 20 calls a layer (4-5 ms of a 15 ms single-request decode step here).
// Attention stays outside: the backend writes the cache and attends between the two calls.
//
// A linear layer takes the skinny kernel up to 8 rows and oneDNN's packed matmul above,
// as engine_worker.layers.kernels.cpu_linear does. References: engine_worker/layers/blocks.py.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string_view>
#include <tuple>

#include "ops.h"

namespace quire {
namespace {

constexpr int64_t kSkinnyMaxRows = 8;

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w,
                         const std::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            std::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<std::string_view>)>();
  return op.call(x, w, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

// x @ W^T + bias with W in both packed layouts (pack_skinny's and oneDNN's)
at::Tensor linear(const at::Tensor& x, const at::Tensor& skinny, const at::Tensor& onednn,
                  const std::optional<at::Tensor>& bias) {
  if (x.size(0) <= kSkinnyMaxRows) return skinny_linear_packed(x, skinny, bias);
  return onednn_linear(x, onednn, bias);
}

void check_x(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 &&
                  x.size(0) >= 1 && x.size(1) % 32 == 0,
              name, ": x must be contiguous bf16 [tokens >= 1, hidden], hidden % 32 == 0");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_qkv_rope(
    const at::Tensor& x, const at::Tensor& norm_weight, double eps, const at::Tensor& qkv_skinny,
    const at::Tensor& qkv_onednn, const std::optional<at::Tensor>& qkv_bias,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
    int64_t num_kv_heads) {
  check_x(x, "norm_qkv_rope");
  const int64_t head_dim = cos.size(1), tokens = x.size(0);
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "norm_qkv_rope: num_heads must be a positive multiple of num_kv_heads");
  const at::Tensor qkv = linear(rms_norm(x, norm_weight, eps), qkv_skinny, qkv_onednn, qkv_bias);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "norm_qkv_rope: the QKV weight does not give (heads + 2 kv heads) * head_dim");
  // views into the one [tokens, (heads + 2 kv_heads) * head_dim] output, as torch's split
  at::Tensor q = qkv.narrow(1, 0, num_heads * head_dim).view({tokens, num_heads, head_dim});
  at::Tensor k = qkv.narrow(1, num_heads * head_dim, num_kv_heads * head_dim)
                     .view({tokens, num_kv_heads, head_dim});
  at::Tensor v = qkv.narrow(1, (num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim)
                     .view({tokens, num_kv_heads, head_dim});
  rotary_embedding(q, k, positions, cos, sin);
  return {q, k, v};
}

at::Tensor residual_mlp(const at::Tensor& x, const at::Tensor& attn, const at::Tensor& o_skinny,
                        const at::Tensor& o_onednn, const at::Tensor& norm_weight, double eps,
                        const at::Tensor& gate_up_skinny, const at::Tensor& gate_up_onednn,
                        const std::optional<at::Tensor>& gate_up_bias,
                        const at::Tensor& down_skinny, const at::Tensor& down_onednn,
                        const std::optional<at::Tensor>& down_bias) {
  check_x(x, "residual_mlp");
  TORCH_CHECK(attn.dim() == 2 && attn.size(0) == x.size(0) && attn.dtype() == x.dtype(),
              "residual_mlp: attn must be [tokens, heads * head_dim] in x's dtype");
  at::Tensor h = linear(attn.contiguous(), o_skinny, o_onednn, std::nullopt);
  TORCH_CHECK(h.sizes() == x.sizes(), "residual_mlp: o_proj must map back to hidden");
  h.add_(x);  // x + o_proj(attn), rounded once as torch's bf16 add rounds
  const at::Tensor act = silu_and_mul(
      linear(rms_norm(h, norm_weight, eps), gate_up_skinny, gate_up_onednn, gate_up_bias));
  at::Tensor out = linear(act, down_skinny, down_onednn, down_bias);
  TORCH_CHECK(out.sizes() == x.sizes(), "residual_mlp: down_proj must map back to hidden");
  return out.add_(h);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(quire, m) {
  m.def("norm_qkv_rope(Tensor x, Tensor norm_weight, float eps, Tensor qkv_skinny, "
        "Tensor qkv_onednn, Tensor? qkv_bias, Tensor positions, Tensor cos, Tensor sin, "
        "int num_heads, int num_kv_heads) -> (Tensor, Tensor, Tensor)");
  m.def("residual_mlp(Tensor x, Tensor attn, Tensor o_skinny, Tensor o_onednn, "
        "Tensor norm_weight, float eps, Tensor gate_up_skinny, Tensor gate_up_onednn, "
        "Tensor? gate_up_bias, Tensor down_skinny, Tensor down_onednn, Tensor? down_bias) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(quire, CPU, m) {
  m.impl("norm_qkv_rope", &norm_qkv_rope);
  m.impl("residual_mlp", &residual_mlp);
}

// oneDNN's packed weights are MkldnnCPU tensors, which the dispatcher ranks above CPU.
TORCH_LIBRARY_IMPL(quire, MkldnnCPU, m) {
  m.impl("norm_qkv_rope", &norm_qkv_rope);
  m.impl("residual_mlp", &residual_mlp);
}

}  // namespace quire
