// replica's side of ../shared/bench/ddp_mlp.py: the same MLP, per-rank batch, steps, warm-up,
// threads and data (Fashion-MNIST), trained through replica's DistributedDataParallel.
// usage: replica launch --nproc-per-node W -- bench_ddp_mlp --hidden 1024 --layers 2 --batch 128 --steps 200
//        [--shard-optimizer] [--torch-sgd] [--device cpu|cuda] [--synthetic]
// --device cuda trains on cuda:LOCAL_RANK (cuda:0 when the process sees one GPU) over NCCL;
// bench/ddp_mlp_peer.py is the PyTorch side there. --synthetic trains on random data of
// Fashion-MNIST's shape instead (the GPU machines have no dataset package); the peer makes the
// same tensors from the same seeds, so both sides still print the same loss.
// Rank 0 prints: peer=replica world=.. params=.. batch/rank=.. steps/s=.. samples/s=.. loss=.. device=..
#include "replica/core/system.h"
#include "replica/data/fashion_mnist.h"
#include "replica/ddp/ddp.h"
#include "replica/distributed/process_group.h"
#include "replica/models/fused_linear.h"
#include "replica/train/engine.h"
#include "replica/train/optim.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <CLI/CLI.hpp>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

int main(int argc, char** argv) {
  int hidden = 1024, layers = 2, batch = 128, steps = 200, warmup = 20, threads = 1;
  std::string shard = "auto", device_name = "cpu";
  bool torch_sgd = false, torch_linear = false, synthetic = false;
  CLI::App app{"replica's side of ../shared/bench/ddp_mlp.py"};
  app.add_option("--hidden", hidden, "Hidden width")->capture_default_str();
  app.add_option("--layers", layers, "Hidden layers")->capture_default_str();
  app.add_option("--batch", batch, "Samples per rank per step")->capture_default_str();
  app.add_option("--steps", steps, "Timed steps")->capture_default_str();
  app.add_option("--warmup", warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--threads", threads, "Intra-op threads per rank")->capture_default_str();
  app.add_option("--shard-optimizer", shard,
                 "DDP steps 1/N of the parameters per rank (params.shard_optimizer): auto (as the trainer: on "
                 "when the ranks share one host), true or false")
      ->check(CLI::IsMember({"auto", "true", "false"}))
      ->capture_default_str();
  app.add_flag("--torch-sgd", torch_sgd, "torch::optim::SGD instead of replica's FusedSGD (the trainer's sgd)");
  app.add_flag("--torch-linear", torch_linear,
               "torch::nn::Linear instead of replica's FusedLinear (the mlp model's layers, which write weight "
               "gradients straight into DDP's buckets)");
  app.add_option("--device", device_name, "cpu, or cuda: cuda:LOCAL_RANK (cuda:0 when one GPU is visible) over NCCL")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  app.add_flag("--synthetic", synthetic,
               "Random inputs [60000, 784] in [0,1) and labels in [0,10) from a fixed seed instead of Fashion-MNIST");
  CLI11_PARSE(app, argc, argv);
  replica::set_compute_threads(threads);
  auto world = replica::distributed::world_from_env().value_or(replica::distributed::WorldInfo{});
  torch::Device device = torch::kCPU;
  replica::distributed::ProcessGroupOptions pg_options;
  if (device_name == "cuda") {
    // The trainer's own decision (Note [worker device], train/engine.cpp): cuda:LOCAL_RANK, made
    // current before the first allocation and the NCCL process group.
    try {
      device = replica::train::worker_device(replica::train::DeviceKind::Cuda, world);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_ddp_mlp: %s\n", e.what());
      return 1;
    }
    pg_options.backend = replica::train::process_group_backend("auto", device);
    pg_options.cuda_device = device.index();
  }
  // On the CPU, DistributedDataParallel's constructor makes the C allocator keep freed blocks
  // (core/system.h), sized by the model's parameters, as in the trainer.
  // The device waits for its queued kernels, so that the clock measures the steps, not their launch.
  auto sync = [&] {
    if (device.is_cuda()) torch::cuda::synchronize();
  };
  auto pg = replica::distributed::init_process_group(world, pg_options);
  const int rank = pg->rank(), size = pg->size();

  torch::Tensor X, Y;
  if (synthetic) {
    // Made on the CPU from its own generator, as bench/ddp_mlp_peer.py does, so that both sides
    // (and every device) train on the same numbers.
    auto data_gen = at::detail::createCPUGenerator(2);
    X = torch::rand({60000, 784}, data_gen);
    Y = torch::randint(0, 10, {60000}, data_gen);
  } else {
    auto data = replica::data::load_fashion_mnist(replica::data::kFashionMnistDir, "train");
    X = data.images.reshape({data.size(), -1}).to(torch::kFloat32) / 255.0;
    Y = data.labels;
  }
  if (device.is_cuda()) {
    X = X.to(device);
    Y = Y.to(device);
  }

  torch::manual_seed(0);
  torch::nn::Sequential model;
  auto push_linear = [&](int64_t in_features, int64_t out_features) {
    if (torch_linear) {
      model->push_back(torch::nn::Linear(in_features, out_features));
    } else {
      model->push_back(replica::models::FusedLinear(in_features, out_features));
    }
  };
  int64_t in = 784;
  for (int l = 0; l < layers; ++l) {
    push_linear(in, hidden);
    model->push_back(torch::nn::ReLU());
    in = hidden;
  }
  push_linear(in, 10);
  if (device.is_cuda()) model->to(device);  // before DDP wraps it, so that its buckets are made on the device
  replica::ddp::DDPOptions ddp_options;
  if (shard == "auto") {
    ddp_options.shard_optimizer.reset();  // as the trainer: DDP decides
  } else {
    ddp_options.shard_optimizer = shard == "true";
  }
  replica::ddp::DistributedDataParallel ddp(model.ptr(), pg, ddp_options);
  const auto sgd_options = torch::optim::SGDOptions(0.05).momentum(0.9);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (torch_sgd) {
    opt = std::make_unique<torch::optim::SGD>(ddp.shard_parameters(), sgd_options);
  } else {
    opt = std::make_unique<replica::train::FusedSGD>(ddp.shard_parameters(), sgd_options);
  }
  std::vector<torch::Tensor> stepped = ddp.shard_parameters();
  const int64_t n = X.size(0);
  // On a GPU the indices are drawn there (a CUDA generator seeded as the peer's), so that no step
  // waits for a host-to-device copy.
  at::Generator gen = at::detail::createCPUGenerator(1);
  if (device.is_cuda()) {
    gen = at::detail::getCUDAHooks().getNewGenerator(device.index());
    gen.set_current_seed(1);
  }
  const auto idx_options = torch::TensorOptions().dtype(torch::kLong).device(device);  // kLong: randint's own default

  torch::Tensor loss;
  auto step = [&] {
    auto idx = torch::randint(0, n, {static_cast<int64_t>(batch) * size}, gen, idx_options)
                   .slice(0, rank * batch, (rank + 1) * batch);
    for (auto& p : stepped) p.mutable_grad() = torch::Tensor();  // zero_grad(set_to_none=True), as the peer
    loss = torch::nn::functional::cross_entropy(model->forward(X.index_select(0, idx)), Y.index_select(0, idx));
    loss.backward();
    opt->step();
    ddp.after_step();  // sharded: all-gather the parameters (a no-op otherwise)
  };
  // Every rank's steps finished, on the device too, before the clock is read: sync, the barrier,
  // and a sync for the barrier's own work under NCCL (all no-ops on the CPU but the barrier).
  auto settle = [&] {
    sync();
    pg->barrier();
    sync();
  };
  for (int i = 0; i < warmup; ++i) step();
  settle();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step();
  settle();
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (rank == 0) {
    int64_t params = 0;
    for (auto& p : model->parameters()) params += p.numel();
    std::printf("peer=replica world=%d params=%lld batch/rank=%d steps/s=%.2f samples/s=%.1f loss=%.4f device=%s\n",
                size, static_cast<long long>(params), batch, steps / dt, static_cast<double>(steps) * batch * size / dt,
                loss.item<double>(), device.str().c_str());
  }
  return 0;
}
