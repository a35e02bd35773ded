// Image classification on Fashion-MNIST (model: mlp | resnet18).
//
// resnet18 inputs are normalised with Fashion-MNIST's training mean and std; with
// `augment: true` each training image is randomly shifted (a 28x28 crop of the image padded
// by 4 zero pixels) and flipped horizontally with probability 1/2, as torchvision's
// RandomCrop(28, padding=4) + RandomHorizontalFlip do. The next micro-batch is assembled
// (gathered, augmented, normalised) on a background thread while the current one trains
// (Workload::prefetch), so the workers never wait for data.
#include "replica/core/error.h"
#include "replica/data/fashion_mnist.h"
#include "replica/ddp/sync_batchnorm.h"
#include "replica/models/mlp.h"
#include "replica/models/resnet.h"
#include "replica/train/image_classification.h"

#include <torch/torch.h>

#include <algorithm>
#include <deque>
#include <future>
#include <mutex>

namespace replica::train {
namespace {

constexpr double kFashionMnistMean = 0.2860;
constexpr double kFashionMnistStd = 0.3530;

// Random crop with zero padding and horizontal flip of a [B, 1, H, W] batch in [0, 1].
torch::Tensor augment(const torch::Tensor& x, torch::Generator& gen) {
  const int64_t b = x.size(0), h = x.size(2), w = x.size(3), pad = 4;
  torch::Tensor padded = torch::constant_pad_nd(x, {pad, pad, pad, pad}, 0);
  torch::Tensor offsets = torch::randint(0, 2 * pad + 1, {b, 2}, gen, torch::kLong);
  torch::Tensor flips = torch::rand({b}, gen).lt(0.5);
  torch::Tensor out = torch::empty_like(x);
  auto o = offsets.accessor<int64_t, 2>();
  auto f = flips.accessor<bool, 1>();
  for (int64_t i = 0; i < b; ++i) {
    torch::Tensor crop = padded[i].narrow(1, o[i][0], h).narrow(2, o[i][1], w);
    out[i].copy_(f[i] ? crop.flip({2}) : crop);
  }
  return out;
}

class ImageClassification final : public Workload {
 public:
  ImageClassification(const io::RunConfig& config, std::shared_ptr<dist::ProcessGroup> pg)
      : kind_(config.model), hidden_(config.params.hidden_sizes), augment_(config.params.augment),
        stem_(config.params.resnet_stem), sync_batchnorm_(config.params.sync_batchnorm) {
    const std::string where = config.source.empty() ? "config" : config.source;
    if (kind_ != "mlp" && kind_ != "resnet18") {
      fail("{}: model '{}' is not available for image-classification (mlp, resnet18)", where, kind_);
    }
    if (kind_ == "mlp" && (augment_ || sync_batchnorm_)) {
      fail("{}: params.augment and params.sync_batchnorm apply to model resnet18, not mlp", where);
    }
    train_ = data::load_fashion_mnist(config.data.path, config.data.train_split);
    if (config.data.valid_split) valid_ = data::load_fashion_mnist(config.data.path, *config.data.valid_split);
    const int64_t pixels = train_.images.size(1) * train_.images.size(2);
    in_features_ = pixels;
    if (kind_ == "mlp") {
      mlp_ = models::MLP(pixels, hidden_, 10);
      module_ = mlp_.ptr();
    } else {
      models::ResNetOptions options;
      options.stem = stem_;
      if (sync_batchnorm_ && pg && pg->size() > 1) {
        options.norm_layer = [pg](int64_t channels) {
          return torch::nn::AnyModule(ddp::SyncBatchNorm2d(channels, pg));
        };
      }
      resnet_ = models::ResNet18(options);
      module_ = resnet_.ptr();
    }
    // Augmentation draws from its own generator, seeded per rank, so that it neither disturbs
    // nor depends on the global generator (dropout, init) the trainer checkpoints.
    generator_ = at::detail::createCPUGenerator(static_cast<uint64_t>(config.params.seed) * 1000003 +
                                                static_cast<uint64_t>(pg ? pg->rank() : 0));
  }

  ~ImageClassification() override { pending_.clear(); }

  std::shared_ptr<torch::nn::Module> model() override { return module_; }
  int64_t train_size() const override { return train_.size(); }
  int64_t valid_size() const override { return valid_.labels.defined() ? valid_.size() : 0; }

  // The trainer announces micro-batch k + 1 just before it asks for micro-batch k, so up to
  // two prepared batches are kept; one asked for is taken, older ones are dropped.
  void prefetch(const std::vector<int64_t>& indices) override {
    while (pending_.size() >= 2) pending_.pop_front();  // the future's destructor waits for it
    pending_.push_back({indices, std::async(std::launch::async, [this, indices] {
                          return prepare(train_, indices, augment_);
                        })});
  }

  torch::Tensor train_loss(const std::vector<int64_t>& indices) override {
    Batch batch;
    auto it = std::find_if(pending_.begin(), pending_.end(), [&](const auto& p) { return p.indices == indices; });
    if (it != pending_.end()) {
      batch = it->batch.get();
      pending_.erase(pending_.begin(), it + 1);
    } else {
      batch = prepare(train_, indices, augment_);
    }
    return torch::nn::functional::cross_entropy(forward(batch.x), batch.y);
  }

  EvalSums evaluate(const std::vector<int64_t>& indices) override {
    torch::NoGradGuard no_grad;
    EvalSums sums;
    const size_t chunk = 500;
    for (size_t begin = 0; begin < indices.size(); begin += chunk) {
      std::vector<int64_t> part(indices.begin() + begin,
                                indices.begin() + std::min(indices.size(), begin + chunk));
      Batch batch = prepare(valid_, part, /*augment=*/false);
      auto logits = forward(batch.x);
      sums.loss_sum += torch::nn::functional::cross_entropy(
                           logits, batch.y, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
                           .item<double>();
      sums.correct += logits.argmax(1).eq(batch.y).sum().item<double>();
      sums.count += static_cast<double>(part.size());
    }
    return sums;
  }

  nlohmann::json model_config() const override {
    if (kind_ == "resnet18") {
      return {{"model_type", "resnet18"}, {"in_channels", 1}, {"num_classes", 10}, {"stem", stem_},
              {"sync_batchnorm", sync_batchnorm_}, {"normalize_mean", kFashionMnistMean},
              {"normalize_std", kFashionMnistStd}, {"library", "replica"}};
    }
    return {{"model_type", "mlp"}, {"in_features", in_features_}, {"hidden_sizes", hidden_},
            {"num_classes", 10}, {"library", "replica"}};
  }

 private:
  struct Batch {
    torch::Tensor x, y;
  };

  Batch prepare(const data::ImageDataset& dataset, const std::vector<int64_t>& indices, bool augment_batch) {
    auto [x, y] = data::make_batch(dataset, torch::tensor(indices, torch::kLong));
    if (kind_ == "resnet18") {
      if (augment_batch) {
        // The generator's own mutex is taken inside each random op; this one keeps a batch's
        // draws together when the background thread and the trainer both prepare batches.
        std::lock_guard<std::mutex> lock(augment_mutex_);
        x = augment(x, generator_);
      }
      x = (x - kFashionMnistMean) / kFashionMnistStd;
    }
    return {x, y};
  }

  torch::Tensor forward(const torch::Tensor& x) { return kind_ == "mlp" ? mlp_->forward(x) : resnet_->forward(x); }

  std::string kind_;
  std::vector<int64_t> hidden_;
  bool augment_ = false;
  std::string stem_;
  bool sync_batchnorm_ = false;
  int64_t in_features_ = 0;
  data::ImageDataset train_, valid_;
  models::MLP mlp_{nullptr};
  models::ResNet18 resnet_{nullptr};
  std::shared_ptr<torch::nn::Module> module_;
  at::Generator generator_;
  std::mutex augment_mutex_;
  struct Pending {
    std::vector<int64_t> indices;
    std::future<Batch> batch;
  };
  std::deque<Pending> pending_;
};

}  // namespace

std::unique_ptr<Workload> make_image_classification(const io::RunConfig& config,
                                                    std::shared_ptr<dist::ProcessGroup> pg) {
  return std::make_unique<ImageClassification>(config, std::move(pg));
}

}  // namespace replica::train
