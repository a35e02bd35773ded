// Task image-classification: Fashion-MNIST (IDX files) with an MLP or a ResNet-18; its own
// `params:` keys and its registration (the key table and the workload: image_classification.cpp).
#pragma once

#include "replica/train/run_config.h"
#include "replica/train/task.h"

#include <array>
#include <cstdint>
#include <vector>

namespace replica::train {

enum class ResnetStem { ImageNet, Pooled, Small };
template <>
struct EnumNames<ResnetStem> {
  static constexpr std::array<const char*, 3> names = {"imagenet", "pooled", "small"};
};

struct ImageParams {
  std::vector<int64_t> hidden_sizes = {256, 128};  // mlp
  bool sync_batchnorm = false;                     // resnet18
  bool augment = false;                            // resnet18
  ResnetStem resnet_stem = ResnetStem::ImageNet;   // resnet18
  bool gradient_checkpointing = false;             // resnet18: recompute each stage in backward
};

inline const ImageParams& image_params(const RunConfig& config) { return config.task_params.get<ImageParams>(); }
inline ImageParams& image_params(RunConfig& config) { return config.task_params.get<ImageParams>(); }

// The task's registration (replica/tasks/registry.cpp).
TaskSpec image_classification_task();

}  // namespace replica::train
