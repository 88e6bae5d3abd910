// The AVX2 set's linear layers (linear.cpp): bf16 weights under fp32 activations, widened by a
// shift and multiplied with fp32 FMAs, for any number of rows.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace QUIRE_NS {

// What the fused layer ops take: fp32 activations (no bf16 arithmetic here), hidden a multiple
// of 16 (pack_bf16w's panels of output columns: o_proj's and down_proj's outputs).
constexpr at::ScalarType kActivationType = at::kFloat;
constexpr int64_t kHiddenMultiple = 16;
constexpr const char* kPackedWeights = "pack_bf16w's";

// a bf16 weight [N, K] -> the layout linear_bf16w streams
at::Tensor pack_bf16w(const at::Tensor& w);
// x fp32 [M, K] @ a packed bf16 weight (+ fp32 bias [N]) -> fp32 [M, N]
at::Tensor linear_bf16w(const at::Tensor& x, const at::Tensor& packed_w,
                        const std::optional<at::Tensor>& bias);
// x @ w^T (+ bias) where w is in a layout this set packs (here: pack_bf16w's panels); nullopt
// for anything else
std::optional<at::Tensor> packed_linear(const at::Tensor& x, const at::Tensor& w,
                                        const std::optional<at::Tensor>& bias);
// the output features of a weight this set packed (0 where its layout does not say)
int64_t packed_out_features(const at::Tensor& w);

}  // namespace QUIRE_NS
