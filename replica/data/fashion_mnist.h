// Fashion-MNIST (and MNIST) from the idx files of Debian's dataset-fashion-mnist.
#pragma once

#include <torch/types.h>

#include <string>

namespace replica::data {

inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

struct ImageDataset {
  torch::Tensor images;  // uint8 [N, H, W]
  torch::Tensor labels;  // int64 [N]
  int64_t size() const { return labels.size(0); }
};

// Reads DIR/<split>-images-idx3-ubyte[.gz] and DIR/<split>-labels-idx1-ubyte[.gz]
// (split: train | t10k). Every header field is checked: a missing, truncated or
// inconsistent file is a replica::Error naming the file.
ImageDataset load_fashion_mnist(const std::string& dir, const std::string& split);

// Builds a float batch [B, 1, H, W] scaled to [0, 1] and its labels from dataset rows.
std::pair<torch::Tensor, torch::Tensor> make_batch(const ImageDataset& dataset,
                                                   const torch::Tensor& indices);

}  // namespace replica::data
