// The optimizer step alone: replica's FusedSGD against torch::optim::SGD (momentum 0.9) on one
// flat parameter of N elements, alternating, median of R steps each. The step is memory-bound:
// LibTorch's three kernels move 8 x 4 bytes per element, the fused loop 5 x 4.
// usage: bench_optimizer_step [--elements 54000000] [--rounds 15] [--threads 1]
#include "replica/core/system.h"
#include "replica/train/optim.h"

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int64_t elements = 54'000'000;
  int rounds = 15, threads = 1;
  CLI::App app{"optimizer step time: FusedSGD vs torch::optim::SGD"};
  app.add_option("--elements", elements, "Parameter elements")->capture_default_str();
  app.add_option("--rounds", rounds, "Timed steps of each")->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  replica::set_compute_threads(threads);

  auto options = torch::optim::SGDOptions(0.05).momentum(0.9);
  torch::Tensor a = torch::randn({elements}), b = a.clone();
  a.mutable_grad() = torch::randn({elements}).mul_(1e-3);
  replica::keep_freed_memory_in_process(a.numel() * a.element_size());  // a's size, as the trainer's for its model
  b.mutable_grad() = a.grad().clone();
  torch::optim::SGD reference({a}, options);
  replica::train::FusedSGD fused({b}, options);
  reference.step();  // the first step creates the momentum buffers
  fused.step();
  std::vector<double> t_ref, t_fused;
  auto time = [](torch::optim::Optimizer& opt) {
    const auto start = std::chrono::steady_clock::now();
    opt.step();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  for (int r = 0; r < rounds; ++r) {
    t_ref.push_back(time(reference));
    t_fused.push_back(time(fused));
  }
  const double mb = elements * 4.0 / 1e6;
  std::printf("elements=%lld threads=%d torch_sgd_ms=%.2f fused_sgd_ms=%.2f speedup=%.2f "
              "torch_GBps=%.1f fused_GBps=%.1f max_abs_diff=%.2e\n",
              static_cast<long long>(elements), threads, median(t_ref) * 1e3, median(t_fused) * 1e3,
              median(t_ref) / median(t_fused), 8 * mb / 1e3 / median(t_ref), 5 * mb / 1e3 / median(t_fused),
              (a - b).abs().max().item<double>());
}
