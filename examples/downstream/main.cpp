// A user's own model, trained data-parallel with replica's DistributedDataParallel.
//
// Run it under the launcher, which gives every worker RANK, WORLD_SIZE, MASTER_ADDR, ...:
//   replica launch --nproc-per-node 2 -- ./downstream_ddp
// Each worker draws its own batches of a synthetic regression (y = a.x + b), DDP averages the
// gradients, and at the end every rank checks that all replicas hold the same weights and
// that the loss fell. Exit code 0 means both held.
#include <replica/ddp/ddp.h>
#include <replica/distributed/process_group.h>
#include <replica/distributed/world.h>

#include <torch/torch.h>

#include <cstdio>

// The user-written model: nothing replica-specific in it.
struct RegressorImpl : torch::nn::Module {
  RegressorImpl()
      : hidden(register_module("hidden", torch::nn::Linear(8, 32))),
        out(register_module("out", torch::nn::Linear(32, 1))) {}
  torch::Tensor forward(torch::Tensor x) { return out(torch::tanh(hidden(x))); }
  torch::nn::Linear hidden, out;
};
TORCH_MODULE(Regressor);

int main() {
  const auto world = replica::distributed::world_from_env().value_or(replica::distributed::WorldInfo{});
  auto pg = replica::distributed::init_process_group(world, replica::distributed::ProcessGroupOptions{});
  const int rank = pg->rank();

  torch::manual_seed(100 + rank);  // different initial weights: DDP starts every rank from rank 0's
  Regressor model;
  replica::ddp::DistributedDataParallel ddp(model.ptr(), pg);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

  const torch::Tensor a = torch::linspace(-1, 1, 8).unsqueeze(1);
  auto batch = [&](int64_t n) {
    torch::Tensor x = torch::randn({n, 8});
    return std::make_pair(x, torch::matmul(x, a) + 0.5);
  };
  double first = 0, last = 0;
  for (int step = 0; step < 200; ++step) {
    auto [x, y] = batch(32);  // this rank's own data (its own seed)
    optimizer.zero_grad();
    torch::Tensor loss = torch::mse_loss(model->forward(x), y);
    loss.backward();  // gradients are all-reduced in buckets while backward runs
    optimizer.step();
    if (step == 0) first = loss.item<double>();
    last = loss.item<double>();
  }

  // Identical replicas: the sum over ranks of each rank's weights is world_size times ours.
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> flat;
  for (auto& p : model->parameters()) flat.push_back(p.detach().reshape({-1}));
  torch::Tensor mine = torch::cat(flat).to(torch::kDouble);
  torch::Tensor sum = mine.clone();
  pg->allreduce_sum(sum).wait();
  const double divergence = (sum / pg->size() - mine).abs().max().item<double>();
  std::printf("rank %d of %d: loss %.4f -> %.4f, replica divergence %.3g\n", rank, pg->size(), first, last,
              divergence);
  pg->barrier();
  return divergence < 1e-9 && last < first / 10 ? 0 : 1;
}
