// Tokens/s of a full training step (forward, loss, backward, AdamW) of a ~20M-parameter Llama
// at sequence length 256, against the same model in PyTorch eager (bench/llama_step.py).
// usage: bench_llama_step [--batch 4 --seq 256 --steps 10 --warmup 2 --threads 1 --profile FILE]
// --profile writes a Chrome trace of the timed steps (per-op times; bench/op_times.py sums them).
#include "replica/core/system.h"
#include "replica/models/llama.h"
#include "replica/train/optim.h"

#include <CLI/CLI.hpp>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <string>

// The model both sides build: 5 layers of hidden 512 with 8 heads (4 KV heads), SwiGLU 1376,
// vocabulary 8192 with tied embeddings: 20.0M parameters.
static const char* kConfig = R"({
  "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 512,
  "intermediate_size": 1376, "num_hidden_layers": 5, "num_attention_heads": 8,
  "num_key_value_heads": 4, "vocab_size": 8192, "max_position_embeddings": 1024,
  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": true, "hidden_act": "silu",
  "torch_dtype": "float32"})";

int main(int argc, char** argv) {
  int batch = 4, seq = 256, steps = 10, warmup = 2, threads = 1;
  std::string profile;
  CLI::App app{"Tokens/s of a Llama training step (bench/llama_step.py is the PyTorch side)"};
  app.add_option("--batch", batch, "Rows per step")->capture_default_str();
  app.add_option("--seq", seq, "Tokens per row")->capture_default_str();
  app.add_option("--steps", steps, "Timed steps")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads")->capture_default_str();
  app.add_option("--profile", profile, "Write a Chrome trace of the timed steps to this file");
  CLI11_PARSE(app, argc, argv);
  replica::set_compute_threads(threads);
  replica::keep_freed_memory_in_process();
  torch::manual_seed(0);
  auto config = replica::models::parse_llama_config(kConfig, "bench config");
  replica::models::LlamaForCausalLM model(config);
  // The trainer's AdamW (replica::train::FusedAdamW), with torch.optim.AdamW's default weight
  // decay as on the PyTorch side.
  replica::train::OptimizerSpec spec;
  spec.kind = replica::train::OptimizerKind::AdamW;
  spec.lr = 1e-4;
  spec.weight_decay = 0.01;
  auto optimizer = replica::train::make_optimizer(spec, model->parameters());
  auto& opt = *optimizer;
  auto gen = at::detail::createCPUGenerator(1);
  torch::Tensor loss;
  auto step = [&] {
    auto ids = torch::randint(0, config.vocab_size, {batch, seq}, gen);
    for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
    loss = replica::models::causal_lm_loss(model->forward(ids), ids);
    loss.backward();
    opt.step();
  };
  for (int i = 0; i < warmup; ++i) step();
  std::unique_ptr<torch::autograd::profiler::RecordProfile> recording;
  if (!profile.empty()) recording = std::make_unique<torch::autograd::profiler::RecordProfile>(profile);
  auto t0 = std::chrono::steady_clock::now();
  const std::clock_t c0 = std::clock();
  for (int i = 0; i < steps; ++i) step();
  const double cpu = static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
  recording.reset();
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int64_t params = 0;
  for (auto& p : model->parameters()) params += p.numel();
  // cpu_tokens/s divides by this process's CPU time: with one thread it matches tokens/s on a
  // quiet machine and stays meaningful when other work shares the cores.
  std::printf("side=replica params=%lld batch=%d seq=%d steps/s=%.3f tokens/s=%.1f cpu_tokens/s=%.1f loss=%.4f\n",
              static_cast<long long>(params), batch, seq, steps / dt,
              static_cast<double>(steps) * batch * seq / dt, static_cast<double>(steps) * batch * seq / cpu,
              loss.item<double>());
  return 0;
}
