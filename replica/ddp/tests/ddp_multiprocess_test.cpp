// DDP against single-process training, with real worker processes started by the launcher.
//
// Each scenario runs on every rank: the rank trains a DDP replica on its share of each
// global batch while, in the same process, a reference copy trains on the whole global batch
// without any communication. DDP is right when both end with the same parameters.
#include "replica/core/error.h"
#include "replica/testing/paths.h"
#include "replica/testing/launch_scenario.h"
#include "replica/ddp/ddp.h"
#include "replica/ddp/sync_batchnorm.h"
#include "replica/distributed/process_group.h"
#include "replica/launch/launcher.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <map>
#include <thread>
#include <unistd.h>

#include "replica/core/system.h"
#include <iostream>

using replica::ddp::DDPOptions;
using replica::ddp::DistributedDataParallel;

using replica::testing::launch_scenario;

namespace {

// Four Linear layers so that a tiny bucket cap yields several buckets.
struct NetImpl : torch::nn::Module {
  NetImpl(bool with_unused_branch = false) {
    fc1 = register_module("fc1", torch::nn::Linear(20, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 64));
    fc3 = register_module("fc3", torch::nn::Linear(64, 32));
    head = register_module("head", torch::nn::Linear(32, 10));
    if (with_unused_branch) unused = register_module("unused", torch::nn::Linear(32, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(fc1(x));
    x = torch::tanh(fc2(x));
    x = torch::relu(fc3(x));
    return head(x);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr}, head{nullptr}, unused{nullptr};
};
TORCH_MODULE(Net);

struct Batch {
  torch::Tensor x, y;
};

// The global batch of step `step`, identical on every rank.
Batch global_batch(int step, int64_t size) {
  torch::manual_seed(1000 + step);
  return {torch::randn({size, 20}), torch::randint(0, 10, {size})};
}

Batch shard(const Batch& b, int rank, int world) {
  const int64_t n = b.x.size(0) / world;
  return {b.x.slice(0, rank * n, (rank + 1) * n), b.y.slice(0, rank * n, (rank + 1) * n)};
}

double max_abs_diff(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.parameters();
  auto pb = b.parameters();
  double worst = 0;
  for (size_t i = 0; i < pa.size(); ++i) {
    worst = std::max(worst, (pa[i] - pb[i]).abs().max().item<double>());
  }
  return worst;
}

std::shared_ptr<replica::distributed::ProcessGroup> group() {
  auto world = replica::distributed::world_from_env();
  if (!world) replica::fail("worker started without RANK/WORLD_SIZE");
  return replica::distributed::init_process_group(*world);
}

int check(bool ok, const std::string& what) {
  if (!ok) std::cerr << "worker check failed: " << what << "\n";
  return ok ? 0 : 1;
}

// (a) world W with per-rank batch B/W equals world 1 with batch B after 20 SGD steps.
int sgd_equivalence() {
  auto pg = group();
  torch::manual_seed(pg->rank());  // different init per rank: the broadcast must fix it
  Net model;
  DDPOptions opts;
  opts.bucket_cap_mb = 0.01;  // ~2.6k floats: several buckets
  opts.first_bucket_cap_mb = 0.002;
  DistributedDataParallel ddp(model.ptr(), pg, opts);
  Net reference;
  {
    torch::NoGradGuard g;
    auto src = model->parameters();
    auto dst = reference->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const int64_t global = 48;  // divisible by 2 and 3
  for (int step = 0; step < 20; ++step) {
    Batch b = global_batch(step, global);
    Batch mine = shard(b, pg->rank(), pg->size());
    opt.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(mine.x), mine.y).backward();
    opt.step();
    ref_opt.zero_grad();
    torch::nn::functional::cross_entropy(reference->forward(b.x), b.y).backward();
    ref_opt.step();
  }
  const double diff = max_abs_diff(*model, *reference);
  std::cerr << "rank " << pg->rank() << " sgd_equivalence max_abs_diff=" << diff
            << " buckets=" << ddp.bucket_assignment().size() << " transport=" << pg->transport() << "\n";
  if (auto expected = replica::env("EXPECT_TRANSPORT")) {
    if (check(pg->transport() == *expected, "transport " + pg->transport() + " != " + *expected)) return 1;
  }
  return check(diff <= 1e-5, "parameters within 1e-5 of single-process training") +
         check(ddp.bucket_assignment().size() >= 3, "several buckets") +
         check(ddp.buckets_rebuilt(), "buckets rebuilt after the first step");
}

// (b) gradient accumulation under no_sync equals one large batch.
int no_sync_accumulation() {
  auto pg = group();
  torch::manual_seed(0);
  Net model;
  DistributedDataParallel ddp(model.ptr(), pg);
  torch::manual_seed(0);
  Net reference;
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW ref_opt(reference->parameters(), torch::optim::AdamWOptions(1e-2));
  const int micro = 4;
  const int64_t micro_global = 16;  // per micro-step, across ranks
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    for (int m = 0; m < micro; ++m) {
      Batch b = shard(global_batch(step * micro + m, micro_global), pg->rank(), pg->size());
      auto loss = torch::nn::functional::cross_entropy(model->forward(b.x), b.y) / micro;
      if (m + 1 < micro) {
        auto guard = ddp.no_sync();
        loss.backward();
      } else {
        loss.backward();
      }
    }
    opt.step();
    // Reference: the whole accumulated global batch at once.
    std::vector<torch::Tensor> xs, ys;
    for (int m = 0; m < micro; ++m) {
      Batch b = global_batch(step * micro + m, micro_global);
      xs.push_back(b.x);
      ys.push_back(b.y);
    }
    ref_opt.zero_grad();
    torch::nn::functional::cross_entropy(reference->forward(torch::cat(xs)), torch::cat(ys)).backward();
    ref_opt.step();
  }
  const double diff = max_abs_diff(*model, *reference);
  std::cerr << "rank " << pg->rank() << " no_sync max_abs_diff=" << diff << "\n";
  return check(diff <= 1e-5, "no_sync accumulation equals the large batch");
}

// Parameters without gradient: an error naming them, or handled with find_unused_parameters.
int unused_parameters() {
  auto pg = group();
  torch::manual_seed(0);
  Net model(/*with_unused_branch=*/true);
  int failures = 0;
  {
    DistributedDataParallel ddp(model.ptr(), pg);
    Batch b = shard(global_batch(0, 8), pg->rank(), pg->size());
    try {
      torch::nn::functional::cross_entropy(model->forward(b.x), b.y).backward();
      failures += check(false, "backward with an unused parameter must fail");
    } catch (const std::exception& e) {
      const std::string msg = e.what();
      failures += check(msg.find("unused.weight") != std::string::npos &&
                            msg.find("unused.bias") != std::string::npos &&
                            msg.find("find_unused_parameters") != std::string::npos,
                        "error names the parameters: " + msg);
    }
  }
  model->zero_grad();
  DDPOptions opts;
  opts.find_unused_parameters = true;
  DistributedDataParallel ddp(model.ptr(), pg, opts);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  auto before = model->unused->weight.clone();
  for (int step = 0; step < 3; ++step) {
    Batch b = shard(global_batch(step, 8), pg->rank(), pg->size());
    opt.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(b.x), b.y).backward();
    opt.step();
  }
  failures += check(torch::equal(before, model->unused->weight), "unused parameter unchanged");
  // static_graph: the first step learns the unused set; later steps need no search.
  {
    DDPOptions st;
    st.static_graph = true;
    DistributedDataParallel sddp(model.ptr(), pg, st);
    for (int step = 0; step < 3; ++step) {
      Batch b = shard(global_batch(step, 8), pg->rank(), pg->size());
      opt.zero_grad();
      torch::nn::functional::cross_entropy(model->forward(b.x), b.y).backward();
      opt.step();
    }
    failures += check(torch::equal(before, model->unused->weight), "static graph: unused parameter unchanged");
  }
  // Replicas stay identical.
  std::vector<torch::Tensor> gathered;
  pg->allgather(gathered, model->fc1->weight.detach());
  failures += check(torch::equal(gathered[0], gathered.back()), "replicas identical");
  return failures;
}

// Frozen parameters are never synced (and need no gradient).
int frozen_parameters() {
  auto pg = group();
  torch::manual_seed(0);
  Net model;
  model->fc1->weight.set_requires_grad(false);
  model->fc1->bias.set_requires_grad(false);
  DistributedDataParallel ddp(model.ptr(), pg);
  for (auto& name : ddp.trainable_parameter_names()) {
    if (name.rfind("fc1.", 0) == 0) return check(false, "frozen parameter in buckets: " + name);
  }
  Batch b = shard(global_batch(0, 8), pg->rank(), pg->size());
  torch::nn::functional::cross_entropy(model->forward(b.x), b.y).backward();
  return check(!model->fc1->weight.grad().defined(), "frozen parameter has no gradient") +
         check(model->fc2->weight.grad().defined(), "trainable parameter has a gradient");
}

// Compression hooks: training still matches single-process training, within bf16/fp16 rounding,
// and a user-written hook sees every bucket once per step, in order.
int comm_hooks() {
  auto pg = group();
  int failures = 0;
  // bf16 needs the shared-memory transport (LibTorch 1.13's Gloo cannot sum bf16).
  std::vector<std::string> kinds = {"fp16", "custom"};
  if (pg->transport() == "shm") kinds.push_back("bf16");
  for (const std::string& kind : kinds) {
    torch::manual_seed(0);
    Net model;
    DDPOptions opts;
    opts.bucket_cap_mb = 0.01;
    opts.first_bucket_cap_mb = 0.002;
    DistributedDataParallel ddp(model.ptr(), pg, opts);
    std::vector<size_t> seen;
    if (kind == "bf16") ddp.register_comm_hook(replica::ddp::bf16_compress_hook());
    if (kind == "fp16") ddp.register_comm_hook(replica::ddp::fp16_compress_hook());
    if (kind == "custom") {
      // A user hook: sum with the default hook, record the bucket order.
      auto inner = replica::ddp::allreduce_average_hook();
      ddp.register_comm_hook([&seen, inner](replica::distributed::ProcessGroup& g, replica::ddp::GradBucket& b) {
        seen.push_back(b.index);
        return inner(g, b);
      });
    }
    torch::manual_seed(0);
    Net reference;
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05));
    torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.05));
    for (int step = 0; step < 5; ++step) {
      Batch b = global_batch(step, 32);
      Batch mine = shard(b, pg->rank(), pg->size());
      opt.zero_grad();
      torch::nn::functional::cross_entropy(model->forward(mine.x), mine.y).backward();
      opt.step();
      ref_opt.zero_grad();
      torch::nn::functional::cross_entropy(reference->forward(b.x), b.y).backward();
      ref_opt.step();
    }
    const double diff = max_abs_diff(*model, *reference);
    const double tolerance = kind == "custom" ? 1e-5 : 2e-3;
    failures += check(diff <= tolerance, kind + " hook: diff " + std::to_string(diff));
    if (kind == "custom") {
      const size_t buckets = ddp.bucket_assignment().size();
      failures += check(seen.size() == 5 * buckets, "custom hook called once per bucket per step");
      for (size_t i = 0; i < seen.size(); ++i) failures += check(seen[i] == i % buckets, "bucket order");
    }
    std::vector<torch::Tensor> gathered;
    pg->allgather(gathered, model->fc1->weight.detach());
    failures += check(torch::equal(gathered[0], gathered.back()), kind + ": replicas identical");
  }
  return failures;
}


// SyncBatchNorm2d on each rank's share of a global batch against BatchNorm2d on the whole
// batch in one process: outputs, running statistics, input gradients (of the sum of every
// rank's loss) and parameter gradients (summed over ranks) all agree; so do all_gather_with_grad's
// rows and gradients.
int sync_batchnorm() {
  auto pg = group();
  const int rank = pg->rank(), world = pg->size();
  const int64_t n = 4 * world;
  torch::manual_seed(7);
  torch::Tensor x_all = torch::randn({n, 3, 5, 5}) * 2 + 1;
  torch::Tensor r_all = torch::randn({n, 3, 5, 5});
  torch::Tensor gamma = torch::rand({3}) + 0.5, beta = torch::randn({3});
  int failures = 0;

  torch::nn::BatchNorm2d reference(3);
  replica::ddp::SyncBatchNorm2d sync(3, pg);
  {
    torch::NoGradGuard no_grad;
    reference->weight.copy_(gamma);
    reference->bias.copy_(beta);
    sync->weight.copy_(gamma);
    sync->bias.copy_(beta);
  }
  torch::Tensor x_ref = x_all.clone().requires_grad_(true);
  torch::Tensor y_ref = reference->forward(x_ref);
  (y_ref * r_all).sum().backward();

  const int64_t rows = n / world;
  torch::Tensor x = x_all.slice(0, rank * rows, (rank + 1) * rows).clone().requires_grad_(true);
  torch::Tensor y = sync->forward(x);
  (y * r_all.slice(0, rank * rows, (rank + 1) * rows)).sum().backward();

  auto diff = [](const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); };
  failures += check(diff(y, y_ref.slice(0, rank * rows, (rank + 1) * rows)) < 1e-5, "outputs");
  failures += check(diff(sync->running_mean, reference->running_mean) < 1e-6, "running_mean");
  failures += check(diff(sync->running_var, reference->running_var) < 1e-6, "running_var");
  failures += check(diff(x.grad(), x_ref.grad().slice(0, rank * rows, (rank + 1) * rows)) < 1e-5, "input gradients");
  torch::Tensor grads = torch::cat({sync->weight.grad(), sync->bias.grad()}).contiguous();
  pg->allreduce_sum(grads).wait();
  failures += check(diff(grads, torch::cat({reference->weight.grad(), reference->bias.grad()})) < 1e-4,
                    "parameter gradients summed over ranks");
  // Eval mode normalises with the (shared) running statistics, as BatchNorm2d does.
  sync->eval();
  reference->eval();
  {
    torch::NoGradGuard no_grad;
    failures += check(diff(sync->forward(x), reference->forward(x)) < 1e-5, "eval outputs");
  }

  // all_gather_with_grad: every rank's rows in rank order; the gradient of the sum of all
  // ranks' losses reaches each rank's own rows.
  torch::Tensor mine = x_all.slice(0, rank * rows, (rank + 1) * rows).clone().requires_grad_(true);
  torch::Tensor gathered = replica::ddp::all_gather_with_grad(mine, *pg);
  failures += check(torch::equal(gathered, x_all), "gathered rows");
  ((gathered * r_all).sum() * (rank + 1)).backward();
  // d/dmine of sum_s (s + 1) * sum(gathered * r) = (sum_s (s + 1)) * r[own rows].
  const double weight = world * (world + 1) / 2.0;
  failures += check(diff(mine.grad(), r_all.slice(0, rank * rows, (rank + 1) * rows) * weight) < 1e-5,
                    "all_gather_with_grad gradient");
  return failures;
}

}  // namespace

int run_test_worker(const std::string& name) {
  try {
    if (name == "sgd_equivalence") return sgd_equivalence();
    if (name == "no_sync_accumulation") return no_sync_accumulation();
    if (name == "unused_parameters") return unused_parameters();
    if (name == "frozen_parameters") return frozen_parameters();
    if (name == "comm_hooks") return comm_hooks();
    if (name == "sync_batchnorm") return sync_batchnorm();
    std::cerr << "unknown worker scenario " << name << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "worker failed: " << e.what() << "\n";
    return 1;
  }
}

TEST(DDPMultiProcess, World2EqualsWorld1With20SgdSteps) { EXPECT_EQ(launch_scenario("sgd_equivalence", 2), 0); }
TEST(DDPMultiProcess, World2OverSharedMemory) {
  EXPECT_EQ(launch_scenario("sgd_equivalence", 2, {{"EXPECT_TRANSPORT", "shm"}}), 0);
}
TEST(DDPMultiProcess, World2OverGloo) {
  EXPECT_EQ(launch_scenario("sgd_equivalence", 2, {{"REPLICA_TRANSPORT", "gloo"}, {"EXPECT_TRANSPORT", "gloo"}}), 0);
}
// Two "nodes" of two workers on this host: shared memory inside each node, Gloo between the
// node leaders (the hierarchical path), started as two launchers like a two-node job.
TEST(DDPMultiProcess, TwoNodesHierarchical) {
  const int port = replica::launch::find_free_port();
  auto node = [&](int k) {
    return fmt::format("EXPECT_TRANSPORT=shm {} launch --nnodes 2 --node-rank {} --nproc-per-node 2 --master-port {} "
                       "--threads-per-worker 1 -- /proc/{}/exe --worker sgd_equivalence",
                       REPLICA_BIN, k, port, getpid());
  };
  int rc1 = -1;
  std::thread second([&] { rc1 = std::system(node(1).c_str()); });
  const int rc0 = std::system(node(0).c_str());
  second.join();
  EXPECT_EQ(rc0, 0);
  EXPECT_EQ(rc1, 0);
}
TEST(DDPMultiProcess, World3EqualsWorld1With20SgdSteps) { EXPECT_EQ(launch_scenario("sgd_equivalence", 3), 0); }
TEST(DDPMultiProcess, NoSyncAccumulationEqualsLargeBatch) { EXPECT_EQ(launch_scenario("no_sync_accumulation", 2), 0); }
TEST(DDPMultiProcess, UnusedParametersNamedOrHandled) { EXPECT_EQ(launch_scenario("unused_parameters", 2), 0); }
TEST(DDPMultiProcess, FrozenParametersNeverSynced) { EXPECT_EQ(launch_scenario("frozen_parameters", 2), 0); }

TEST(DDPMultiProcess, SyncBatchNormWorld2EqualsBatchNormOnTheGlobalBatch) {
  EXPECT_EQ(launch_scenario("sync_batchnorm", 2), 0);
}
TEST(DDPMultiProcess, CompressionAndUserCommHooks) { EXPECT_EQ(launch_scenario("comm_hooks", 2), 0); }

TEST(DDP, WorldOfOneInstallsNothingAndTrainsPlainly) {
  auto pg = replica::distributed::init_process_group(replica::distributed::WorldInfo{});
  torch::manual_seed(0);
  Net model;
  DistributedDataParallel ddp(model.ptr(), pg);
  EXPECT_TRUE(ddp.bucket_assignment().empty());
  Batch b = global_batch(0, 8);
  torch::nn::functional::cross_entropy(model->forward(b.x), b.y).backward();
  EXPECT_TRUE(model->fc1->weight.grad().defined());
}
