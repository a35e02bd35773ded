// Image classification on Fashion-MNIST (model: mlp | resnet18): the workload of task
// image-classification.
#pragma once

#include "replica/train/workload.h"

namespace replica::train {

std::unique_ptr<Workload> make_image_classification(const io::RunConfig& config,
                                                   std::shared_ptr<dist::ProcessGroup> pg = nullptr);

}  // namespace replica::train
