// Tokens/s of a full training step (forward, loss, backward, AdamW) of a Llama, against the
// same model in PyTorch eager (bench/llama_step.py), on the CPU or a GPU.
// usage: bench_llama_step [--batch 4 --seq 256 --steps 10 --warmup 2 --threads 1 --profile FILE --segments N]
//                         [--device cpu|cuda] [--dtype fp32|bf16|fp16|bf16-weights] [--preset small|500m] [--peak-tflops T]
// --profile writes a Chrome trace of the timed steps (per-op times; bench/op_times.py sums them).
// --dtype bf16 runs forward and backward under bf16 autocast with fp32 weights and optimizer
// state, as the trainer's mixed_precision: bf16 does (fp16 likewise, without loss scaling). --dtype bf16-weights holds the weights in
// bf16 and computes in bf16 throughout (no autocast), the optimizer stepping fp32 master copies
// (train/optim.h, Note [master weights]): FSDP2's MixedPrecisionPolicy(param_dtype=bf16), what
// torchtitan trains with. --peak-tflops prints the model FLOPs
// utilisation, 6 x parameters x tokens/s over the device's peak (H100 SXM bf16 dense: 989).
#include "replica/core/cpu_gemm.h"
#include "replica/core/system.h"
#include "replica/models/llama.h"
#include "replica/train/optim.h"

#include <ATen/autocast_mode.h>
#include <CLI/CLI.hpp>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <string>

// The models both sides build. small: 5 layers of hidden 512 with 8 heads (4 KV heads), SwiGLU
// 1376, vocabulary 8192 with tied embeddings: 20.0M parameters. 500m: 18 layers of hidden 1536,
// 12 heads (4 KV heads), SwiGLU 4096, vocabulary 32000, tied: 503M parameters (a Llama-shape
// model for the GPU).
static const char* kSmall = R"({
  "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 512,
  "intermediate_size": 1376, "num_hidden_layers": 5, "num_attention_heads": 8,
  "num_key_value_heads": 4, "vocab_size": 8192, "max_position_embeddings": 1024,
  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": true, "hidden_act": "silu",
  "torch_dtype": "float32"})";
static const char* k500m = R"({
  "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 1536,
  "intermediate_size": 4096, "num_hidden_layers": 18, "num_attention_heads": 12,
  "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 4096,
  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": true, "hidden_act": "silu",
  "torch_dtype": "float32"})";

int main(int argc, char** argv) {
  int batch = 4, seq = 256, steps = 10, warmup = 2, threads = 1;
  double peak_tflops = 0;
  std::string profile, device_name = "cpu", dtype = "fp32", preset = "small";
  CLI::App app{"Tokens/s of a Llama training step (bench/llama_step.py is the PyTorch side)"};
  app.add_option("--batch", batch, "Rows per step")->capture_default_str();
  app.add_option("--seq", seq, "Tokens per row")->capture_default_str();
  app.add_option("--steps", steps, "Timed steps")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads")->capture_default_str();
  app.add_option("--profile", profile, "Write a Chrome trace of the timed steps to this file");
  app.add_option("--device", device_name, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  app.add_option("--dtype", dtype, "fp32, bf16 or fp16 (autocast), or bf16-weights")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16", "bf16-weights"}))
      ->capture_default_str();
  app.add_option("--preset", preset, "small (20M) or 500m")->check(CLI::IsMember({"small", "500m"}))->capture_default_str();
  app.add_option("--peak-tflops", peak_tflops, "The device's peak TFLOP/s: prints MFU");
  int segments = 0;
  app.add_option("--segments", segments,
                 "Pack each row as this many samples of equal length (segment ids; 0: one causal row). "
                 "REPLICA_PACKED_ATTENTION=mask|varlen picks the packed attention path")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const torch::Device device = device_name == "cuda" ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  if (device.is_cuda() && !torch::cuda::is_available()) {
    std::fprintf(stderr, "bench_llama_step: --device cuda but no GPU is visible\n");
    return 1;
  }
  // autocast to bf16 or fp16 (the step's speed: no loss scaling); bf16-weights converts the model instead
  const bool bf16 = dtype == "bf16" || dtype == "fp16";
  const auto autocast_dtype = dtype == "fp16" ? at::kHalf : at::kBFloat16;
  auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize();
  };
  replica::set_compute_threads(threads);
  torch::manual_seed(0);
  auto config = replica::models::parse_llama_config(preset == "500m" ? k500m : kSmall, "bench config");
  replica::models::LlamaForCausalLM model(config);
  model->to(device);
  if (dtype == "bf16-weights") model->to(torch::kBFloat16);
  replica::keep_freed_memory_for(model->parameters());  // as the trainer, once the model is built
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
  // Packed rows: segment s of a row is tokens [s * seq / segments, (s + 1) * seq / segments).
  torch::Tensor segment_ids, device_segments;
  if (segments > 0) {
    segment_ids = (torch::arange(seq, torch::kInt64) * segments).div(seq, "floor").expand({batch, seq}).contiguous();
    device_segments = segment_ids.to(device);
  }
  auto step = [&] {
    auto host_ids = torch::randint(0, config.vocab_size, {batch, seq}, gen);
    // As the trainer's workloads: ids checked and the packed layout computed on the host.
    const auto facts = replica::models::host_batch_facts(host_ids, segment_ids, config.vocab_size, device, "ids");
    auto ids = host_ids.to(device);
    for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
    at::autocast::set_autocast_enabled(device.type(), bf16);
    if (bf16) at::autocast::set_autocast_dtype(device.type(), autocast_dtype);
    loss = replica::models::causal_lm_loss(model->forward(ids, {}, device_segments, facts), ids, device_segments);
    at::autocast::set_autocast_enabled(device.type(), false);
    if (bf16) at::autocast::clear_cache();
    loss.backward();
    opt.step();
  };
  for (int i = 0; i < warmup; ++i) step();
  sync();
  // On the CPU the legacy profiler's per-op times (bench/op_times.py); on CUDA Kineto's, which
  // hold the kernels' own times (the host's op times there are launch times).
  std::unique_ptr<torch::autograd::profiler::RecordProfile> recording;
  const bool kineto = !profile.empty() && device.is_cuda();
  if (kineto) {
    using torch::profiler::impl::ActivityType;
    const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
    const std::set<ActivityType> activities{ActivityType::CPU, ActivityType::CUDA};
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
  } else if (!profile.empty()) {
    recording = std::make_unique<torch::autograd::profiler::RecordProfile>(profile);
  }
  auto t0 = std::chrono::steady_clock::now();
  const std::clock_t c0 = std::clock();
  for (int i = 0; i < steps; ++i) step();
  sync();
  const double cpu = static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
  recording.reset();
  if (kineto) torch::autograd::profiler::disableProfiler()->save(profile);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int64_t params = 0;
  for (auto& p : model->parameters()) params += p.numel();
  // cpu_tokens/s divides by this process's CPU time: with one thread it matches tokens/s on a
  // quiet machine and stays meaningful when other work shares the cores.
  const double tokens_per_s = static_cast<double>(steps) * batch * seq / dt;
  std::printf("side=replica device=%s dtype=%s params=%lld batch=%d seq=%d steps/s=%.3f tokens/s=%.1f cpu_tokens/s=%.1f "
              "loss=%.4f",
              device_name.c_str(), dtype.c_str(), static_cast<long long>(params), batch, seq, steps / dt, tokens_per_s,
              static_cast<double>(steps) * batch * seq / cpu, loss.item<double>());
  // 6 FLOPs per parameter per token (forward 2, backward 4); attention's own FLOPs left out.
  if (peak_tflops > 0) std::printf(" mfu=%.3f", 6.0 * params * tokens_per_s / (peak_tflops * 1e12));
  // Which library multiplied the layers' weights on the CPU (core/cpu_gemm.h; REPLICA_CPU_GEMM).
  if (device_name == "cpu") std::printf(" gemm=%s", replica::cpu_gemm_is_openblas() ? "openblas" : "aten");
  if (segments > 0) {
    std::printf(" segments=%d packed_attention=%s", segments,
                replica::models::to_string(replica::models::packed_attention_mode()));
  }
  std::printf("\n");
  return 0;
}
