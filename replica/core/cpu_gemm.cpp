#include "replica/core/cpu_gemm.h"

#include "replica/core/error.h"
#include "replica/core/system.h"

#include <ATen/Parallel.h>

#include <dlfcn.h>

#include <algorithm>
#include <climits>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace replica {
namespace {

// cblas.h's values (the CBLAS standard's), so that no OpenBLAS header is needed to build.
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
using CblasSgemm = void (*)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a,
                            int lda, const float* b, int ldb, float beta, float* c, int ldc);
using OpenblasConfig = char* (*)();

// "GenuineIntel", "AuthenticAMD", ...; "" off x86.
std::string cpu_vendor() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return {};
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  return vendor;
#else
  return {};
#endif
}

struct Choice {
  CblasSgemm sgemm = nullptr;  // set: OpenBLAS takes the model layers' GEMMs
  std::string description;
};

// Debian's single-threaded OpenBLAS (libopenblas0-serial), wherever the multiarch folder is.
void* open_serial_openblas(std::string& tried) {
  if (auto path = env("REPLICA_OPENBLAS")) {
    tried = *path;
    return dlopen(path->c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
  }
  for (const char* dir : {"/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"}) {
    const std::string path = std::string(dir) + "/openblas-serial/libopenblas.so.0";
    if (void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND)) {
      tried = path;
      return handle;
    }
  }
  tried = "openblas-serial/libopenblas.so.0 (Debian's libopenblas0-serial)";
  return nullptr;
}

Choice decide() {
  Choice choice;
  const std::string asked = env("REPLICA_CPU_GEMM").value_or("auto");
  if (asked != "auto" && asked != "openblas" && asked != "aten") {
    fail("REPLICA_CPU_GEMM={}: expected auto, openblas or aten", asked);
  }
  const std::string vendor = cpu_vendor();
  std::string why;
  if (asked == "aten") {
    choice.description = "LibTorch (MKL) (REPLICA_CPU_GEMM=aten)";
    return choice;
  }
  if (asked == "auto") {
    if (vendor.empty() || vendor == "GenuineIntel") {
      choice.description = "LibTorch (MKL) (auto: " + (vendor.empty() ? std::string("not an x86 CPU") : vendor) + ")";
      return choice;
    }
    why = "auto: " + vendor;
  } else {
    why = "REPLICA_CPU_GEMM=openblas";
  }
  std::string tried;
  void* handle = open_serial_openblas(tried);
  auto sgemm = handle ? reinterpret_cast<CblasSgemm>(dlsym(handle, "cblas_sgemm")) : nullptr;
  if (!sgemm) {
    if (asked == "openblas") {
      fail("REPLICA_CPU_GEMM=openblas: cannot load cblas_sgemm from {} ({}); install libopenblas0-serial or set "
           "REPLICA_OPENBLAS to a libopenblas.so",
           tried, handle ? "no such symbol" : dlerror());
    }
    choice.description = "LibTorch (MKL) (" + why + ", no " + tried + ")";
    return choice;
  }
  choice.sgemm = sgemm;
  auto config = reinterpret_cast<OpenblasConfig>(dlsym(handle, "openblas_get_config"));
  choice.description = (config ? std::string(config()) : std::string("OpenBLAS")) + " from " + tried + " (" + why + ")";
  return choice;
}

const Choice& choice() {
  static const Choice c = decide();
  return c;
}

}  // namespace

bool cpu_gemm_is_openblas() { return choice().sgemm != nullptr; }

std::string cpu_gemm_description() { return choice().description; }

void cpu_sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const auto sgemm = choice().sgemm;
  if (!sgemm) fail("cpu_sgemm: OpenBLAS is not in use ({})", cpu_gemm_description());
  for (int64_t v : {m, n, k, lda, ldb, ldc}) {
    if (v > INT_MAX) fail("cpu_sgemm: {} x {} x {} does not fit OpenBLAS's 32-bit sizes", m, n, k);
  }
  if (m == 0 || n == 0) return;
  auto call = [&](int64_t rows, int64_t cols, const float* pa, const float* pb, float* pc) {
    sgemm(kRowMajor, trans_a ? kTrans : kNoTrans, trans_b ? kTrans : kNoTrans, static_cast<int>(rows),
          static_cast<int>(cols), static_cast<int>(k), 1.0f, pa, static_cast<int>(lda), pb, static_cast<int>(ldb), beta,
          pc, static_cast<int>(ldc));
  };
  const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  // Blocks of at least 64 rows (or columns): below that a block's packing costs more than a
  // thread saves.
  const bool by_rows = m >= n;
  const int64_t extent = by_rows ? m : n;
  const int64_t parts = std::min<int64_t>(threads, std::max<int64_t>(1, extent / 64));
  if (parts <= 1) {
    call(m, n, a, b, c);
    return;
  }
  const int64_t block = (extent + parts - 1) / parts;
  at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const int64_t start = p * block, len = std::min(block, extent - start);
      if (len <= 0) continue;
      if (by_rows) {
        // Rows of op(A): rows of A, or columns when A is stored transposed.
        call(len, n, trans_a ? a + start : a + start * lda, b, c + start * ldc);
      } else {
        call(m, len, a, trans_b ? b + start * ldb : b + start, c + start);
      }
    }
  });
}

}  // namespace replica
