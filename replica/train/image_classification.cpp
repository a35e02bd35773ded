// Image classification on Fashion-MNIST (model: mlp).
#include "replica/core/error.h"
#include "replica/data/fashion_mnist.h"
#include "replica/models/mlp.h"
#include "replica/train/image_classification.h"

#include <torch/torch.h>

namespace replica::train {
namespace {

class ImageClassification final : public Workload {
 public:
  explicit ImageClassification(const io::RunConfig& config) : hidden_(config.params.hidden_sizes) {
    if (config.model != "mlp") {
      fail("{}: model '{}' is not available for image-classification in this build (mlp)",
           config.source.empty() ? "config" : config.source, config.model);
    }
    train_ = data::load_fashion_mnist(config.data.path, config.data.train_split);
    if (config.data.valid_split) valid_ = data::load_fashion_mnist(config.data.path, *config.data.valid_split);
    const int64_t pixels = train_.images.size(1) * train_.images.size(2);
    model_ = models::MLP(pixels, hidden_, 10);
    in_features_ = pixels;
  }

  std::shared_ptr<torch::nn::Module> model() override { return model_.ptr(); }
  int64_t train_size() const override { return train_.size(); }
  int64_t valid_size() const override { return valid_.labels.defined() ? valid_.size() : 0; }

  torch::Tensor train_loss(const std::vector<int64_t>& indices) override {
    auto [x, y] = data::make_batch(train_, index_tensor(indices));
    return torch::nn::functional::cross_entropy(model_->forward(x), y);
  }

  EvalSums evaluate(const std::vector<int64_t>& indices) override {
    torch::NoGradGuard no_grad;
    EvalSums sums;
    const size_t chunk = 1000;
    for (size_t begin = 0; begin < indices.size(); begin += chunk) {
      std::vector<int64_t> part(indices.begin() + begin,
                                indices.begin() + std::min(indices.size(), begin + chunk));
      auto [x, y] = data::make_batch(valid_, index_tensor(part));
      auto logits = model_->forward(x);
      sums.loss_sum += torch::nn::functional::cross_entropy(
                           logits, y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                           .item<double>();
      sums.correct += logits.argmax(1).eq(y).sum().item<double>();
      sums.count += static_cast<double>(part.size());
    }
    return sums;
  }

  nlohmann::json model_config() const override {
    return {{"model_type", "mlp"}, {"in_features", in_features_}, {"hidden_sizes", hidden_},
            {"num_classes", 10}, {"library", "replica"}};
  }

 private:
  static torch::Tensor index_tensor(const std::vector<int64_t>& indices) {
    return torch::tensor(indices, torch::kLong);
  }

  std::vector<int64_t> hidden_;
  int64_t in_features_ = 0;
  data::ImageDataset train_, valid_;
  models::MLP model_{nullptr};
};

}  // namespace

std::unique_ptr<Workload> make_image_classification(const io::RunConfig& config) {
  return std::make_unique<ImageClassification>(config);
}

}  // namespace replica::train
