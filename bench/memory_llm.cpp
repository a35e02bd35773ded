// Peak memory and tokens/s of a LoRA SFT step of a Llama-shape model (random weights), batch 1,
// sequence 2048, gradient checkpointing on, against transformers + peft on the same model
// (bench/memory_llm.py; bench/memory_compare.sh runs both and prints the ratios).
// usage: bench_memory_llm [--device cpu|cuda] [--dtype fp32|bf16] [--quantization none|int4|int8]
//          [--quantize-embeddings]
//          [--hidden 1024 --layers 24 --heads 16 --kv-heads 8 --intermediate 2816 --vocab 32000]
//          [--seq 2048 --batch 1 --steps 3 --warmup 1 --threads 1] [--r 16 --alpha 32 --lora-dropout 0.05]
//          [--no-checkpointing] [--keep-freed-memory trainer|before-build|off] [--max-rss-gib G]
// Built with replica's own API, as llm-sft builds it: LlamaForCausalLM (models/llama.h) with its
// decoder layers recomputed in backward (set_gradient_checkpointing), LoRA on q/k/v/o and
// gate/up/down (models/lora.h, PEFT's initialisation and names), the trainer's AdamW
// (train/optim.h make_optimizer: FusedAdamW) over the adapters, the C allocator told to keep freed
// memory once the model is built, as the trainer does (--keep-freed-memory before-build: before
// it; off: glibc's defaults). Over a quantized base the setting's place matters: set before the
// build, the freed full-precision weights and the quantizer's temporaries stay resident (glibc
// returns nothing), and the process holds more than with an unquantized base.
// --dtype bf16: the frozen base in bf16, the adapters fp32, forward under bf16 autocast (llm-sft
// with mixed_precision: bf16 and peft); fp32: everything fp32.
// Prints one line of key=value; the memory keys are bench/memory_llm.py's (see there):
// rss_base_mib, rss_model_mib, peak_rss_mib, step_peak_rss_mib, base_mib, base_vs_fp16,
// state_mib, and on CUDA cuda_peak_alloc_mib / cuda_peak_reserved_mib. With --quantization,
// base_mib counts the codes and statistics (lora.h base_memory), base_vs_fp16 is the whole base
// (embeddings, lm_head and norms stay unquantized, the first two quantized as well with
// --quantize-embeddings) against fp16, and quantized_vs_fp16 the quantized weights alone.
#include "replica/core/cuda.h"
#include "replica/core/system.h"
#include "replica/models/llama.h"
#include "replica/models/lora.h"
#include "replica/models/quant.h"
#include "replica/train/optim.h"

#include <ATen/autocast_mode.h>
#include <CLI/CLI.hpp>
#include <sys/resource.h>
#include <torch/cuda.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

double rss_mib() {
  std::ifstream f("/proc/self/statm");
  long long size = 0, resident = 0;
  f >> size >> resident;
  return static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / kMiB;
}

// A "Key:   123 kB" line of /proc/self/status or /proc/meminfo, in MiB (-1 when absent).
double proc_kib_field_mib(const char* file, const std::string& key) {
  std::ifstream f(file);
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(key + ":", 0) == 0) {
      std::istringstream in(line.substr(key.size() + 1));
      long long kib = 0;
      in >> kib;
      return static_cast<double>(kib) / 1024.0;
    }
  }
  return -1;
}

double ru_maxrss_mib() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int64_t bytes_of(const torch::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; }

}  // namespace

int main(int argc, char** argv) {
  int64_t hidden = 1024, layers = 24, heads = 16, kv_heads = 8, intermediate = 2816, vocab = 32000;
  int seq = 2048, batch = 1, steps = 3, warmup = 1, threads = 1, r = 16;
  double alpha = 32, lora_dropout = 0.05, max_rss_gib = 0;
  bool no_checkpointing = false, quantize_embeddings = false;
  std::string device_name = "cpu", dtype = "fp32", quantization = "none", keep_freed = "trainer";
  CLI::App app{"Peak memory and tokens/s of a LoRA SFT step (bench/memory_llm.py is the transformers + peft side)"};
  app.add_option("--hidden", hidden, "hidden_size")->capture_default_str();
  app.add_option("--layers", layers, "num_hidden_layers")->capture_default_str();
  app.add_option("--heads", heads, "num_attention_heads")->capture_default_str();
  app.add_option("--kv-heads", kv_heads, "num_key_value_heads")->capture_default_str();
  app.add_option("--intermediate", intermediate, "intermediate_size")->capture_default_str();
  app.add_option("--vocab", vocab, "vocab_size")->capture_default_str();
  app.add_option("--seq", seq, "Tokens per row")->capture_default_str();
  app.add_option("--batch", batch, "Rows per step")->capture_default_str();
  app.add_option("--steps", steps, "Timed steps")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads")->capture_default_str();
  app.add_option("--r", r, "LoRA rank")->capture_default_str();
  app.add_option("--alpha", alpha, "lora_alpha")->capture_default_str();
  app.add_option("--lora-dropout", lora_dropout, "lora_dropout")->capture_default_str();
  app.add_option("--device", device_name, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  app.add_option("--dtype", dtype, "fp32, or a bf16 base under bf16 autocast")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  app.add_option("--quantization", quantization, "none, int4 or int8: the frozen base quantized")
      ->check(CLI::IsMember({"none", "int4", "int8"}))
      ->capture_default_str();
  app.add_flag("--quantize-embeddings", quantize_embeddings,
               "with --quantization: the embeddings and lm_head quantized too (llm-sft's quantize_embeddings)");
  app.add_flag("--no-checkpointing", no_checkpointing, "Gradient checkpointing off");
  app.add_option("--keep-freed-memory", keep_freed,
                 "keep_freed_memory_in_process (the trainer's allocator setting): trainer (once the model is "
                 "built, as run_worker calls it), before-build, or off")
      ->check(CLI::IsMember({"trainer", "before-build", "off"}))
      ->capture_default_str();
  app.add_option("--max-rss-gib", max_rss_gib, "Stop (exit 3) when RSS passes this, or MemAvailable < 1 GiB");
  CLI11_PARSE(app, argc, argv);

  // A guard for the fit search: ulimit -v does not work with LibTorch's address-space
  // reservations, so RSS is sampled and the run ends before it can push the machine into the
  // OOM killer (which would pick whichever process it likes).
  if (max_rss_gib > 0) {
    std::thread([limit = max_rss_gib * 1024.0, hidden, layers] {
      for (;;) {
        const double rss = rss_mib();
        const double available = proc_kib_field_mib("/proc/meminfo", "MemAvailable");
        if (rss > limit || (available >= 0 && available < 1024.0)) {
          std::printf("side=replica exceeded=1 rss_mib=%.0f limit_mib=%.0f mem_available_mib=%.0f peak_rss_mib=%.0f "
                      "hidden=%lld layers=%lld\n",
                      rss, limit, available, proc_kib_field_mib("/proc/self/status", "VmHWM"),
                      static_cast<long long>(hidden), static_cast<long long>(layers));
          std::fflush(stdout);
          std::_Exit(3);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }).detach();
  }

  const torch::Device device = device_name == "cuda" ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  if (device.is_cuda() && !torch::cuda::is_available()) {
    std::fprintf(stderr, "bench_memory_llm: --device cuda but no GPU is visible\n");
    return 1;
  }
  if (quantize_embeddings && quantization == "none") {
    std::fprintf(stderr, "bench_memory_llm: --quantize-embeddings needs --quantization int4 or int8\n");
    return 2;
  }
  const bool bf16 = dtype == "bf16";
  auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize();
  };
  replica::set_compute_threads(threads);
  // before-build: sized as for a model without large trainable parameters (LoRA's).
  if (keep_freed == "before-build") replica::keep_freed_memory_in_process(0);
  const double rss_base = rss_mib();

  torch::manual_seed(0);
  const std::string config_json =
      "{\"model_type\": \"llama\", \"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": " +
      std::to_string(hidden) + ", \"intermediate_size\": " + std::to_string(intermediate) +
      ", \"num_hidden_layers\": " + std::to_string(layers) + ", \"num_attention_heads\": " + std::to_string(heads) +
      ", \"num_key_value_heads\": " + std::to_string(kv_heads) + ", \"vocab_size\": " + std::to_string(vocab) +
      ", \"max_position_embeddings\": " + std::to_string(std::max(4096, seq)) +
      ", \"rms_norm_eps\": 1e-6, \"rope_theta\": 10000.0, \"tie_word_embeddings\": false, \"hidden_act\": \"silu\", "
      "\"torch_dtype\": \"" + (bf16 ? "bfloat16" : "float32") + "\"}";
  auto config = replica::models::parse_llama_config(config_json, "bench config");
  const bool quantized = quantization != "none";
  // Quantized: built as load_hf_model builds it (models/hf_model_dir.cpp), with init false (no
  // page of a weight is resident before it is written), each decoder linear's weight drawn and
  // quantized at once so the full-precision model is never resident; the embeddings, lm_head
  // and norms get HF's init (normal(0, 0.02), ones) and stay as they are (the first two
  // quantized then with --quantize-embeddings, as the loader does).
  replica::models::LlamaForCausalLM model(config, bf16 ? torch::kBFloat16 : torch::kFloat32, /*init=*/!quantized);
  if (quantized) {
    const auto options = replica::models::quant_options(quantization, "--quantization");
    torch::NoGradGuard no_grad;
    for (auto& [name, layer] : replica::models::quantizable_linears(*model)) {
      layer->weight.normal_(0.0, config.initializer_range);
      layer->quantize_base(options);  // the weight is a parameter no more
    }
    for (auto& item : model->named_parameters()) {
      const auto& key = item.key();
      if (key.size() >= 11 && key.compare(key.size() - 11, 11, "norm.weight") == 0) {
        item.value().fill_(1.0);
      } else {
        item.value().normal_(0.0, config.initializer_range);
      }
    }
    if (quantize_embeddings) model->quantize_embeddings(options);
  }
  model->to(device);
  model->train();
  model->model->set_gradient_checkpointing(!no_checkpointing);
  replica::models::LoraConfig lora;
  lora.r = r;
  lora.lora_alpha = alpha;
  lora.lora_dropout = lora_dropout;
  lora.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  replica::models::apply_lora(*model, lora);
  std::vector<torch::Tensor> trainable;
  int64_t params = 0, n_trainable = 0, base_bytes = 0;
  for (const auto& p : model->parameters()) {
    params += p.numel();
    if (p.requires_grad()) {
      trainable.push_back(p);
      n_trainable += p.numel();
    } else {
      base_bytes += bytes_of(p);
    }
  }
  for (const auto& b : model->buffers()) base_bytes += bytes_of(b);
  int64_t base_params = params - n_trainable;
  std::string quant_fields;
  double base_vs_fp16 = base_params > 0 ? static_cast<double>(base_bytes) / (2.0 * static_cast<double>(base_params)) : 0;
  {
    // The quantized weights are no parameters: lora.h's account of what the base holds.
    const auto held = replica::models::base_memory(*model);
    base_bytes = held.bytes;
    base_params = held.fp16_bytes / 2;
    params = base_params + n_trainable;
    base_vs_fp16 = held.fp16_bytes > 0 ? static_cast<double>(held.bytes) / static_cast<double>(held.fp16_bytes) : 0;
    if (held.quantized_layers > 0) {
      char buf[160];
      std::snprintf(buf, sizeof buf, " quantized_layers=%d quantized_mib=%.1f quantized_vs_fp16=%.3f",
                    held.quantized_layers, held.quantized_bytes / kMiB,
                    static_cast<double>(held.quantized_bytes) / static_cast<double>(held.quantized_fp16_bytes));
      quant_fields = buf;
    }
  }
  // The trainer's AdamW (FusedAdamW) with torch.optim.AdamW's weight decay, as the peer.
  replica::train::OptimizerSpec spec;
  spec.kind = replica::train::OptimizerKind::AdamW;
  spec.lr = 1e-4;
  spec.weight_decay = 0.01;
  auto optimizer = replica::train::make_optimizer(spec, trainable);
  if (keep_freed == "trainer") replica::keep_freed_memory_for(trainable);  // as the trainer, once the model is built
  const double rss_model = rss_mib();

  auto gen = at::detail::createCPUGenerator(1);
  torch::Tensor loss;
  auto step = [&] {
    auto ids = torch::randint(0, vocab, {batch, seq}, gen).to(device);
    for (auto& p : trainable) p.mutable_grad() = torch::Tensor();
    at::autocast::set_autocast_enabled(device.type(), bf16);
    if (bf16) at::autocast::set_autocast_dtype(device.type(), at::kBFloat16);
    // The trainer's path: the head and its loss in chunks, no [tokens, vocab] logits (llama.h loss_sum).
    const auto parts = model->loss_sum(ids, ids);
    loss = parts.sum / parts.count.clamp_min(1).to(torch::kFloat32);
    at::autocast::set_autocast_enabled(device.type(), false);
    if (bf16) at::autocast::clear_cache();
    loss.backward();
    optimizer->step();
  };

  // The peak over the steps alone: VmHWM (and with it ru_maxrss) reset to the current RSS; the
  // process's peak is the larger of the build's and the steps'.
  const double build_peak = ru_maxrss_mib();
  bool step_peak_ok = false;
  {
    std::ofstream clear("/proc/self/clear_refs");
    if (clear) {
      clear << "5";
      clear.flush();
      step_peak_ok = static_cast<bool>(clear);
    }
  }
  std::vector<double> times, cpus;
  for (int i = 0; i < warmup + steps; ++i) {
    sync();
    const auto t0 = std::chrono::steady_clock::now();
    const std::clock_t c0 = std::clock();
    step();
    sync();
    if (i >= warmup) {
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      cpus.push_back(static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC);
    }
  }
  const double step_peak = proc_kib_field_mib("/proc/self/status", "VmHWM");
  const double peak = std::max(build_peak, ru_maxrss_mib());

  int64_t state = 0;
  for (const auto& p : trainable) state += bytes_of(p) + bytes_of(p.grad());
  for (const auto& p : trainable) {
    auto it = optimizer->state().find(p.unsafeGetTensorImpl());
    if (it == optimizer->state().end()) continue;
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    state += bytes_of(s.exp_avg()) + bytes_of(s.exp_avg_sq()) + bytes_of(s.max_exp_avg_sq());
  }
  const double tokens = static_cast<double>(batch) * seq;
  std::string step_s;
  for (double t : times) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%s%.2f", step_s.empty() ? "" : ",", t);
    step_s += buf;
  }
  std::printf("side=replica device=%s dtype=%s quantization=%s params=%lld trainable=%lld hidden=%lld layers=%lld "
              "batch=%d seq=%d steps=%zu tokens/s=%.1f cpu_tokens/s=%.1f step_s=%s loss=%.4f rss_base_mib=%.0f "
              "rss_model_mib=%.0f peak_rss_mib=%.0f",
              device_name.c_str(), dtype.c_str(), quantization.c_str(), static_cast<long long>(params),
              static_cast<long long>(n_trainable), static_cast<long long>(hidden), static_cast<long long>(layers),
              batch, seq, times.size(), times.empty() ? 0.0 : tokens / median(times),
              cpus.empty() ? 0.0 : tokens / median(cpus), step_s.c_str(), loss.defined() ? loss.item<double>() : 0.0,
              rss_base, rss_model, peak);
  if (step_peak_ok) std::printf(" step_peak_rss_mib=%.0f", step_peak);
  std::printf(" base_mib=%.1f base_vs_fp16=%.3f%s state_mib=%.1f", base_bytes / kMiB, base_vs_fp16,
              quant_fields.c_str(), state / kMiB);
  if (device.is_cuda()) {
    const auto m = replica::gpu_memory(device.index());
    std::printf(" cuda_peak_alloc_mib=%.0f cuda_peak_reserved_mib=%.0f", m.peak_allocated / kMiB,
                m.peak_reserved / kMiB);
  }
  std::printf("\n");
  std::fflush(stdout);
  return 0;
}
