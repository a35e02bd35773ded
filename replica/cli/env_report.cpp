#include "replica/cli/env_report.h"

#include "replica/core/cpu_gemm.h"
#include "replica/core/cuda.h"
#include "replica/core/system.h"
#include "replica/distributed/process_group.h"
#include "replica/distributed/shm_allreduce.h"
#include "replica/models/fused_ops.h"
#include "replica/models/varlen_attention.h"
#include "replica/models/linear.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/version.h>
#include <fmt/format.h>

#include <arpa/inet.h>
#include <climits>
#include <dlfcn.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <sys/statvfs.h>
#include <sys/sysinfo.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <set>
#include <thread>

extern char** environ;

namespace replica::cli {
namespace {

// Every file mapped into this process: which libraries the dynamic loader actually picked.
std::set<std::string> mapped_files() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  std::set<std::string> seen;
  while (std::getline(maps, line)) {
    auto slash = line.find('/');
    if (slash != std::string::npos) seen.insert(line.substr(slash));
  }
  return seen;
}

std::string mapped_library(const std::set<std::string>& files, const std::string& name) {
  for (const auto& f : files) {
    const auto base = f.substr(f.rfind('/') + 1);
    if (base.rfind(name, 0) == 0) return f;
  }
  return {};
}

// Variables that shape a distributed run, for the report; secrets are shown as "(set)".
bool is_relevant_variable(const std::string& name) {
  static const char* exact[] = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "LD_PRELOAD"};
  for (const char* e : exact) {
    if (name == e) return true;
  }
  for (const char* prefix : {"MASTER_", "REPLICA_", "TORCHELASTIC_", "OMP_", "MKL_", "OPENBLAS_", "GOTO_",
                             "NCCL_", "GLOO_", "TP_SOCKET_", "CUDA_", "TORCH_", "OMPI_COMM_WORLD_", "PMI_",
                             "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_NODELIST"}) {
    if (name.rfind(prefix, 0) == 0) return true;
  }
  return false;
}

bool is_secret(const std::string& name) {
  for (const char* word : {"TOKEN", "SECRET", "PASSWORD", "KEY"}) {
    if (name.find(word) != std::string::npos) return true;
  }
  return false;
}

nlohmann::json network_interfaces() {
  nlohmann::json out = nlohmann::json::array();
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return out;
  std::map<std::string, nlohmann::json> by_name;
  for (ifaddrs* a = list; a; a = a->ifa_next) {
    auto& j = by_name[a->ifa_name];
    if (j.is_null()) {
      j = {{"name", a->ifa_name}, {"up", (a->ifa_flags & IFF_UP) != 0}, {"loopback", (a->ifa_flags & IFF_LOOPBACK) != 0},
           {"addresses", nlohmann::json::array()}};
    }
    if (!a->ifa_addr) continue;
    char text[INET6_ADDRSTRLEN] = {};
    if (a->ifa_addr->sa_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof(text));
      j["addresses"].push_back(text);
    } else if (a->ifa_addr->sa_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr, text, sizeof(text));
      j["addresses"].push_back(text);
    }
  }
  freeifaddrs(list);
  for (auto& [name, j] : by_name) out.push_back(j);
  return out;
}

}  // namespace

BlasInfo loaded_blas() {
  auto classify = [](const std::string& path) -> std::string {
    if (path.find("openblas") != std::string::npos) return "openblas";
    if (path.find("mkl") != std::string::npos) return "mkl";
    if (path.find("blis") != std::string::npos) return "blis";
    if (path.find("/blas/") != std::string::npos || path.find("libblas") != std::string::npos) return "reference";
    return "unknown";
  };
  // The library that LibTorch's BLAS calls resolve to: where the global symbol sgemm_ lives
  // (other BLAS libraries may be mapped too, e.g. OpenBLAS pulled in by LAPACK, unused).
  if (void* sgemm = dlsym(RTLD_DEFAULT, "sgemm_")) {
    Dl_info info{};
    if (dladdr(sgemm, &info) != 0 && info.dli_fname) {
      char resolved[PATH_MAX];
      const std::string path = realpath(info.dli_fname, resolved) ? resolved : info.dli_fname;
      // PyTorch's wheels link MKL statically into libtorch_cpu.so: sgemm_ lives there, and the
      // loader's choice of libblas cannot change what LibTorch uses.
      if (classify(path) == "unknown" && at::hasMKL()) return {"MKL, statically linked into " + path, "mkl"};
      return {path, classify(path)};
    }
  }
  // No sgemm_ visible: the mapped files show which alternative the loader picked.
  BlasInfo info{"", "unknown"};
  for (const auto& p : mapped_files()) {
    if (p.find("blas") == std::string::npos && p.find("mkl") == std::string::npos &&
        p.find("blis") == std::string::npos) {
      continue;
    }
    if (info.name == "unknown" || classify(p) == "openblas") info = {p, classify(p)};
  }
  return info;
}

std::string env_report(bool json) {
  utsname uts{};
  uname(&uts);
  const BlasInfo blas = loaded_blas();
  const auto files = mapped_files();
  const bool cuda = torch::cuda::is_available();
  const std::string nccl_lib = mapped_library(files, "libnccl");
  const std::string mpi_lib = mapped_library(files, "libmpi");
  struct statvfs shm {};
  const bool shm_ok = access("/dev/shm", W_OK) == 0 && statvfs("/dev/shm", &shm) == 0;
  const double shm_free_gb = shm_ok ? double(shm.f_bavail) * double(shm.f_frsize) / 1e9 : 0;
  struct sysinfo si {};
  sysinfo(&si);
  const double memory_gb = double(si.totalram) * si.mem_unit / 1e9;

  nlohmann::json backends = {
      {"gloo", {{"available", true}, {"detail", "LibTorch c10d ProcessGroupGloo (CPU, across hosts)"}}},
      {"nccl", {{"available", cuda && !nccl_lib.empty()},
                {"detail", cuda ? (nccl_lib.empty() ? "CUDA present but libnccl is not loaded" : nccl_lib)
                                : "no CUDA in this LibTorch or no GPU visible"}}},
      {"mpi", {{"available", !mpi_lib.empty()},
               {"detail", mpi_lib.empty() ? "LibTorch was built without MPI (libmpi not loaded)" : mpi_lib}}},
      {"shm", {{"available", shm_ok},
               {"detail", shm_ok ? fmt::format("replica shared-memory transport (one host), /dev/shm {:.1f} GB free",
                                               shm_free_gb)
                                 : "/dev/shm is not writable"}}},
  };
  nlohmann::json devices = nlohmann::json::array();
  for (const GpuInfo& g : visible_gpus()) {
    devices.push_back({{"index", g.index},
                       {"name", g.name},
                       {"memory_gb", double(g.total_memory) / 1e9},
                       {"compute_capability", fmt::format("{}.{}", g.major, g.minor)}});
  }
  nlohmann::json gpus = {{"cuda_available", cuda},
                         {"device_count", visible_gpu_count()},
                         {"devices", devices},
                         {"cuda_runtime", cuda_runtime_version()},
                         {"cuda_driver", cuda_driver_version()},
                         {"nccl", distributed::nccl_version()},
                         {"CUDA_VISIBLE_DEVICES", env("CUDA_VISIBLE_DEVICES").value_or("(unset)")}};
  nlohmann::json vars = nlohmann::json::object();
  for (char** e = environ; *e; ++e) {
    const std::string entry(*e);
    const auto eq = entry.find('=');
    const std::string name = entry.substr(0, eq);
    if (!is_relevant_variable(name)) continue;
    vars[name] = is_secret(name) ? std::string("(set, hidden)") : entry.substr(eq + 1);
  }
  std::vector<std::string> warnings;
  if (blas.name == "reference") {
    warnings.push_back("LibTorch is using the REFERENCE BLAS (" + blas.path +
                       "), which is about 15x slower for training: install OpenBLAS "
                       "(apt-get install libopenblas0-pthread) or select it with update-alternatives "
                       "--config libblas.so.3-x86_64-linux-gnu");
  } else if (blas.name == "unknown") {
    warnings.push_back("no BLAS library is mapped into this process: cannot tell which one LibTorch uses");
  }
  if (!env("OMP_NUM_THREADS") && at::get_num_threads() > usable_cores()) {
    warnings.push_back("more intra-op threads than usable cores: set OMP_NUM_THREADS");
  }

  nlohmann::json j = {
      {"replica_version", REPLICA_VERSION},
      {"libtorch_version", TORCH_VERSION},
      {"os", fmt::format("{} {} {}", uts.sysname, uts.release, uts.machine)},
      {"hostname", uts.nodename},
      {"cpu", {{"online_cpus", static_cast<int>(std::thread::hardware_concurrency())},
               {"usable_cores", usable_cores()},
               {"torch_intra_op_threads", at::get_num_threads()},
               {"torch_inter_op_threads", at::get_num_interop_threads()}}},
      {"memory_gb", memory_gb},
      {"blas", {{"name", blas.name}, {"path", blas.path}}},
      {"model_layer_gemm", cpu_gemm_description()},
      {"backends", backends},
      {"gpus", gpus},
      {"network_interfaces", network_interfaces()},
      {"environment", vars},
      {"warnings", warnings},
      // Training backends (params.distributed_backend); a run's log names the one it used and
      // the per-worker memory of its model state.
      {"distributed_backends", {"ddp", "zero3"}},
  };
  if (json) return j.dump(2) + "\n";

  std::string out;
  for (const auto& w : warnings) {
    out += "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n";
    out += "WARNING: " + w + "\n";
    out += "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n";
  }
  out += fmt::format("replica version:     {}\n", REPLICA_VERSION);
  out += fmt::format("LibTorch version:    {}\n", TORCH_VERSION);
  out += fmt::format("OS:                  {} ({})\n", j["os"].get<std::string>(), uts.nodename);
  out += fmt::format("CPUs:                {} online, {} usable by this process\n",
                     std::thread::hardware_concurrency(), usable_cores());
  out += fmt::format("torch threads:       {} intra-op, {} inter-op\n", at::get_num_threads(),
                     at::get_num_interop_threads());
  out += fmt::format("memory:              {:.1f} GB\n", memory_gb);
  out += fmt::format("BLAS:                {} ({}){}\n", blas.name, blas.path.empty() ? "not found" : blas.path,
                     blas.name == "reference" ? "  <-- SLOW, see the warning" : "");
  out += fmt::format("model layers' GEMM:  {}\n", cpu_gemm_description());
  // The other paths picked from the CPU (docs/code-paths.md lists each and how to force it).
  out += fmt::format("bf16 CPU GEMMs:      {} (REPLICA_CPU_BF16_GEMM=fp32|aten forces)\n",
                     models::cpu_bf16_through_fp32() ? "through the fp32 GEMM" : "ATen's bf16 kernels");
  out += fmt::format("fp16 CPU GEMMs:      {} (REPLICA_CPU_FP16_GEMM=fp32|aten forces)\n",
                     models::cpu_fp16_through_fp32() ? "through the fp32 GEMM" : "ATen's fp16 kernels");
  out += fmt::format("fused CPU kernels:   {} (REPLICA_FUSED_KERNELS=0 turns off)\n",
                     !models::fused_cpu_kernels_available() ? "no (needs AVX2 and FMA)"
                     : models::fused_kernels_for(at::zeros({1})) ? "yes (AVX2 + FMA)"
                                                                     : "off");
  out += fmt::format("packed attention:    {} (REPLICA_PACKED_ATTENTION=varlen|mask forces)\n",
                     models::packed_attention_mode() == models::PackedAttentionMode::kAuto
                         ? "auto (CUDA: flash varlen in fp16/bf16, else the mask; CPU: a loop over segments)"
                         : models::to_string(models::packed_attention_mode()));
  out += fmt::format("shm reduce kernels:  {} (REPLICA_SHM_REDUCE=portable|avx2|avx512 forces)\n",
                     distributed::shm_reduce_kernels_name(distributed::shm_reduce_kernels()));
  out += "backends:\n";
  for (const char* b : {"gloo", "nccl", "mpi", "shm"}) {
    out += fmt::format("  {:<5} {:<4} {}\n", b, backends[b]["available"].get<bool>() ? "yes" : "no",
                       backends[b]["detail"].get<std::string>());
  }
  out += "training backends:   ddp (default), zero3 (also spelled deepspeed)\n";
  out += fmt::format("GPUs:                {} (CUDA {}; CUDA_VISIBLE_DEVICES={})\n", gpus["device_count"].get<int>(),
                     cuda ? "available" : "not available", gpus["CUDA_VISIBLE_DEVICES"].get<std::string>());
  for (const auto& d : devices) {
    out += fmt::format("  cuda:{} {}, {:.1f} GB, compute capability {}\n", d["index"].get<int>(),
                       d["name"].get<std::string>(), d["memory_gb"].get<double>(),
                       d["compute_capability"].get<std::string>());
  }
  auto or_none = [](const std::string& v) { return v.empty() ? std::string("none") : v; };
  out += fmt::format("CUDA runtime:        {} (driver {}); NCCL {}\n", or_none(cuda_runtime_version()),
                     or_none(cuda_driver_version()), or_none(distributed::nccl_version()));
  out += "network interfaces:\n";
  for (const auto& n : j["network_interfaces"]) {
    std::string addresses;
    for (const auto& a : n["addresses"]) addresses += (addresses.empty() ? "" : ", ") + a.get<std::string>();
    out += fmt::format("  {:<10} {:<4} {}\n", n["name"].get<std::string>(), n["up"].get<bool>() ? "up" : "down",
                       addresses.empty() ? "(no address)" : addresses);
  }
  out += "environment:\n";
  if (vars.empty()) out += "  (no distributed or threading variables set)\n";
  for (auto& [k, v] : vars.items()) out += fmt::format("  {}={}\n", k, v.get<std::string>());
  return out;
}

}  // namespace replica::cli
