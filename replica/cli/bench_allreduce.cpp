#include "replica/cli/bench_allreduce.h"

#include "replica/core/error.h"
#include "replica/distributed/process_group.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace replica::cli {

int bench_allreduce_worker(const BenchAllreduceOptions& options) {
  auto world = distributed::world_from_env().value_or(distributed::WorldInfo{});
  torch::set_num_threads(1);
  const torch::ScalarType dtype = options.dtype == "bfloat16" ? torch::kBFloat16
                                  : options.dtype == "float16" ? torch::kHalf
                                                               : torch::kFloat32;
  const int64_t elem = torch::elementSize(dtype);
  auto pg = distributed::init_process_group(world);
  for (const auto& transport : options.transports) {
    try {
      pg->set_transport(transport);
    } catch (const replica::Error& e) {
      if (world.rank == 0) std::printf("# transport %s unavailable: %s\n", transport.c_str(), e.what());
      continue;
    }
    const int n = pg->size();
    // One worker has no transport: one table, not one per transport asked for.
    if (n == 1 && &transport != &options.transports.front()) break;
    if (pg->rank() == 0) {
      std::printf("# replica bench allreduce: transport %s, world %d, dtype %s, %d iterations (median)\n",
                  pg->transport().c_str(), n, options.dtype.c_str(), options.iterations);
      std::printf("%12s %12s %10s %12s %12s\n", "size(B)", "count", "time(us)", "algbw(GB/s)", "busbw(GB/s)");
    }
    for (int64_t bytes = options.min_bytes; bytes <= options.max_bytes; bytes *= 2) {
      const int64_t count = bytes / elem;
      torch::Tensor t = pg->alloc_buffer(count, dtype);
      t.zero_();  // zeros stay finite however often they are summed
      std::vector<double> times;
      for (int i = 0; i < options.warmup + options.iterations; ++i) {
        pg->barrier();
        auto t0 = std::chrono::steady_clock::now();
        pg->allreduce_sum(t).wait();
        const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (i >= options.warmup) times.push_back(dt);
      }
      // The slowest rank's time is the collective's time.
      auto tt = torch::tensor(times, torch::kDouble);
      std::vector<torch::Tensor> all;
      pg->allgather(all, tt);
      auto worst = torch::stack(all).amax(0);
      std::vector<double> w(worst.data_ptr<double>(), worst.data_ptr<double>() + worst.numel());
      std::sort(w.begin(), w.end());
      const double median = w[w.size() / 2];
      if (pg->rank() == 0) {
        const double algbw = bytes / median / 1e9;
        const double busbw = algbw * 2.0 * (n - 1) / n;
        std::printf("%12lld %12lld %10.1f %12.2f %12.2f\n", static_cast<long long>(bytes),
                    static_cast<long long>(count), median * 1e6, algbw, busbw);
      }
    }
    pg->barrier();
  }
  return 0;
}

}  // namespace replica::cli
