#include "replica/ddp/bucketing.h"

#include "replica/core/error.h"

#include <map>

namespace replica::ddp {

std::vector<std::vector<size_t>> assign_buckets(const std::vector<ParamInfo>& params,
                                                const std::vector<size_t>& order,
                                                size_t first_cap_bytes, size_t cap_bytes) {
  struct Open {
    std::vector<size_t> members;
    size_t bytes = 0;
    size_t cap = 0;
  };
  // One open bucket per kind; the first bucket of each kind gets the small cap.
  std::map<std::string, Open> open;
  std::vector<std::vector<size_t>> buckets;
  std::vector<bool> seen(params.size(), false);
  for (size_t index : order) {
    if (index >= params.size()) fail("bucket order names parameter {} of {}", index, params.size());
    if (seen[index]) fail("bucket order names parameter {} twice", index);
    seen[index] = true;
    const ParamInfo& p = params[index];
    auto [it, fresh] = open.try_emplace(p.kind);
    Open& b = it->second;
    if (fresh) b.cap = first_cap_bytes;
    b.members.push_back(index);
    b.bytes += p.bytes;
    if (b.bytes >= b.cap) {
      buckets.push_back(std::move(b.members));
      b.members.clear();
      b.bytes = 0;
      b.cap = cap_bytes;
    }
  }
  // Left-over partial buckets close in the order their kinds were first seen... PyTorch sorts
  // them by the position of their first member, which keeps launch order close to readiness.
  std::vector<std::vector<size_t>> rest;
  for (auto& [kind, b] : open) {
    if (!b.members.empty()) rest.push_back(std::move(b.members));
  }
  std::vector<size_t> position(params.size(), 0);
  for (size_t i = 0; i < order.size(); ++i) position[order[i]] = i;
  std::sort(rest.begin(), rest.end(), [&](const auto& a, const auto& b) {
    return position[a.front()] < position[b.front()];
  });
  for (auto& b : rest) buckets.push_back(std::move(b));
  // Keep every bucket in order of its first member so launch order follows readiness.
  std::stable_sort(buckets.begin(), buckets.end(), [&](const auto& a, const auto& b) {
    return position[a.front()] < position[b.front()];
  });
  for (size_t i = 0; i < params.size(); ++i) {
    if (!seen[i]) fail("bucket order leaves out parameter {}", i);
  }
  return buckets;
}

}  // namespace replica::ddp
