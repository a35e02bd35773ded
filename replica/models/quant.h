// Quantized frozen weights: the storage formats of QLoRA (bitsandbytes), for LoRA training on
// a base held in 4 or 8 bits and dequantized layer by layer on the fly (models/lora.h:
// LoraLinearImpl::quantize_base, quantize_base_linears).
//
// NF4 (params.quantization: int4) is bitsandbytes' quantize_4bit(quant_type="nf4"), code for
// code: the tensor is flattened and cut into blocks of `blocksize` (64) values; each block
// keeps its absolute maximum (absmax, fp32) and each value the index of the nearest of the 16
// NormalFloat levels (nf4_levels(): bitsandbytes' table, quantiles of N(0, 1) scaled to
// [-1, 1], with an exact 0) to value / absmax. Two 4-bit codes per byte, the first value of a
// pair in the high nibble; a last, partial block has its own absmax. Dequantized:
// level * absmax in fp32, then cast.
//   Double quantization (QLoRA's DQ, bitsandbytes' compress_statistics=True): the absmax,
// less their mean (the offset), are quantized in turn, in blocks of 256, to 8-bit codes of
// bitsandbytes' signed dynamic map (dynamic_map(): 256 levels, dense near 0) with one fp32
// absmax per block. Statistics then cost 8/64 + 32/(64 * 256) = 0.127 bits per weight
// instead of 32/64 = 0.5.
//   Storage per weight: 4.5 bits (0.281x fp16), 4.127 bits with double quantization (0.258x).
// `quantization: int4` uses double quantization (QLoRA's recommended setting; AutoTrain passes
// bnb_4bit_use_double_quant=False to bitsandbytes, which costs 0.37 bits more per weight).
//
// Int8 (params.quantization: int8) is LLM.int8()'s vector-wise weight quantization as
// bitsandbytes' int8_vectorwise_quant computes it: per output row r, absmax_r = max |W[r, :]|
// (fp32) and code = round(W * 127 / absmax_r) as int8; dequantized code * absmax_r / 127. Not
// LLM.int8()'s outlier decomposition (threshold 0: no input column is kept in fp16) nor its
// int8 GEMM: the weight is dequantized and multiplied in the compute dtype, which is more exact
// than bitsandbytes' int8 matmul. 8 bits per weight plus 4 bytes per row (0.5x fp16).
//
// Everything is ATen tensor ops (amax, bucketize, shifts, index_select, mul), so quantizing and
// dequantizing run wherever the tensor lives, CPU or CUDA, with the same codes: no custom
// kernel. bitsandbytes 0.50.2's codes, statistics and dequantized values are reproduced exactly
// (tests/quant_test.cpp, QuantBitsandbytes: a committed fixture that bitsandbytes wrote), the
// double quantization's 8-bit codes as its reference implementation picks them (the nearest
// level); its CPU C library picks a neighbouring, farther code for about 1% of the absmax.
//
// Error bounds (each checked in tests/quant_test.cpp):
//   NF4   |w - dequantize(w)| <= kNf4MaxHalfGap * absmax of its block (0.152: half the largest
//         gap between neighbouring levels, -1 .. -0.696); each value gets the nearest level;
//         zeros come back exactly, and so does each block's absmax element (without double
//         quantization: with it, the block's absmax itself is within the 8-bit step of the
//         dynamic map, and the bound holds with the dequantized absmax plus that error).
//   Int8  |w - dequantize(w)| <= absmax of its row / 254 (plus fp32 rounding); zeros exact.
#pragma once

#include <torch/types.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace replica::models {

enum class QuantKind { None, Int8, Nf4 };

struct QuantOptions {
  QuantKind kind = QuantKind::None;
  int64_t blocksize = 64;     // NF4: values per absmax (bitsandbytes: 32, 64, ..., 4096)
  bool double_quant = false;  // NF4: quantize the absmax too (blocks of 256, dynamic map)
  // Where, beside the decoder's linears (always): also the token embeddings and an untied
  // lm_head (params.quantize_embeddings). bitsandbytes keeps both in 16 bits; at a small
  // model or a large vocabulary they are a large share of the base (Note [quantized embeddings]
  // in models/llama.cpp).
  bool embeddings = false;
  bool enabled() const { return kind != QuantKind::None; }
};

// params.quantization's values: "none", "int8" (vector-wise int8), "int4" (NF4, blocks of 64,
// double quantization). `where` (a key, a file) is named in the error for anything else.
QuantOptions quant_options(const std::string& name, const std::string& where = "quantization");
// "nf4 (blocks of 64, double-quantized absmax)", "int8 (per-row absmax)", "none".
std::string describe(const QuantOptions& options);

// Half the largest gap between neighbouring NF4 levels (between -1 and -0.6962): the largest
// error of a value, as a fraction of its block's absmax.
constexpr double kNf4MaxHalfGap = (1.0 - 0.6961928009986877) / 2;

// A quantized tensor: its codes, statistics, shape and original dtype. Plain tensors (never
// parameters); they live on one device.
struct QuantizedTensor {
  QuantKind kind = QuantKind::None;
  std::vector<int64_t> shape;
  torch::ScalarType dtype = torch::kFloat32;  // of the tensor that was quantized
  int64_t blocksize = 0;                      // NF4
  // NF4: uint8 [ceil(n / 2)], two codes per byte (value 2i in the high nibble, 2i + 1 in the
  // low one). Int8: int8 [rows, cols].
  torch::Tensor codes;
  // fp32: NF4 [ceil(n / blocksize)] (undefined when double-quantized); int8 [rows].
  torch::Tensor absmax;
  // NF4 double quantization: uint8 [blocks] dynamic-map codes of (absmax - offset), fp32
  // [ceil(blocks / 256)] absmax of each 256-block of them, fp32 [] the offset (mean absmax).
  torch::Tensor absmax_codes;
  torch::Tensor absmax_absmax;
  torch::Tensor absmax_offset;

  bool defined() const { return kind != QuantKind::None && codes.defined(); }
  bool double_quantized() const { return absmax_codes.defined(); }
  int64_t numel() const;
  // Bytes of codes and statistics: what the tensor costs resident.
  int64_t bytes() const;
  torch::Device device() const { return codes.device(); }
  // The same codes on `device` (a copy; `this` when already there).
  QuantizedTensor to(torch::Device device, bool non_blocking = false) const;
  // NF4: the fp32 absmax of every block, dequantized when double-quantized.
  torch::Tensor block_absmax() const;
};

// Quantizes a floating-point tensor (fp32, bf16, fp16; any device). Int8 needs a 2-D tensor
// (rows are output features). replica::Error naming the problem for an empty tensor, another
// dtype, a blocksize bitsandbytes does not have, or kind none.
QuantizedTensor quantize(const torch::Tensor& tensor, const QuantOptions& options);
// The values back, in `dtype` (default: the quantized tensor's), on its device. Computed in
// fp32 and rounded once, as bitsandbytes does.
torch::Tensor dequantize(const QuantizedTensor& q, std::optional<torch::ScalarType> dtype = std::nullopt);

// Rows `rows` (integer ids, any shape) of a quantized 2-D tensor [R, C], dequantized: [..., C]
// in `dtype` (default: the quantized tensor's), equal bit for bit to
// dequantize(q).index_select(0, rows) without dequantizing the rest (an embedding lookup).
// NF4 blocks then must not straddle rows (C a multiple of the blocksize, as every model width
// is); otherwise the whole tensor is dequantized and the rows taken from it.
torch::Tensor dequantize_rows(const QuantizedTensor& q, const torch::Tensor& rows,
                              std::optional<torch::ScalarType> dtype = std::nullopt);

// A module that may hold its frozen weight quantized (LoraLinear, the token embedding): what
// base_memory() and has_quantized_base() (models/lora.h) count, whatever the module's kind.
class QuantizedWeightHolder {
 public:
  virtual ~QuantizedWeightHolder() = default;
  virtual bool base_quantized() const = 0;
  virtual const QuantizedTensor& quantized_weight() const = 0;

 protected:
  // What the holder's Module::to overrides add: the held codes move with the module (`device`)
  // and compute in its new dtype (`dtype`); nothing when `q` is not quantized.
  static void follow_module_to(QuantizedTensor& q, std::optional<torch::Device> device,
                               std::optional<torch::Dtype> dtype, bool non_blocking);
};

// Bytes quantize() keeps for a [rows, cols] tensor (planning: nothing is allocated).
int64_t quantized_bytes(int64_t rows, int64_t cols, const QuantOptions& options);

// bitsandbytes' NF4 table (get_4bit_type("nf4")), ascending.
const std::array<float, 16>& nf4_levels();
// bitsandbytes' signed 8-bit dynamic map (create_dynamic_map(signed=True)), ascending, fp32 [256]
// on the CPU.
torch::Tensor dynamic_map();

// x W^T (+ bias) with W = dequantize(q). The quantized weight is frozen: the gradient flows
// to x (and to the bias, added by ordinary autograd, should it require one). The weight is
// dequantized in forward and again in backward (a torch::autograd::Function that keeps only
// the codes), so no full-precision copy of it outlives the layer's call. Computed in the autocast dtype when
// autocast is on for x's device, else in x's dtype; the result has that dtype, like
// torch::linear under the same settings.
torch::Tensor quantized_linear(const torch::Tensor& x, const QuantizedTensor& q, const torch::Tensor& bias = {});

}  // namespace replica::models
