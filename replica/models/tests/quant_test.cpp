// Quantized frozen bases (models/quant.h, LoraLinear's quantize_base): NF4 and int8 round-trip
// error bounds and exact properties, bitsandbytes' own codes (a committed fixture), resident
// bytes, and a LoRA model over a quantized base: the same logits and gradients as the model whose
// weights are the dequantized ones, close logits to the unquantized model, bf16 autocast,
// recomputed layers, loading that quantizes layer by layer, and the refusals.
#include "replica/models/quant.h"
#include "replica/testing/paths.h"

#include "replica/core/error.h"
#include "replica/io/safetensors.h"
#include "replica/models/hf_model_dir.h"
#include "replica/models/llama.h"
#include "replica/models/lora.h"
#include "replica/models/tests/test_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

using namespace replica::models;
using namespace replica::models::testing;

namespace {

const QuantOptions kNf4{QuantKind::Nf4, 64, false};
const QuantOptions kNf4Dq{QuantKind::Nf4, 64, true};
const QuantOptions kInt8{QuantKind::Int8, 64, false};

torch::Tensor levels_tensor() {
  const auto& l = nf4_levels();
  return torch::tensor(std::vector<float>(l.begin(), l.end()), torch::kFloat32);
}

// A weight like a trained layer's: N(0, 0.02) with exact zeros, a few outliers, and (when the
// shape allows) a row of zeros.
torch::Tensor test_weight(int64_t rows, int64_t cols, torch::ScalarType dtype, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto w = torch::randn({rows, cols}, gen, torch::kFloat32) * 0.02;
  auto flat = w.view({-1});
  const int64_t n = flat.numel();
  for (int64_t i = 0; i < n; i += 37) flat[i] = 0.0;
  if (n > 10) flat[n / 3] = 0.5;
  if (n > 10) flat[(2 * n) / 3] = -0.9;
  if (rows > 2) w[1].zero_();
  return w.to(dtype);
}

// The absmax of each block of `blocksize` values of flat `x` (fp32), repeated per value.
torch::Tensor absmax_per_value(const torch::Tensor& x, int64_t blocksize) {
  auto flat = x.reshape({-1}).to(torch::kFloat32);
  const int64_t n = flat.numel(), blocks = (n + blocksize - 1) / blocksize;
  auto padded = torch::constant_pad_nd(flat.abs(), {0, blocks * blocksize - n});
  auto m = padded.view({blocks, blocksize}).amax(1);
  return m.repeat_interleave(blocksize).narrow(0, 0, n);
}

struct Shape {
  int64_t rows, cols;
};

// Two models made from the same seed: identical weights.
LlamaConfig small_config(bool tied = false) {
  const std::string text = std::string(R"({"model_type": "llama", "vocab_size": 64, "hidden_size": 128,
    "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": )") + (tied ? "true" : "false") + "}";
  return parse_llama_config(text, "small config");
}

LlamaForCausalLM seeded_model(const LlamaConfig& config, uint64_t seed, torch::ScalarType dtype = torch::kFloat32) {
  torch::manual_seed(seed);
  return LlamaForCausalLM(config, dtype);
}

// Every quantizable linear of `target` given the dequantized weight of `quantized`'s layer of
// the same name: the model whose forward a quantized one must compute.
void copy_dequantized(LlamaForCausalLM& target, const LlamaForCausalLM& quantized) {
  std::map<std::string, std::shared_ptr<LoraLinearImpl>> q;
  for (auto& [name, layer] : quantizable_linears(*quantized)) q[name] = layer;
  torch::NoGradGuard no_grad;
  for (auto& [name, layer] : quantizable_linears(*target)) layer->weight.copy_(q.at(name)->base_weight());
}

torch::Tensor sample_ids(int64_t vocab, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  return torch::randint(0, vocab, {2, 24}, gen, torch::kInt64);
}

double relative_diff(const torch::Tensor& a, const torch::Tensor& b) {
  auto x = a.to(torch::kFloat64), y = b.to(torch::kFloat64);
  return ((x - y).norm() / y.norm()).item<double>();
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Names and tables

TEST(QuantOptions, NamesOfTheQuantizationKey) {
  const auto int4 = quant_options("int4");
  EXPECT_EQ(int4.kind, QuantKind::Nf4);
  EXPECT_EQ(int4.blocksize, 64);
  EXPECT_TRUE(int4.double_quant);
  EXPECT_EQ(quant_options("int8").kind, QuantKind::Int8);
  EXPECT_FALSE(quant_options("none").enabled());
  expect_error([] { quant_options("int3", "params.quantization"); }, {"params.quantization", "'int3'", "int4"});
  EXPECT_EQ(describe(int4), "nf4 (blocks of 64, double-quantized absmax)");
  EXPECT_EQ(describe(kNf4), "nf4 (blocks of 64, fp32 absmax)");
}

TEST(QuantNf4, LevelsAreBitsandbytesTableWithTheLargestGapAtMinusOne) {
  const auto& l = nf4_levels();
  EXPECT_EQ(l[0], -1.0f);
  EXPECT_EQ(l[7], 0.0f);
  EXPECT_EQ(l[15], 1.0f);
  double largest = 0;
  for (size_t i = 1; i < l.size(); ++i) {
    EXPECT_LT(l[i - 1], l[i]);
    largest = std::max(largest, static_cast<double>(l[i]) - l[i - 1]);
  }
  EXPECT_NEAR(largest / 2, kNf4MaxHalfGap, 1e-7);
  EXPECT_EQ(largest, static_cast<double>(l[1]) - l[0]);
}

// ---------------------------------------------------------------------------------------
// Round trips

TEST(QuantNf4, RoundTripErrorIsAtMostHalfTheLargestGapTimesTheBlockAbsmax) {
  const std::vector<Shape> shapes = {{64, 260}, {7, 9}, {1, 1}, {3, 64}, {33, 31}};
  for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    for (const int64_t blocksize : {64, 32, 128}) {
      for (const auto& s : shapes) {
        SCOPED_TRACE(fmt::format("{} [{}, {}] blocks of {}", c10::toString(dtype), s.rows, s.cols, blocksize));
        const auto w = test_weight(s.rows, s.cols, dtype, 7 + s.rows);
        const auto q = quantize(w, {QuantKind::Nf4, blocksize, false});
        EXPECT_EQ(q.codes.scalar_type(), torch::kUInt8);
        EXPECT_EQ(q.codes.numel(), (w.numel() + 1) / 2);
        EXPECT_EQ(q.absmax.numel(), (w.numel() + blocksize - 1) / blocksize);
        const auto back = dequantize(q, torch::kFloat32);
        ASSERT_EQ(back.sizes(), w.sizes());
        const auto x = w.to(torch::kFloat32);
        const auto a = absmax_per_value(w, blocksize).view(w.sizes());
        // The bound, per value, with room for the fp32 product's rounding.
        const auto err = (back - x).abs();
        EXPECT_TRUE((err <= a * kNf4MaxHalfGap * (1 + 1e-6) + 1e-30).all().item<bool>())
            << "max error / absmax " << (err / a.clamp_min(1e-30)).max().item<double>();
        // Each value takes the nearest level: no level is closer to value / absmax.
        const auto scaled = (x / a.clamp_min(1e-30)).reshape({-1, 1});
        const auto chosen = (back / a.clamp_min(1e-30)).reshape({-1, 1});
        const auto best = (scaled - levels_tensor().view({1, -1})).abs().amin(1, true);
        EXPECT_TRUE(((scaled - chosen).abs() <= best + 1e-6).all().item<bool>());
        // Zeros come back exactly, and so does the absmax element of each block, in the
        // original dtype.
        const auto back_native = dequantize(q);
        EXPECT_EQ(back_native.scalar_type(), dtype);
        EXPECT_TRUE(back_native.masked_select(w == 0).eq(0).all().item<bool>());
        const auto at_absmax = (x.abs() == a) & (a > 0);
        EXPECT_TRUE(torch::equal(back_native.masked_select(at_absmax), w.masked_select(at_absmax)));
      }
    }
  }
}

TEST(QuantNf4, DoubleQuantizationKeepsTheCodesAndAddsOnlyTheAbsmaxError) {
  const auto w = test_weight(64, 520, torch::kFloat32, 3);  // 520 blocks: two 256-blocks of absmax and a tail
  const auto single = quantize(w, kNf4);
  const auto dq = quantize(w, kNf4Dq);
  EXPECT_TRUE(torch::equal(single.codes, dq.codes));
  EXPECT_TRUE(dq.double_quantized());
  EXPECT_FALSE(dq.absmax.defined());
  EXPECT_EQ(dq.absmax_codes.numel(), 520);
  EXPECT_EQ(dq.absmax_absmax.numel(), 3);
  // The absmax come back within half the dynamic map's largest step times the absmax of
  // their 256-block (of absmax - offset).
  const auto map = dynamic_map();
  const double half_step = ((map.narrow(0, 1, 255) - map.narrow(0, 0, 255)).max().item<double>()) / 2;
  const auto a = single.absmax, a2 = dq.block_absmax();
  const auto block_scale = dq.absmax_absmax.repeat_interleave(256).narrow(0, 0, 520);
  const auto absmax_err = (a2 - a).abs();
  EXPECT_TRUE((absmax_err <= block_scale * half_step * (1 + 1e-5) + 1e-7).all().item<bool>())
      << (absmax_err / block_scale).max().item<double>() << " vs " << half_step;
  // (A block of zeros gets an absmax near the offset instead of 0: its values stay 0, level 0
  // times anything. The step is relative to the spread of a 256-block's absmax: the outliers
  // of this weight make it coarse, up to a few percent of a typical absmax.)
  // Each value: the 4-bit error with the exact absmax plus |level| times the absmax error.
  const auto back = dequantize(dq);
  const auto per_value = [](const torch::Tensor& t) { return t.repeat_interleave(64).view({64, 520}); };
  const auto bound = per_value(a) * kNf4MaxHalfGap + per_value(absmax_err);
  EXPECT_TRUE(((back - w).abs() <= bound * (1 + 1e-5) + 1e-7).all().item<bool>());
  EXPECT_TRUE(back.masked_select(w == 0).eq(0).all().item<bool>());
  EXPECT_LT(dq.bytes(), single.bytes());
}

TEST(QuantInt8, RoundTripWithinRowAbsmaxOver254) {
  for (auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const auto w = test_weight(48, 100, dtype, 11);
    const auto q = quantize(w, kInt8);
    EXPECT_EQ(q.codes.scalar_type(), torch::kInt8);
    EXPECT_EQ(q.codes.sizes(), w.sizes());
    EXPECT_EQ(q.absmax.numel(), 48);
    const auto x = w.to(torch::kFloat32);
    const auto back = dequantize(q, torch::kFloat32);
    const auto row_absmax = x.abs().amax(1, true);
    EXPECT_TRUE(torch::equal(q.absmax, row_absmax.view({-1})));
    EXPECT_TRUE(((back - x).abs() <= row_absmax / 254 * (1 + 1e-5) + 1e-30).all().item<bool>());
    EXPECT_TRUE(back.masked_select(x == 0).eq(0).all().item<bool>());
    // The row of zeros (where bitsandbytes would compute 0 * inf): codes 0, values 0.
    EXPECT_TRUE(q.codes[1].eq(0).all().item<bool>());
    EXPECT_TRUE(back[1].eq(0).all().item<bool>());
    // A row's absmax element: code +-127, back within one fp32 rounding of 127 * a / 127.
    const auto at_absmax = (x.abs() == row_absmax) & (row_absmax > 0);
    EXPECT_TRUE(q.codes.masked_select(at_absmax).abs().eq(127).all().item<bool>());
    const auto rel = ((back - x).abs() / x.abs().clamp_min(1e-30)).masked_select(at_absmax);
    EXPECT_LE(rel.max().item<double>(), 2.5e-7);
  }
}

TEST(QuantErrors, NameWhatCannotBeQuantized) {
  expect_error([] { quantize(torch::zeros({0, 4}), kNf4); }, {"empty"});
  expect_error([] { quantize(torch::zeros({4, 4}, torch::kInt32), kNf4); }, {"Int"});
  expect_error([] { quantize(torch::zeros({4, 4}), {QuantKind::Nf4, 48, false}); }, {"blocksize 48"});
  expect_error([] { quantize(torch::zeros({2, 4, 4}), kInt8); }, {"int8", "2-D"});
  expect_error([] { quantize(torch::zeros({4, 4}), QuantOptions{}); }, {"none"});
  const auto q = quantize(torch::ones({4, 8}), kNf4);
  expect_error([&] { quantized_linear(torch::ones({2, 5}), q); }, {"in_features 8"});
}

// ---------------------------------------------------------------------------------------
// bitsandbytes' own codes: tests/reference/bnb_quant.safetensors (bnb_quant_reference.py)

TEST(QuantBitsandbytes, CodesStatisticsAndValuesAreBitsandbytes) {
  auto file = replica::io::load_safetensors(std::string(REPLICA_SOURCE_DIR) +
                                            "/replica/models/tests/reference/bnb_quant.safetensors");
  const auto& f = [&](const std::string& name) { return file.at(name); };
  EXPECT_TRUE(torch::equal(dynamic_map(), f("dynamic_map")));
  EXPECT_TRUE(torch::equal(levels_tensor(), f("nf4_levels")));
  for (const std::string x : {"a", "b", "c"}) {
    SCOPED_TRACE(x);
    const auto& w = f(x);
    const auto q = quantize(w, kNf4);
    EXPECT_TRUE(torch::equal(q.codes, f(x + ".nf4.codes")));
    EXPECT_TRUE(torch::equal(q.absmax, f(x + ".nf4.absmax")));
    if (file.contains(x + ".nf4.dequant")) EXPECT_TRUE(torch::equal(dequantize(q), f(x + ".nf4.dequant")));
    const auto q8 = quantize(w, kInt8);
    EXPECT_TRUE(torch::equal(q8.codes, f(x + ".int8.codes")));
    EXPECT_TRUE(torch::equal(q8.absmax, f(x + ".int8.absmax")));
    if (file.contains(x + ".int8.dequant")) {
      EXPECT_TRUE(torch::equal(dequantize(q8, torch::kFloat32), f(x + ".int8.dequant")));
    }
  }
  const auto dq = quantize(f("a"), kNf4Dq);
  EXPECT_TRUE(torch::equal(dq.codes, f("a.nf4.codes")));
  EXPECT_TRUE(torch::equal(dq.absmax_codes, f("a.nf4dq.absmax_codes")));
  // bitsandbytes' CPU C library searches the dynamic map differently on 3 of these 260 values:
  // a neighbouring code, never nearer to the value than replica's (the reference's) choice.
  const auto& lib = f("a.nf4dq.absmax_codes_cpu_library");
  const auto differ = dq.absmax_codes.ne(lib);
  EXPECT_LE(differ.sum().item<int64_t>(), 3);
  EXPECT_TRUE((dq.absmax_codes.to(torch::kInt32) - lib.to(torch::kInt32)).abs().le(1).all().item<bool>());
  {
    const auto map = dynamic_map();
    const auto a = f("a.nf4.absmax");
    const auto centred = a - dq.absmax_offset;
    const auto scale = dq.absmax_absmax.repeat_interleave(256).narrow(0, 0, a.numel());
    const auto value = (centred / scale).masked_select(differ);
    const auto ours = map.index_select(0, dq.absmax_codes.masked_select(differ).to(torch::kInt64));
    const auto theirs = map.index_select(0, lib.masked_select(differ).to(torch::kInt64));
    EXPECT_TRUE(((value - ours).abs() <= (value - theirs).abs()).all().item<bool>());
  }
  EXPECT_TRUE(torch::equal(dq.absmax_absmax, f("a.nf4dq.absmax_absmax")));
  EXPECT_TRUE(torch::equal(dq.absmax_offset, f("a.nf4dq.offset")));
  EXPECT_TRUE(torch::equal(dequantize(dq), f("a.nf4dq.dequant")));
}

// ---------------------------------------------------------------------------------------
// Bytes

TEST(QuantBytes, Nf4LinearHoldsUnderAThirdOfFp16AndTheWeightIsReleased) {
  struct Case {
    QuantOptions options;
    double ratio;  // of fp16's 2 bytes per weight, for [1024, 1024]
  };
  for (const auto& c : {Case{kNf4, 0.28125}, Case{kNf4Dq, 0.2579}, Case{kInt8, 0.502}}) {
    SCOPED_TRACE(describe(c.options));
    LoraLinear layer(1024, 1024, /*bias=*/true, torch::kFloat32);
    const int64_t fp16 = 2 * 1024 * 1024;
    const c10::weak_intrusive_ptr<c10::TensorImpl> old_weight(layer->weight.getIntrusivePtr());
    layer->quantize_base(c.options);
    // The full-precision weight is gone: not a parameter, no handle, its memory freed.
    EXPECT_FALSE(layer->weight.defined());
    EXPECT_TRUE(old_weight.expired());
    for (const auto& item : layer->named_parameters()) EXPECT_NE(item.key(), "weight");
    const auto& q = layer->quantized_weight();
    EXPECT_EQ(q.bytes(), quantized_bytes(1024, 1024, c.options));
    EXPECT_NEAR(static_cast<double>(q.bytes()) / fp16, c.ratio, 5e-4);
    EXPECT_EQ(layer->base_bytes(), q.bytes() + 1024 * 4);  // plus the fp32 bias
    if (c.options.kind == QuantKind::Nf4) EXPECT_LE(static_cast<double>(q.bytes()) / fp16, 0.3);
    expect_error([&] { layer->quantize_base(c.options); }, {"already quantized"});
  }
}

// ---------------------------------------------------------------------------------------
// A LoRA model over a quantized base

class QuantLora : public ::testing::TestWithParam<std::string> {
 protected:
  QuantOptions options() const { return quant_options(GetParam()); }
};

// The quantized model computes exactly the model whose weights are the dequantized ones, and
// stays close to the unquantized model. Only the decoder's linears are quantized.
TEST_P(QuantLora, LogitsAreTheDequantizedModelsAndCloseToTheUnquantized) {
  torch::NoGradGuard no_grad;
  const auto config = small_config();
  auto plain = seeded_model(config, 5);
  auto quantized = seeded_model(config, 5);
  const auto names = quantize_base_linears(*quantized, options());
  EXPECT_EQ(names.size(), 14u);  // 2 layers x q, k, v, o, gate, up, down
  for (const auto& n : names) EXPECT_NE(n.find("model.layers."), std::string::npos) << n;
  EXPECT_FALSE(quantized->lm_head->base_quantized());
  EXPECT_TRUE(quantized->named_parameters().contains("lm_head.weight"));
  EXPECT_TRUE(quantized->named_parameters().contains("model.embed_tokens.weight"));
  EXPECT_FALSE(quantized->named_parameters().contains("model.layers.0.mlp.up_proj.weight"));
  auto twin = seeded_model(config, 5);
  copy_dequantized(twin, quantized);
  plain->eval();
  quantized->eval();
  twin->eval();
  const auto ids = sample_ids(config.vocab_size, 1);
  const auto logits = quantized->forward(ids);
  // Same dequantized weights, same kernels: equal up to the matmul's own rounding order.
  EXPECT_LE(max_abs_diff(logits, twin->forward(ids)), 1e-5);
  // Against the unquantized model. The error source is each decoder weight's quantization
  // error, whose relative RMS e is measured here (NF4's 16 levels on Gaussian weights: about
  // 0.1; int8's 255 per row: under 0.01). Fourteen such independent perturbations (7 linears x
  // 2 layers) pass through attention, SwiGLU and the residual stream to the logits; to first
  // order their relative effect is of order e times a gain of the network, about 1.5 measured
  // on this random model. The bound is 3 e: a quantization that picked the wrong level or
  // scale (errors of the size of the weights) would be 10x over it.
  double err2 = 0, norm2 = 0;
  std::map<std::string, std::shared_ptr<LoraLinearImpl>> q;
  for (auto& [name, layer] : quantizable_linears(*quantized)) q[name] = layer;
  for (auto& [name, layer] : quantizable_linears(*plain)) {
    err2 += (q.at(name)->base_weight() - layer->weight).pow(2).sum().item<double>();
    norm2 += layer->weight.pow(2).sum().item<double>();
  }
  const double weight_rel = std::sqrt(err2 / norm2);
  EXPECT_LT(weight_rel, options().kind == QuantKind::Nf4 ? 0.12 : 0.01);
  const double rel = relative_diff(logits, plain->forward(ids));
  EXPECT_LE(rel, 3 * weight_rel);
  EXPECT_GT(rel, 0.0);
  std::printf("[quant %s] weights' relative RMS error %.3g; logits' relative L2 difference to the unquantized "
              "model %.3g (bound %.3g)\n",
              GetParam().c_str(), weight_rel, rel, 3 * weight_rel);
}

// Gradients reach the adapters (and only them), equal to the dequantized twin's; the adapter
// saves under the same names as over the unquantized base.
TEST_P(QuantLora, GradientsFlowToTheAdaptersAsInTheDequantizedModel) {
  const auto config = small_config(/*tied=*/true);
  auto quantized = seeded_model(config, 8);
  quantize_base_linears(*quantized, options());
  auto twin = seeded_model(config, 8);
  copy_dequantized(twin, quantized);
  LoraConfig lora;
  lora.r = 4;
  lora.lora_dropout = 0.0;
  for (auto* m : {&quantized, &twin}) {
    LoraConfig c = lora;
    torch::manual_seed(21);
    apply_lora(**m, c);
  }
  {
    // B starts at zero: give it values, the same on both, so that A's gradient is not zero.
    torch::NoGradGuard no_grad;
    auto gen = at::detail::createCPUGenerator(4);
    auto q_params = lora_named_parameters(*quantized);
    auto t_params = lora_named_parameters(*twin);
    ASSERT_EQ(q_params.size(), t_params.size());
    for (size_t i = 0; i < q_params.size(); ++i) {
      ASSERT_EQ(q_params[i].first, t_params[i].first);
      auto v = torch::randn(q_params[i].second.sizes(), gen) * 0.05;
      q_params[i].second.copy_(v);
      t_params[i].second.copy_(v);
    }
  }
  const auto ids = sample_ids(config.vocab_size, 2);
  for (auto* m : {&quantized, &twin}) {
    (*m)->train();
    causal_lm_loss((*m)->forward(ids), ids).backward();
  }
  for (const auto& item : quantized->named_parameters()) {
    if (peft_adapter_key(item.key()).empty()) {
      EXPECT_FALSE(item.value().requires_grad()) << item.key();
      EXPECT_FALSE(item.value().grad().defined()) << item.key();
    }
  }
  const auto q_params = lora_named_parameters(*quantized);
  const auto t_params = lora_named_parameters(*twin);
  double worst = 0;
  for (size_t i = 0; i < q_params.size(); ++i) {
    const auto& g = q_params[i].second.grad();
    ASSERT_TRUE(g.defined()) << q_params[i].first;
    EXPECT_GT(g.abs().max().item<double>(), 0) << q_params[i].first;
    worst = std::max(worst, relative_diff(g, t_params[i].second.grad()));
  }
  EXPECT_LE(worst, 1e-4);
  // The saved adapter: PEFT's names and shapes, as the unquantized model's.
  const auto saved = lora_state_dict(*quantized), reference = lora_state_dict(*twin);
  ASSERT_EQ(saved.size(), reference.size());
  for (size_t i = 0; i < saved.size(); ++i) {
    EXPECT_EQ(saved[i].first, reference[i].first);
    EXPECT_EQ(saved[i].second.sizes(), reference[i].second.sizes());
    EXPECT_EQ(saved[i].second.scalar_type(), torch::kFloat32);
  }
}

// PEFT's bf16 path (the base in bf16, fp32 adapters) under CPU autocast, with every decoder
// layer recomputed in backward: bf16 logits, finite gradients, the same as without recomputing.
TEST_P(QuantLora, Bf16AutocastAndRecomputedLayersTrain) {
  for_each_bf16_gemm_path([&] {
  const auto config = small_config(/*tied=*/true);
  std::vector<std::vector<torch::Tensor>> grads;
  for (const bool recompute : {false, true}) {
    auto model = seeded_model(config, 12, torch::kBFloat16);
    quantize_base_linears(*model, options());
    LoraConfig lora;
    lora.r = 4;
    lora.lora_dropout = 0.0;
    torch::manual_seed(3);
    apply_lora(*model, lora);
    {
      torch::NoGradGuard no_grad;
      for (auto& [name, p] : lora_named_parameters(*model)) {
        if (name.find("lora_B") != std::string::npos) p.fill_(0.01);
      }
    }
    model->model->set_gradient_checkpointing(recompute);
    model->train();
    const auto ids = sample_ids(config.vocab_size, 3);
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    torch::Tensor logits;
    try {
      logits = model->forward(ids);
      causal_lm_loss(logits, ids).backward();
    } catch (...) {
      at::autocast::set_autocast_enabled(at::kCPU, false);
      throw;
    }
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
    EXPECT_EQ(logits.scalar_type(), torch::kBFloat16);
    std::vector<torch::Tensor> g;
    for (auto& [name, p] : lora_named_parameters(*model)) {
      EXPECT_EQ(p.scalar_type(), torch::kFloat32) << name;
      ASSERT_TRUE(p.grad().defined()) << name;
      EXPECT_TRUE(torch::isfinite(p.grad()).all().item<bool>()) << name;
      g.push_back(p.grad().clone());
    }
    grads.push_back(g);
  }
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) EXPECT_LE(max_abs_diff(grads[0][i], grads[1][i]), 1e-6);
  });
}

INSTANTIATE_TEST_SUITE_P(Quant, QuantLora, ::testing::Values("int4", "int8"));

// A tiny untied Llama (hidden 128, 4 heads / 2 KV heads) of `layers` decoder layers.
static TinyLlamaOptions untied_tiny(int layers) {
  TinyLlamaOptions tiny;
  tiny.hidden_size = 128;
  tiny.num_hidden_layers = layers;
  tiny.num_attention_heads = 4;
  tiny.num_key_value_heads = 2;
  tiny.intermediate_size = 192;
  tiny.tie_word_embeddings = false;
  return tiny;
}

// load_hf_model with a quantization quantizes each decoder linear as its weight is read: the
// same codes as loading in full and quantizing after.
TEST(QuantLoad, QuantizesEachDecoderLinearAsItIsRead) {
  TempDir dir("quant_load");
  make_tiny_llama(dir.str(), 96, untied_tiny(2));
  auto loaded = load_hf_model(dir.str(), torch::kFloat32, quant_options("int4"));
  auto after = load_hf_model(dir.str(), torch::kFloat32);
  quantize_base_linears(*after, quant_options("int4"));
  const auto a = quantizable_linears(*loaded), b = quantizable_linears(*after);
  ASSERT_EQ(a.size(), 14u);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(a[i].second->base_quantized()) << a[i].first;
    EXPECT_TRUE(torch::equal(a[i].second->quantized_weight().codes, b[i].second->quantized_weight().codes));
    EXPECT_TRUE(torch::equal(a[i].second->quantized_weight().block_absmax(), b[i].second->quantized_weight().block_absmax()));
  }
  EXPECT_FALSE(loaded->lm_head->base_quantized());
  // The base's bytes: the decoder linears at 0.258x fp16, the embeddings, head and norms as
  // loaded (fp32 here).
  const BaseMemory m = base_memory(*loaded);
  EXPECT_EQ(m.quantized_layers, 14);
  EXPECT_LE(static_cast<double>(m.quantized_bytes) / m.quantized_fp16_bytes, 0.26);
  const BaseMemory full = base_memory(*load_hf_model(dir.str(), torch::kFloat32));
  EXPECT_EQ(full.quantized_layers, 0);
  EXPECT_EQ(full.fp16_bytes, m.fp16_bytes);
  EXPECT_LT(m.bytes, full.bytes);
  // Nothing can write the quantized model as a model directory or merge into it.
  expect_error([&] { hf_state_dict(loaded); }, {"quantized"});
  LoraConfig lora;
  apply_lora(*loaded, lora);
  expect_error([&] { merge_lora(*loaded); }, {"model.layers.0.self_attn.q_proj", "quantized", "merge-adapter"});
}

// Module::to moves the codes with the model and never casts them.
TEST(QuantLoad, ToDtypeKeepsTheCodesAndChangesTheComputeDtype) {
  auto model = seeded_model(small_config(), 2);
  quantize_base_linears(*model, quant_options("int4"));
  model->to(torch::kBFloat16);
  const auto& q = model->model->layers[0]->as<LlamaDecoderLayerImpl>()->self_attn->q_proj->quantized_weight();
  EXPECT_EQ(q.codes.scalar_type(), torch::kUInt8);
  EXPECT_EQ(q.absmax_absmax.scalar_type(), torch::kFloat32);
  EXPECT_EQ(q.dtype, torch::kBFloat16);
  model->to(torch::Device(torch::kCPU));
  torch::NoGradGuard no_grad;
  const auto logits = model->forward(sample_ids(64, 4));
  EXPECT_EQ(logits.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::isfinite(logits).all().item<bool>());
}

// ---------------------------------------------------------------------------------------
// Quantized embeddings and lm_head (QuantOptions::embeddings, Note [quantized embeddings])

// A lookup dequantizes only its rows, bit for bit what dequantizing everything would give: NF4
// with and without double quantization (600 rows of 64: three 256-blocks of absmax codes), int8,
// bf16 output, repeated and last ids, and a width no NF4 block divides (the whole-tensor path).
TEST(QuantRows, DequantizeRowsIsDequantizeThenIndexSelect) {
  struct Case {
    QuantOptions options;
    Shape shape;
  };
  const auto ids_for = [](int64_t rows) {
    return torch::tensor({int64_t{0}, rows - 1, int64_t{3}, int64_t{3}, rows / 2, int64_t{1}}, torch::kInt64).view({2, 3});
  };
  for (const auto& c : {Case{kNf4, {64, 128}}, Case{kNf4Dq, {600, 64}}, Case{kNf4Dq, {40, 256}},
                        Case{kInt8, {50, 96}}, Case{kNf4, {10, 96}}, Case{kNf4Dq, {10, 96}}}) {
    SCOPED_TRACE(describe(c.options) + " " + std::to_string(c.shape.rows) + "x" + std::to_string(c.shape.cols));
    const auto q = quantize(test_weight(c.shape.rows, c.shape.cols, torch::kFloat32, 17), c.options);
    const auto ids = ids_for(c.shape.rows);
    const auto rows = dequantize_rows(q, ids);
    EXPECT_EQ(rows.sizes(), (std::vector<int64_t>{2, 3, c.shape.cols}));
    EXPECT_TRUE(torch::equal(rows.view({6, c.shape.cols}), dequantize(q).index_select(0, ids.view({-1}))));
    const auto bf16 = dequantize_rows(q, ids.to(torch::kInt32), torch::kBFloat16);
    EXPECT_EQ(bf16.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(bf16.view({6, c.shape.cols}),
                             dequantize(q, torch::kBFloat16).index_select(0, ids.view({-1}))));
  }
  expect_error([] { dequantize_rows(QuantizedTensor{}, torch::zeros({1}, torch::kInt64)); }, {"not quantized"});
}

// With the embeddings and an untied head quantized too: the model computes the twin whose every
// quantized weight is its dequantized value (forward and the chunked loss_sum, gradients to the
// adapters), the full-precision tables are gone, and the base's bytes count them.
TEST_P(QuantLora, QuantizedEmbeddingsAndHeadComputeTheirDequantizedValues) {
  for (const bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const auto config = small_config(tied);
    auto quantized = seeded_model(config, 31);
    const BaseMemory before = base_memory(*quantized);
    quantize_base_linears(*quantized, options());
    EXPECT_EQ(quantized->quantize_embeddings(options()), tied ? 1 : 2);
    EXPECT_EQ(quantized->quantize_embeddings(options()), 0);  // already quantized: nothing more
    EXPECT_TRUE(quantized->model->embed_tokens->base_quantized());
    EXPECT_FALSE(quantized->model->embed_tokens->weight.defined());
    EXPECT_FALSE(quantized->named_parameters().contains("model.embed_tokens.weight"));
    EXPECT_FALSE(quantized->named_parameters().contains("lm_head.weight"));
    const BaseMemory m = base_memory(*quantized);
    EXPECT_EQ(m.quantized_layers, tied ? 15 : 16);
    EXPECT_EQ(m.fp16_bytes, before.fp16_bytes);  // the same weights, counted once each
    // Only the norms (fp32) stay unquantized: the whole base is the format's ratio.
    if (options().kind == QuantKind::Nf4) EXPECT_LE(static_cast<double>(m.bytes) / m.fp16_bytes, 0.3);
    expect_error([&] { hf_state_dict(quantized); }, {"quantized"});

    auto twin = seeded_model(config, 31);
    copy_dequantized(twin, quantized);
    {
      torch::NoGradGuard no_grad;
      twin->model->embed_tokens->weight.copy_(quantized->model->embed_tokens->base_weight());
      if (!tied) twin->lm_head->weight.copy_(quantized->lm_head->base_weight());
    }
    LoraConfig lora;
    lora.r = 4;
    lora.lora_dropout = 0.0;
    for (auto* m2 : {&quantized, &twin}) {
      torch::manual_seed(22);
      apply_lora(**m2, lora);
      torch::NoGradGuard no_grad;
      for (auto& [name, p] : lora_named_parameters(**m2)) {
        if (name.find("lora_B") != std::string::npos) p.fill_(0.02);
      }
      (*m2)->train();
    }
    const auto ids = sample_ids(config.vocab_size, 6);
    {
      torch::NoGradGuard no_grad;
      EXPECT_LE(max_abs_diff(quantized->forward(ids), twin->forward(ids)), 1e-5);
    }
    // The chunked head (5 tokens a chunk) over the dequantized head, against the twin's logits.
    const auto parts = quantized->loss_sum(ids, ids, {}, 5);
    const auto reference = causal_lm_loss_sum(twin->forward(ids), ids);
    EXPECT_EQ(parts.count.item<int64_t>(), reference.count.item<int64_t>());
    EXPECT_NEAR(parts.sum.item<double>(), reference.sum.item<double>(), 1e-4 * reference.sum.item<double>());
    (parts.sum / parts.count).backward();
    (reference.sum / reference.count).backward();
    const auto q_params = lora_named_parameters(*quantized), t_params = lora_named_parameters(*twin);
    ASSERT_EQ(q_params.size(), t_params.size());
    for (size_t i = 0; i < q_params.size(); ++i) {
      ASSERT_TRUE(q_params[i].second.grad().defined()) << q_params[i].first;
      EXPECT_LE(relative_diff(q_params[i].second.grad(), t_params[i].second.grad()), 1e-4) << q_params[i].first;
    }
  }
}

// Loading with QuantOptions::embeddings: the same codes as loading whole and quantizing after.
TEST(QuantLoad, EmbeddingsAndHeadAreQuantizedOnLoadWhenAsked) {
  TempDir dir("quant_load_embeddings");
  make_tiny_llama(dir.str(), 96, untied_tiny(1));
  auto options = quant_options("int4");
  options.embeddings = true;
  auto loaded = load_hf_model(dir.str(), torch::kFloat32, options);
  auto after = load_hf_model(dir.str(), torch::kFloat32);
  after->quantize_embeddings(quant_options("int4"));
  ASSERT_TRUE(loaded->model->embed_tokens->base_quantized());
  ASSERT_TRUE(loaded->lm_head->base_quantized());
  EXPECT_TRUE(torch::equal(loaded->model->embed_tokens->quantized_weight().codes,
                           after->model->embed_tokens->quantized_weight().codes));
  EXPECT_TRUE(torch::equal(loaded->lm_head->quantized_weight().codes, after->lm_head->quantized_weight().codes));
  EXPECT_EQ(base_memory(*loaded).quantized_layers, 7 + 2);
  // Without the option the two stay as they are (bitsandbytes' choice).
  auto plain = load_hf_model(dir.str(), torch::kFloat32, quant_options("int4"));
  EXPECT_FALSE(plain->model->embed_tokens->base_quantized());
  EXPECT_FALSE(plain->lm_head->base_quantized());
}
