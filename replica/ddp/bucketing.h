// Gradient bucket assignment, as PyTorch's Reducer does it (compute_bucket_assignment_by_size).
//
// Parameters are taken in the given order (DDP passes reverse registration order at first, the
// observed gradient arrival order after the first step) and packed greedily into buckets of at
// most `first_cap_bytes` for the first bucket and `cap_bytes` for every later one; a bucket
// only holds one dtype/device, and a parameter larger than the cap gets a bucket of its own.
// Small first bucket: its all-reduce can start as soon as the last layers' gradients exist.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace replica::ddp {

struct ParamInfo {
  size_t bytes = 0;
  std::string kind;  // dtype and device; buckets never mix kinds
};

// Returns buckets as lists of indices into `params`, in launch order. Every index in `order`
// appears exactly once.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<ParamInfo>& params,
                                                const std::vector<size_t>& order,
                                                size_t first_cap_bytes, size_t cap_bytes);

}  // namespace replica::ddp
