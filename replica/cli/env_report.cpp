#include "replica/cli/env_report.h"

#include "replica/core/system.h"

#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/version.h>
#include <fmt/format.h>

#include <fstream>
#include <set>
#include <sys/utsname.h>

namespace replica::cli {

BlasInfo loaded_blas() {
  // The mapped files show which alternative the dynamic loader actually picked.
  std::ifstream maps("/proc/self/maps");
  std::string line;
  std::set<std::string> seen;
  while (std::getline(maps, line)) {
    auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    std::string path = line.substr(slash);
    if (path.find("blas") == std::string::npos && path.find("mkl") == std::string::npos &&
        path.find("blis") == std::string::npos) {
      continue;
    }
    seen.insert(path);
  }
  BlasInfo info{"", "unknown"};
  for (const auto& p : seen) {
    if (p.find("openblas") != std::string::npos) return {p, "openblas"};
    if (p.find("mkl") != std::string::npos) info = {p, "mkl"};
    else if (p.find("blis") != std::string::npos) info = {p, "blis"};
    else if (p.find("/blas/") != std::string::npos && info.name == "unknown") info = {p, "reference"};
    else if (info.path.empty()) info.path = p;
  }
  return info;
}

std::string env_report(bool json) {
  utsname uts{};
  uname(&uts);
  const BlasInfo blas = loaded_blas();
  const bool cuda = torch::cuda::is_available();
  nlohmann::json j = {
      {"replica_version", REPLICA_VERSION},
      {"libtorch_version", TORCH_VERSION},
      {"os", fmt::format("{} {} {}", uts.sysname, uts.release, uts.machine)},
      {"usable_cores", usable_cores()},
      {"torch_threads", at::get_num_threads()},
      {"blas", {{"name", blas.name}, {"path", blas.path}}},
      {"backends", {{"gloo", true}, {"nccl", cuda}, {"mpi", false}, {"cuda", cuda}}},
      {"cuda_devices", cuda ? static_cast<int>(torch::cuda::device_count()) : 0},
      // Training backends (params.distributed_backend); a run's log names the one it used and,
      // for zero3, the per-worker memory of its model state.
      {"distributed_backends", {"ddp", "zero3"}},
  };
  nlohmann::json vars = nlohmann::json::object();
  for (const char* v : {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                        "GROUP_RANK", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME",
                        "REPLICA_RDZV_TIMEOUT", "REPLICA_RESTART_COUNT", "OMPI_COMM_WORLD_RANK",
                        "SLURM_PROCID", "SLURM_NTASKS"}) {
    if (auto value = env(v)) vars[v] = *value;
  }
  j["environment"] = vars;
  if (json) return j.dump(2) + "\n";

  std::string out;
  out += fmt::format("replica version:   {}\n", REPLICA_VERSION);
  out += fmt::format("LibTorch version:  {}\n", TORCH_VERSION);
  out += fmt::format("OS:                {}\n", j["os"].get<std::string>());
  out += fmt::format("usable cores:      {}\n", usable_cores());
  out += fmt::format("torch threads:     {}\n", at::get_num_threads());
  out += fmt::format("BLAS:              {} ({})\n", blas.name, blas.path.empty() ? "not found" : blas.path);
  out += fmt::format("backends:          gloo yes, nccl {}, mpi no, cuda {}\n", cuda ? "yes" : "no",
                     cuda ? fmt::format("yes ({} devices)", j["cuda_devices"].get<int>()) : "no");
  out += "training backends: ddp (default), zero3 (also spelled deepspeed)\n";
  out += "environment:\n";
  if (vars.empty()) out += "  (no distributed variables set)\n";
  for (auto& [k, v] : vars.items()) out += fmt::format("  {}={}\n", k, v.get<std::string>());
  if (blas.name == "reference") {
    out += "WARNING: LibTorch is using the reference BLAS, which is ~15x slower: install "
           "libopenblas0-pthread (apt-get install libopenblas0-pthread)\n";
  }
  return out;
}

}  // namespace replica::cli
