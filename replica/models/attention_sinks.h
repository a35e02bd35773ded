// Attention with sinks (GPT-OSS): each head has a learned logit s_h that joins every query's
// softmax as one more column and is then dropped, so a query may put part of its attention
// on "nothing": p_ij = exp(a_ij) / (exp(s_h) + sum_j' exp(a_ij')). Numerically transformers'
// eager_attention_forward for GptOssAttention (transformers has no fused kernel for it either:
// GptOss declares _supports_sdpa = False): scores, mask, the sink column, the row max
// subtracted, softmax in the scores' dtype, the sink dropped, times v.
//
// Why not at::scaled_dot_product_attention with the sink as an extra zero key and a float
// mask: the fused CPU kernel does not differentiate its mask, and the sink is a parameter
// (full fine-tuning trains it). The [B, heads, T, T] scores this path materialises are what
// transformers materialises too.
#pragma once

#include <torch/types.h>

namespace replica::models {

// q [B, heads, T, D]; k, v [B, kv_heads, T, D] (grouped-query: each kv head serves heads /
// kv_heads query heads); allowed [B or 1, 1, T, T] bool (which keys each query may see), or
// undefined for plain causal; sinks [heads]. Dropout applies to the probabilities (training).
torch::Tensor attention_with_sinks(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   const torch::Tensor& allowed, const torch::Tensor& sinks, double scaling,
                                   double dropout, bool training);

}  // namespace replica::models
