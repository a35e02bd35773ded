#include "replica/train/optim_8bit.h"

#include "replica/core/cuda.h"
#include "replica/core/error.h"
#include "replica/train/optim.h"
#include "replica/train/saved_state.h"

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <mutex>

namespace replica::train {

namespace {

constexpr int64_t kLutSize = 65536;

// bitsandbytes' build_quantize_lut (csrc/cpu_ops.cpp): for each of 65536 evenly spaced values in
// [-1, 1], the index of the nearest map entry (by the midpoints between entries). The CPU
// quantizer looks values up here instead of searching the map, so the bytes it writes are this
// table's, not always the exactly nearest entry's: the same table gives the same bytes.
torch::Tensor quantize_lut(const torch::Tensor& code) {
  const auto c = code.to(torch::kCPU).contiguous();
  const float* e = c.data_ptr<float>();
  std::array<float, 255> mid{};
  for (int i = 0; i < 255; ++i) mid[i] = 0.5f * (e[i] + e[i + 1]);
  auto lut = torch::empty({kLutSize}, torch::kUInt8);
  uint8_t* out = lut.data_ptr<uint8_t>();
  int ci = 0;
  for (int i = 0; i < kLutSize; ++i) {
    const float val = -1.0f + (2.0f * static_cast<float>(i)) / static_cast<float>(kLutSize - 1);
    while (ci < 255 && mid[ci] < val) ++ci;
    out[i] = static_cast<uint8_t>(ci);
  }
  return lut;
}

struct Maps {
  torch::Tensor code;  // float32 [256]
  torch::Tensor lut;   // uint8 [65536]
};

// The two maps (and tables) per device, made once.
const Maps& maps(bool is_signed, const torch::Device& device) {
  static std::mutex mutex;
  static std::map<std::pair<std::string, bool>, Maps> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto key = std::make_pair(device.str(), is_signed);
  auto it = cache.find(key);
  if (it == cache.end()) {
    const torch::Tensor code = dynamic_map(is_signed);
    it = cache.emplace(key, Maps{code.to(device), quantize_lut(code).to(device)}).first;
  }
  return it->second;
}

Quantized quantize_with(const torch::Tensor& x, const Maps& m);

torch::Tensor closure_loss(const torch::optim::Optimizer::LossClosure& closure) {
  if (closure == nullptr) return {};
  at::AutoGradMode enable_grad(true);
  return closure();
}

// `per_block` [blocks] repeated over the elements of each block, `n` elements.
torch::Tensor per_element(const torch::Tensor& per_block, int64_t n) {
  return per_block.repeat_interleave(kQuantBlock).narrow(0, 0, n);
}

}  // namespace

torch::Tensor dynamic_map(bool is_signed) {
  // create_dynamic_map(signed, max_exponent_bits=7, total_bits=8) in the same tensor operations
  // (linspace and the means in float32, each scaled by a double power of ten).
  constexpr int kMaxExponentBits = 7, kNonSignBits = 7;
  std::vector<float> data;
  for (int i = 0; i < kMaxExponentBits; ++i) {
    const int64_t items = is_signed ? (int64_t{1} << (i + kNonSignBits - kMaxExponentBits)) + 1
                                    : (int64_t{1} << (i + kNonSignBits - kMaxExponentBits + 1)) + 1;
    const auto boundaries = torch::linspace(0.1, 1, items, torch::kFloat32);
    const auto means = (boundaries.slice(0, 0, -1) + boundaries.slice(0, 1)) / 2.0;
    const double scale = std::pow(10.0, -(kMaxExponentBits - 1) + i);
    for (const double sign : is_signed ? std::vector<double>{1.0, -1.0} : std::vector<double>{1.0}) {
      const auto v = (means * (sign * scale)).contiguous();
      data.insert(data.end(), v.data_ptr<float>(), v.data_ptr<float>() + v.numel());
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  while (data.size() < 256) data.push_back(0.0f);
  std::sort(data.begin(), data.end());
  return torch::tensor(data, torch::kFloat32);
}

Quantized quantize_blockwise(const torch::Tensor& x, const torch::Tensor& code) {
  return quantize_with(x, Maps{code, quantize_lut(code).to(code.device())});
}

namespace {

Quantized quantize_with(const torch::Tensor& x, const Maps& m) {
  const int64_t n = x.numel();
  const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  auto flat = x.reshape({-1}).to(torch::kFloat32);
  if (blocks * kQuantBlock != n) flat = torch::constant_pad_nd(flat, {0, blocks * kQuantBlock - n}, 0.0);
  const auto xb = flat.view({blocks, kQuantBlock});
  auto absmax = xb.abs().amax(1);
  const auto empty_block = absmax.eq(0.0f);
  // 1.0f / absmax as the CPU kernel takes it; an all-zero block is written as code 0.
  const auto inv = torch::where(empty_block, torch::zeros_like(absmax), absmax.reciprocal());
  // ((v + 1) * 0.5) * 65535 + 0.5, truncated: each operation rounded on its own, as bitsandbytes'
  // scalar and AVX2 paths do (no fused multiply-add).
  auto index = (xb * inv.unsqueeze(1)).clamp_(-1.0, 1.0).add_(1.0).mul_(0.5).mul_(static_cast<double>(kLutSize - 1)).add_(0.5);
  auto codes = m.lut.index({index.to(torch::kInt64)});
  codes.masked_fill_(empty_block.unsqueeze(1), 0);
  return {codes.view({-1}).narrow(0, 0, n).view(x.sizes()), absmax};
}

// Each block's maximum as saved per element: the first element's of each block.
torch::Tensor block_heads(const torch::Tensor& per_element_absmax, int64_t blocks) {
  return per_element_absmax.index({torch::arange(blocks, per_element_absmax.options().dtype(torch::kLong)) * kQuantBlock});
}

}  // namespace

torch::Tensor dequantize_blockwise(const torch::Tensor& codes, const torch::Tensor& absmax, const torch::Tensor& code) {
  const int64_t n = codes.numel();
  const int64_t full = n / kQuantBlock;
  auto values = code.index({codes.reshape({-1}).to(torch::kInt64)});
  auto out = torch::empty({n}, values.options());
  if (full > 0) {
    out.narrow(0, 0, full * kQuantBlock)
        .view({full, kQuantBlock})
        .copy_(values.narrow(0, 0, full * kQuantBlock).view({full, kQuantBlock}) * absmax.narrow(0, 0, full).unsqueeze(1));
  }
  if (full * kQuantBlock < n) {
    out.narrow(0, full * kQuantBlock, n - full * kQuantBlock)
        .copy_(values.narrow(0, full * kQuantBlock, n - full * kQuantBlock) * absmax.narrow(0, full, 1));
  }
  return out.view(codes.sizes());
}

bool paged_state(bool paged, const torch::Device& device, int64_t numel) {
  return paged && device.is_cuda() && numel >= kPagedMinNumel;
}

AdamW8bit::AdamW8bit(std::vector<torch::Tensor> params, AdamW8bitOptions options)
    : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(std::move(params))},
                              std::make_unique<AdamW8bitOptions>(options)) {
  TORCH_CHECK(options.lr() >= 0, "Invalid learning rate: ", options.lr());
  TORCH_CHECK(options.weight_decay() >= 0, "Invalid weight_decay value: ", options.weight_decay());
}

torch::Tensor AdamW8bit::zeros(const torch::Tensor& p, at::IntArrayRef sizes, torch::ScalarType dtype) const {
  const auto& options = static_cast<const AdamW8bitOptions&>(defaults());
  if (paged_state(options.paged(), p.device(), p.numel())) {
    // Managed memory lives as long as the tensor that wraps it.
    int64_t numel = 1;
    for (int64_t s : sizes) numel *= s;
    const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
    void* ptr = managed_zeros(bytes);
    return torch::from_blob(ptr, sizes, [](void* q) { managed_free(q); },
                            torch::TensorOptions().dtype(dtype).device(p.device()));
  }
  return state_zeros(sizes, p.options().dtype(dtype));
}

AdamW8bitParamState AdamW8bit::fresh_state(const torch::Tensor& p) const {
  AdamW8bitParamState s;
  if (p.numel() < kMin8bitSize) {
    s.state1 = zeros(p, p.sizes(), torch::kFloat32);
    s.state2 = zeros(p, p.sizes(), torch::kFloat32);
    return s;
  }
  const int64_t blocks = (p.numel() + kQuantBlock - 1) / kQuantBlock;
  s.state1 = zeros(p, p.sizes(), torch::kUInt8);
  s.state2 = zeros(p, p.sizes(), torch::kUInt8);
  s.absmax1 = zeros(p, {blocks}, torch::kFloat32);
  s.absmax2 = zeros(p, {blocks}, torch::kFloat32);
  return s;
}

torch::Tensor AdamW8bit::step(LossClosure closure) {
  const torch::Tensor loss = closure_loss(closure);
  torch::NoGradGuard no_grad;
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const AdamW8bitOptions&>(group.options());
    const double lr = o.lr(), beta1 = o.beta1(), beta2 = o.beta2(), eps = o.eps(), wd = o.weight_decay();
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      if (p.grad().is_sparse()) fail("adamw 8-bit: sparse gradients are not supported");
      if (!p.is_contiguous()) fail("adamw 8-bit: parameters must be contiguous");
      void* const key = p.unsafeGetTensorImpl();
      auto it = state_.find(key);
      if (it == state_.end()) {
        it = state_.emplace(key, std::make_unique<AdamW8bitParamState>(fresh_state(p))).first;
      }
      auto& s = static_cast<AdamW8bitParamState&>(*it->second);
      s.step += 1;
      const auto grad = p.grad().to(torch::kFloat32);
      // bitsandbytes steps a float32 view of the parameter and copies it back.
      torch::Tensor p32 = p.scalar_type() == torch::kFloat32 ? p : p.to(torch::kFloat32);
      const double correction1 = 1.0 - std::pow(beta1, static_cast<double>(s.step));
      const double correction2 = std::sqrt(1.0 - std::pow(beta2, static_cast<double>(s.step)));
      if (s.eight_bit()) {
        // _optimizer_update_8bit_blockwise_cpu, "adam".
        const Maps& m1 = maps(true, p.device());
        const Maps& m2 = maps(false, p.device());
        auto s1 = dequantize_blockwise(s.state1, s.absmax1, m1.code);
        auto s2 = dequantize_blockwise(s.state2, s.absmax2, m2.code);
        s1.mul_(beta1).add_(grad, 1.0 - beta1);
        s2.mul_(beta2).addcmul_(grad, grad, 1.0 - beta2);
        const auto denom = (s2.sqrt() / correction2).add_(eps);
        if (wd > 0.0) p32.mul_(1.0 - lr * wd);
        p32.addcdiv_(s1, denom, -lr / correction1);
        auto q1 = quantize_with(s1, m1);
        auto q2 = quantize_with(s2, m2);
        s.state1.copy_(q1.codes);
        s.absmax1.copy_(q1.absmax);
        s.state2.copy_(q2.codes);
        s.absmax2.copy_(q2.absmax);
      } else {
        // _optimizer_update_32bit_cpu, "adam" (no update-norm clipping: max_unorm 0).
        s.state1.mul_(beta1).add_(grad, 1.0 - beta1);
        s.state2.mul_(beta2).addcmul_(grad, grad, 1.0 - beta2);
        const double step_size = -lr * correction2 / correction1;
        if (wd > 0.0) p32.mul_(1.0 - lr * wd);
        const auto update = s.state1 / (s.state2.sqrt() + eps * correction2);
        p32.add_(update, step_size * 1.0);
      }
      if (!p32.is_same(p)) p.copy_(p32);
    }
  }
  return loss;
}

io::NamedTensors adamw_8bit_state(AdamW8bit& optimizer, const std::vector<torch::Tensor>& params,
                                  const std::vector<std::string>& names) {
  io::NamedTensors out;
  auto& state = optimizer.state();
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = state.find(params[i].unsafeGetTensorImpl());
    if (it == state.end()) continue;
    const auto& s = static_cast<const AdamW8bitParamState&>(*it->second);
    const std::string& n = names[i];
    out.emplace_back(n + ".step", torch::tensor(s.step, torch::kLong));
    if (!s.eight_bit()) {
      out.emplace_back(n + ".exp_avg", s.state1);
      out.emplace_back(n + ".exp_avg_sq", s.state2);
      continue;
    }
    const auto shape = params[i].sizes();
    const int64_t numel = params[i].numel();
    out.emplace_back(n + ".state1", s.state1.to(torch::kBFloat16));
    out.emplace_back(n + ".state2", s.state2.to(torch::kBFloat16));
    out.emplace_back(n + ".absmax1", per_element(s.absmax1, numel).view(shape));
    out.emplace_back(n + ".absmax2", per_element(s.absmax2, numel).view(shape));
  }
  return out;
}

size_t load_adamw_8bit_state(AdamW8bit& optimizer, const std::vector<torch::Tensor>& params,
                             const std::vector<std::string>& names, const io::NamedTensors& state) {
  SavedOptimizerState saved(state);
  auto take = [&](const std::string& name, const torch::Tensor& like) -> torch::Tensor {
    const torch::Tensor t = saved.take(name, like, SavedOptimizerState::Match::Elements);
    return t.defined() && like.defined() ? t.reshape({-1}).to(like.device()) : t;
  };
  auto& slots = optimizer.state();
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& n = names[i];
    const auto& p = params[i];
    const auto step = take(n + ".step", torch::Tensor());
    if (!step.defined()) continue;
    AdamW8bitParamState s = optimizer.fresh_state(p);
    s.step = step.item<int64_t>();
    const std::array<torch::Tensor, 2> plain = {take(n + ".exp_avg", p), take(n + ".exp_avg_sq", p)};
    const std::array<torch::Tensor, 2> codes = {take(n + ".state1", p), take(n + ".state2", p)};
    const std::array<torch::Tensor, 2> absmax = {take(n + ".absmax1", p), take(n + ".absmax2", p)};
    for (int k = 0; k < 2; ++k) {
      if (!plain[k].defined() && !(codes[k].defined() && absmax[k].defined())) {
        fail("optimizer state for '{}' is incomplete ({} missing)", n, k == 0 ? "exp_avg or state1/absmax1"
                                                                                : "exp_avg_sq or state2/absmax2");
      }
      const Maps& m = maps(k == 0, p.device());
      const torch::Tensor& code = m.code;
      // The moment's value per element: a sharded checkpoint holds float32 moments for some
      // slices of a parameter and codes for others (each zero where the other applies).
      torch::Tensor values = plain[k].defined() ? plain[k].to(torch::kFloat32) : torch::zeros({p.numel()}, p.options().dtype(torch::kFloat32));
      if (codes[k].defined()) values = values + code.index({codes[k].to(torch::kInt64)}) * absmax[k];
      torch::Tensor& target = k == 0 ? s.state1 : s.state2;
      if (!s.eight_bit()) {
        target.copy_(values.view(p.sizes()));
        continue;
      }
      torch::Tensor& target_absmax = k == 0 ? s.absmax1 : s.absmax2;
      // Cut as saved: every block has one maximum, and no element came from float32 state.
      const int64_t blocks = target_absmax.numel();
      const bool as_saved = codes[k].defined() && (!plain[k].defined() || plain[k].eq(0).all().item<bool>()) &&
                            torch::equal(absmax[k], per_element(block_heads(absmax[k], blocks), p.numel()));
      if (as_saved) {
        target.copy_(codes[k].to(torch::kUInt8).view(p.sizes()));
        target_absmax.copy_(block_heads(absmax[k], blocks));
      } else {
        const Quantized q = quantize_with(values, m);
        target.copy_(q.codes.view(p.sizes()));
        target_absmax.copy_(q.absmax);
      }
    }
    slots[p.unsafeGetTensorImpl()] = std::make_unique<AdamW8bitParamState>(std::move(s));
  }
  return saved.used();
}

int64_t adamw_8bit_state_bytes(AdamW8bit& optimizer) {
  int64_t bytes = 0;
  for (auto& [key, state] : optimizer.state()) {
    const auto& s = static_cast<const AdamW8bitParamState&>(*state);
    for (const torch::Tensor* t : {&s.state1, &s.state2, &s.absmax1, &s.absmax2}) {
      if (t->defined()) bytes += t->numel() * static_cast<int64_t>(t->element_size());
    }
  }
  return bytes;
}

}  // namespace replica::train
