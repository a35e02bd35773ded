// The collective watchdog and desync checks (ranks as threads of this process, each its own
// store client and Gloo context), and the Slurm hostlist the master comes from.
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
#include <future>
#include <thread>

using replica::distributed::init_process_group;
using replica::distributed::ProcessGroupOptions;
using replica::distributed::WorldInfo;

namespace {

using replica::testing::free_port;

WorldInfo world(int rank, int size, int port) { return replica::testing::loopback_world(rank, size, port); }

// Runs fn(rank) on two threads; returns each rank's error message ("" when none).
template <typename F>
std::vector<std::string> run_two_ranks(F fn) {
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

ProcessGroupOptions desync_options() {
  ProcessGroupOptions o;
  o.desync_check = true;
  o.transport = "gloo";
  return o;
}

}  // namespace

TEST(Desync, MatchingCollectivesPass) {
  const int port = free_port();
  const auto errors = run_two_ranks([&](int r) {
    auto pg = init_process_group(world(r, 2, port), desync_options());
    auto t = torch::ones({3, 2});
    pg->allreduce_sum(t).wait();
    std::vector<torch::Tensor> b{torch::zeros({4}, torch::kLong)};
    pg->broadcast(b, 0);
    pg->barrier();
    if (!torch::equal(t, torch::full({3, 2}, 2.0f))) throw std::runtime_error("wrong sum");
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

TEST(Desync, ShapeMismatchNamesBothRanksAndCallSites) {
  const int port = free_port();
  const auto errors = run_two_ranks([&](int r) {
    auto pg = init_process_group(world(r, 2, port), desync_options());
    pg->barrier();
    auto t = torch::ones({r == 0 ? 4 : 5});
    pg->allreduce_sum(t).wait();
  });
  EXPECT_NE(errors[1].find("collective desync at collective #2: rank 1 issued all-reduce Float[5] at "
                           "collective_monitor_test.cpp:"),
            std::string::npos)
      << errors[1];
  EXPECT_NE(errors[1].find("but rank 0 issued all-reduce Float[4] at collective_monitor_test.cpp:"), std::string::npos)
      << errors[1];
  EXPECT_NE(errors[0].find("rank 0 issued all-reduce Float[4]"), std::string::npos) << errors[0];
}

TEST(Desync, OrderMismatchNamesTheKinds) {
  const int port = free_port();
  const auto errors = run_two_ranks([&](int r) {
    auto pg = init_process_group(world(r, 2, port), desync_options());
    auto t = torch::ones({2});
    std::vector<torch::Tensor> b{torch::ones({2})};
    if (r == 0) {
      pg->broadcast(b, 0);
      pg->allreduce_sum(t).wait();
    } else {
      pg->allreduce_sum(t).wait();
      pg->broadcast(b, 0);
    }
  });
  EXPECT_NE(errors[0].find("collective desync at collective #1: rank 0 issued broadcast Float[2]"), std::string::npos)
      << errors[0];
  EXPECT_NE(errors[0].find("but rank 1 issued all-reduce Float[2]"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("but rank 0 issued broadcast Float[2]"), std::string::npos) << errors[1];
}

TEST(Desync, TurnedOnByTheEnvironmentAndBadValuesAreErrors) {
  setenv("REPLICA_DISTRIBUTED_DEBUG", "detail", 1);
  const int port = free_port();
  const auto errors = run_two_ranks([&](int r) {
    auto pg = init_process_group(world(r, 2, port));
    auto t = torch::ones({r + 1});
    pg->allreduce_sum(t).wait();
  });
  EXPECT_NE(errors[0].find("collective desync at collective #1"), std::string::npos) << errors[0];
  setenv("REPLICA_DISTRIBUTED_DEBUG", "verbose", 1);
  const int port2 = free_port();
  const auto bad = run_two_ranks([&](int r) { init_process_group(world(r, 2, port2)); });
  EXPECT_NE(bad[0].find("REPLICA_DISTRIBUTED_DEBUG='verbose' is not one of OFF, INFO, DETAIL"), std::string::npos)
      << bad[0];
  unsetenv("REPLICA_DISTRIBUTED_DEBUG");
}

// Rank 1 completes a barrier and then never enters the all-reduce rank 0 waits in: the
// watchdog ends rank 0's process after collective_timeout, naming rank 1 and what each rank
// completed last.
TEST(CollectiveWatchdog, HungRankIsNamedAndTheProcessEnds) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        const int port = free_port();
        ProcessGroupOptions o;
        o.collective_timeout = std::chrono::milliseconds(1000);
        o.transport = "gloo";
        std::promise<void> never;
        std::thread rank1([&] {
          auto pg = init_process_group(world(1, 2, port), o);
          pg->barrier();
          never.get_future().wait();  // hung outside any collective
        });
        auto pg = init_process_group(world(0, 2, port), o);
        pg->barrier();
        auto t = torch::ones({8});
        pg->allreduce_sum(t).wait();
        rank1.join();
        std::exit(0);
      },
      ::testing::ExitedWithCode(1),
      "rank 0: collective timeout: all-reduce #2 did not complete within [0-9]+ s \\(collective_timeout 1 s\\); "
      "last collective completed by each rank: rank 0: #1 barrier \\(waiting in #2 all-reduce\\); "
      "rank 1: #1 barrier \\(not in a collective\\); not in this collective: rank 1 \\(hung, stopped or dead\\)");
}

TEST(SlurmHostlist, FirstHost) {
  using replica::distributed::first_host_of_hostlist;
  EXPECT_EQ(first_host_of_hostlist("node[01-02]"), "node01");
  EXPECT_EQ(first_host_of_hostlist("node[07,03-04],gpu1"), "node07");
  EXPECT_EQ(first_host_of_hostlist("gpu3,node[1-2]"), "gpu3");
  EXPECT_EQ(first_host_of_hostlist("10.0.0.[3-4]"), "10.0.0.3");
  EXPECT_EQ(first_host_of_hostlist("rack[2-3]-n[10-11]"), "rack2-n10");
  EXPECT_EQ(first_host_of_hostlist("single"), "single");
  EXPECT_THROW(first_host_of_hostlist("node[01-02"), replica::Error);
  EXPECT_THROW(first_host_of_hostlist(""), replica::Error);
}

TEST(SlurmHostlist, MasterComesFromTheNodeListAndJobId) {
  for (auto v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"}) {
    unsetenv(v);
  }
  setenv("SLURM_PROCID", "1", 1);
  setenv("SLURM_NTASKS", "4", 1);
  setenv("SLURM_LOCALID", "1", 1);
  setenv("SLURM_TASKS_PER_NODE", "2(x2)", 1);
  setenv("SLURM_NODEID", "0", 1);
  setenv("SLURM_NODELIST", "node[01-02]", 1);
  setenv("SLURM_JOB_ID", "123456", 1);
  auto w = replica::distributed::world_from_env();
  ASSERT_TRUE(w);
  EXPECT_EQ(w->launched_by, "slurm");
  EXPECT_EQ(w->master_addr, "node01");
  EXPECT_EQ(w->master_port, 10000 + 123456 % 20000);
  EXPECT_EQ(w->local_world_size, 2);
  setenv("MASTER_ADDR", "10.1.2.3", 1);
  setenv("MASTER_PORT", "4242", 1);
  w = replica::distributed::world_from_env();
  EXPECT_EQ(w->master_addr, "10.1.2.3");
  EXPECT_EQ(w->master_port, 4242);
  for (auto v : {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_TASKS_PER_NODE", "SLURM_NODEID",
                 "SLURM_NODELIST", "SLURM_JOB_ID", "MASTER_ADDR", "MASTER_PORT"}) {
    unsetenv(v);
  }
}
