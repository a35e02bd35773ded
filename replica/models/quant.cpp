// NF4 and int8 quantization with ATen ops, transcribing bitsandbytes 0.50.2's reference
// implementations (backends/default/ops.py: quantize_4bit, int8_vectorwise_quant;
// functional.py: quantize_4bit's compress_statistics, create_dynamic_map) operation for
// operation, so that the same floats come out: the reciprocal multiplied in for full blocks
// and the division for a last partial block, bucketize against the midpoints of the levels
// (a value on a midpoint takes the lower level, as bitsandbytes' CUDA kernel does), fp32
// products rounded once to the output dtype.
#include "replica/models/quant.h"

#include "replica/core/error.h"
#include "replica/models/linear.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>

namespace replica::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kDoubleQuantBlocksize = 256;  // bitsandbytes: quantize_blockwise(absmax, blocksize=256)

// get_4bit_type("nf4"): the decimal strings of bitsandbytes' table, rounded to float as
// torch.tensor(list) rounds them (its division by the largest magnitude, 1.0, changes nothing).
constexpr std::array<float, 16> kNf4 = {
    static_cast<float>(-1.0),
    static_cast<float>(-0.6961928009986877),
    static_cast<float>(-0.5250730514526367),
    static_cast<float>(-0.39491748809814453),
    static_cast<float>(-0.28444138169288635),
    static_cast<float>(-0.18477343022823334),
    static_cast<float>(-0.09105003625154495),
    static_cast<float>(0.0),
    static_cast<float>(0.07958029955625534),
    static_cast<float>(0.16093020141124725),
    static_cast<float>(0.24611230194568634),
    static_cast<float>(0.33791524171829224),
    static_cast<float>(0.44070982933044434),
    static_cast<float>(0.5626170039176941),
    static_cast<float>(0.7229568362236023),
    static_cast<float>(1.0),
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Midpoints between neighbouring levels (fp32, as bitsandbytes computes them): bucketize
// against them gives the index of the nearest level.
torch::Tensor midpoints(const torch::Tensor& levels) {
  const int64_t n = levels.numel();
  return (levels.narrow(0, 0, n - 1) + levels.narrow(0, 1, n - 1)) / 2;
}

// The lookup tables, made once per device (a quantized model dequantizes every layer on every
// step: no host-to-device copy of a table each time).
struct Tables {
  torch::Tensor nf4;          // [16]
  torch::Tensor nf4_bounds;   // [15]
  torch::Tensor nf4_pairs;    // [256, 2]: a packed byte's two levels (high nibble first)
  torch::Tensor dynamic;      // [256]
  torch::Tensor dynamic_bounds;
};

const Tables& tables(torch::Device device) {
  static std::mutex mutex;
  static std::map<std::string, Tables> by_device;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = by_device.find(device.str());
  if (it != by_device.end()) return it->second;
  Tables t;
  auto nf4 = torch::tensor(std::vector<float>(kNf4.begin(), kNf4.end()), torch::kFloat32);
  auto byte = torch::arange(256, torch::kInt64);
  t.nf4_pairs = torch::stack({nf4.index_select(0, byte.bitwise_right_shift(4)), nf4.index_select(0, byte.bitwise_and(15))}, 1)
                    .to(device);
  t.nf4 = nf4.to(device);
  t.nf4_bounds = midpoints(nf4).to(device);
  auto dynamic = dynamic_map();
  t.dynamic = dynamic.to(device);
  t.dynamic_bounds = midpoints(dynamic).to(device);
  return by_device.emplace(device.str(), std::move(t)).first->second;
}

// bitsandbytes' blockwise step over a flat fp32 tensor: the absmax of each block of
// `blocksize` (a last partial block keeps its own, clamped to 1e-38 as bitsandbytes stores it)
// and each value's bucket among `bounds` after scaling by its block's absmax. Returns
// {codes int32 [n], absmax fp32 [blocks]}.
std::pair<torch::Tensor, torch::Tensor> blockwise(const torch::Tensor& flat, int64_t blocksize,
                                                  const torch::Tensor& bounds) {
  const int64_t n = flat.numel();
  const int64_t rem = n % blocksize, full = n - rem;
  std::vector<torch::Tensor> absmax, scaled;
  if (full > 0) {
    auto body = flat.narrow(0, 0, full).view({full / blocksize, blocksize});
    auto m = body.abs().amax(1);
    // bitsandbytes: A_com * (1.0 / absmax.clamp(min=1e-38)), Python's 1.0 / t being t.reciprocal().
    scaled.push_back((body * m.clamp_min(1e-38).reciprocal().view({-1, 1})).clamp(-1, 1).reshape({-1}));
    absmax.push_back(m);
  }
  if (rem > 0) {
    auto tail = flat.narrow(0, full, rem);
    auto m = tail.abs().max().clamp_min(1e-38);
    scaled.push_back((tail / m).clamp(-1, 1));
    absmax.push_back(m.unsqueeze(0));
  }
  auto s = scaled.size() == 1 ? scaled[0] : torch::cat(scaled);
  auto a = absmax.size() == 1 ? absmax[0] : torch::cat(absmax);
  return {torch::bucketize(s, bounds, /*out_int32=*/true), a};
}

// table[codes] scaled by the absmax of each block of `blocksize`, in fp32, as [n].
torch::Tensor scale_blocks(const torch::Tensor& values, const torch::Tensor& absmax, int64_t blocksize, int64_t n) {
  const int64_t blocks = absmax.numel();
  torch::Tensor v = values.narrow(0, 0, std::min(values.numel(), blocks * blocksize));
  // Pad the last block to full size: every value is still level * its block's absmax.
  if (v.numel() < blocks * blocksize) v = torch::constant_pad_nd(v, {0, blocks * blocksize - v.numel()});
  return (v.view({blocks, blocksize}) * absmax.view({-1, 1})).view({-1}).narrow(0, 0, n);
}

void check_quantizable(const torch::Tensor& t, const QuantOptions& options) {
  if (!options.enabled()) fail("quantize: the quantization kind is none");
  if (!t.defined() || t.numel() == 0) fail("quantize: the tensor is empty");
  const auto dt = t.scalar_type();
  if (dt != torch::kFloat32 && dt != torch::kBFloat16 && dt != torch::kFloat16) {
    fail("quantize: tensor of dtype {} (float32, bfloat16 or float16 are quantized)", c10::toString(dt));
  }
  if (options.kind == QuantKind::Nf4) {
    const int64_t b = options.blocksize;
    if (b < 32 || b > 4096 || (b & (b - 1)) != 0) {
      fail("quantize: NF4 blocksize {} is not one of bitsandbytes' 32, 64, 128, 256, 512, 1024, 2048, 4096", b);
    }
  }
  if (options.kind == QuantKind::Int8 && t.dim() != 2) {
    fail("quantize: int8 quantizes a 2-D weight row by row; got shape {}", c10::str(t.sizes()));
  }
}

QuantizedTensor quantize_nf4(const torch::Tensor& t, const QuantOptions& options) {
  const Tables& tab = tables(t.device());
  QuantizedTensor q;
  q.kind = QuantKind::Nf4;
  q.shape = t.sizes().vec();
  q.dtype = t.scalar_type();
  q.blocksize = options.blocksize;
  auto flat = t.detach().reshape({-1}).to(torch::kFloat32);
  auto [codes, absmax] = blockwise(flat, options.blocksize, tab.nf4_bounds);
  flat = torch::Tensor();
  // An odd count: bitsandbytes pads the scaled values with one 0, which takes level 7 (0.0).
  if (codes.numel() % 2 != 0) codes = torch::constant_pad_nd(codes, {0, 1}, 7);
  auto c = codes.to(torch::kUInt8);
  const int64_t m = c.numel();
  q.codes = c.slice(0, 0, m, 2).bitwise_left_shift(4).bitwise_or(c.slice(0, 1, m, 2)).contiguous();
  if (!options.double_quant) {
    q.absmax = absmax;
    return q;
  }
  // compress_statistics: offset = absmax.mean(); quantize_blockwise(absmax - offset, blocksize=256)
  // with the dynamic map.
  q.absmax_offset = absmax.mean();
  auto [absmax_codes, absmax_absmax] = blockwise(absmax - q.absmax_offset, kDoubleQuantBlocksize, tab.dynamic_bounds);
  q.absmax_codes = absmax_codes.to(torch::kUInt8);
  q.absmax_absmax = absmax_absmax;
  return q;
}

QuantizedTensor quantize_int8(const torch::Tensor& t) {
  QuantizedTensor q;
  q.kind = QuantKind::Int8;
  q.shape = t.sizes().vec();
  q.dtype = t.scalar_type();
  auto w = t.detach();
  // int8_vectorwise_quant: row_stats = max |A| per row (fp32); round(A * (127.0 / row_stats)),
  // Python's 127.0 / t being t.reciprocal() * 127. A row of zeros (where bitsandbytes would
  // compute 0 * inf) is coded 0.
  q.absmax = w.abs().amax(1).to(torch::kFloat32);
  auto scale = torch::where(q.absmax > 0, q.absmax.reciprocal() * 127.0, torch::zeros_like(q.absmax));
  q.codes = torch::round(w * scale.unsqueeze(1)).clamp(-127, 127).to(torch::kInt8).contiguous();
  return q;
}

// The pieces of a QuantizedTensor kept in an autograd node's saved_data (IValues), and back.
void save_quantized(AutogradContext* ctx, const QuantizedTensor& q) {
  ctx->saved_data["kind"] = static_cast<int64_t>(q.kind);
  ctx->saved_data["shape"] = q.shape;
  ctx->saved_data["dtype"] = static_cast<int64_t>(q.dtype);
  ctx->saved_data["blocksize"] = q.blocksize;
  ctx->saved_data["codes"] = q.codes;
  ctx->saved_data["double_quant"] = q.double_quantized();
  if (q.double_quantized()) {
    ctx->saved_data["absmax_codes"] = q.absmax_codes;
    ctx->saved_data["absmax_absmax"] = q.absmax_absmax;
    ctx->saved_data["absmax_offset"] = q.absmax_offset;
  } else {
    ctx->saved_data["absmax"] = q.absmax;
  }
}

QuantizedTensor saved_quantized(AutogradContext* ctx) {
  QuantizedTensor q;
  q.kind = static_cast<QuantKind>(ctx->saved_data["kind"].toInt());
  q.shape = ctx->saved_data["shape"].toIntVector();
  q.dtype = static_cast<torch::ScalarType>(ctx->saved_data["dtype"].toInt());
  q.blocksize = ctx->saved_data["blocksize"].toInt();
  q.codes = ctx->saved_data["codes"].toTensor();
  if (ctx->saved_data["double_quant"].toBool()) {
    q.absmax_codes = ctx->saved_data["absmax_codes"].toTensor();
    q.absmax_absmax = ctx->saved_data["absmax_absmax"].toTensor();
    q.absmax_offset = ctx->saved_data["absmax_offset"].toTensor();
  } else {
    q.absmax = ctx->saved_data["absmax"].toTensor();
  }
  return q;
}

// y = x W^T with W dequantized here and again in backward: only the codes are saved (the
// layer's resident bytes), never the full-precision weight. x arrives in the compute dtype.
struct QuantizedMatmul : public torch::autograd::Function<QuantizedMatmul> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const QuantizedTensor& q) {
    save_quantized(ctx, q);
    return dtype_matmul(x, dequantize(q, x.scalar_type()).t());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const torch::Tensor& grad = grads[0];
    if (!grad.defined()) return {torch::Tensor(), torch::Tensor()};
    // dL/dx = dL/dy W; the frozen weight gets no gradient.
    return {dtype_matmul(grad, dequantize(saved_quantized(ctx), grad.scalar_type())), torch::Tensor()};
  }
};

}  // namespace

QuantOptions quant_options(const std::string& name, const std::string& where) {
  QuantOptions o;
  if (name == "none") return o;
  if (name == "int8") {
    o.kind = QuantKind::Int8;
    return o;
  }
  if (name == "int4") {
    o.kind = QuantKind::Nf4;
    o.blocksize = 64;
    o.double_quant = true;
    return o;
  }
  fail("{}: '{}' is not a quantization (none, int4, int8)", where, name);
}

std::string describe(const QuantOptions& options) {
  switch (options.kind) {
    case QuantKind::None: return "none";
    case QuantKind::Int8: return "int8 (per-row absmax)";
    case QuantKind::Nf4:
      return fmt::format("nf4 (blocks of {}{})", options.blocksize,
                         options.double_quant ? ", double-quantized absmax" : ", fp32 absmax");
  }
  return "?";
}

int64_t QuantizedTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

int64_t QuantizedTensor::bytes() const {
  int64_t total = 0;
  for (const auto* t : {&codes, &absmax, &absmax_codes, &absmax_absmax, &absmax_offset}) {
    if (t->defined()) total += t->numel() * static_cast<int64_t>(t->element_size());
  }
  return total;
}

QuantizedTensor QuantizedTensor::to(torch::Device device, bool non_blocking) const {
  QuantizedTensor out = *this;
  for (auto* t : {&out.codes, &out.absmax, &out.absmax_codes, &out.absmax_absmax, &out.absmax_offset}) {
    if (t->defined()) *t = t->to(device, non_blocking);
  }
  return out;
}

torch::Tensor QuantizedTensor::block_absmax() const {
  if (kind != QuantKind::Nf4) fail("block_absmax: only NF4 tensors have block statistics");
  if (!double_quantized()) return absmax;
  // dequantize_blockwise(absmax_codes, state2) + offset, in fp32.
  const Tables& tab = tables(device());
  auto values = tab.dynamic.index_select(0, absmax_codes.to(torch::kInt32));
  return scale_blocks(values, absmax_absmax, kDoubleQuantBlocksize, absmax_codes.numel()) + absmax_offset;
}

QuantizedTensor quantize(const torch::Tensor& tensor, const QuantOptions& options) {
  check_quantizable(tensor, options);
  torch::NoGradGuard no_grad;
  return options.kind == QuantKind::Nf4 ? quantize_nf4(tensor, options) : quantize_int8(tensor);
}

// int8_vectorwise_dequant: A * stats.view(-1, 1) * 7.874015718698502e-3 (1/127), in fp32; rows
// of codes with their absmax.
static torch::Tensor dequantize_int8_rows(const torch::Tensor& codes, const torch::Tensor& absmax) {
  return codes.to(torch::kFloat32) * absmax.view({-1, 1}) * 7.874015718698502e-3;
}

torch::Tensor dequantize(const QuantizedTensor& q, std::optional<torch::ScalarType> dtype) {
  if (!q.defined()) fail("dequantize: the tensor is not quantized");
  torch::NoGradGuard no_grad;
  const auto out_dtype = dtype.value_or(q.dtype);
  if (q.kind == QuantKind::Int8) return dequantize_int8_rows(q.codes, q.absmax).to(out_dtype);
  const Tables& tab = tables(q.device());
  // Each byte's two levels at once (a [256, 2] table), then level * absmax per block.
  auto values = tab.nf4_pairs.index_select(0, q.codes.to(torch::kInt32)).view({-1});
  return scale_blocks(values, q.block_absmax(), q.blocksize, q.numel()).view(q.shape).to(out_dtype);
}

torch::Tensor dequantize_rows(const QuantizedTensor& q, const torch::Tensor& rows, std::optional<torch::ScalarType> dtype) {
  if (!q.defined()) fail("dequantize_rows: the tensor is not quantized");
  if (q.shape.size() != 2) fail("dequantize_rows: needs a 2-D tensor, got shape {}", c10::str(q.shape));
  torch::NoGradGuard no_grad;
  const auto out_dtype = dtype.value_or(q.dtype);
  const int64_t R = q.shape[0], C = q.shape[1];
  auto out_shape = rows.sizes().vec();
  out_shape.push_back(C);
  auto flat = rows.reshape({-1}).to(torch::kInt64);
  const int64_t n = flat.numel();
  if (q.kind == QuantKind::Int8) {
    return dequantize_int8_rows(q.codes.index_select(0, flat), q.absmax.index_select(0, flat))
        .to(out_dtype)
        .view(out_shape);
  }
  if (C % q.blocksize != 0) return dequantize(q, out_dtype).index_select(0, flat).view(out_shape);
  const Tables& tab = tables(q.device());
  const int64_t per_row = C / q.blocksize;  // blocks of a row
  auto codes = q.codes.view({R, C / 2}).index_select(0, flat);
  auto values = tab.nf4_pairs.index_select(0, codes.reshape({-1}).to(torch::kInt32)).view({n, per_row, q.blocksize});
  // The selected rows' blocks, and their absmax as block_absmax() computes it.
  auto blocks = (flat.view({-1, 1}) * per_row + torch::arange(per_row, flat.options())).view({-1});
  torch::Tensor absmax;
  if (q.double_quantized()) {
    auto levels = tab.dynamic.index_select(0, q.absmax_codes.index_select(0, blocks).to(torch::kInt32));
    absmax = levels * q.absmax_absmax.index_select(0, blocks.div(kDoubleQuantBlocksize, "floor")) + q.absmax_offset;
  } else {
    absmax = q.absmax.index_select(0, blocks);
  }
  return (values * absmax.view({n, per_row, 1})).view({n, C}).to(out_dtype).view(out_shape);
}

void QuantizedWeightHolder::follow_module_to(QuantizedTensor& q, std::optional<torch::Device> device,
                                             std::optional<torch::Dtype> dtype, bool non_blocking) {
  if (!q.defined()) return;
  if (device) q = q.to(*device, non_blocking);
  if (dtype) q.dtype = *dtype;
}

int64_t quantized_bytes(int64_t rows, int64_t cols, const QuantOptions& options) {
  const int64_t n = rows * cols;
  switch (options.kind) {
    case QuantKind::None: return 0;
    case QuantKind::Int8: return n + 4 * rows;
    case QuantKind::Nf4: {
      const int64_t blocks = ceil_div(n, options.blocksize);
      const int64_t stats = options.double_quant ? blocks + 4 * ceil_div(blocks, kDoubleQuantBlocksize) + 4 : 4 * blocks;
      return ceil_div(n, 2) + stats;
    }
  }
  return 0;
}

const std::array<float, 16>& nf4_levels() { return kNf4; }

torch::Tensor dynamic_map() {
  // create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8): for each exponent
  // i = 0..6, the midpoints of linspace(0.1, 1, 2^i + 1) times 10^(i - 6), with both signs;
  // then 0 and 1; sorted. (The "additional items" of that function are 2^0 - 1 = 0 here.)
  std::vector<float> data;
  for (int i = 0; i < 7; ++i) {
    const int64_t items = (int64_t{1} << i) + 1;
    auto boundaries = torch::linspace(0.1, 1, items, torch::kFloat32);
    auto means = (boundaries.narrow(0, 0, items - 1) + boundaries.narrow(0, 1, items - 1)) / 2.0;
    const double scale = std::pow(10.0, static_cast<double>(i - 6));  // Python's 10 ** (i - 6)
    for (const auto& part : {means * scale, means * -scale}) {
      auto p = part.contiguous();
      data.insert(data.end(), p.data_ptr<float>(), p.data_ptr<float>() + p.numel());
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  std::sort(data.begin(), data.end());
  return torch::tensor(data, torch::kFloat32);
}

torch::Tensor quantized_linear(const torch::Tensor& x, const QuantizedTensor& q, const torch::Tensor& bias) {
  if (!q.defined()) fail("quantized_linear: the weight is not quantized");
  if (q.shape.size() != 2) fail("quantized_linear: the weight must be 2-D, got {} dimensions", q.shape.size());
  if (x.dim() < 1 || x.size(-1) != q.shape[1]) {
    fail("quantized_linear: input of shape {} for a weight [{}, {}] (in_features {})", c10::str(x.sizes()), q.shape[0],
         q.shape[1], q.shape[1]);
  }
  if (x.device() != q.device()) {
    fail("quantized_linear: input on {}, quantized weight on {}", x.device().str(), q.device().str());
  }
  // The dtype torch::linear would compute in: autocast's where it is on, else the input's.
  const auto device = x.device().type();
  const auto compute = at::autocast::is_autocast_enabled(device) ? at::autocast::get_autocast_dtype(device)
                                                                 : x.scalar_type();
  auto out = QuantizedMatmul::apply(x.to(compute), q);
  if (bias.defined()) out = out + bias.to(compute);
  return out;
}

}  // namespace replica::models
