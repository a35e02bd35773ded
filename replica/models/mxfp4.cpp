#include "replica/models/mxfp4.h"

#include "replica/core/error.h"

#include <torch/torch.h>

namespace replica::models {

torch::Tensor dequantize_mxfp4(const torch::Tensor& blocks, const torch::Tensor& scales, torch::ScalarType dtype,
                               const std::string& what) {
  if (blocks.scalar_type() != torch::kUInt8 || scales.scalar_type() != torch::kUInt8) {
    fail("{}: MXFP4 blocks and scales must be uint8, got {} and {}", what, c10::toString(blocks.scalar_type()),
         c10::toString(scales.scalar_type()));
  }
  if (blocks.dim() < 3 || blocks.size(-1) != 16 || scales.sizes() != blocks.sizes().slice(0, blocks.dim() - 1)) {
    fail("{}: MXFP4 blocks {} and scales {} do not fit ([..., G, 16] and [..., G])", what, c10::str(blocks.sizes()),
         c10::str(scales.sizes()));
  }
  // E2M1: sign, two exponent bits, one mantissa bit.
  static const float kFp4[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  const auto lut = torch::from_blob(const_cast<float*>(kFp4), {16}, torch::kFloat32).to(blocks.device());
  const auto b = blocks.to(torch::kInt64);
  auto lo = lut.index_select(0, b.bitwise_and(0x0F).reshape(-1)).view(b.sizes());
  auto hi = lut.index_select(0, b.bitwise_right_shift(4).reshape(-1)).view(b.sizes());
  // [..., G, 16, 2] -> [..., G, 32]: low nibble, then high, per byte.
  auto values = torch::stack({lo, hi}, -1).flatten(-2);
  const auto exponent = scales.to(torch::kInt32) - 127;
  values = torch::ldexp(values, exponent.unsqueeze(-1));  // exact: a power-of-two scale
  auto shape = values.sizes().vec();                      // [..., C, G, 32]
  shape.pop_back();
  shape.back() *= 32;                                     // [..., C, G*32]
  return values.reshape(shape).transpose(-1, -2).to(dtype).contiguous();
}

}  // namespace replica::models
