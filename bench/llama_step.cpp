// Tokens/s of a full training step (forward, loss, backward, AdamW) of a ~20M-parameter Llama
// at sequence length 256, against the same model in PyTorch eager (bench/llama_step.py).
// usage: bench_llama_step [--batch 4 --seq 256 --steps 10 --warmup 2 --threads 1]
#include "replica/core/system.h"
#include "replica/models/llama.h"

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
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
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int v = std::atoi(argv[i + 1]);
    if (k == "--batch") batch = v;
    else if (k == "--seq") seq = v;
    else if (k == "--steps") steps = v;
    else if (k == "--warmup") warmup = v;
    else if (k == "--threads") threads = v;
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  replica::set_compute_threads(threads);
  torch::manual_seed(0);
  auto config = replica::models::parse_llama_config(kConfig, "bench config");
  replica::models::LlamaForCausalLM model(config);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-4));
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
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step();
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int64_t params = 0;
  for (auto& p : model->parameters()) params += p.numel();
  std::printf("side=replica params=%lld batch=%d seq=%d steps/s=%.3f tokens/s=%.1f loss=%.4f\n",
              static_cast<long long>(params), batch, seq, steps / dt,
              static_cast<double>(steps) * batch * seq / dt, loss.item<double>());
  return 0;
}
