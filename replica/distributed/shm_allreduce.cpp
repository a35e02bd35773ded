// Shared-memory all-reduce: segments, barriers, failure detection and the summing kernels.
#include "replica/distributed/shm_allreduce.h"

#include "replica/core/error.h"
#include "replica/distributed/process_group.h"

#include <c10/util/Half.h>
#include <fcntl.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

namespace replica::distributed {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kMagic = 0x314d4853'4c504552ULL;  // "REPLSHM1"
constexpr std::uint32_t kVersion = 2;
constexpr std::size_t kPage = 4096;
constexpr std::size_t kSmallBytes = std::size_t{1} << 20;  // naive algorithm up to this size
// Bytes per step of the in-place (alloc()'ed) algorithm: small enough that a chunk one rank
// has just reduced is still in its cache when the others gather it (measured best at 1 MiB
// on 2 cores with 2 MiB L2 each); a tensor that fits the shared L3 twice over goes in one step.
constexpr std::size_t kDirectStepBytes = std::size_t{1} << 20;
constexpr std::size_t kDirectWholeBytes = std::size_t{8} << 20;
constexpr std::size_t kChunkAlignBytes = 64;  // chunk boundaries fall on cache lines
constexpr auto kPollInterval = std::chrono::milliseconds(20);
constexpr auto kSpinTime = std::chrono::microseconds(50);

enum State : std::uint32_t { kRunning = 0, kFailed = 1, kClosed = 2 };

// What a rank is about to do; peers compare it with their own after the first barrier.
enum Op : std::int32_t { kAllreduce = 0, kReduceScatter = 1, kAllGather = 2, kBarrier = 3 };
const char* op_name(std::int32_t op) {
  return op == kReduceScatter ? "reduce-scatter"
         : op == kAllGather   ? "all-gather"
         : op == kBarrier     ? "barrier"
                              : "all-reduce";
}

struct OpDesc {
  std::uint64_t collective;
  std::int64_t numel;
  std::int32_t dtype;
  std::int32_t in_place;  // 1: alloc()'ed memory at (region, offset)
  std::int64_t region;
  std::int64_t offset;
  std::int32_t op;        // Op
};

// First page of each rank's control segment; written by its owner, read by everyone.
struct Header {
  std::uint64_t magic;
  std::uint32_t version;
  std::int32_t pid;
  std::int32_t local_rank;
  std::int32_t local_size;
  std::uint64_t slice_bytes;
  // Barrier counter: the owner stores the number of barriers it has arrived at, then bumps the
  // futex word and wakes it if anyone sleeps on it.
  alignas(64) std::atomic<std::uint64_t> epoch;
  std::atomic<std::uint32_t> futex;
  std::atomic<std::uint32_t> waiters;
  alignas(64) std::atomic<std::uint32_t> state;
  char reason[512];
  alignas(64) OpDesc desc[2];  // indexed by collective parity
};
static_assert(sizeof(Header) <= kPage, "header must fit its page");
static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "needs address-free atomics");
static_assert(std::atomic<std::uint32_t>::is_always_lock_free, "needs address-free atomics");
static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t), "futex word");

std::size_t round_up(std::size_t x, std::size_t to) { return (x + to - 1) / to * to; }

void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, Clock::duration d) {
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
  if (ns < 0) ns = 0;
  timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
  // Shared (not FUTEX_PRIVATE): the word lives in memory mapped by several processes.
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<std::uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Gone, or a zombie nobody has reaped yet (its parent may be the rank waiting for it).
bool process_dead(pid_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) == 0 || errno != ESRCH) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(stat, line)) return false;
    auto paren = line.rfind(')');
    if (paren == std::string::npos || paren + 2 >= line.size()) return false;
    char state = line[paren + 2];
    return state == 'Z' || state == 'X';
  }
  return true;
}

std::string dtype_name(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float: return "float32";
    case c10::ScalarType::BFloat16: return "bfloat16";
    case c10::ScalarType::Half: return "float16";
    case c10::ScalarType::Double: return "float64";
    default: return std::string(c10::toString(dtype));
  }
}
std::string dtype_name(std::int32_t dtype) { return dtype_name(static_cast<c10::ScalarType>(dtype)); }

double seconds(std::chrono::milliseconds ms) { return ms.count() / 1000.0; }

std::string sanitize(const std::string& s) {
  std::string out;
  for (char c : s) out += (std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.') ? c : '_';
  if (out.size() > 120) out.resize(120);
  return out;
}

// ---- segments -----------------------------------------------------------------------------

// One mapping of a POSIX shared-memory object, owned (created, unlinked) by this rank or not.
struct Mapping {
  void* addr = nullptr;
  std::size_t bytes = 0;
  std::string name;
  bool linked = false;  // created here and not unlinked yet

  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  Mapping(Mapping&& o) noexcept { *this = std::move(o); }
  Mapping& operator=(Mapping&& o) noexcept {
    std::swap(addr, o.addr);
    std::swap(bytes, o.bytes);
    std::swap(name, o.name);
    std::swap(linked, o.linked);
    return *this;
  }
  ~Mapping() {
    unlink();
    if (addr != nullptr) munmap(addr, bytes);
  }
  void unlink() {
    if (linked) shm_unlink(name.c_str());
    linked = false;
  }
  char* data() const { return static_cast<char*>(addr); }
};

std::atomic<std::uint64_t> g_segment_counter{0};

Mapping create_segment(const std::string& job, int rank, std::size_t bytes) {
  Mapping m;
  m.name = fmt::format("/replica-{}-{}-{}-{}", getpid(), rank, g_segment_counter.fetch_add(1),
                       job);
  int fd = shm_open(m.name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) fail("shm all-reduce: cannot create shared memory {}: {}", m.name, std::strerror(errno));
  m.linked = true;
  // posix_fallocate reserves the pages now: a full /dev/shm is an error here rather than a
  // SIGBUS at first touch (Docker's default /dev/shm is 64 MB).
  int err = ftruncate(fd, static_cast<off_t>(bytes)) != 0 ? errno : 0;
  if (err == 0) err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err != 0) {
    close(fd);
    fail("shm all-reduce: cannot allocate {} bytes of shared memory for {}: {} (is /dev/shm big "
         "enough? see df -h /dev/shm)", bytes, m.name, std::strerror(err));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    fail("shm all-reduce: cannot map {} bytes of shared memory: {}", bytes, std::strerror(err));
  }
  m.addr = p;
  m.bytes = bytes;
  return m;
}

Mapping open_segment(const std::string& name, std::size_t expected_bytes, int peer) {
  Mapping m;
  m.name = name;
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    fail("shm all-reduce: cannot open local rank {}'s shared memory {}: {}", peer, name,
         std::strerror(errno));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) != expected_bytes) {
    close(fd);
    fail("shm all-reduce: local rank {}'s shared memory {} has {} bytes, expected {} (ranks "
         "disagree on the size)", peer, name, static_cast<long long>(st.st_size), expected_bytes);
  }
  void* p = mmap(nullptr, expected_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    fail("shm all-reduce: cannot map local rank {}'s shared memory: {}", peer, std::strerror(err));
  }
  m.addr = p;
  m.bytes = expected_bytes;
  return m;
}

// ---- kernels ------------------------------------------------------------------------------
// out[i] = (in[0][i] + in[1][i] + ... + in[n-1][i]) / divisor, summed left to right in float32
// and divided before the one rounding to the output type (divisor 1: no division); out may be
// one of the inputs (same index only). n >= 2.

constexpr std::size_t kBlock = 2048;

// Note [the reduction kernels' instruction sets]
// The float32 and bfloat16 sums are written once, as plain loops (the *_body functions, always
// inlined), and compiled three times: for AVX-512, for AVX2 and for any x86-64; float16 has an
// F16C kernel and a portable one. Which one runs is picked once from the CPU (the widest it
// has), or forced with REPLICA_SHM_REDUCE=portable|avx2|avx512 (refused where the CPU lacks the
// instructions), so a machine of one kind still runs the others' paths (tests run every kernel
// the CPU can execute against the portable one, bit for bit: the same additions in the same
// order, only the vector width differs).

__attribute__((always_inline)) inline void reduce_f32_body(float* out, const float* const* in, int n,
                                                           std::size_t count, float divisor) {
  alignas(64) float acc[kBlock];
  for (std::size_t b = 0; b < count; b += kBlock) {
    const std::size_t m = std::min(kBlock, count - b);
    const float* a0 = in[0] + b;
    const float* a1 = in[1] + b;
    for (std::size_t i = 0; i < m; ++i) acc[i] = a0[i] + a1[i];
    for (int p = 2; p < n; ++p) {
      const float* ap = in[p] + b;
      for (std::size_t i = 0; i < m; ++i) acc[i] += ap[i];
    }
    float* o = out + b;
    if (divisor == 1.0f) {
      for (std::size_t i = 0; i < m; ++i) o[i] = acc[i];
    } else {
      for (std::size_t i = 0; i < m; ++i) o[i] = acc[i] / divisor;
    }
  }
}

// float64 (the trainer's loss and sample counts, logged every few steps): summed in float64,
// left to right, so a count stays exact to 2^53.
void reduce_f64(double* out, const double* const* in, int n, std::size_t count, float divisor) {
  for (std::size_t i = 0; i < count; ++i) {
    double acc = in[0][i] + in[1][i];
    for (int p = 2; p < n; ++p) acc += in[p][i];
    out[i] = divisor == 1.0f ? acc : acc / static_cast<double>(divisor);
  }
}

inline float bf16_to_f32(std::uint16_t h) {
  std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// c10::BFloat16's rounding: nearest, ties to even; NaN becomes the canonical quiet NaN.
inline std::uint16_t f32_to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  std::uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? std::uint16_t{0x7FC0} : static_cast<std::uint16_t>(rounded);
}

__attribute__((always_inline)) inline void reduce_bf16_body(std::uint16_t* out, const std::uint16_t* const* in,
                                                            int n, std::size_t count, float divisor) {
  alignas(64) float acc[kBlock];
  for (std::size_t b = 0; b < count; b += kBlock) {
    const std::size_t m = std::min(kBlock, count - b);
    const std::uint16_t* a0 = in[0] + b;
    const std::uint16_t* a1 = in[1] + b;
    for (std::size_t i = 0; i < m; ++i) acc[i] = bf16_to_f32(a0[i]) + bf16_to_f32(a1[i]);
    for (int p = 2; p < n; ++p) {
      const std::uint16_t* ap = in[p] + b;
      for (std::size_t i = 0; i < m; ++i) acc[i] += bf16_to_f32(ap[i]);
    }
    std::uint16_t* o = out + b;
    if (divisor != 1.0f) {
      for (std::size_t i = 0; i < m; ++i) acc[i] /= divisor;
    }
    for (std::size_t i = 0; i < m; ++i) o[i] = f32_to_bf16(acc[i]);
  }
}

void reduce_f32_portable(float* out, const float* const* in, int n, std::size_t count, float divisor) {
  reduce_f32_body(out, in, n, count, divisor);
}
__attribute__((target("avx2"))) void reduce_f32_avx2(float* out, const float* const* in, int n,
                                                          std::size_t count, float divisor) {
  reduce_f32_body(out, in, n, count, divisor);
}
__attribute__((target("avx512f"))) void reduce_f32_avx512(float* out, const float* const* in, int n,
                                                          std::size_t count, float divisor) {
  reduce_f32_body(out, in, n, count, divisor);
}
void reduce_bf16_portable(std::uint16_t* out, const std::uint16_t* const* in, int n, std::size_t count,
                          float divisor) {
  reduce_bf16_body(out, in, n, count, divisor);
}
__attribute__((target("avx2"))) void reduce_bf16_avx2(std::uint16_t* out, const std::uint16_t* const* in,
                                                          int n, std::size_t count, float divisor) {
  reduce_bf16_body(out, in, n, count, divisor);
}
__attribute__((target("avx512f,avx512bw"))) void reduce_bf16_avx512(std::uint16_t* out,
                                                                    const std::uint16_t* const* in, int n,
                                                                    std::size_t count, float divisor) {
  reduce_bf16_body(out, in, n, count, divisor);
}

void reduce_f16_scalar(std::uint16_t* out, const std::uint16_t* const* in, int n, std::size_t from,
                       std::size_t count, float divisor) {
  for (std::size_t i = from; i < count; ++i) {
    float acc = static_cast<float>(c10::Half(in[0][i], c10::Half::from_bits())) +
                static_cast<float>(c10::Half(in[1][i], c10::Half::from_bits()));
    for (int p = 2; p < n; ++p) acc += static_cast<float>(c10::Half(in[p][i], c10::Half::from_bits()));
    if (divisor != 1.0f) acc /= divisor;
    out[i] = c10::Half(acc).x;
  }
}

// F16C converts exactly like c10::Half (IEEE, nearest-even), 8 lanes at a time.
__attribute__((target("avx2,f16c")))
void reduce_f16_f16c(std::uint16_t* out, const std::uint16_t* const* in, int n, std::size_t count, float divisor) {
  const __m256 by = _mm256_set1_ps(divisor);
  std::size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    __m256 acc = _mm256_add_ps(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in[0] + i))),
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in[1] + i))));
    for (int p = 2; p < n; ++p) {
      acc = _mm256_add_ps(acc, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in[p] + i))));
    }
    if (divisor != 1.0f) acc = _mm256_div_ps(acc, by);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(acc, _MM_FROUND_TO_NEAREST_INT));
  }
  reduce_f16_scalar(out, in, n, i, count, divisor);
}

bool cpu_runs(ShmReduceKernels k) {
  __builtin_cpu_init();
  switch (k) {
    case ShmReduceKernels::kPortable:
      return true;
    case ShmReduceKernels::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    case ShmReduceKernels::kAvx512:
      return cpu_runs(ShmReduceKernels::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw");
  }
  return false;
}

ShmReduceKernels decide_kernels() {
  const char* v = std::getenv("REPLICA_SHM_REDUCE");
  const std::string choice = v && *v ? v : "auto";
  if (choice == "auto") {
    for (auto k : {ShmReduceKernels::kAvx512, ShmReduceKernels::kAvx2}) {
      if (cpu_runs(k)) return k;
    }
    return ShmReduceKernels::kPortable;
  }
  for (auto k : {ShmReduceKernels::kPortable, ShmReduceKernels::kAvx2, ShmReduceKernels::kAvx512}) {
    if (choice != shm_reduce_kernels_name(k)) continue;
    if (!cpu_runs(k)) fail("REPLICA_SHM_REDUCE={}: this CPU lacks the instructions of those kernels", choice);
    return k;
  }
  fail("REPLICA_SHM_REDUCE={}: want auto, portable, avx2 or avx512", choice);
}

std::atomic<int>& kernels_switch() {  // -1: not decided yet
  static std::atomic<int> k{-1};
  return k;
}

void reduce(c10::ScalarType dtype, void* out, const void* const* in, int n, std::size_t count,
            float divisor = 1.0f) {
  if (count == 0) return;
  const ShmReduceKernels k = shm_reduce_kernels();
  auto* out16 = static_cast<std::uint16_t*>(out);
  const auto* in16 = reinterpret_cast<const std::uint16_t* const*>(in);
  switch (dtype) {
    case c10::ScalarType::Float: {
      auto* o = static_cast<float*>(out);
      const auto* i = reinterpret_cast<const float* const*>(in);
      if (k == ShmReduceKernels::kAvx512) {
        reduce_f32_avx512(o, i, n, count, divisor);
      } else if (k == ShmReduceKernels::kAvx2) {
        reduce_f32_avx2(o, i, n, count, divisor);
      } else {
        reduce_f32_portable(o, i, n, count, divisor);
      }
      break;
    }
    case c10::ScalarType::Double:
      reduce_f64(static_cast<double*>(out), reinterpret_cast<const double* const*>(in), n, count, divisor);
      break;
    case c10::ScalarType::BFloat16:
      if (k == ShmReduceKernels::kAvx512) {
        reduce_bf16_avx512(out16, in16, n, count, divisor);
      } else if (k == ShmReduceKernels::kAvx2) {
        reduce_bf16_avx2(out16, in16, n, count, divisor);
      } else {
        reduce_bf16_portable(out16, in16, n, count, divisor);
      }
      break;
    case c10::ScalarType::Half:
      if (k != ShmReduceKernels::kPortable) {
        reduce_f16_f16c(out16, in16, n, count, divisor);
      } else {
        reduce_f16_scalar(out16, in16, n, 0, count, divisor);
      }
      break;
    default:
      fail("shm all-reduce: internal: no kernel for {}", c10::toString(dtype));
  }
}

// memcpy in pieces that stay below glibc's non-temporal threshold: the copies here are read
// again soon (by a peer or by the caller), so they should stay in cache.
void copy_bytes(void* dst, const void* src, std::size_t bytes) {
  constexpr std::size_t kPiece = 256 << 10;
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  for (std::size_t off = 0; off < bytes; off += kPiece) {
    std::memcpy(d + off, s + off, std::min(kPiece, bytes - off));
  }
}

bool supported(c10::ScalarType t) {
  return t == c10::ScalarType::Float || t == c10::ScalarType::BFloat16 || t == c10::ScalarType::Half ||
         t == c10::ScalarType::Double;
}

// Chunk p of `len` elements split n ways on cache-line boundaries: [begin, end).
std::pair<std::size_t, std::size_t> chunk_of(std::size_t len, int n, int p, std::size_t elem) {
  const std::size_t align = std::max<std::size_t>(1, kChunkAlignBytes / elem);
  const std::size_t c = round_up((len + n - 1) / n, align);
  const std::size_t b = std::min(len, c * static_cast<std::size_t>(p));
  return {b, std::min(len, b + c)};
}

}  // namespace

const char* shm_reduce_kernels_name(ShmReduceKernels k) {
  switch (k) {
    case ShmReduceKernels::kPortable:
      return "portable";
    case ShmReduceKernels::kAvx2:
      return "avx2";
    case ShmReduceKernels::kAvx512:
      return "avx512";
  }
  return "?";
}

ShmReduceKernels shm_reduce_kernels() {
  int k = kernels_switch().load();
  if (k < 0) {
    k = static_cast<int>(decide_kernels());
    kernels_switch().store(k);
  }
  return static_cast<ShmReduceKernels>(k);
}

std::vector<ShmReduceKernels> shm_reduce_kernels_this_cpu_runs() {
  std::vector<ShmReduceKernels> out;
  for (auto k : {ShmReduceKernels::kPortable, ShmReduceKernels::kAvx2, ShmReduceKernels::kAvx512}) {
    if (cpu_runs(k)) out.push_back(k);
  }
  return out;
}

ShmReduceKernels set_shm_reduce_kernels(ShmReduceKernels k) {
  if (!cpu_runs(k)) fail("shm all-reduce: this CPU cannot run the {} kernels", shm_reduce_kernels_name(k));
  const ShmReduceKernels was = shm_reduce_kernels();
  kernels_switch().store(static_cast<int>(k));
  return was;
}

void shm_reduce_for_testing(const torch::Tensor& out, const std::vector<torch::Tensor>& in, float divisor) {
  std::vector<const void*> ptrs;
  for (const auto& t : in) ptrs.push_back(t.data_ptr());
  reduce(out.scalar_type(), out.data_ptr(), ptrs.data(), static_cast<int>(ptrs.size()),
         static_cast<std::size_t>(out.numel()), divisor);
}

// ---- alloc()'ed regions -------------------------------------------------------------------

namespace {
struct Region {
  std::int64_t id = 0;
  Mapping own;
  std::vector<Mapping> peers;  // by local rank; peers[own rank] empty
};
}  // namespace

// ---- the implementation -------------------------------------------------------------------

struct ShmAllreduce::Impl {
  int rank = 0;
  int size = 1;
  Rendezvous rdzv;
  std::chrono::milliseconds timeout{0};
  std::string job;
  std::string key_prefix;
  std::size_t slice_bytes = 0;
  bool spin = true;

  Mapping own_ctl;
  std::vector<Mapping> peer_ctl;  // by local rank
  std::vector<Header*> hdr;       // by local rank
  std::vector<char*> staging;     // by local rank: two slices of slice_bytes

  std::uint64_t epoch = 0;       // barriers arrived at
  std::uint64_t collective = 0;  // allreduce_sum calls
  std::uint64_t steps = 0;       // staging steps (picks the slice)
  std::int64_t allocs = 0;
  std::string where = "setup";
  std::string broken;  // the failure that made this object unusable

  std::mutex regions_mu;  // alloc() may race with a tensor's deleter on another thread
  std::vector<std::weak_ptr<Region>> regions;

  Header* me() const { return hdr[rank]; }

  // ---- synchronisation --------------------------------------------------------------------

  void arrive() {
    ++epoch;
    Header* h = me();
    h->epoch.store(epoch, std::memory_order_seq_cst);
    h->futex.fetch_add(1, std::memory_order_seq_cst);
    if (h->waiters.load(std::memory_order_seq_cst) != 0) futex_wake_all(&h->futex);
  }

  bool arrived(int p, std::uint64_t target) const {
    return hdr[p]->epoch.load(std::memory_order_acquire) >= target;
  }

  // Throws if a peer that has not reached `target` never will: dead, failed or closed. Deaths
  // first, so that the root cause is named rather than a peer that failed because of it.
  void check_peers(std::uint64_t target) const {
    for (int q = 0; q < size; ++q) {
      if (q == rank || arrived(q, target)) continue;
      const Header* h = hdr[q];
      if (process_dead(h->pid) && !arrived(q, target)) {
        fail("shm all-reduce: local rank {} (pid {}) died during {}", q, h->pid, where);
      }
    }
    for (int q = 0; q < size; ++q) {
      if (q == rank || arrived(q, target)) continue;
      const Header* h = hdr[q];
      std::uint32_t st = h->state.load(std::memory_order_acquire);
      if (st != kRunning && arrived(q, target)) continue;
      if (st == kFailed) {
        fail("shm all-reduce: local rank {} (pid {}) failed during {}: {}", q, h->pid, where,
             std::string(h->reason, strnlen(h->reason, sizeof h->reason)));
      }
      if (st == kClosed) {
        fail("shm all-reduce: local rank {} (pid {}) destroyed its all-reduce during {}", q,
             h->pid, where);
      }
    }
  }

  void wait_for(int p, std::uint64_t target) {
    Header* h = hdr[p];
    if (arrived(p, target)) return;
    if (spin) {
      const auto t0 = Clock::now();
      for (unsigned i = 1;; ++i) {
        _mm_pause();
        if (arrived(p, target)) return;
        if ((i & 63) == 0 && Clock::now() - t0 > kSpinTime) break;
      }
    }
    const auto start = Clock::now();
    for (;;) {
      check_peers(target);
      const auto now = Clock::now();
      Clock::duration nap = kPollInterval;
      if (timeout.count() > 0) {
        const auto deadline = start + timeout;
        if (now >= deadline) {
          fail("shm all-reduce: timed out after {:g} s waiting for local rank {} at {}",
               seconds(timeout), p, where);
        }
        nap = std::min<Clock::duration>(nap, deadline - now);
      }
      h->waiters.fetch_add(1, std::memory_order_seq_cst);
      const std::uint32_t word = h->futex.load(std::memory_order_seq_cst);
      if (h->epoch.load(std::memory_order_seq_cst) < target) futex_wait(&h->futex, word, nap);
      h->waiters.fetch_sub(1, std::memory_order_seq_cst);
      if (arrived(p, target)) return;
    }
  }

  void barrier() {
    arrive();
    for (int p = 0; p < size; ++p) {
      if (p != rank) wait_for(p, epoch);
    }
  }

  void set_state(State st, const std::string& reason) {
    Header* h = me();
    std::size_t n = std::min(reason.size(), sizeof h->reason - 1);
    std::memcpy(h->reason, reason.data(), n);
    h->reason[n] = '\0';
    h->state.store(st, std::memory_order_seq_cst);
    h->futex.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&h->futex);  // sleepers re-check the peers now rather than at their next poll
  }

  void mark_failed(const std::string& reason) {
    broken = reason;
    if (!hdr.empty() && hdr[rank] != nullptr) set_state(kFailed, reason);
  }

  void check_usable() const {
    if (!broken.empty()) fail("shm all-reduce: unusable after an earlier failure: {}", broken);
  }

  // ---- setup ------------------------------------------------------------------------------

  std::string key(const std::string& what, int r) const {
    return fmt::format("{}{}/{}", key_prefix, what, r);
  }

  void setup() {
    hdr.assign(size, nullptr);
    staging.assign(size, nullptr);
    peer_ctl.resize(size);
    const std::size_t ctl_bytes = kPage + 2 * slice_bytes;
    own_ctl = create_segment(job, rank, ctl_bytes);
    auto* h = new (own_ctl.addr) Header{};
    h->magic = kMagic;
    h->version = kVersion;
    h->pid = static_cast<std::int32_t>(getpid());
    h->local_rank = rank;
    h->local_size = size;
    h->slice_bytes = slice_bytes;
    hdr[rank] = h;
    staging[rank] = own_ctl.data() + kPage;
    rdzv.set(key("ctl", rank), own_ctl.name);

    std::vector<std::string> names(size);
    try {
      for (int p = 0; p < size; ++p) {
        if (p == rank) continue;
        names[p] = rdzv.get(key("ctl", p));
        peer_ctl[p] = open_segment(names[p], ctl_bytes, p);
        auto* ph = reinterpret_cast<Header*>(peer_ctl[p].addr);
        if (ph->magic != kMagic || ph->version != kVersion) {
          fail("shm all-reduce: local rank {}'s segment {} is not a replica all-reduce of this "
               "version", p, names[p]);
        }
        if (ph->local_rank != p || ph->local_size != size || ph->slice_bytes != slice_bytes) {
          fail("shm all-reduce: local rank {} was set up as local rank {} of {} with {}-byte "
               "slices; this rank is {} of {} with {}-byte slices", p, ph->local_rank,
               ph->local_size, ph->slice_bytes, rank, size, slice_bytes);
        }
        hdr[p] = ph;
        staging[p] = peer_ctl[p].data() + kPage;
      }
      barrier();  // everyone has mapped everyone
    } catch (const std::exception& e) {
      mark_failed(e.what());  // peers waiting for us fail now instead of at their timeout
      // A peer that died before unlinking its name would leave it behind: unlink what we know.
      for (const auto& n : names) {
        if (!n.empty()) shm_unlink(n.c_str());
      }
      throw;
    }
    own_ctl.unlink();
  }

  // ---- collectives ------------------------------------------------------------------------

  void check_descs(const OpDesc& d) const {
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      const OpDesc& o = hdr[p]->desc[d.collective & 1];
      if (o.collective != d.collective) {
        fail("shm all-reduce: local ranks out of step: this is collective #{} on local rank {} "
             "but #{} on local rank {}", d.collective, rank, o.collective, p);
      }
      if (o.numel != d.numel || o.dtype != d.dtype || o.in_place != d.in_place ||
          o.region != d.region || o.offset != d.offset || o.op != d.op) {
        auto show = [](const OpDesc& x) {
          if (x.op == kBarrier) return std::string("a barrier");
          return x.in_place ? fmt::format("{} of {} {} elements at byte {} of alloc #{}", op_name(x.op),
                                          x.numel, dtype_name(x.dtype), x.offset, x.region)
                            : fmt::format("{} of {} {} elements (not alloc()'ed)", op_name(x.op), x.numel,
                                          dtype_name(x.dtype));
        };
        fail("shm all-reduce: local ranks disagree at collective #{}: local rank {} has {}, "
             "local rank {} has {}", d.collective, rank, show(d), p, show(o));
      }
    }
  }

  char* slice(int p, std::uint64_t s) const { return staging[p] + (s & 1) * slice_bytes; }

  // <= 1 MiB: copy in, one barrier, every rank sums every slice.
  void naive(char* data, const OpDesc& d, c10::ScalarType dtype, std::size_t elem) {
    const std::uint64_t s = steps++;
    const std::size_t count = static_cast<std::size_t>(d.numel);
    copy_bytes(slice(rank, s), data, count * elem);
    barrier();
    check_descs(d);
    std::vector<const void*> in(size);
    for (int p = 0; p < size; ++p) in[p] = slice(p, s);
    reduce(dtype, data, in.data(), size, count);
    // The next use of this slice is two steps on, after a barrier everyone passes only when
    // done reading it.
  }

  // Reduce-scatter + all-gather through the staging slices, one slice-full per step.
  void staged(char* data, const OpDesc& d, c10::ScalarType dtype, std::size_t elem) {
    const std::size_t numel = static_cast<std::size_t>(d.numel);
    const std::size_t step = slice_bytes / elem;
    std::vector<const void*> in(size);
    for (std::size_t off = 0; off < numel; off += step) {
      const std::size_t len = std::min(step, numel - off);
      const std::uint64_t s = steps++;
      copy_bytes(slice(rank, s), data + off * elem, len * elem);
      barrier();
      if (off == 0) check_descs(d);
      auto [b, e] = chunk_of(len, size, rank, elem);
      for (int p = 0; p < size; ++p) in[p] = slice(p, s) + b * elem;
      reduce(dtype, slice(rank, s) + b * elem, in.data(), size, e - b);
      barrier();
      for (int p = 0; p < size; ++p) {
        auto [pb, pe] = chunk_of(len, size, p, elem);
        copy_bytes(data + (off + pb) * elem, slice(p, s) + pb * elem, (pe - pb) * elem);
      }
    }
  }

  // In place on alloc()'ed memory: ready barrier, then per step reduce-scatter, barrier,
  // all-gather; a last barrier so nobody reads a rank's tensor after that rank returned.
  // (All-gather of step k and reduce-scatter of step k+1 touch disjoint memory.)
  void direct(const Region& region, const OpDesc& d, c10::ScalarType dtype, std::size_t elem) {
    barrier();
    check_descs(d);
    std::vector<char*> base(size);
    for (int p = 0; p < size; ++p) {
      base[p] = (p == rank ? region.own.data() : region.peers[p].data()) + d.offset;
    }
    const std::size_t numel = static_cast<std::size_t>(d.numel);
    const std::size_t step = numel * elem <= kDirectWholeBytes ? numel : kDirectStepBytes / elem;
    std::vector<const void*> in(size);
    for (std::size_t off = 0; off < numel; off += step) {
      const std::size_t len = std::min(step, numel - off);
      auto [b, e] = chunk_of(len, size, rank, elem);
      for (int p = 0; p < size; ++p) in[p] = base[p] + (off + b) * elem;
      reduce(dtype, base[rank] + (off + b) * elem, in.data(), size, e - b);
      barrier();
      for (int p = 0; p < size; ++p) {
        if (p == rank) continue;
        auto [pb, pe] = chunk_of(len, size, p, elem);
        copy_bytes(base[rank] + (off + pb) * elem, base[p] + (off + pb) * elem, (pe - pb) * elem);
      }
    }
    barrier();
  }

  // Reduce-scatter in place on alloc()'ed memory: this rank sums its own shard (chunk_of the
  // whole tensor) over every rank's memory, a slice at a time. The closing barrier keeps every
  // rank's tensor unchanged until all have read it.
  void direct_reduce_scatter(const Region& region, const OpDesc& d, c10::ScalarType dtype, std::size_t elem,
                             float divisor) {
    barrier();
    check_descs(d);
    std::vector<char*> base = bases(region, d);
    auto [b, e] = chunk_of(static_cast<std::size_t>(d.numel), size, rank, elem);
    const std::size_t step = kDirectStepBytes / elem;
    std::vector<const void*> in(size);
    for (std::size_t off = b; off < e; off += step) {
      const std::size_t len = std::min(step, e - off);
      for (int p = 0; p < size; ++p) in[p] = base[p] + off * elem;
      reduce(dtype, base[rank] + off * elem, in.data(), size, len, divisor);
    }
    barrier();
  }

  // All-gather in place on alloc()'ed memory: this rank copies every peer's shard from the
  // peer's memory; the closing barrier keeps every shard unchanged until all have copied it.
  void direct_all_gather(const Region& region, const OpDesc& d, std::size_t elem) {
    barrier();
    check_descs(d);
    std::vector<char*> base = bases(region, d);
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      auto [pb, pe] = chunk_of(static_cast<std::size_t>(d.numel), size, p, elem);
      copy_bytes(base[rank] + pb * elem, base[p] + pb * elem, (pe - pb) * elem);
    }
    barrier();
  }

  // What alloc() and alloc_shared() share: the checks, the allocation's number (the same on
  // every rank, so it names the segment in the rendezvous) and the segment's size. `ready` is
  // set instead when there is nothing to map: a world of one, or no elements.
  struct Allocation {
    std::int64_t id = 0;
    std::size_t bytes = 0;
    torch::Tensor ready;
  };
  Allocation start_alloc(const char* what, std::int64_t numel, torch::ScalarType dtype) {
    if (numel < 0) fail("shm all-reduce: {} of {} elements", what, numel);
    const auto options = torch::TensorOptions().dtype(dtype);
    Allocation a;
    if (size == 1) {
      a.ready = torch::zeros({numel}, options);
      return a;
    }
    check_usable();
    a.id = ++allocs;
    if (numel == 0) {
      a.ready = torch::empty({0}, options);
      return a;
    }
    where = fmt::format("{} #{}", what, a.id);
    a.bytes = round_up(static_cast<std::size_t>(numel) * c10::elementSize(dtype), kPage);
    return a;
  }

  std::vector<char*> bases(const Region& region, const OpDesc& d) const {
    std::vector<char*> base(size);
    for (int p = 0; p < size; ++p) {
      base[p] = (p == rank ? region.own.data() : region.peers[p].data()) + d.offset;
    }
    return base;
  }

  std::shared_ptr<Region> find_region(const void* ptr, std::size_t bytes) {
    std::lock_guard<std::mutex> lock(regions_mu);
    const char* c = static_cast<const char*>(ptr);
    std::shared_ptr<Region> found;
    for (auto it = regions.begin(); it != regions.end();) {
      auto r = it->lock();
      if (!r) {
        it = regions.erase(it);
        continue;
      }
      if (c >= r->own.data() && c + bytes <= r->own.data() + r->own.bytes) found = r;
      ++it;
    }
    return found;
  }
};

// ---- public surface -----------------------------------------------------------------------

ShmAllreduce::ShmAllreduce(int local_rank, int local_size, Rendezvous rendezvous,
                           std::chrono::milliseconds timeout, std::string job_id,
                           std::size_t slice_bytes)
    : impl_(std::make_unique<Impl>()) {
  if (local_size < 1 || local_rank < 0 || local_rank >= local_size) {
    fail("shm all-reduce: local rank {} of {} is not a valid rank", local_rank, local_size);
  }
  Impl& m = *impl_;
  m.rank = local_rank;
  m.size = local_size;
  m.timeout = timeout;
  m.job = sanitize(job_id);
  m.key_prefix = "shm_allreduce/" + job_id + "/";
  m.slice_bytes = round_up(std::max<std::size_t>(slice_bytes, kPage), kPage);
  if (local_size == 1) return;
  if (!rendezvous.set || !rendezvous.get) fail("shm all-reduce: the rendezvous needs set and get");
  m.rdzv = std::move(rendezvous);
  // Spinning only pays while every rank has a core of its own.
  m.spin = static_cast<unsigned>(local_size) <= std::max(1u, std::thread::hardware_concurrency());
  m.setup();
}

ShmAllreduce::~ShmAllreduce() {
  if (impl_ && impl_->size > 1 && !impl_->hdr.empty() && impl_->hdr[impl_->rank] != nullptr &&
      impl_->broken.empty()) {
    impl_->set_state(kClosed, "closed");
  }
}

int ShmAllreduce::local_rank() const { return impl_->rank; }
int ShmAllreduce::local_size() const { return impl_->size; }
std::uint64_t ShmAllreduce::collectives() const { return impl_->collective; }

torch::Tensor ShmAllreduce::alloc(std::int64_t numel, torch::ScalarType dtype) {
  Impl& m = *impl_;
  if (!supported(dtype)) {
    fail("shm all-reduce: alloc of {} is not supported (float32, bfloat16, float16 or float64)",
         dtype_name(dtype));
  }
  Impl::Allocation a = m.start_alloc("alloc", numel, dtype);
  if (a.ready.defined()) return a.ready;
  const std::int64_t id = a.id;
  const std::size_t bytes = a.bytes;
  auto region = std::make_shared<Region>();
  region->id = id;
  region->peers.resize(m.size);
  std::vector<std::string> names(m.size);
  try {
    region->own = create_segment(m.job, m.rank, bytes);
    m.rdzv.set(m.key(fmt::format("alloc/{}", id), m.rank), region->own.name);
    for (int p = 0; p < m.size; ++p) {
      if (p == m.rank) continue;
      names[p] = m.rdzv.get(m.key(fmt::format("alloc/{}", id), p));
      region->peers[p] = open_segment(names[p], bytes, p);
    }
    m.barrier();  // everyone has mapped everyone's
  } catch (const std::exception& e) {
    for (const auto& n : names) {
      if (!n.empty()) shm_unlink(n.c_str());
    }
    m.mark_failed(e.what());
    throw;
  }
  region->own.unlink();
  {
    std::lock_guard<std::mutex> lock(m.regions_mu);
    m.regions.push_back(region);
  }
  void* data = region->own.addr;
  return torch::from_blob(data, {numel}, [region](void*) mutable { region.reset(); },
                          torch::TensorOptions().dtype(dtype));
}

void ShmAllreduce::allreduce_sum(torch::Tensor& tensor) { run(tensor, kAllreduce); }

void ShmAllreduce::reduce_scatter_sum(torch::Tensor& tensor, float divisor) {
  if (!(divisor > 0)) fail("shm reduce-scatter: divisor {} is not positive", divisor);
  run(tensor, kReduceScatter, divisor);
}

void ShmAllreduce::all_gather(torch::Tensor& tensor) { run(tensor, kAllGather); }

void ShmAllreduce::barrier() {
  Impl& m = *impl_;
  if (m.size == 1) return;
  m.check_usable();
  const std::uint64_t c = ++m.collective;
  m.where = fmt::format("collective #{} (barrier)", c);
  OpDesc d{};
  d.collective = c;
  d.dtype = -1;
  d.region = -1;
  d.op = kBarrier;
  m.me()->desc[c & 1] = d;
  try {
    m.barrier();
    m.check_descs(d);
  } catch (const std::exception& e) {
    m.mark_failed(e.what());
    throw;
  }
}

torch::Tensor ShmAllreduce::alloc_shared(std::int64_t numel, torch::ScalarType dtype) {
  Impl& m = *impl_;
  Impl::Allocation a = m.start_alloc("alloc_shared", numel, dtype);
  if (a.ready.defined()) return a.ready;
  const std::int64_t id = a.id;
  const std::size_t bytes = a.bytes;
  auto mapping = std::make_shared<Mapping>();
  std::string name;
  try {
    // Local rank 0 creates the one segment; the others map it.
    if (m.rank == 0) {
      *mapping = create_segment(m.job, m.rank, bytes);
      m.rdzv.set(m.key(fmt::format("alloc/{}", id), 0), mapping->name);
    } else {
      name = m.rdzv.get(m.key(fmt::format("alloc/{}", id), 0));
      *mapping = open_segment(name, bytes, 0);
    }
    m.barrier();  // everyone has mapped it
  } catch (const std::exception& e) {
    if (!name.empty()) shm_unlink(name.c_str());
    m.mark_failed(e.what());
    throw;
  }
  mapping->unlink();
  return torch::from_blob(mapping->addr, {numel}, [mapping](void*) mutable { mapping.reset(); },
                          torch::TensorOptions().dtype(dtype));
}

std::pair<std::int64_t, std::int64_t> ShmAllreduce::shard_range(std::int64_t numel, int ranks, int rank,
                                                                std::size_t element_size) {
  auto [b, e] = chunk_of(static_cast<std::size_t>(numel), ranks, rank, element_size);
  return {static_cast<std::int64_t>(b), static_cast<std::int64_t>(e)};
}

void ShmAllreduce::run(torch::Tensor& tensor, int op, float divisor) {
  Impl& m = *impl_;
  if (!tensor.defined() || !tensor.device().is_cpu() || !tensor.is_contiguous() ||
      !supported(tensor.scalar_type())) {
    fail("shm {}: needs a contiguous CPU tensor of float32, bfloat16, float16 or float64, got {}", op_name(op),
         tensor.defined() ? fmt::format("a {}{} {} tensor",
                                        tensor.is_contiguous() ? "" : "non-contiguous ",
                                        dtype_name(tensor.scalar_type()),
                                        tensor.device().str())
                          : std::string("an undefined tensor"));
  }
  // Reduce-scatters taken as an all-reduce divide this rank's shard afterwards.
  const bool divide_after = op == kReduceScatter && divisor != 1.0f;
  auto divide_own_shard = [&] {
    auto [b, e] = chunk_of(static_cast<std::size_t>(tensor.numel()), m.size, m.rank, tensor.element_size());
    torch::NoGradGuard no_grad;
    tensor.slice(0, static_cast<int64_t>(b), static_cast<int64_t>(e)).div_(divisor);
  };
  if (m.size == 1) {
    if (divide_after) divide_own_shard();
    return;
  }
  m.check_usable();
  const c10::ScalarType dtype = tensor.scalar_type();
  const std::size_t elem = tensor.element_size();
  const std::size_t nbytes = static_cast<std::size_t>(tensor.numel()) * elem;
  char* data = static_cast<char*>(tensor.data_ptr());
  std::shared_ptr<Region> region = m.find_region(data, nbytes);
  if (op != kAllreduce && !region) {
    // Outside shared memory the shards take the all-reduce: a reduce-scatter is an all-reduce
    // of which each rank keeps its shard, an all-gather the sum of tensors that are zero
    // outside each rank's shard (adding zeros is exact).
    if (op == kAllGather) {
      auto [b, e] = chunk_of(static_cast<std::size_t>(tensor.numel()), m.size, m.rank, elem);
      torch::NoGradGuard no_grad;
      tensor.slice(0, 0, static_cast<int64_t>(b)).zero_();
      tensor.slice(0, static_cast<int64_t>(e)).zero_();
    }
    op = kAllreduce;
  }
  const std::uint64_t c = ++m.collective;
  if (tensor.numel() == 0) return;
  m.where = fmt::format("collective #{}", c);

  OpDesc d{};
  d.collective = c;
  d.numel = tensor.numel();
  d.dtype = static_cast<std::int32_t>(dtype);
  d.in_place = region ? 1 : 0;
  d.region = region ? region->id : -1;
  d.offset = region ? static_cast<std::int64_t>(data - region->own.data()) : 0;
  d.op = op;
  m.me()->desc[c & 1] = d;

  try {
    if (op == kReduceScatter) {
      m.direct_reduce_scatter(*region, d, dtype, elem, divisor);
    } else if (op == kAllGather) {
      m.direct_all_gather(*region, d, elem);
    } else if (nbytes <= std::min(kSmallBytes, m.slice_bytes)) {
      m.naive(data, d, dtype, elem);
    } else if (region) {
      m.direct(*region, d, dtype, elem);
    } else {
      m.staged(data, d, dtype, elem);
    }
    if (divide_after && op == kAllreduce) divide_own_shard();
  } catch (const std::exception& e) {
    m.mark_failed(e.what());
    throw;
  }
}

ShmAllreduce::Rendezvous store_rendezvous(ProcessGroup& group) {
  ProcessGroup* g = &group;
  return ShmAllreduce::Rendezvous{
      [g](const std::string& k, const std::string& v) { g->store_set(k, v); },
      [g](const std::string& k) { return g->store_get(k); }};
}

}  // namespace replica::distributed
