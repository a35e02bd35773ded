// Note [optimizer offload] (optim.cpp) at the optimizer's level: state in files under
// nvme_path, the same arithmetic as in RAM, and loaded state landing in files too.
#include "replica/core/file_tensor.h"
#include "replica/train/optim.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace fs = std::filesystem;
using namespace replica::train;

namespace {

class Offload : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "replica_offload_XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

// Whether this process maps a (deleted) file under `dir`.
bool maps_a_file_under(const fs::path& dir) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find(dir.string() + "/replica-swap-") != std::string::npos) return true;
  }
  return false;
}

TEST_F(Offload, FileBackedTensorsAreZerosInAnUnlinkedFile) {
  {
    auto t = replica::file_backed_zeros((dir_ / "swap").string(), {1000, 3}, torch::kFloat32);
    EXPECT_EQ(t.sizes(), (std::vector<int64_t>{1000, 3}));
    EXPECT_TRUE(torch::equal(t, torch::zeros({1000, 3})));
    EXPECT_TRUE(replica::is_file_backed(t));
    EXPECT_FALSE(replica::is_file_backed(torch::zeros({3})));
    t.fill_(2.5f);
    EXPECT_EQ(t.sum().item<float>(), 7500.0f);
    EXPECT_TRUE(maps_a_file_under(dir_ / "swap"));
    EXPECT_TRUE(fs::is_empty(dir_ / "swap"));  // unlinked as soon as mapped
  }
  EXPECT_FALSE(maps_a_file_under(dir_ / "swap"));  // unmapped with the last reference
}

TEST_F(Offload, NvmeStateStepsBitForBitAsInRam) {
  for (const OptimizerKind kind : {OptimizerKind::AdamW, OptimizerKind::Sgd}) {
    torch::manual_seed(3);
    auto w_ram = torch::randn({257, 33}).set_requires_grad(true);
    auto w_nvme = w_ram.detach().clone().set_requires_grad(true);
    OptimizerSpec spec{kind, 0.01, 0.9, 0.01};
    auto ram = make_optimizer(spec, {w_ram});
    spec.offload = OffloadDevice::Nvme;
    spec.nvme_path = (dir_ / "nvme").string();
    auto nvme = make_optimizer(spec, {w_nvme});
    for (int step = 0; step < 5; ++step) {
      auto g = torch::randn({257, 33});
      w_ram.mutable_grad() = g.clone();
      w_nvme.mutable_grad() = g.clone();
      ram->step();
      nvme->step();
    }
    EXPECT_TRUE(torch::equal(w_ram, w_nvme)) << name_of(kind);
    const auto state = optimizer_state(*nvme, kind, {w_nvme}, {"w"});
    ASSERT_FALSE(state.empty());
    for (const auto& [name, t] : state) {
      if (name != "w.step") EXPECT_TRUE(replica::is_file_backed(t)) << name;
    }
    // Loaded state (a resume) lands in files too, and equals what was saved.
    auto w_loaded = w_nvme.detach().clone().set_requires_grad(true);
    auto loaded = make_optimizer(spec, {w_loaded});
    load_optimizer_state(*loaded, kind, {w_loaded}, {"w"}, state);
    for (const auto& [name, t] : optimizer_state(*loaded, kind, {w_loaded}, {"w"})) {
      if (name == "w.step") continue;
      EXPECT_TRUE(replica::is_file_backed(t)) << name;
    }
  }
}

}  // namespace
