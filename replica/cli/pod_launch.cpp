// Kubernetes: a run started in a PyTorchJob pod (Note [PyTorchJob pods] in pod_launch.h).
#include "replica/cli/pod_launch.h"

#include "replica/core/error.h"
#include "replica/core/system.h"
#include "replica/launch/launcher.h"
#include "replica/train/engine.h"
#include "replica/train/keys.h"
#include "replica/train/workload.h"

#include <spdlog/spdlog.h>

#include <filesystem>
#include <limits>

#include <unistd.h>

namespace fs = std::filesystem;

namespace replica::cli {
namespace {

// The first of the variables that is set.
std::optional<std::string> first_env(const char* a, const char* b) {
  if (auto v = env(a)) return v;
  return env(b);
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

}  // namespace

std::optional<int> torchrun_env_int(const char* name) {
  const auto text = env(name);
  if (!text) return std::nullopt;
  const auto value = train::parse_int(*text);
  if (!value || *value < 0 || *value > std::numeric_limits<int>::max()) {
    if (std::string(name) == "PET_NNODES") {
      fail("PET_NNODES='{}' is not a number of pods (an elastic range such as 1:4 is not supported: give the "
           "PyTorchJob a fixed number of replicas and no elasticPolicy)", *text);
    }
    fail("environment variable {}='{}' is not a non-negative integer", name, *text);
  }
  return static_cast<int>(*value);
}

std::optional<int> run_in_pytorchjob_pod(const train::RunConfig& config, const std::vector<std::string>& self_argv) {
  if (!env("PET_NNODES") || env("LOCAL_RANK")) return std::nullopt;
  const auto nnodes = torchrun_env_int("PET_NNODES");
  if (*nnodes < 1) fail("PET_NNODES='{}' is not a number of pods", *nnodes);
  const auto node_rank = torchrun_env_int("PET_NODE_RANK");
  if (!node_rank) fail("PET_NNODES is set but PET_NODE_RANK is not: this pod does not know its index");
  const auto master_addr = first_env("PET_MASTER_ADDR", "MASTER_ADDR");
  const auto master_port = first_env("PET_MASTER_PORT", "MASTER_PORT");
  if (!master_addr || !master_port) {
    fail("PET_NNODES is set but neither PET_MASTER_ADDR/PET_MASTER_PORT nor MASTER_ADDR/MASTER_PORT is: "
         "the pods cannot find the master");
  }
  const auto port = train::parse_int(*master_port);
  if (!port || *port < 1 || *port > 65535) fail("MASTER_PORT='{}' is not a TCP port (1..65535)", *master_port);

  train::check_workload_config(config);  // what can be refused before any worker starts
  const int gpus = train::gpus_for(config.params.device);
  std::string nproc = env("PET_NPROC_PER_NODE").value_or("auto");
  if (nproc == "auto" && config.params.nproc_per_node > 0) nproc = std::to_string(config.params.nproc_per_node);

  launch::LaunchOptions opts;
  opts.nnodes = static_cast<int>(*nnodes);
  opts.node_rank = static_cast<int>(*node_rank);
  opts.nproc_per_node = launch::resolve_nproc(nproc, gpus);
  opts.master_addr = *master_addr;
  // Some operators (and the older pytorch-operator) give the master pod MASTER_ADDR=localhost,
  // fine for a store that listens everywhere; replica's listens on MASTER_ADDR only, so the
  // master pod listens on its own host name (its pod IP), where the other pods arrive.
  if (opts.node_rank == 0 && opts.nnodes > 1 && is_loopback(opts.master_addr)) {
    char host[256] = {};
    if (gethostname(host, sizeof host - 1) == 0 && host[0] != '\0') opts.master_addr = host;
  }
  opts.master_port = static_cast<int>(*port);
  opts.max_restarts = config.params.max_restarts;
  opts.threads_per_worker = config.params.threads_per_worker;
  opts.error_dir = (fs::path(config.project_name) / "errors").string();
  opts.command = self_argv;
  opts.token = config.params.token;
  spdlog::info("PyTorchJob pod {} of {}: {} worker(s) here, master {}:{} (PET_* of the training operator)",
               opts.node_rank, opts.nnodes, opts.nproc_per_node, opts.master_addr, opts.master_port);
  return launch::run(opts);
}

}  // namespace replica::cli
