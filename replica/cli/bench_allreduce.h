// `replica bench allreduce`: all-reduce bandwidth per message size and transport, printed like
// nccl-tests (algbw = bytes / time; busbw = algbw * 2 (n - 1) / n, the per-link load of a ring).
#pragma once

#include <string>
#include <vector>

namespace replica::cli {

struct BenchAllreduceOptions {
  int64_t min_bytes = 4 << 10;
  int64_t max_bytes = 256 << 20;
  int iterations = 20;
  int warmup = 5;
  std::vector<std::string> transports = {"shm", "gloo"};
  std::string dtype = "float32";
};

// One worker's part (RANK/WORLD_SIZE from the environment); rank 0 prints the table.
int bench_allreduce_worker(const BenchAllreduceOptions& options);

}  // namespace replica::cli
