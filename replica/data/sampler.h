// DistributedSampler with PyTorch's semantics (torch.utils.data.DistributedSampler).
//
// Every epoch is a seeded shuffle (randperm with a generator seeded seed + epoch, so the
// order equals PyTorch's), identical on every rank; rank r takes indices r, r+W, r+2W, ...
// drop_last=false pads by repeating the start so every rank gets ceil(N/W) samples;
// drop_last=true truncates so every rank gets floor(N/W). Ranks' slices are disjoint
// (apart from padding) and together cover the data set.
//
// Thread-safety: a sampler is a plain value; set_epoch() and indices() on one instance need
// external synchronization, separate instances are independent.
#pragma once

#include <cstdint>
#include <vector>

namespace replica::data {

class DistributedSampler {
 public:
  DistributedSampler(int64_t dataset_size, int rank, int world_size, bool shuffle = true,
                     uint64_t seed = 0, bool drop_last = false);

  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }

  // This rank's indices for the current epoch, in order.
  std::vector<int64_t> indices() const;

  // Samples per rank per epoch.
  int64_t num_samples() const { return num_samples_; }
  int64_t total_size() const { return total_size_; }

 private:
  int64_t dataset_size_;
  int rank_;
  int world_size_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  int64_t epoch_ = 0;
  int64_t num_samples_ = 0;
  int64_t total_size_ = 0;
};

}  // namespace replica::data
