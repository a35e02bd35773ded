// Quantized bases on CUDA (CTest label `gpu`; every test skips, saying why, where no GPU is
// visible): the ATen ops of models/quant.h give on the GPU the codes, statistics and values
// they give on the CPU (bitsandbytes' fixture included), and a LoRA model over a quantized base
// computes on CUDA what it computes on the CPU, in fp32 and under bf16 autocast, holding its
// quantized linears at their quantized bytes.
#include "replica/testing/gpu_skip.h"
#include "replica/testing/paths.h"
#include "replica/io/safetensors.h"
#include "replica/models/llama.h"
#include "replica/models/lora.h"
#include "replica/models/quant.h"

#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

using namespace replica::models;

namespace {

const torch::Device kCuda(torch::kCUDA, 0);

bool same(const torch::Tensor& gpu, const torch::Tensor& cpu) { return torch::equal(gpu.cpu(), cpu); }

}  // namespace

TEST(QuantGpu, CudaQuantizesToTheSameCodesAsTheCpuAndBitsandbytes) {
  REPLICA_SKIP_WITHOUT_GPU();
  auto file = replica::io::load_safetensors(std::string(REPLICA_SOURCE_DIR) +
                                            "/replica/models/tests/reference/bnb_quant.safetensors");
  for (const std::string x : {"a", "b", "c"}) {
    SCOPED_TRACE(x);
    const auto& w = file.at(x);
    const auto q = quantize(w.to(kCuda), {QuantKind::Nf4, 64, false});
    EXPECT_EQ(q.device(), kCuda);
    EXPECT_TRUE(same(q.codes, file.at(x + ".nf4.codes")));
    EXPECT_TRUE(same(q.absmax, file.at(x + ".nf4.absmax")));
    EXPECT_TRUE(same(dequantize(q), dequantize(quantize(w, {QuantKind::Nf4, 64, false}))));
    const auto q8 = quantize(w.to(kCuda), {QuantKind::Int8, 64, false});
    EXPECT_TRUE(same(q8.codes, file.at(x + ".int8.codes")));
    EXPECT_TRUE(same(q8.absmax, file.at(x + ".int8.absmax")));
  }
  const auto dq = quantize(file.at("a").to(kCuda), {QuantKind::Nf4, 64, true});
  EXPECT_TRUE(same(dq.absmax_codes, file.at("a.nf4dq.absmax_codes")));
  EXPECT_TRUE(same(dq.absmax_absmax, file.at("a.nf4dq.absmax_absmax")));
  EXPECT_TRUE(same(dequantize(dq), file.at("a.nf4dq.dequant")));
  // Moving a CPU-quantized tensor gives the same values there.
  const auto moved = quantize(file.at("a"), {QuantKind::Nf4, 64, true}).to(kCuda);
  EXPECT_TRUE(same(dequantize(moved), file.at("a.nf4dq.dequant")));
}

TEST(QuantGpu, LoraOverAQuantizedBaseComputesOnCudaWhatItComputesOnTheCpu) {
  REPLICA_SKIP_WITHOUT_GPU();
  const auto config = parse_llama_config(R"({"model_type": "llama", "vocab_size": 64, "hidden_size": 128,
    "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": true})",
                                         "gpu config");
  for (const std::string name : {"int4", "int8"}) {
    SCOPED_TRACE(name);
    torch::manual_seed(5);
    LlamaForCausalLM cpu(config);
    quantize_base_linears(*cpu, quant_options(name));
    LoraConfig lora;
    lora.r = 4;
    lora.lora_dropout = 0.0;
    torch::manual_seed(6);
    apply_lora(*cpu, lora);
    {
      torch::NoGradGuard no_grad;
      for (auto& [n, p] : lora_named_parameters(*cpu)) p.fill_(0.01);
    }
    torch::manual_seed(5);
    LlamaForCausalLM gpu(config);
    quantize_base_linears(*gpu, quant_options(name));
    LoraConfig lora2 = lora;
    apply_lora(*gpu, lora2);
    {
      torch::NoGradGuard no_grad;
      for (auto& [n, p] : lora_named_parameters(*gpu)) p.fill_(0.01);
    }
    gpu->to(kCuda);
    const auto& q = gpu->model->layers[0]->as<LlamaDecoderLayerImpl>()->mlp->up_proj->quantized_weight();
    EXPECT_EQ(q.device(), kCuda);
    EXPECT_EQ(q.bytes(), quantized_bytes(192, 128, quant_options(name)));
    const auto ids = torch::randint(0, 64, {2, 16}, torch::kInt64);
    const auto cpu_logits = cpu->forward(ids);
    const auto gpu_logits = gpu->forward(ids.to(kCuda));
    EXPECT_LE((gpu_logits.cpu() - cpu_logits).abs().max().item<double>(), 1e-3);
    causal_lm_loss(cpu_logits, ids).backward();
    causal_lm_loss(gpu_logits, ids.to(kCuda)).backward();
    const auto a = lora_named_parameters(*cpu), b = lora_named_parameters(*gpu);
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_TRUE(b[i].second.grad().defined()) << b[i].first;
      const double scale = a[i].second.grad().abs().max().item<double>() + 1e-12;
      EXPECT_LE((b[i].second.grad().cpu() - a[i].second.grad()).abs().max().item<double>() / scale, 1e-2)
          << a[i].first;
    }
    // bf16 autocast on CUDA: bf16 logits, finite adapter gradients.
    gpu->zero_grad();
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    const auto logits16 = gpu->forward(ids.to(kCuda));
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
    EXPECT_EQ(logits16.scalar_type(), torch::kBFloat16);
    causal_lm_loss(logits16, ids.to(kCuda)).backward();
    for (auto& [n, p] : lora_named_parameters(*gpu)) {
      ASSERT_TRUE(p.grad().defined()) << n;
      EXPECT_TRUE(torch::isfinite(p.grad()).all().item<bool>()) << n;
    }
  }
}
