// MXFP4 (the OCP microscaling format GPT-OSS's published checkpoints store their expert
// weights in): blocks of 32 FP4 (E2M1) values sharing one power-of-two scale. A checkpoint
// holds, for an expert tensor W of logical shape [E, R, C]:
//   W_blocks [E, C, G, 16] uint8   two FP4 codes per byte, low nibble first (G = R / 32)
//   W_scales [E, C, G]     uint8   the block's exponent, biased by 127
// dequantize_mxfp4 gives the [E, R, C] tensor transformers' convert_moe_packed_tensors gives
// (the last two dimensions swapped back into the layout GptOssExperts multiplies by).
#pragma once

#include <torch/types.h>

namespace replica::models {

// blocks [..., C, G, 16] uint8 and scales [..., C, G] uint8 -> [..., G*32, C] of `dtype`.
// replica::Error naming `what` when the shapes or dtypes do not fit.
torch::Tensor dequantize_mxfp4(const torch::Tensor& blocks, const torch::Tensor& scales, torch::ScalarType dtype,
                               const std::string& what);

}  // namespace replica::models
