// Where a worker computes (Note [worker device] in engine.cpp), on whatever this machine has:
// without a GPU, cpu and auto are the CPU and cuda is an error naming the rank; with GPUs, a
// LOCAL_RANK past them is an error naming the rank and the count.
#include "replica/core/cuda.h"
#include "replica/core/error.h"
#include "replica/train/engine.h"

#include <gtest/gtest.h>

using replica::train::DeviceKind;
using replica::train::worker_device;

namespace {

replica::distributed::WorldInfo world_at(int rank, int local_rank, int local_world_size) {
  replica::distributed::WorldInfo w;
  w.rank = rank;
  w.local_rank = local_rank;
  w.local_world_size = local_world_size;
  w.world_size = local_world_size;
  return w;
}

std::string error_of(DeviceKind kind, const replica::distributed::WorldInfo& world) {
  try {
    worker_device(kind, world);
  } catch (const replica::Error& e) {
    return e.what();
  }
  return "";
}

TEST(WorkerDevice, CpuIsTheCpuWhateverIsVisible) {
  EXPECT_EQ(worker_device(DeviceKind::Cpu, world_at(3, 3, 8)), torch::Device(torch::kCPU));
}

TEST(WorkerDevice, AutoAndCudaFollowTheVisibleGpus) {
  const int gpus = replica::visible_gpu_count();
  if (gpus == 0) {
    EXPECT_EQ(worker_device(DeviceKind::Auto, world_at(1, 1, 2)), torch::Device(torch::kCPU));
    const std::string e = error_of(DeviceKind::Cuda, world_at(1, 1, 2));
    EXPECT_EQ(e.rfind("rank 1: device cuda asked for, but no GPU is visible", 0), 0u) << e;
    return;
  }
  // cuda:LOCAL_RANK, or cuda:0 when a single GPU is visible (one per task).
  EXPECT_EQ(worker_device(DeviceKind::Auto, world_at(0, 0, 1)), torch::Device(torch::kCUDA, 0));
  const int local = gpus == 1 ? 0 : gpus - 1;
  EXPECT_EQ(worker_device(DeviceKind::Cuda, world_at(local, local, gpus)), torch::Device(torch::kCUDA, gpus == 1 ? 0 : local));
  if (gpus > 1) {
    const std::string e = error_of(DeviceKind::Cuda, world_at(gpus, gpus, gpus + 1));
    EXPECT_NE(e.find("LOCAL_RANK " + std::to_string(gpus) + " has no GPU of its own"), std::string::npos) << e;
  }
}

// ddp_backend: auto follows the device, gloo is Gloo everywhere, nccl on a CPU worker is an
// error naming the key.
TEST(ProcessGroupBackend, FollowsTheDeviceUnlessAsked) {
  using replica::train::process_group_backend;
  const torch::Device cpu(torch::kCPU), gpu(torch::kCUDA, 1);
  EXPECT_EQ(process_group_backend("auto", cpu), "gloo");
  EXPECT_EQ(process_group_backend("auto", gpu), "nccl");
  EXPECT_EQ(process_group_backend("gloo", gpu), "gloo");
  EXPECT_EQ(process_group_backend("nccl", gpu), "nccl");
  try {
    process_group_backend("nccl", cpu);
    FAIL() << "expected replica::Error";
  } catch (const replica::Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("ddp_backend nccl needs workers on GPUs", 0), 0u) << e.what();
  }
}

// With GPUs shared (ddp_backend gloo), LOCAL_RANKs past the GPU count wrap around.
TEST(WorkerDevice, SharedGpusWrapAround) {
  const int gpus = replica::visible_gpu_count();
  if (gpus == 0) {
    EXPECT_EQ(worker_device(DeviceKind::Auto, world_at(1, 1, 2), /*gpus_shared=*/true), torch::Device(torch::kCPU));
    return;
  }
  EXPECT_EQ(worker_device(DeviceKind::Cuda, world_at(gpus, gpus, gpus + 1), /*gpus_shared=*/true),
            torch::Device(torch::kCUDA, 0));
}

}  // namespace
