// The AVX-512 set's linear layers (linear.cpp): bf16 activations and weights, AVX-512 BF16 dot
// products, for few rows (decode); the fused layer ops (llama_block.cpp) take more rows to
// oneDNN.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace QUIRE_NS {

// What the fused layer ops take: bf16 activations, hidden a multiple of 32 (the skinny
// kernel's K: 16 lanes of bf16 pairs).
constexpr at::ScalarType kActivationType = at::kBFloat16;
constexpr int64_t kHiddenMultiple = 32;
constexpr const char* kPackedWeights = "pack_skinny's or pack_coded's";

// x [M <= 8, K] bf16 @ a weight from pack_skinny or pack_coded (+ bias) -> [M, N]
at::Tensor skinny_linear_packed(const at::Tensor& x, const at::Tensor& wp,
                                const std::optional<at::Tensor>& bias);
// x @ w^T (+ bias) where w is in a layout this set packs and x has rows its kernel takes
// (here: up to 8 rows on pack_skinny / pack_coded weights); nullopt for anything else
std::optional<at::Tensor> packed_linear(const at::Tensor& x, const at::Tensor& w,
                                        const std::optional<at::Tensor>& bias);
// the output features of a weight this set packed (0 where its layout does not say)
int64_t packed_out_features(const at::Tensor& w);

}  // namespace QUIRE_NS
