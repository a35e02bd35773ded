// Fault tolerance and other ways of starting workers, through the real `replica` program
// (REPLICA_BIN) on Fashion-MNIST:
// - a worker killed with SIGKILL mid-epoch is restarted (--max-restarts 1) and the run ends
//   bit for bit where an uninterrupted one ends (params.deterministic);
// - a stopped (hung) worker is named by the collective watchdog and the job fails, never hangs;
// - workers started by mpirun, by (simulated) Slurm and by two launchers in two network
//   namespaces end with the same parameters as `replica launch` with world 2.
// The faults are injected at real points: a watcher waits (inotify, no sleeping) for the first
// checkpoint to be renamed into place and then signals the rank-1 worker it finds in /proc.
#include "replica/io/safetensors.h"
#include "replica/testing/paths.h"
#include "replica/testing/program_runner.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <nlohmann/json.hpp>
#include <poll.h>
#include <signal.h>
#include <sys/inotify.h>
#include <sys/socket.h>
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;

namespace {

using replica::testing::Result;
using replica::testing::run_program;

constexpr const char* kFashionMnist = "/usr/share/datasets/fashion-mnist";

using replica::testing::read_file;

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

using Model = std::map<std::string, torch::Tensor>;

Model load_model(const fs::path& file) {
  auto f = replica::io::load_safetensors(file.string());
  return {f.tensors.begin(), f.tensors.end()};
}

// Largest absolute difference over all tensors; 1e30 when the tensor sets differ.
double max_abs_diff(const Model& a, const Model& b) {
  if (a.size() != b.size()) return 1e30;
  double worst = 0;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end() || t.sizes() != it->second.sizes()) return 1e30;
    worst = std::max(worst, (t.to(torch::kDouble) - it->second.to(torch::kDouble)).abs().max().item<double>());
  }
  return worst;
}

bool bitwise_equal(const Model& a, const Model& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [name, t] : a) {
    auto it = b.find(name);
    if (it == b.end() || t.scalar_type() != it->second.scalar_type() || !torch::equal(t, it->second)) return false;
  }
  return true;
}

// The environment of process `pid` as NAME -> VALUE (empty when it cannot be read).
std::map<std::string, std::string> environment_of(pid_t pid) {
  std::map<std::string, std::string> out;
  std::istringstream in(read_file(fs::path("/proc") / std::to_string(pid) / "environ"));
  std::string entry;
  while (std::getline(in, entry, '\0')) {
    const auto eq = entry.find('=');
    if (eq != std::string::npos) out[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  return out;
}

// The pid of the worker with RANK=rank of the first attempt whose environment carries
// REPLICA_TEST_MARK=mark, or -1.
pid_t find_worker(const std::string& mark, int rank) {
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = std::stoi(name);
    const auto env = environment_of(pid);
    auto is = [&](const char* key, const std::string& value) {
      auto it = env.find(key);
      return it != env.end() && it->second == value;
    };
    if (is("REPLICA_TEST_MARK", mark) && is("RANK", std::to_string(rank)) && is("REPLICA_RESTART_COUNT", "0")) {
      return pid;
    }
  }
  return -1;
}

// Waits (inotify, bounded) until a directory named checkpoint-* is renamed into `project`,
// then sends `signo` to the rank-1 worker. Runs beside a blocking run_program().
class FaultInjector {
 public:
  FaultInjector(fs::path project, std::string mark, int signo)
      : project_(std::move(project)), mark_(std::move(mark)), signo_(signo) {
    fs::create_directories(project_);
    fd_ = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
    EXPECT_GE(fd_, 0) << std::strerror(errno);
    EXPECT_GE(inotify_add_watch(fd_, project_.c_str(), IN_MOVED_TO), 0) << std::strerror(errno);
    thread_ = std::thread([this] { run(); });
  }
  ~FaultInjector() {
    done_ = true;
    thread_.join();
    close(fd_);
  }
  void stop() { done_ = true; }
  pid_t victim() const { return victim_; }
  std::string checkpoint() const { return checkpoint_; }

 private:
  void run() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    char buf[4096] __attribute__((aligned(__alignof__(inotify_event))));
    while (!done_ && std::chrono::steady_clock::now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 200) <= 0) continue;  // the timeout only lets stop() end the thread
      const ssize_t n = read(fd_, buf, sizeof buf);
      for (ssize_t off = 0; off < n;) {
        const auto* ev = reinterpret_cast<const inotify_event*>(buf + off);
        const std::string name = ev->len ? ev->name : "";
        off += static_cast<ssize_t>(sizeof(inotify_event) + ev->len);
        if (name.rfind("checkpoint-", 0) != 0) continue;
        victim_ = find_worker(mark_, 1);
        if (victim_ > 0) {
          checkpoint_ = name;
          kill(victim_, signo_);
          return;
        }
      }
    }
  }

  fs::path project_;
  std::string mark_;
  int signo_;
  int fd_ = -1;
  std::atomic<bool> done_{false};
  std::atomic<pid_t> victim_{-1};
  std::string checkpoint_;
  std::thread thread_;
};

class FaultTolerance : public replica::testing::ScratchDirTest {
 protected:
  FaultTolerance() : ScratchDirTest("replica-ft") {}
  void SetUp() override {
    ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
    ScratchDirTest::SetUp();
  }

  fs::path write_config(const std::map<std::string, std::string>& params = {}) {
    std::map<std::string, std::string> p = {
        {"nproc_per_node", "2"}, {"max_steps", "30"},        {"batch_size", "16"},
        {"optimizer", "sgd"},    {"lr", "0.05"},             {"momentum", "0.9"},
        {"scheduler", "cosine"}, {"max_grad_norm", "1.0"},   {"seed", "11"},
        {"threads_per_worker", "1"}, {"checkpoint_every", "0"}, {"logging_steps", "10"},
        {"hidden_sizes", "[64]"}, {"deterministic", "true"},
    };
    for (const auto& [k, v] : params) p[k] = v;
    std::ostringstream y;
    y << "task: image-classification\nbackend: local\nmodel: mlp\nproject_name: " << (dir_ / "unused").string()
      << "\nlog: jsonl\ndata:\n  path: " << kFashionMnist << "\n  train_split: train\n  valid_split: null\nparams:\n";
    for (const auto& [k, v] : p) y << "  " << k << ": " << v << "\n";
    const fs::path file = dir_ / "run.yaml";
    std::ofstream(file) << y.str();
    return file;
  }

  Result replica(const std::vector<std::string>& args, const std::map<std::string, std::string>& env = {},
                 int limit_s = 120) {
    return run_program(REPLICA_BIN, args, env, std::chrono::seconds(limit_s));
  }

  // The reference: `replica --config` with world 2 on one node (through `replica launch`).
  Model reference(const fs::path& cfg) {
    const fs::path p = dir_ / "reference";
    const Result r = replica({"--config", cfg.string(), "--project-name", p.string()});
    EXPECT_EQ(r.exit_code, 0) << r;
    return load_model(p / "final" / "model.safetensors");
  }

};

// ---------------------------------------------------------------------------------------
// Elastic restart: SIGKILL of rank 1 after the first checkpoint, --max-restarts 1.

TEST_F(FaultTolerance, KilledWorkerIsRestartedAndTheRunEndsBitForBit) {
  const fs::path cfg = write_config({{"max_steps", "300"}, {"checkpoint_every", "20"}, {"save_total_limit", "2"}});
  const Model straight = reference(cfg);

  const fs::path p = dir_ / "killed";
  const std::string mark = p.string();
  Result r;
  pid_t victim = -1;
  std::string at;
  {
    FaultInjector injector(p, mark, SIGKILL);
    r = replica({"--config", cfg.string(), "--project-name", p.string(), "--max-restarts", "1"},
                {{"REPLICA_TEST_MARK", mark}});
    injector.stop();
    victim = injector.victim();
    at = injector.checkpoint();
  }
  ASSERT_GT(victim, 0) << "no rank-1 worker was found to kill\n" << r;
  EXPECT_EQ(r.exit_code, 0) << r;
  const std::string killed = "rank 1 (local rank 1, pid " + std::to_string(victim) + ") was killed by SIGKILL";
  EXPECT_NE(r.err.find(killed), std::string::npos) << r;
  EXPECT_NE(r.err.find("restarting workers (restart 1 of 1)"), std::string::npos) << r;
  // The second attempt resumed from a checkpoint before the end (the kill was mid-run) and
  // knew it was a restart.
  EXPECT_NE(r.err.find("resuming from"), std::string::npos) << r;
  EXPECT_NE(r.err.find("REPLICA_RESTART_COUNT 1"), std::string::npos) << r;
  EXPECT_EQ(r.err.find("checkpoint-300 (step 300"), std::string::npos) << "killed after the last step\n" << r;

  // The failed worker's record: the launcher wrote it (SIGKILL leaves the worker no chance).
  const fs::path record = p / "errors" / "rank-1.restart-0.json";
  ASSERT_TRUE(fs::exists(record)) << r;
  const auto j = nlohmann::json::parse(read_file(record));
  EXPECT_EQ(j.at("rank"), 1);
  EXPECT_EQ(j.at("pid"), victim);
  EXPECT_NE(j.at("message").get<std::string>().find("SIGKILL"), std::string::npos) << j;
  EXPECT_FALSE(j.at("time").get<std::string>().empty());
  EXPECT_NE(r.err.find(record.string()), std::string::npos) << "the launcher did not report the record\n" << r;

  const Model resumed = load_model(p / "final" / "model.safetensors");
  EXPECT_TRUE(bitwise_equal(straight, resumed)) << "max abs diff " << max_abs_diff(straight, resumed)
                                                << " (killed after " << at << ")";
}

// ---------------------------------------------------------------------------------------
// Collective watchdog: rank 1 stopped (SIGSTOP) after the first checkpoint; rank 0 waits in
// its next collective, and after collective_timeout the watchdog names rank 1.

TEST_F(FaultTolerance, HungRankIsNamedByTheCollectiveWatchdog) {
  const fs::path cfg =
      write_config({{"max_steps", "1000000"}, {"checkpoint_every", "20"}, {"collective_timeout", "5"}});
  const fs::path p = dir_ / "hung";
  const std::string mark = p.string();
  Result r;
  pid_t victim = -1;
  {
    FaultInjector injector(p, mark, SIGSTOP);
    r = replica({"--config", cfg.string(), "--project-name", p.string()}, {{"REPLICA_TEST_MARK", mark}}, 90);
    injector.stop();
    victim = injector.victim();
  }
  ASSERT_GT(victim, 0) << r;
  EXPECT_NE(r.exit_code, 0) << r;
  EXPECT_FALSE(r.timed_out);
  EXPECT_NE(r.err.find("rank 0: collective timeout: "), std::string::npos) << r;
  EXPECT_NE(r.err.find("last collective completed by each rank: rank 0: #"), std::string::npos) << r;
  EXPECT_NE(r.err.find("not in this collective: rank 1 (hung, stopped or dead)"), std::string::npos) << r;
  // Rank 0's error file holds the watchdog's message; the launcher reported it.
  const fs::path record = p / "errors" / "rank-0.restart-0.json";
  ASSERT_TRUE(fs::exists(record)) << r;
  const auto j = nlohmann::json::parse(read_file(record));
  EXPECT_EQ(j.at("rank"), 0);
  EXPECT_NE(j.at("message").get<std::string>().find("collective timeout"), std::string::npos) << j;
  // The stopped worker did not survive the job.
  EXPECT_NE(kill(victim, 0), 0);
}

// ---------------------------------------------------------------------------------------
// mpirun and Slurm: rank, world and master come from their variables.

TEST_F(FaultTolerance, MpirunWorkersMatchTheLauncher) {
  const fs::path cfg = write_config();
  const Model expected = reference(cfg);
  const std::string mpirun = "/usr/bin/mpirun";
  ASSERT_TRUE(fs::exists(mpirun)) << "mpirun is missing: scripts/setup.sh installs openmpi-bin";
  const fs::path p = dir_ / "mpirun";
  const std::string port = std::to_string(free_port());
  const Result r = run_program(mpirun,
                               {"--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "MASTER_ADDR=127.0.0.1",
                                "-x", "MASTER_PORT=" + port, REPLICA_BIN, "--config", cfg.string(), "--project-name",
                                p.string()},
                               {{"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"}},
                               std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_NE(r.err.find("on 2 workers"), std::string::npos) << r;
  const Model got = load_model(p / "final" / "model.safetensors");
  EXPECT_TRUE(bitwise_equal(expected, got)) << "max abs diff " << max_abs_diff(expected, got);
}

TEST_F(FaultTolerance, SlurmWorkersMatchTheLauncher) {
  const fs::path cfg = write_config();
  const Model expected = reference(cfg);
  const fs::path p = dir_ / "slurm";
  const std::string port = std::to_string(free_port());
  // Two tasks of one job step as srun starts them; the master is the first host of the
  // node list (127.0.0.[1-2] -> 127.0.0.1), MASTER_PORT as sbatch scripts export it.
  std::vector<Result> results(2);
  std::vector<std::thread> tasks;
  for (int rank = 0; rank < 2; ++rank) {
    tasks.emplace_back([&, rank] {
      results[rank] = replica({"--config", cfg.string(), "--project-name", p.string()},
                              {{"SLURM_PROCID", std::to_string(rank)},
                               {"SLURM_LOCALID", std::to_string(rank)},
                               {"SLURM_NTASKS", "2"},
                               {"SLURM_NTASKS_PER_NODE", "2"},
                               {"SLURM_NODEID", "0"},
                               {"SLURM_NODELIST", "127.0.0.[1-2]"},
                               {"MASTER_PORT", port}});
    });
  }
  for (auto& t : tasks) t.join();
  ASSERT_EQ(results[0].exit_code, 0) << results[0];
  ASSERT_EQ(results[1].exit_code, 0) << results[1];
  EXPECT_NE(results[0].err.find("on 2 workers"), std::string::npos) << results[0];
  const Model got = load_model(p / "final" / "model.safetensors");
  EXPECT_TRUE(bitwise_equal(expected, got)) << "max abs diff " << max_abs_diff(expected, got);
}

// ---------------------------------------------------------------------------------------
// Two nodes for real: two network namespaces joined by a veth pair, one launcher in each.

// Runs `ip ARGS...`; returns its output on failure (empty on success).
std::string ip(const std::vector<std::string>& args) {
  const Result r = run_program("/usr/sbin/ip", args, {}, std::chrono::seconds(20));
  return r.exit_code == 0 ? std::string() : "ip failed (exit " + std::to_string(r.exit_code) + "): " + r.all();
}

// Two namespaces and the veth pair between them; deleted (with the pair) however the test ends.
class NamespacePair {
 public:
  NamespacePair() {
    const std::string tag = std::to_string(getpid() % 100000);
    ns_ = {"rpl" + tag + "a", "rpl" + tag + "b"};
    dev_ = {"rpl" + tag + "a", "rpl" + tag + "b"};
    const int subnet = 16 + getpid() % 200;
    addr_ = {"10.231." + std::to_string(subnet) + ".1", "10.231." + std::to_string(subnet) + ".2"};
    for (const auto& ns : ns_) {
      if ((error_ = ip({"netns", "add", ns})).empty()) created_.push_back(ns);
      else return;
    }
    const std::vector<std::vector<std::string>> steps = {
        {"link", "add", dev_[0], "netns", ns_[0], "type", "veth", "peer", "name", dev_[1], "netns", ns_[1]},
        {"-n", ns_[0], "addr", "add", addr_[0] + "/24", "dev", dev_[0]},
        {"-n", ns_[1], "addr", "add", addr_[1] + "/24", "dev", dev_[1]},
        {"-n", ns_[0], "link", "set", dev_[0], "up"},
        {"-n", ns_[1], "link", "set", dev_[1], "up"},
        {"-n", ns_[0], "link", "set", "lo", "up"},
        {"-n", ns_[1], "link", "set", "lo", "up"},
    };
    for (const auto& step : steps) {
      if (!(error_ = ip(step)).empty()) return;
    }
  }
  ~NamespacePair() {
    for (const auto& ns : created_) ip({"netns", "del", ns});
  }
  bool ok() const { return error_.empty(); }
  // Why the namespaces could not be made (`ip netns add` refused) or set up.
  const std::string& error() const { return error_; }
  bool namespaces_refused() const { return created_.size() < 2; }

  std::vector<std::string> ns_, dev_, addr_;

 private:
  std::vector<std::string> created_;
  std::string error_;
};

TEST_F(FaultTolerance, TwoNodesInTwoNetworkNamespacesMatchOneNode) {
  NamespacePair net;
  if (net.namespaces_refused()) GTEST_SKIP() << "network namespaces cannot be created here: " << net.error();
  ASSERT_TRUE(net.ok()) << net.error();

  // Plain DDP on both sides: on one host shard_optimizer would be on by default, and its
  // averaging inside the reduce-scatter rounds differently from Gloo's all-reduce (1 ulp).
  const fs::path cfg = write_config({{"shard_optimizer", "false"}});
  const Model expected = reference(cfg);
  const fs::path p = dir_ / "two-nodes";
  const std::string port = std::to_string(free_port());
  std::vector<Result> results(2);
  std::vector<std::thread> nodes;
  for (int node = 0; node < 2; ++node) {
    nodes.emplace_back([&, node] {
      results[node] = run_program(
          "/usr/sbin/ip",
          {"netns", "exec", net.ns_[node], REPLICA_BIN, "launch", "--nnodes", "2", "--node-rank",
           std::to_string(node), "--nproc-per-node", "1", "--master-addr", net.addr_[0], "--master-port", port,
           "--iface", net.dev_[node], "--", REPLICA_BIN, "--config", cfg.string(), "--project-name", p.string()},
          {}, std::chrono::seconds(120));
    });
  }
  for (auto& t : nodes) t.join();
  ASSERT_EQ(results[0].exit_code, 0) << results[0];
  ASSERT_EQ(results[1].exit_code, 0) << results[1];
  EXPECT_NE(results[0].err.find("on 2 workers"), std::string::npos) << results[0];
  const Model got = load_model(p / "final" / "model.safetensors");
  // Across nodes the all-reduce is Gloo's, on one node shared memory: a sum of two values is
  // the same either way, so the parameters agree exactly.
  EXPECT_LE(max_abs_diff(expected, got), 0.0) << "max abs diff " << max_abs_diff(expected, got);
}

}  // namespace
