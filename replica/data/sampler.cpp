// Mirrors torch.utils.data.DistributedSampler (PyTorch 1.13) line by line, so a run that
// switches between PyTorch and replica sees the same sample order for the same seed.
#include "replica/data/sampler.h"

#include "replica/core/error.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>

namespace replica::data {

DistributedSampler::DistributedSampler(int64_t dataset_size, int rank, int world_size,
                                       bool shuffle, uint64_t seed, bool drop_last)
    : dataset_size_(dataset_size),
      rank_(rank),
      world_size_(world_size),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last) {
  if (world_size < 1) fail("DistributedSampler: world_size {} must be at least 1", world_size);
  if (rank < 0 || rank >= world_size) {
    fail("DistributedSampler: rank {} must be in [0, {}]", rank, world_size - 1);
  }
  if (dataset_size < 0) fail("DistributedSampler: dataset size {} is negative", dataset_size);
  const int64_t replicas = world_size;
  if (drop_last && dataset_size % replicas != 0) {
    // PyTorch: ceil((N - W) / W), which for N % W != 0 equals floor(N / W) (0 when N < W).
    num_samples_ = dataset_size / replicas;
  } else {
    num_samples_ = (dataset_size + replicas - 1) / replicas;
  }
  total_size_ = num_samples_ * replicas;
}

std::vector<int64_t> DistributedSampler::indices() const {
  if (dataset_size_ == 0) return {};

  std::vector<int64_t> order(static_cast<size_t>(dataset_size_));
  if (shuffle_) {
    // Same generator, seed and randperm as PyTorch: torch.Generator().manual_seed(seed + epoch).
    // The sum wraps like the uint64 PyTorch's manual_seed receives.
    at::Generator generator =
        at::detail::createCPUGenerator(seed_ + static_cast<uint64_t>(epoch_));
    const torch::Tensor permutation =
        torch::randperm(dataset_size_, generator, torch::TensorOptions().dtype(torch::kInt64));
    const int64_t* values = permutation.data_ptr<int64_t>();
    std::copy(values, values + dataset_size_, order.begin());
  } else {
    for (int64_t i = 0; i < dataset_size_; ++i) order[static_cast<size_t>(i)] = i;
  }

  // Position p of the padded (or truncated) list is order[p % N]: PyTorch pads by repeating
  // the list from its start, as often as needed; drop_last keeps only the first total_size.
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(num_samples_));
  for (int64_t position = rank_; position < total_size_; position += world_size_) {
    mine.push_back(order[static_cast<size_t>(position % dataset_size_)]);
  }
  return mine;
}

}  // namespace replica::data
