// Conformance: replica's ResNet-18 against torchvision.models.resnet18.
//
// replica's ResNet-18 with 3 input channels and the `imagenet` stem is torchvision's
// architecture: torchvision.models.resnet18(num_classes=10) must load its weights (what the
// trainer saves: every named parameter and buffer) with strict=True and give its eval-mode
// outputs within 1e-4. The Fashion-MNIST variants map onto torchvision by replacing conv1
// (1 input channel; a 3x3 stride-1 conv for the `pooled` and `small` stems) and, for `small`,
// the max-pool by Identity; the referee checks those the same way, and a model the `replica`
// program really trained and saved (examples/fashion_mnist_resnet18.yaml: 2 workers,
// SyncBatchNorm) loads and agrees as well.
#include "replica/io/safetensors.h"
#include "replica/testing/paths.h"
#include "replica/models/resnet.h"
#include "replica/testing/referee.h"
#include "replica/testing/program_runner.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using json = nlohmann::json;
using replica::models::ResNet18;
using replica::models::ResNetOptions;

namespace {

struct TempDir : replica::testing::ScratchDir {
  TempDir() : ScratchDir("replica-resnet-conformance") {}
};

// What the trainer saves for a model (Workload::state_tensors): every parameter, then every
// buffer, under the module's own names.
replica::io::NamedTensors state_tensors(torch::nn::Module& m) {
  replica::io::NamedTensors out;
  for (auto& item : m.named_parameters()) out.emplace_back(item.key(), item.value().detach());
  for (auto& item : m.named_buffers()) out.emplace_back(item.key(), item.value().detach());
  return out;
}

// Writes the case's batch file: x and replica's eval-mode logits on it.
void write_batch(ResNet18& model, const torch::Tensor& x, const fs::path& file) {
  model->eval();
  torch::NoGradGuard no_grad;
  const torch::Tensor logits = model->forward(x);
  replica::io::save_safetensors(file.string(), {{"x", x}, {"logits", logits}});
}

// One intra-op thread while the test computes (restored after): on this 2-core machine, busy
// with other work, OpenMP's spinning workers cost more than they bring for these small convs.
struct OneThread {
  int before = torch::get_num_threads();
  OneThread() { torch::set_num_threads(1); }
  ~OneThread() { torch::set_num_threads(before); }
};

json make_case(const std::string& name, const fs::path& weights, const fs::path& batch, int64_t in_channels,
               const std::string& stem) {
  return {{"name", name}, {"weights", weights.string()}, {"batch", batch.string()},
          {"in_channels", in_channels}, {"stem", stem}};
}

replica::testing::PythonRun run_referee(const fs::path& dir, const json& cases) {
  const fs::path manifest = dir / "manifest.json";
  std::ofstream(manifest) << cases.dump(2);
  return replica::testing::run_python(
      fs::path(REPLICA_SOURCE_DIR) / "replica/models/tests/referee/resnet_referee.py", {manifest.string()});
}

}  // namespace

TEST(ResnetConformance, TorchvisionLoadsReplicaWeightsStrictAndGivesItsOutputs) {
  REPLICA_REQUIRE_PYTHON("safetensors", "torch", "torchvision");
  OneThread one_thread;
  TempDir dir;
  torch::manual_seed(1234);
  struct Variant {
    std::string name;
    int64_t in_channels;
    std::string stem;
    int64_t side;  // input height = width
  };
  // The first is torchvision's architecture itself; the others are replica's Fashion-MNIST
  // variants (1 channel, 28x28), which map by the referee's documented edits.
  const std::vector<Variant> variants = {{"imagenet-3ch", 3, "imagenet", 64},
                                         {"imagenet-1ch", 1, "imagenet", 28},
                                         {"pooled-1ch", 1, "pooled", 28},
                                         {"small-1ch", 1, "small", 20}};
  json cases = json::array();
  for (const auto& v : variants) {
    ResNetOptions options;
    options.in_channels = v.in_channels;
    options.num_classes = 10;
    options.stem = v.stem;
    ResNet18 model(options);
    // Non-trivial BatchNorm state, so that eval mode (running statistics) is what is compared:
    // a few training-mode passes move the running statistics, then random affine parameters.
    {
      torch::NoGradGuard no_grad;
      model->train();
      for (int i = 0; i < 2; ++i) (void)model->forward(torch::randn({6, v.in_channels, v.side, v.side}) * 2 + 0.5);
      for (auto& item : model->named_parameters()) {
        if (item.key().find("bn") != std::string::npos || item.key().find("downsample.1") != std::string::npos) {
          item.value().uniform_(0.5, 1.5);
        }
      }
    }
    const fs::path weights = dir.path / (v.name + ".safetensors"), batch = dir.path / (v.name + ".batch.safetensors");
    replica::io::save_safetensors(weights.string(), state_tensors(*model), {{"format", "pt"}});
    write_batch(model, torch::randn({4, v.in_channels, v.side, v.side}), batch);
    cases.push_back(make_case(v.name, weights, batch, v.in_channels, v.stem));
  }
  const auto run = run_referee(dir.path, cases);
  EXPECT_EQ(run.exit_code, 0) << run.output;
  std::cerr << run.output;
}

TEST(ResnetConformance, AModelTheProgramTrainedLoadsIntoTorchvision) {
  REPLICA_REQUIRE_PYTHON("safetensors", "torch", "torchvision");
  ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
  TempDir dir;
  const fs::path project = dir.path / "run";
  // The example as it stands (pooled stem, SyncBatchNorm on 2 workers, augmentation), without
  // evaluation and cut to 3 steps of 8 images per worker.
  std::string yaml;
  {
    std::ifstream in(std::string(REPLICA_SOURCE_DIR) + "/examples/fashion_mnist_resnet18.yaml");
    std::stringstream text;
    text << in.rdbuf();
    yaml = text.str();
  }
  const std::string valid = "valid_split: t10k";
  ASSERT_NE(yaml.find(valid), std::string::npos);
  yaml.replace(yaml.find(valid), valid.size(), "valid_split: null");
  const fs::path config_file = dir.path / "resnet18.yaml";
  std::ofstream(config_file) << yaml;
  const auto r = replica::testing::run_program(
      REPLICA_BIN,
      {"--config", config_file.string(), "--project-name", project.string(), "--max-steps", "3", "--batch-size", "8",
       "--threads-per-worker", "1", "--checkpoint-every", "0", "--logging-steps", "1"},
      {}, std::chrono::seconds(240));
  ASSERT_EQ(r.exit_code, 0) << r;
  const fs::path weights = project / "final" / "model.safetensors";
  ASSERT_TRUE(fs::exists(weights)) << r;
  std::ifstream config_stream(project / "final" / "config.json");
  const json config = json::parse(config_stream);

  // replica's own model, loaded from the file the program wrote.
  OneThread one_thread;
  ResNetOptions options;
  options.in_channels = config.at("in_channels").get<int64_t>();
  options.num_classes = config.at("num_classes").get<int64_t>();
  options.stem = config.at("stem").get<std::string>();
  ResNet18 model(options);
  const auto file = replica::io::load_safetensors(weights.string());
  {
    torch::NoGradGuard no_grad;
    std::map<std::string, torch::Tensor> by_name(file.tensors.begin(), file.tensors.end());
    size_t assigned = 0;
    for (auto& [name, target] : state_tensors(*model)) {
      ASSERT_TRUE(by_name.count(name)) << name;
      target.copy_(by_name.at(name));
      ++assigned;
    }
    EXPECT_EQ(assigned, file.tensors.size());
  }
  torch::manual_seed(7);
  const fs::path batch = dir.path / "batch.safetensors";
  write_batch(model, torch::randn({4, options.in_channels, 28, 28}), batch);
  const auto run = run_referee(dir.path, json::array({make_case("trained-" + options.stem, weights, batch,
                                                                options.in_channels, options.stem)}));
  EXPECT_EQ(run.exit_code, 0) << run.output;
  std::cerr << run.output;
}
