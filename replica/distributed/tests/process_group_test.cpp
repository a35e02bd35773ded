// Rendezvous and collectives, with ranks as threads of this process (each its own store
// client and Gloo context, exactly as separate processes would have).
#include "replica/core/error.h"
#include "replica/distributed/process_group.h"
#include "replica/distributed/world.h"
#include "replica/distributed/tests/loopback.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <thread>

using replica::distributed::init_process_group;
using replica::distributed::ProcessGroupOptions;
using replica::distributed::WorldInfo;

namespace {

using replica::testing::free_port;

WorldInfo world(int rank, int size, int port) { return replica::testing::loopback_world(rank, size, port); }

// Runs fn(rank) on `size` threads and rethrows the first failure.
template <typename F>
void run_ranks(int size, F fn) {
  std::vector<std::thread> threads;
  std::vector<std::string> errors(size);
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < size; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

}  // namespace

TEST(ProcessGroup, AllreduceBroadcastAllgatherAcrossThreeRanks) {
  const int port = free_port();
  run_ranks(3, [&](int r) {
    auto pg = init_process_group(world(r, 3, port));
    auto t = torch::full({1000}, static_cast<float>(r + 1));
    auto work = pg->allreduce_sum(t);
    work.wait();
    if (!torch::allclose(t, torch::full({1000}, 6.0f))) throw std::runtime_error("allreduce");

    std::vector<torch::Tensor> b{torch::full({5}, static_cast<float>(r))};
    pg->broadcast(b, 2);
    if (!torch::equal(b[0], torch::full({5}, 2.0f))) throw std::runtime_error("broadcast");

    std::vector<torch::Tensor> out;
    pg->allgather(out, torch::full({2}, static_cast<int64_t>(r), torch::kLong));
    for (int k = 0; k < 3; ++k) {
      if (out[k][1].item<int64_t>() != k) throw std::runtime_error("allgather");
    }
    pg->store_set("key" + std::to_string(r), "v" + std::to_string(r));
    pg->barrier();
    if (pg->store_get("key" + std::to_string((r + 1) % 3)) != "v" + std::to_string((r + 1) % 3)) {
      throw std::runtime_error("store");
    }
  });
}

TEST(ProcessGroup, WorldOfOneOpensNothingAndCollectivesAreNoOps) {
  auto pg = init_process_group(world(0, 1, 1));
  auto t = torch::ones({3});
  pg->allreduce_sum(t).wait();
  EXPECT_TRUE(torch::equal(t, torch::ones({3})));
  pg->barrier();
}

TEST(ProcessGroup, RendezvousTimeoutNamesTheRanksThatNeverJoined) {
  ProcessGroupOptions opts;
  opts.rdzv_timeout = std::chrono::milliseconds(2000);
  const int port = free_port();
  try {
    // Ranks 0 and 2 of 4 arrive; 1 and 3 never do.
    std::thread other([&] {
      try {
        init_process_group(world(2, 4, port), opts);
      } catch (...) {
      }
    });
    try {
      init_process_group(world(0, 4, port), opts);
      other.join();
      FAIL() << "rendezvous should time out";
    } catch (const replica::Error& e) {
      other.join();
      const std::string msg = e.what();
      EXPECT_NE(msg.find("ranks 1, 3 never joined"), std::string::npos) << msg;
      EXPECT_NE(msg.find("127.0.0.1:" + std::to_string(port)), std::string::npos) << msg;
      EXPECT_NE(msg.find("2 of 4 joined"), std::string::npos) << msg;
    }
  } catch (...) {
    throw;
  }
}

TEST(ProcessGroup, PortInUseIsNamed) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  try {
    init_process_group(world(0, 2, port));
    FAIL() << "should fail";
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("port " + std::to_string(port) + " on 127.0.0.1 is already in use"),
              std::string::npos)
        << e.what();
  }
  close(fd);
}

TEST(ProcessGroup, WorkerWithoutMasterFailsWithinTimeoutNamingAddress) {
  ProcessGroupOptions opts;
  opts.rdzv_timeout = std::chrono::milliseconds(1500);
  const int port = free_port();
  try {
    init_process_group(world(1, 2, port), opts);
    FAIL() << "should fail";
  } catch (const replica::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("rank 1 could not reach the rendezvous at 127.0.0.1:" + std::to_string(port)),
              std::string::npos)
        << msg;
  }
}

TEST(World, ReadsTorchrunMpiAndSlurmVariables) {
  for (auto v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID",
                 "SLURM_NTASKS", "SLURM_LOCALID"}) {
    unsetenv(v);
  }
  EXPECT_FALSE(replica::distributed::world_from_env().has_value());
  setenv("SLURM_PROCID", "3", 1);
  setenv("SLURM_NTASKS", "4", 1);
  setenv("SLURM_LOCALID", "1", 1);
  setenv("SLURM_NTASKS_PER_NODE", "2", 1);
  auto s = replica::distributed::world_from_env();
  ASSERT_TRUE(s);
  EXPECT_EQ(s->rank, 3);
  EXPECT_EQ(s->world_size, 4);
  EXPECT_EQ(s->local_rank, 1);
  EXPECT_EQ(s->launched_by, "slurm");
  setenv("OMPI_COMM_WORLD_RANK", "1", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  EXPECT_EQ(replica::distributed::world_from_env()->launched_by, "mpirun");
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_PORT", "12345", 1);
  auto t = replica::distributed::world_from_env();
  EXPECT_EQ(t->launched_by, "torchrun-env");
  EXPECT_EQ(t->master_port, 12345);
  setenv("RANK", "2", 1);
  EXPECT_THROW(replica::distributed::world_from_env(), replica::Error);
  setenv("RANK", "x", 1);
  EXPECT_THROW(replica::distributed::world_from_env(), replica::Error);
  for (auto v : {"RANK", "WORLD_SIZE", "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"}) {
    unsetenv(v);
  }
}

TEST(ProcessGroup, WorkerStartedBeforeMasterWaitsForIt) {
  const int port = free_port();
  std::string error;
  std::thread late_master([&] {
    // Rank 1 is already trying when rank 0 arrives 300 ms later.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    try {
      auto pg = init_process_group(world(0, 2, port));
      pg->barrier();
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  auto pg = init_process_group(world(1, 2, port));
  pg->barrier();
  late_master.join();
  EXPECT_EQ(error, "");
}

// Note [native reduce-scatter and all-gather] (c10d_compat.cpp): over Gloo, shards of a flat
// tensor reduced and gathered by the backend's own collectives, with the padded tail (1000
// elements over 3 ranks), an exact multiple, and a tensor smaller than one chunk.
TEST(ProcessGroup, NativeReduceScatterAndAllGatherOverGloo) {
  const int port = free_port();
  run_ranks(3, [&](int r) {
    ProcessGroupOptions options;
    options.transport = "gloo";
    auto pg = init_process_group(world(r, 3, port), options);
    if (pg->shares_memory()) throw std::runtime_error("expected the Gloo transport");
    for (const int64_t numel : {int64_t{1000}, int64_t{3 * 4096}, int64_t{5}}) {
      // Rank r holds (r + 1) * (i + 1) at element i: the sum is 6 (i + 1), the average 2 (i + 1).
      auto base = torch::arange(1, numel + 1, torch::kFloat32);
      auto t = base * static_cast<float>(r + 1);
      pg->reduce_scatter_average(t).wait();
      const auto [b, e] = pg->shard_range(numel, torch::kFloat32, r);
      if (e > b && !torch::equal(t.slice(0, b, e), base.slice(0, b, e) * 2.0f)) {
        throw std::runtime_error(fmt::format("reduce-scatter average of {} elements", numel));
      }
      auto s = torch::zeros({numel});
      if (e > b) s.slice(0, b, e).copy_(base.slice(0, b, e));
      s.slice(0, 0, b).fill_(-1.0f);  // not this rank's: overwritten by the gather
      pg->all_gather_shards(s).wait();
      if (!torch::equal(s, base)) throw std::runtime_error(fmt::format("all-gather of {} elements", numel));
      auto u = base * static_cast<float>(r + 1);
      pg->reduce_scatter_sum(u).wait();
      if (e > b && !torch::equal(u.slice(0, b, e), base.slice(0, b, e) * 6.0f)) {
        throw std::runtime_error(fmt::format("reduce-scatter sum of {} elements", numel));
      }
    }
  });
}
