// Image classification on Fashion-MNIST (model: mlp | resnet18).
//
// resnet18 inputs are normalised with Fashion-MNIST's training mean and std; with
// `augment: true` each training image is randomly shifted (a 28x28 crop of the image padded
// by 4 zero pixels) and flipped horizontally with probability 1/2, as torchvision's
// RandomCrop(28, padding=4) + RandomHorizontalFlip do. The next micro-batch is assembled
// (gathered, augmented, normalised) on a background thread while the current one trains
// (Workload::prefetch), so the workers never wait for data, when a core is free for that thread;
// when the workers' compute threads fill every core it is assembled when it is taken.
// `gradient_checkpointing: true` (resnet18) recomputes each stage in backward
// (models/resnet.h); BatchNorm's running statistics are updated once per forward as without it.
//
// The augmentation's random draws are counter-based: the n-th training micro-batch a worker
// takes is augmented from a generator seeded by (seed, rank, n). Whichever thread prepares a
// batch and whenever it does, its draws are the same, and the state to checkpoint is just n
// (the same on every rank): a run resumed mid-epoch augments exactly as the uninterrupted run.
#include "replica/core/error.h"
#include "replica/core/system.h"
#include "replica/data/fashion_mnist.h"
#include "replica/ddp/sync_batchnorm.h"
#include "replica/distributed/world.h"
#include "replica/models/mlp.h"
#include "replica/models/resnet.h"
#include "replica/tasks/image_classification/image_classification.h"
#include "replica/train/task.h"
#include "replica/train/workload.h"

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <algorithm>
#include <deque>
#include <future>

namespace replica::train {
namespace {

constexpr double kFashionMnistMean = 0.2860;
constexpr double kFashionMnistStd = 0.3530;
constexpr const char* kAugmentCounterName = "augment_batches_taken";

// SplitMix64's finaliser: neighbouring counters give unrelated seeds.
uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

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
  ImageClassification(const RunConfig& config, const WorkloadContext& context)
      : context_(context), kind_(config.model), hidden_(image_params(config).hidden_sizes), augment_(image_params(config).augment),
        stem_(name_of(image_params(config).resnet_stem)), sync_batchnorm_(image_params(config).sync_batchnorm),
        gradient_checkpointing_(image_params(config).gradient_checkpointing) {
    const auto& pg = context.pg;
    const std::string where = config.source.empty() ? "config" : config.source;
    if (kind_ != "mlp" && kind_ != "resnet18") {
      fail("{}: model '{}' is not available for image-classification (mlp, resnet18)", where, kind_);
    }
    if (kind_ == "mlp" && (augment_ || sync_batchnorm_ || gradient_checkpointing_)) {
      fail("{}: params.augment, params.sync_batchnorm and params.gradient_checkpointing apply to model resnet18, "
           "not mlp",
           where);
    }
    train_ = data::load_fashion_mnist(config.data.path, config.data.train_split);
    if (config.data.valid_split) valid_ = data::load_fashion_mnist(config.data.path, *config.data.valid_split);
    const int64_t pixels = train_.images.size(1) * train_.images.size(2);
    in_features_ = pixels;
    if (kind_ == "mlp") {
      // Each width was checked with its key; their product is checked here, where the image
      // size is known, before anything is allocated (models/mlp.h: Note [model size bounds]).
      const int64_t parameters = models::mlp_parameter_count(pixels, hidden_, 10);
      if (parameters > models::kMaxModelParameters) {
        fail("{}: key 'params.hidden_sizes' [{}] gives an MLP of {} parameters on {}-pixel images, more than the {} "
             "replica builds",
             where, fmt::join(hidden_, ", "), parameters, pixels, models::kMaxModelParameters);
      }
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
      resnet_->set_gradient_checkpointing(gradient_checkpointing_);
      module_ = resnet_.ptr();
    }
    // Augmentation draws from its own generators, seeded per rank, so that it neither disturbs
    // nor depends on the global generator (dropout, init).
    augment_seed_ = static_cast<uint64_t>(config.params.seed) * 1000003 + static_cast<uint64_t>(pg ? pg->rank() : 0);
    // A background thread prepares the next batch only when a core is free to run it. With
    // every core computing (this host's workers x their threads >= cores) it would only take
    // turns with the compute threads, and its start and hand-over cost more than the batch:
    // MLP-1.8M at 2 workers on 2 cores trained 2.4% faster preparing batches when taken.
    background_prefetch_ = usable_cores() > std::max(1, context.world.local_world_size) * context.threads;
  }

  ~ImageClassification() override { pending_.clear(); }

  std::shared_ptr<torch::nn::Module> model() override { return module_; }
  int64_t train_size() const override { return train_.size(); }
  int64_t valid_size() const override { return valid_.labels.defined() ? valid_.size() : 0; }

  // The trainer announces micro-batch k + 1 just before it asks for micro-batch k, so the
  // announced batch will be the one taken after the next: its number is batches_taken_ + 1.
  // Up to two prepared batches are kept; one asked for is taken, older ones are dropped.
  void prefetch(const std::vector<int64_t>& indices) override {
    if (!background_prefetch_) return;  // prepared when taken (see the constructor)
    while (pending_.size() >= 2) pending_.pop_front();  // the future's destructor waits for it
    const int64_t number = batches_taken_ + 1;
    pending_.push_back({indices, number, std::async(std::launch::async, [this, indices, number] {
                          return prepare(train_, indices, augment_, number);
                        })});
  }

  torch::Tensor train_loss(const std::vector<int64_t>& indices) override {
    const int64_t number = batches_taken_++;
    Batch batch;
    // A batch prepared under another number (the trainer asked for something else than it
    // announced) was augmented with other draws: it is dropped, not used.
    auto it = std::find_if(pending_.begin(), pending_.end(),
                           [&](const auto& p) { return p.number == number && p.indices == indices; });
    if (it != pending_.end()) {
      batch = it->batch.get();
      pending_.erase(pending_.begin(), it + 1);
    } else {
      batch = prepare(train_, indices, augment_, number);
    }
    return torch::nn::functional::cross_entropy(forward(context_.on_device(batch.x)), context_.on_device(batch.y));
  }

  io::NamedTensors rng_state() const override {
    if (!augment_) return {};
    return {{kAugmentCounterName, torch::tensor({batches_taken_}, torch::kLong)}};
  }

  void load_rng_state(const io::NamedTensors& tensors, const std::string& where) override {
    if (!augment_) return;
    auto it = std::find_if(tensors.begin(), tensors.end(), [](const auto& t) { return t.first == kAugmentCounterName; });
    if (it == tensors.end()) {
      spdlog::warn("{} has no '{}' (written before it was saved): augmentation restarts its random draws, so this "
                   "run will not match an uninterrupted one bit for bit",
                   where, kAugmentCounterName);
      return;
    }
    const torch::Tensor& t = it->second;
    if (t.scalar_type() != torch::kLong || t.numel() != 1 || t.item<int64_t>() < 0) {
      fail("{}: tensor '{}' must be one non-negative int64 (got {} of shape {})", where, kAugmentCounterName,
           c10::toString(t.scalar_type()), c10::str(t.sizes()));
    }
    pending_.clear();  // prepared under the old numbering
    batches_taken_ = t.item<int64_t>();
  }

  EvalSums evaluate(const std::vector<int64_t>& indices) override {
    torch::NoGradGuard no_grad;
    EvalSums sums;
    const size_t chunk = 500;
    for (size_t begin = 0; begin < indices.size(); begin += chunk) {
      std::vector<int64_t> part(indices.begin() + begin,
                                indices.begin() + std::min(indices.size(), begin + chunk));
      Batch batch = prepare(valid_, part, /*augment=*/false, /*number=*/0);
      batch = {context_.on_device(batch.x), context_.on_device(batch.y)};
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

  // `number`: which training micro-batch this is (0, 1, ... over the whole run); its
  // augmentation draws come from a generator of its own, seeded from it.
  Batch prepare(const data::ImageDataset& dataset, const std::vector<int64_t>& indices, bool augment_batch,
                int64_t number) {
    auto [x, y] = data::make_batch(dataset, torch::tensor(indices, torch::kLong));
    if (kind_ == "resnet18") {
      if (augment_batch) {
        torch::Generator generator =
            at::detail::createCPUGenerator(mix64(augment_seed_ ^ mix64(static_cast<uint64_t>(number))));
        x = augment(x, generator);
      }
      x = (x - kFashionMnistMean) / kFashionMnistStd;
    }
    return {x, y};
  }

  torch::Tensor forward(const torch::Tensor& x) { return kind_ == "mlp" ? mlp_->forward(x) : resnet_->forward(x); }

  WorkloadContext context_;
  std::string kind_;
  std::vector<int64_t> hidden_;
  bool augment_ = false;
  std::string stem_;
  bool sync_batchnorm_ = false;
  bool gradient_checkpointing_ = false;
  bool background_prefetch_ = true;
  int64_t in_features_ = 0;
  data::ImageDataset train_, valid_;
  models::MLP mlp_{nullptr};
  models::ResNet18 resnet_{nullptr};
  std::shared_ptr<torch::nn::Module> module_;
  uint64_t augment_seed_ = 0;
  int64_t batches_taken_ = 0;  // training micro-batches taken so far: the augmentation's counter
  struct Pending {
    std::vector<int64_t> indices;
    int64_t number = 0;  // the batches_taken_ it was prepared for
    std::future<Batch> batch;
  };
  std::deque<Pending> pending_;
};

}  // namespace

TaskSpec image_classification_task() {
  TaskSpec t;
  t.name = "image-classification";
  t.params = TaskParams(ImageParams{});
  // IDX files have no columns: no column_mapping.
  t.summary = "Fashion-MNIST (IDX files) with an MLP or a ResNet-18";
  t.models = {"mlp", "resnet18"};
  using I = ImageParams;
  t.keys = {
      key("hidden_sizes", &I::hidden_sizes, "mlp: widths of the hidden layers")
          .group("Model")
          .check(models::layer_widths_problem),
      key("sync_batchnorm", &I::sync_batchnorm, "resnet18: batch statistics across all workers").group("Model"),
      key("augment", &I::augment, "resnet18: random crop (padding 4) and horizontal flip").group("Model"),
      key("resnet_stem", &I::resnet_stem,
          "resnet18: imagenet (7x7/2 conv + max-pool), pooled (3x3/1 + max-pool) or small (3x3/1)")
          .group("Model"),
      key("gradient_checkpointing", &I::gradient_checkpointing,
          "resnet18: recompute each stage's activations in backward instead of keeping them (activation "
          "checkpointing: less memory, one more forward; BatchNorm statistics updated once)")
          .group("Model"),
  };
  t.defaults = [](RunConfig& c) {
    c.data.path = "/usr/share/datasets/fashion-mnist";  // Debian's dataset-fashion-mnist
    c.data.valid_split = "t10k";
  };
  t.make = [](const RunConfig& config, const WorkloadContext& context) -> std::unique_ptr<Workload> {
    return std::make_unique<ImageClassification>(config, context);
  };
  return t;
}

}  // namespace replica::train
