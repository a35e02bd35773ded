#include "replica/core/gradient_home.h"

#include <mutex>
#include <shared_mutex>
#include <unordered_map>

namespace replica {
namespace {

std::shared_mutex g_mutex;
std::unordered_map<const c10::TensorImpl*, torch::Tensor> g_homes;

}  // namespace

void set_gradient_home(const torch::Tensor& param, torch::Tensor home) {
  std::unique_lock<std::shared_mutex> lock(g_mutex);
  if (home.defined()) {
    g_homes[param.unsafeGetTensorImpl()] = std::move(home);
  } else {
    g_homes.erase(param.unsafeGetTensorImpl());
  }
}

torch::Tensor gradient_home(const torch::Tensor& param) {
  std::shared_lock<std::shared_mutex> lock(g_mutex);
  auto it = g_homes.find(param.unsafeGetTensorImpl());
  return it == g_homes.end() ? torch::Tensor() : it->second;
}

}  // namespace replica
