// The 8-bit AdamW on a GPU: paged_adamw_8bit keeps a large tensor's state in CUDA managed
// memory (the GPU path of paged_state, whose choice optimizer_kinds_test.cpp checks on every
// machine), and both 8-bit optimizers step as on the CPU (where bitsandbytes is the referee).
#include "replica/core/cuda.h"
#include "replica/testing/gpu_skip.h"
#include "replica/train/optim.h"
#include "replica/train/optim_8bit.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

using replica::train::OptimizerKind;

namespace {

TEST(OptimGpu, PagedEightBitStateIsManagedMemoryAndStepsAsOnTheCpu) {
  REPLICA_SKIP_WITHOUT_GPU();
  torch::manual_seed(9);
  // 120,000 elements: paged; 5,000: 8-bit but too small to page; 100: float32 state.
  const std::vector<torch::Tensor> init = {torch::randn({400, 300}), torch::randn({5000}), torch::randn({100})};
  for (const OptimizerKind kind : {OptimizerKind::PagedAdamW8bit, OptimizerKind::AdamW8bit}) {
    SCOPED_TRACE(replica::train::name_of(kind));
    std::vector<torch::Tensor> cpu, gpu;
    for (const auto& t : init) {
      cpu.push_back(t.clone().set_requires_grad(true));
      gpu.push_back(t.to(torch::kCUDA).set_requires_grad(true));
    }
    auto on_cpu = replica::train::make_optimizer({kind, 1e-2, 0.9, 0.01}, cpu);
    auto on_gpu = replica::train::make_optimizer({kind, 1e-2, 0.9, 0.01}, gpu);
    for (int s = 0; s < 4; ++s) {
      for (size_t i = 0; i < init.size(); ++i) {
        const auto g = torch::randn(init[i].sizes()) * (1.0 + s);
        cpu[i].mutable_grad() = g.clone();
        gpu[i].mutable_grad() = g.to(torch::kCUDA);
      }
      on_cpu->step();
      on_gpu->step();
    }
    for (size_t i = 0; i < init.size(); ++i) {
      SCOPED_TRACE("tensor " + std::to_string(i));
      const auto& st = static_cast<const replica::train::AdamW8bitParamState&>(
          *on_gpu->state().at(gpu[i].unsafeGetTensorImpl()));
      const bool paged = kind == OptimizerKind::PagedAdamW8bit && gpu[i].numel() >= replica::train::kPagedMinNumel;
      EXPECT_EQ(replica::is_managed_memory(st.state1.data_ptr()), paged);
      EXPECT_EQ(replica::is_managed_memory(st.state2.data_ptr()), paged);
      EXPECT_TRUE(st.state1.is_cuda());
      const double diff = (gpu[i].cpu() - cpu[i]).abs().max().item<double>();
      std::cout << replica::train::name_of(kind) << " tensor " << i << ": GPU vs CPU max |param diff| " << diff << "\n";
      EXPECT_LE(diff, 1e-6);
    }
  }
}

}  // namespace
