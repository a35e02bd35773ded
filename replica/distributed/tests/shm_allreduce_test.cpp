// Shared-memory all-reduce: results against a reference sum (and Gloo), bit-identical ranks,
// disagreeing ranks, timeouts, a SIGKILLed peer, and no /dev/shm leftovers.
//
// Correctness tests run the ranks as threads of this process, each with its own ShmAllreduce
// and an in-memory rendezvous (the segments are still real POSIX shared memory, mapped once per
// rank). The dead-peer test and the bandwidth measurement run the ranks as processes: this
// binary started again with a filter selecting ShmAllreduceWorker.DISABLED_Run.
#include "replica/core/error.h"
#include "replica/distributed/c10d_compat.h"
#include "replica/distributed/process_group.h"
#include "replica/distributed/shm_allreduce.h"
#include "replica/distributed/world.h"
#include "replica/distributed/tests/loopback.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <regex>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

using replica::distributed::ShmAllreduce;
using namespace replica::distributed;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

namespace {

using replica::testing::free_port;

// ---- helpers ------------------------------------------------------------------------------

// The rendezvous for ranks that are threads: a map, and a get that waits for the key.
class MemStore {
 public:
  ShmAllreduce::Rendezvous rendezvous() {
    return {[this](const std::string& k, const std::string& v) {
              {
                std::lock_guard<std::mutex> lock(mu_);
                kv_[k] = v;
              }
              cv_.notify_all();
            },
            [this](const std::string& k) {
              std::unique_lock<std::mutex> lock(mu_);
              if (!cv_.wait_for(lock, 30s, [&] { return kv_.count(k) > 0; })) {
                throw replica::Error("test rendezvous: no key " + k + " after 30 s");
              }
              return kv_[k];
            }};
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> kv_;
};

std::string unique_job() {
  static std::atomic<int> n{0};
  return "t" + std::to_string(getpid()) + "x" + std::to_string(n++);
}

// /dev/shm entries of ours (replica-*) that belong to `job`.
std::vector<std::string> shm_leftovers(const std::string& job) {
  std::vector<std::string> out;
  DIR* d = opendir("/dev/shm");
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    if (name.rfind("replica-", 0) == 0 && name.size() >= job.size() &&
        name.compare(name.size() - job.size(), job.size(), job) == 0) {
      out.push_back(name);
    }
  }
  closedir(d);
  return out;
}

struct RankOptions {
  std::size_t slice_bytes = ShmAllreduce::kDefaultSliceBytes;
  std::chrono::milliseconds timeout = 30s;
};

// Runs fn(allreduce, rank) on `n` threads, each with its own ShmAllreduce; returns each rank's
// error ("" if none) and checks that no segment is left in /dev/shm.
template <typename F>
std::vector<std::string> run_ranks_errors(int n, F fn, RankOptions opt = {}) {
  MemStore store;
  const std::string job = unique_job();
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        ShmAllreduce ar(r, n, store.rendezvous(), opt.timeout, job, opt.slice_bytes);
        fn(ar, r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        if (errors[r].empty()) errors[r] = "(empty error)";
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(shm_leftovers(job), std::vector<std::string>{}) << "segments left in /dev/shm";
  return errors;
}

template <typename F>
void run_ranks(int n, F fn, RankOptions opt = {}) {
  auto errors = run_ranks_errors(n, fn, opt);
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "local rank " << r;
}

torch::Tensor make_input(int rank, std::int64_t numel, torch::ScalarType dtype, int salt) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * salt + rank + 1);
  return torch::randn({numel}, gen, torch::TensorOptions().dtype(torch::kFloat)).to(dtype);
}

// The sum in rank order, accumulated in float32, before its rounding to the inputs' dtype.
torch::Tensor reference_sum_f32(const std::vector<torch::Tensor>& in) {
  torch::Tensor acc = in[0].to(torch::kFloat).clone();
  for (std::size_t p = 1; p < in.size(); ++p) acc.add_(in[p].to(torch::kFloat));
  return acc;
}

// The sum in rank order, accumulated in float32 and rounded once, as the all-reduce defines it
// (float64 inputs: accumulated in float64).
torch::Tensor reference_sum(const std::vector<torch::Tensor>& in) {
  if (in[0].scalar_type() == torch::kDouble) {
    torch::Tensor acc = in[0].clone();
    for (std::size_t p = 1; p < in.size(); ++p) acc.add_(in[p]);
    return acc;
  }
  return reference_sum_f32(in).to(in[0].scalar_type());
}

// Names one case of the shard tests in failure messages.
std::string shard_case(int world, torch::ScalarType dtype, bool use_alloc, std::int64_t size, int rank) {
  return "world " + std::to_string(world) + " " + std::string(c10::toString(dtype)) +
         (use_alloc ? " alloc" : " plain") + " size " + std::to_string(size) + " rank " + std::to_string(rank);
}

// All ranks reduce copies of make_input(rank, numel, ...): every result equals the reference
// bit for bit (so the ranks equal each other too).
void check_sizes(int world, torch::ScalarType dtype, bool use_alloc,
                 const std::vector<std::int64_t>& sizes, RankOptions opt = {}) {
  std::vector<std::vector<torch::Tensor>> inputs(sizes.size());
  std::vector<torch::Tensor> expected(sizes.size());
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    for (int r = 0; r < world; ++r) inputs[i].push_back(make_input(r, sizes[i], dtype, int(i)));
    expected[i] = reference_sum(inputs[i]);
  }
  std::vector<std::vector<torch::Tensor>> results(world, std::vector<torch::Tensor>(sizes.size()));
  run_ranks(
      world,
      [&](ShmAllreduce& ar, int r) {
        for (std::size_t i = 0; i < sizes.size(); ++i) {
          torch::Tensor t = use_alloc ? ar.alloc(sizes[i], dtype) : torch::empty({sizes[i]}, dtype);
          t.copy_(inputs[i][r]);
          ar.allreduce_sum(t);
          results[r][i] = t;
        }
      },
      opt);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    for (int r = 0; r < world; ++r) {
      ASSERT_TRUE(results[r][i].defined()) << "rank " << r << " size " << sizes[i];
      EXPECT_TRUE(torch::equal(results[r][i], expected[i]))
          << "rank " << r << ", " << sizes[i] << " elements, max diff "
          << (results[r][i].to(torch::kFloat) - expected[i].to(torch::kFloat)).abs().max().item<float>();
      EXPECT_TRUE(torch::equal(results[r][i], results[0][i])) << "rank " << r << " differs from rank 0";
    }
  }
}

const std::vector<std::int64_t> kSizes = {0, 1, 3, 1023, 4097, (1 << 20) + 1, 3'000'017};

// ---- correctness --------------------------------------------------------------------------

struct SumCase {
  int world;
  torch::ScalarType dtype;
  bool use_alloc;
  std::size_t slice_bytes;
};

std::string case_name(const testing::TestParamInfo<SumCase>& info) {
  const SumCase& c = info.param;
  std::string dt = c.dtype == torch::kFloat      ? "f32"
                   : c.dtype == torch::kBFloat16 ? "bf16"
                   : c.dtype == torch::kDouble   ? "f64"
                                                 : "f16";
  return "world" + std::to_string(c.world) + "_" + dt + (c.use_alloc ? "_alloc" : "_plain") +
         (c.slice_bytes == ShmAllreduce::kDefaultSliceBytes ? "" : "_smallslice");
}

class ShmAllreduceSum : public testing::TestWithParam<SumCase> {};

TEST_P(ShmAllreduceSum, EqualsReferenceBitForBitOnEveryRank) {
  const SumCase& c = GetParam();
  RankOptions opt;
  opt.slice_bytes = c.slice_bytes;
  check_sizes(c.world, c.dtype, c.use_alloc, kSizes, opt);
}

std::vector<SumCase> all_cases() {
  std::vector<SumCase> out;
  for (int world : {2, 3, 4, 8}) {
    for (auto dt : {torch::kFloat, torch::kBFloat16, torch::kHalf, torch::kDouble}) {
      for (bool a : {false, true}) out.push_back({world, dt, a, ShmAllreduce::kDefaultSliceBytes});
    }
  }
  // Small staging slices: many steps per tensor, and the naive limit drops to the slice size.
  for (int world : {2, 3}) {
    for (auto dt : {torch::kFloat, torch::kBFloat16, torch::kDouble}) out.push_back({world, dt, false, 64 << 10});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(ShmCases, ShmAllreduceSum, testing::ValuesIn(all_cases()), case_name);

// Note [the reduction kernels' instruction sets]: every kernel set this CPU can execute (the
// portable one on every machine, AVX2 and AVX-512 where present), forced in turn, sums like
// the float32 left-to-right reference bit for bit, tails included.
TEST(ShmReduceKernels, EveryKernelThisCpuRunsSumsLikeTheReference) {
  const auto kernels = shm_reduce_kernels_this_cpu_runs();
  ASSERT_FALSE(kernels.empty());
  EXPECT_EQ(kernels.front(), ShmReduceKernels::kPortable);
  const ShmReduceKernels chosen = shm_reduce_kernels();
  for (const auto k : kernels) {
    SCOPED_TRACE(shm_reduce_kernels_name(k));
    set_shm_reduce_kernels(k);
    EXPECT_EQ(shm_reduce_kernels(), k);
    for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf, torch::kDouble}) {
      for (int n : {2, 3, 5}) {
        for (int64_t size : {1, 7, 2048 + 13, 10000}) {
          for (float divisor : {1.0f, 3.0f}) {
            torch::manual_seed(size + n);
            std::vector<torch::Tensor> in;
            for (int p = 0; p < n; ++p) in.push_back((torch::randn({size}) * 100).to(dtype));
            auto out = torch::empty({size}, torch::dtype(dtype));
            shm_reduce_for_testing(out, in, divisor);
            const auto wide = dtype == torch::kDouble ? torch::kDouble : torch::kFloat;
            auto ref = in[0].to(wide) + in[1].to(wide);
            for (int p = 2; p < n; ++p) ref += in[p].to(wide);
            if (divisor != 1.0f) ref = dtype == torch::kDouble ? ref / static_cast<double>(divisor) : ref / divisor;
            EXPECT_TRUE(torch::equal(out, ref.to(dtype)))
                << c10::toString(dtype) << " n " << n << " size " << size << " divisor " << divisor;
          }
        }
      }
    }
  }
  set_shm_reduce_kernels(chosen);
}

TEST(ShmAllreduce, TenMillionElements) {
  for (int world : {2, 3}) {
    check_sizes(world, torch::kFloat, false, {10'000'000});
    check_sizes(world, torch::kFloat, true, {10'000'000});
  }
  check_sizes(4, torch::kBFloat16, false, {10'000'001});
  check_sizes(8, torch::kHalf, true, {10'000'001});
}

// Sizes, dtypes, alloc()'ed and plain tensors interleaved in one object: slices and
// descriptors are reused across collectives of different kinds.
TEST(ShmAllreduce, InterleavedCollectivesStayCorrect) {
  const int world = 3;
  std::mt19937 rng(7);
  const torch::ScalarType dtypes[] = {torch::kFloat, torch::kBFloat16, torch::kHalf};
  struct Op {
    std::int64_t numel;
    torch::ScalarType dtype;
    bool use_alloc;
    std::vector<torch::Tensor> in;
    torch::Tensor expected;
  };
  std::vector<Op> ops;
  for (int i = 0; i < 40; ++i) {
    Op op;
    const int kind = static_cast<int>(rng() % 4);
    op.numel = kind == 0 ? std::int64_t(rng() % 100) : kind == 1 ? std::int64_t(rng() % 300'000)
                                                                  : std::int64_t(rng() % 40'000);
    op.dtype = dtypes[rng() % 3];
    op.use_alloc = rng() % 2 == 0;
    for (int r = 0; r < world; ++r) op.in.push_back(make_input(r, op.numel, op.dtype, 100 + i));
    op.expected = reference_sum(op.in);
    ops.push_back(std::move(op));
  }
  std::vector<std::vector<torch::Tensor>> out(world);
  RankOptions opt;
  opt.slice_bytes = 64 << 10;
  run_ranks(
      world,
      [&](ShmAllreduce& ar, int r) {
        for (auto& op : ops) {
          torch::Tensor t = op.use_alloc ? ar.alloc(op.numel, op.dtype) : torch::empty({op.numel}, op.dtype);
          t.copy_(op.in[r]);
          ar.allreduce_sum(t);
          out[r].push_back(t);
        }
        EXPECT_EQ(ar.collectives(), ops.size());
      },
      opt);
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(out[r].size(), ops.size());
    for (std::size_t i = 0; i < ops.size(); ++i) {
      EXPECT_TRUE(torch::equal(out[r][i], ops[i].expected)) << "rank " << r << " op " << i;
    }
  }
}

// A view into alloc()'ed memory at an odd offset is reduced in place; the rest is untouched.
TEST(ShmAllreduce, ViewOfAllocatedMemory) {
  const int world = 2;
  const std::int64_t total = 2'000'000, offset = 12'345, len = 1'500'001;
  std::vector<torch::Tensor> in;
  for (int r = 0; r < world; ++r) in.push_back(make_input(r, len, torch::kFloat, 5));
  torch::Tensor expected = reference_sum(in);
  std::vector<torch::Tensor> out(world);
  run_ranks(world, [&](ShmAllreduce& ar, int r) {
    torch::Tensor buf = ar.alloc(total, torch::kFloat);
    EXPECT_TRUE(torch::equal(buf, torch::zeros({total})));  // zero-filled
    buf.fill_(float(r + 1));
    torch::Tensor view = buf.narrow(0, offset, len);
    view.copy_(in[r]);
    ar.allreduce_sum(view);
    out[r] = buf;
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(torch::equal(out[r].narrow(0, offset, len), expected)) << "rank " << r;
    EXPECT_TRUE(torch::equal(out[r].narrow(0, 0, offset), torch::full({offset}, float(r + 1))));
    const std::int64_t rest = total - offset - len;
    EXPECT_TRUE(torch::equal(out[r].narrow(0, offset + len, rest), torch::full({rest}, float(r + 1))));
  }
}

// Reduce-scatter leaves each rank's own shard (shard_range) equal to the all-reduce's result
// bit for bit; all-gather then completes every rank's tensor. Plain tensors take the
// all-reduce and end the same. Sizes include empty, tiny (most ranks own nothing), odd and
// larger than a staging slice.
TEST(ShmAllreduce, ReduceScatterThenAllGatherEqualsAllReduce) {
  for (int world : {2, 3, 5}) {
    for (torch::ScalarType dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
      for (bool use_alloc : {true, false}) {
        const std::vector<std::int64_t> sizes = {0, 1, 17, 4097, 300'001, 2'500'003};
        std::vector<std::vector<torch::Tensor>> inputs(sizes.size());
        std::vector<torch::Tensor> expected(sizes.size());
        for (std::size_t i = 0; i < sizes.size(); ++i) {
          for (int r = 0; r < world; ++r) inputs[i].push_back(make_input(r, sizes[i], dtype, 50 + int(i)));
          expected[i] = reference_sum(inputs[i]);
        }
        std::vector<std::vector<torch::Tensor>> shards(world), gathered(world);
        run_ranks(world, [&](ShmAllreduce& ar, int r) {
          for (std::size_t i = 0; i < sizes.size(); ++i) {
            torch::Tensor t = use_alloc ? ar.alloc(sizes[i], dtype) : torch::empty({sizes[i]}, dtype);
            t.copy_(inputs[i][r]);
            ar.reduce_scatter_sum(t);
            auto [b, e] = ShmAllreduce::shard_range(sizes[i], world, r, t.element_size());
            shards[r].push_back(t.slice(0, b, e).clone());
            ar.all_gather(t);
            gathered[r].push_back(t);
          }
        });
        for (std::size_t i = 0; i < sizes.size(); ++i) {
          std::int64_t covered = 0;
          for (int r = 0; r < world; ++r) {
            const std::string where = shard_case(world, dtype, use_alloc, sizes[i], r);
            ASSERT_EQ(shards[r].size(), sizes.size()) << where;
            auto [b, e] = ShmAllreduce::shard_range(sizes[i], world, r, c10::elementSize(dtype));
            EXPECT_EQ(b, std::min<std::int64_t>(covered, sizes[i])) << where << ": shards are contiguous";
            covered = e;
            EXPECT_TRUE(torch::equal(shards[r][i], expected[i].slice(0, b, e))) << where;
            EXPECT_TRUE(torch::equal(gathered[r][i], expected[i])) << where;
          }
          EXPECT_EQ(covered, sizes[i]) << "the shards cover the tensor";
        }
      }
    }
  }
}

// reduce_scatter_sum with a divisor leaves the average of this rank's shard: the float32 sum
// divided before its one rounding (bit for bit, in place); plain tensors take the all-reduce
// and divide their shard afterwards (float32 bit for bit; 16-bit within one rounding).
TEST(ShmAllreduce, ReduceScatterWithDivisorLeavesTheAverage) {
  for (int world : {2, 3}) {
    for (torch::ScalarType dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
      for (bool use_alloc : {true, false}) {
        const std::vector<std::int64_t> sizes = {1, 4097, 2'500'003};
        std::vector<std::vector<torch::Tensor>> inputs(sizes.size());
        std::vector<torch::Tensor> expected(sizes.size());
        for (std::size_t i = 0; i < sizes.size(); ++i) {
          for (int r = 0; r < world; ++r) inputs[i].push_back(make_input(r, sizes[i], dtype, 70 + int(i)));
          expected[i] = reference_sum_f32(inputs[i]).div_(world).to(dtype);
        }
        std::vector<std::vector<torch::Tensor>> shards(world);
        run_ranks(world, [&](ShmAllreduce& ar, int r) {
          for (std::size_t i = 0; i < sizes.size(); ++i) {
            torch::Tensor t = use_alloc ? ar.alloc(sizes[i], dtype) : torch::empty({sizes[i]}, dtype);
            t.copy_(inputs[i][r]);
            ar.reduce_scatter_sum(t, static_cast<float>(world));
            auto [b, e] = ShmAllreduce::shard_range(sizes[i], world, r, t.element_size());
            shards[r].push_back(t.slice(0, b, e).clone());
          }
        });
        for (std::size_t i = 0; i < sizes.size(); ++i) {
          for (int r = 0; r < world; ++r) {
            const std::string where = shard_case(world, dtype, use_alloc, sizes[i], r);
            ASSERT_EQ(shards[r].size(), sizes.size()) << where;
            auto [b, e] = ShmAllreduce::shard_range(sizes[i], world, r, c10::elementSize(dtype));
            const torch::Tensor want = expected[i].slice(0, b, e);
            if (use_alloc || dtype == torch::kFloat) {
              EXPECT_TRUE(torch::equal(shards[r][i], want)) << where;
            } else {
              EXPECT_TRUE(torch::allclose(shards[r][i].to(torch::kFloat), want.to(torch::kFloat), 1e-2, 1e-2)) << where;
            }
          }
        }
      }
    }
  }
}

// alloc_shared gives every rank the same memory: each rank writes its part, and after a
// barrier every rank reads all of them. Any dtype; zero-filled.
TEST(ShmAllreduce, SharedAllocationIsOneMemoryForEveryRank) {
  const int world = 3;
  const std::int64_t n = 100'003;
  std::vector<torch::Tensor> seen(world);
  run_ranks(world, [&](ShmAllreduce& ar, int r) {
    torch::Tensor shared = ar.alloc_shared(n, torch::kLong);
    EXPECT_TRUE(torch::equal(shared, torch::zeros({n}, torch::kLong))) << "rank " << r;
    ar.barrier();  // nobody writes before everyone has looked
    auto [b, e] = ShmAllreduce::shard_range(n, world, r, sizeof(std::int64_t));
    shared.slice(0, b, e).fill_(r + 1);
    ar.barrier();
    seen[r] = shared.clone();
    ar.barrier();  // the memory outlives nobody's reads
  });
  torch::Tensor want = torch::empty({n}, torch::kLong);
  for (int r = 0; r < world; ++r) {
    auto [b, e] = ShmAllreduce::shard_range(n, world, r, sizeof(std::int64_t));
    want.slice(0, b, e).fill_(r + 1);
  }
  for (int r = 0; r < world; ++r) EXPECT_TRUE(torch::equal(seen[r], want)) << "rank " << r;
}

// Two ranks issuing different operations: both fail, naming both operations. Cases: a
// reduce-scatter against an all-gather, and a barrier against a reduce-scatter.
TEST(ShmAllreduce, MismatchedOperationsFailOnEveryRank) {
  using Op = std::function<void(ShmAllreduce&, torch::Tensor&)>;
  const Op reduce_scatter = [](ShmAllreduce& ar, torch::Tensor& t) { ar.reduce_scatter_sum(t); };
  const Op all_gather = [](ShmAllreduce& ar, torch::Tensor& t) { ar.all_gather(t); };
  const Op barrier = [](ShmAllreduce& ar, torch::Tensor&) { ar.barrier(); };
  struct Case {
    Op rank0, rank1;
    std::string named0, named1;
  };
  const std::vector<Case> cases = {
      {reduce_scatter, all_gather, "reduce-scatter of 100000 float32 elements", "all-gather of 100000 float32 elements"},
      {barrier, reduce_scatter, "a barrier", "reduce-scatter of 100000 float32 elements"},
  };
  for (const auto& c : cases) {
    auto errors = run_ranks_errors(2, [&](ShmAllreduce& ar, int r) {
      torch::Tensor t = ar.alloc(100'000, torch::kFloat);
      (r == 0 ? c.rank0 : c.rank1)(ar, t);
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_NE(errors[r].find(c.named0), std::string::npos) << errors[r];
      EXPECT_NE(errors[r].find(c.named1), std::string::npos) << errors[r];
    }
  }
}

// Same inputs through Gloo: with two ranks a+b == b+a, so the results are identical; with
// three, equal up to summation order.
TEST(ShmAllreduce, AgreesWithGloo) {
  for (int world : {2, 3}) {
    const int port = free_port();
    const std::string job = unique_job();
    const std::vector<std::int64_t> sizes = {7, 300'001};
    // (Gloo in LibTorch 1.13 cannot sum bfloat16.)
    const torch::ScalarType dtypes[] = {torch::kFloat, torch::kHalf};
    std::vector<std::string> errors(world);
    std::vector<std::vector<torch::Tensor>> shm(world), gloo(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        try {
          replica::distributed::WorldInfo w;
          w.rank = w.local_rank = r;
          w.world_size = w.local_world_size = world;
          w.master_port = port;
          auto pg = replica::distributed::init_process_group(w);
          ShmAllreduce ar(r, world, replica::distributed::store_rendezvous(*pg), 30s,
                          job);
          for (auto dt : dtypes) {
            for (auto n : sizes) {
              torch::Tensor x = make_input(r, n, dt, 9);
              torch::Tensor y = x.clone();
              ar.allreduce_sum(x);
              pg->allreduce_sum(y).wait();
              shm[r].push_back(x);
              gloo[r].push_back(y);
            }
          }
          pg->barrier();
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(errors[r], "") << "rank " << r;
      for (std::size_t i = 0; i < shm[r].size(); ++i) {
        if (world == 2) {
          EXPECT_TRUE(torch::equal(shm[r][i], gloo[r][i])) << "world 2, rank " << r << ", case " << i;
        } else {
          const bool f32 = shm[r][i].scalar_type() == torch::kFloat;
          EXPECT_TRUE(torch::allclose(shm[r][i].to(torch::kFloat), gloo[r][i].to(torch::kFloat),
                                      f32 ? 1e-5 : 2e-2, f32 ? 1e-5 : 2e-2))
              << "world 3, rank " << r << ", case " << i;
        }
      }
    }
  }
}

TEST(ShmAllreduce, WorldOfOneIsANoOp) {
  ShmAllreduce ar(0, 1, {}, 1s, unique_job());
  torch::Tensor t = torch::arange(10, torch::kFloat);
  ar.allreduce_sum(t);
  EXPECT_TRUE(torch::equal(t, torch::arange(10, torch::kFloat)));
  torch::Tensor b = ar.alloc(5, torch::kBFloat16);
  EXPECT_EQ(b.numel(), 5);
  EXPECT_EQ(b.scalar_type(), torch::kBFloat16);
  ar.allreduce_sum(b);
  torch::Tensor i = torch::zeros({3}, torch::kInt);
  EXPECT_THROW(ar.allreduce_sum(i), replica::Error);
}

TEST(ShmAllreduce, RejectsUnsupportedTensorsWithoutBreaking) {
  run_ranks(2, [](ShmAllreduce& ar, int r) {
    torch::Tensor i = torch::zeros({3}, torch::kInt);
    EXPECT_THROW(ar.allreduce_sum(i), replica::Error);
    torch::Tensor nc = torch::zeros({4, 4}).t();
    try {
      ar.allreduce_sum(nc);
      ADD_FAILURE() << "non-contiguous accepted";
    } catch (const replica::Error& e) {
      EXPECT_NE(std::string(e.what()).find("non-contiguous"), std::string::npos) << e.what();
    }
    torch::Tensor undefined;
    EXPECT_THROW(ar.allreduce_sum(undefined), replica::Error);
    EXPECT_THROW(ar.alloc(4, torch::kInt), replica::Error);
    torch::Tensor ok = torch::ones({5});
    ar.allreduce_sum(ok);  // still usable
    EXPECT_TRUE(torch::equal(ok, torch::full({5}, 2.0f)));
  });
}

TEST(ShmAllreduce, AllocatedTensorOutlivesTheObject) {
  std::vector<torch::Tensor> kept(2);
  run_ranks(2, [&](ShmAllreduce& ar, int r) {
    kept[r] = ar.alloc(3'000'000, torch::kFloat);
    kept[r].fill_(1.0f);
    ar.allreduce_sum(kept[r]);
  });
  for (auto& t : kept) {
    EXPECT_TRUE(torch::equal(t, torch::full({3'000'000}, 2.0f)));
    t.add_(1.0f);  // still mapped and writable
    EXPECT_EQ(t[2'999'999].item<float>(), 3.0f);
  }
}

TEST(ShmAllreduce, DisagreeingRanksFailOnEveryRank) {
  for (std::int64_t base : {100, 500'000}) {
    auto errors = run_ranks_errors(2, [&](ShmAllreduce& ar, int r) {
      torch::Tensor t = torch::ones({base + r});
      ar.allreduce_sum(t);
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_NE(errors[r].find("disagree at collective #1"), std::string::npos) << errors[r];
      EXPECT_NE(errors[r].find(std::to_string(base + 1) + " float32 elements"), std::string::npos)
          << errors[r];
    }
  }
  // alloc()'ed on one rank, plain on the other.
  auto errors = run_ranks_errors(2, [&](ShmAllreduce& ar, int r) {
    torch::Tensor t = r == 0 ? ar.alloc(600'000, torch::kFloat) : (ar.alloc(600'000, torch::kFloat), torch::ones({600'000}));
    ar.allreduce_sum(t);
  });
  for (int r = 0; r < 2; ++r) EXPECT_NE(errors[r].find("not alloc()'ed"), std::string::npos) << errors[r];
}

TEST(ShmAllreduce, TimeoutNamesTheMissingRank) {
  std::promise<void> rank0_done;
  auto done = rank0_done.get_future();
  RankOptions opt;
  opt.timeout = 300ms;
  double waited = 0;
  auto errors = run_ranks_errors(
      2,
      [&](ShmAllreduce& ar, int r) {
        torch::Tensor t = torch::ones({1000});
        ar.allreduce_sum(t);  // #1: both
        if (r == 1) {
          done.wait();  // never joins #2
          return;
        }
        const auto t0 = Clock::now();
        try {
          ar.allreduce_sum(t);
        } catch (...) {
          waited = std::chrono::duration<double>(Clock::now() - t0).count();
          rank0_done.set_value();
          throw;
        }
        rank0_done.set_value();
      },
      opt);
  EXPECT_EQ(errors[0], "shm all-reduce: timed out after 0.3 s waiting for local rank 1 at collective #2");
  EXPECT_EQ(errors[1], "");
  EXPECT_GE(waited, 0.29);
  EXPECT_LT(waited, 5.0);
}

// A rank that leaves (destroys its object) makes the others fail at once, not at the timeout.
TEST(ShmAllreduce, PeerThatLeavesFailsTheOthersFast) {
  std::vector<double> waited(3, 0);
  auto errors = run_ranks_errors(3, [&](ShmAllreduce& ar, int r) {
    if (r == 2) return;
    torch::Tensor t = torch::ones({5'000'000});
    const auto t0 = Clock::now();
    try {
      ar.allreduce_sum(t);
    } catch (...) {
      waited[r] = std::chrono::duration<double>(Clock::now() - t0).count();
      throw;
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("local rank 2"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("destroyed its all-reduce during collective #1"), std::string::npos) << errors[r];
    EXPECT_LT(waited[r], 5.0);
  }
  EXPECT_EQ(errors[2], "");
}

TEST(ShmAllreduce, UnusableAfterAFailure) {
  RankOptions opt;
  opt.timeout = 100ms;
  std::promise<void> go;
  auto gof = go.get_future();
  auto errors = run_ranks_errors(
      2,
      [&](ShmAllreduce& ar, int r) {
        if (r == 1) {
          gof.wait();
          return;
        }
        torch::Tensor t = torch::ones({10});
        EXPECT_THROW(ar.allreduce_sum(t), replica::Error);  // rank 1 never comes
        go.set_value();
        try {
          ar.allreduce_sum(t);
        } catch (const replica::Error& e) {
          EXPECT_NE(std::string(e.what()).find("unusable after an earlier failure"), std::string::npos);
          return;
        }
        ADD_FAILURE() << "second call did not throw";
      },
      opt);
  EXPECT_EQ(errors[0], "");
}

// ---- processes ----------------------------------------------------------------------------

constexpr int kNotifyFd = 50;  // worker -> parent: "I am in the loop" (victim)
constexpr int kResultFd = 51;  // worker -> parent: the error it got (survivors)

// Starts this test binary as a worker with `env` added; fds[i] becomes fd (50 + i) there.
pid_t spawn_worker(const std::map<std::string, std::string>& env, const std::vector<int>& fds) {
  std::vector<std::string> strs;
  for (char** e = environ; *e != nullptr; ++e) strs.emplace_back(*e);
  for (auto& [k, v] : env) strs.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& s : strs) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe";
  std::string filter = "--gtest_filter=ShmAllreduceWorker.DISABLED_Run";
  std::string disabled = "--gtest_also_run_disabled_tests";
  char* argv[] = {exe.data(), filter.data(), disabled.data(), nullptr};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  for (std::size_t i = 0; i < fds.size(); ++i) {
    if (fds[i] >= 0) posix_spawn_file_actions_adddup2(&fa, fds[i], kNotifyFd + int(i));
  }
  pid_t pid = -1;
  int rc = posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return -1;
  return pid;
}

// Reads what arrives on `fd` until EOF or `limit`; false on timeout.
bool read_all(int fd, std::string& out, std::chrono::milliseconds limit) {
  const auto deadline = Clock::now() + limit;
  char buf[4096];
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    ssize_t n = read(fd, buf, sizeof buf);
    if (n <= 0) return true;
    out.append(buf, static_cast<std::size_t>(n));
  }
}

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}

void write_fd(int fd, const std::string& s) {
  std::size_t off = 0;
  while (off < s.size()) {
    ssize_t n = write(fd, s.data() + off, s.size() - off);
    if (n <= 0) break;
    off += static_cast<std::size_t>(n);
  }
}

// Worker processes, killed and reaped on the way out whatever happened.
struct Children {
  std::vector<pid_t> pids;
  ~Children() {
    for (pid_t& pid : pids) {
      if (pid <= 0) continue;
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      pid = -1;
    }
  }
  int reap(std::size_t i) {
    int status = -1;
    if (pids[i] > 0 && waitpid(pids[i], &status, 0) == pids[i]) pids[i] = -1;
    return status;
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Worker for the dead-peer test: the victim reports after a few collectives and goes on until
// it is killed; survivors loop until the all-reduce fails and send the message to the parent.
void dead_peer_worker(int rank, int size, int port, const std::string& job, int victim) {
  auto store = replica::distributed::detail::make_store("127.0.0.1", port, rank == 0, "shm-test", 60'000ms);
  ShmAllreduce::Rendezvous rdzv{[&](const std::string& k, const std::string& v) { store->set(k, v); },
                                [&](const std::string& k) { return store->get(k); }};
  ShmAllreduce ar(rank, size, rdzv, 3000ms, job);
  torch::Tensor big = ar.alloc(4 << 20, torch::kFloat);
  torch::Tensor plain = torch::ones({3 << 20});
  torch::Tensor small = torch::ones({1000});
  for (int i = 0;; ++i) {
    try {
      big.fill_(1.0f);
      ar.allreduce_sum(big);
      ar.allreduce_sum(plain.fill_(1.0f));
      ar.allreduce_sum(small.fill_(1.0f));
    } catch (const replica::Error& e) {
      write_fd(kResultFd, e.what());
      return;
    }
    if (rank == victim && i == 3) write_fd(kNotifyFd, "x");
  }
}

void bench_worker(int rank, int size, int port, const std::string& job) {
  replica::distributed::WorldInfo w;
  w.rank = w.local_rank = rank;
  w.world_size = w.local_world_size = size;
  w.master_port = port;
  auto pg = replica::distributed::init_process_group(w);
  torch::set_num_threads(1);  // one core per rank: no OpenMP pool spinning beside the collective
  const std::size_t slice = std::stoul(env_or("REPLICA_SHM_BENCH_SLICE", std::to_string(ShmAllreduce::kDefaultSliceBytes)));
  ShmAllreduce ar(rank, size, replica::distributed::store_rendezvous(*pg), 60s, job, slice);
  torch::Tensor sync = torch::ones({1});
  const int warmup = 5, iters = 20;
  auto measure = [&](torch::Tensor& t, auto&& op) {
    for (int i = 0; i < warmup; ++i) op(t);
    std::vector<double> times;
    for (int i = 0; i < iters; ++i) {
      t.fill_(1.0f);
      ar.allreduce_sum(sync);  // start together
      const auto t0 = Clock::now();
      op(t);
      times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    return median(times);
  };
  auto shm = [&](torch::Tensor& t) { ar.allreduce_sum(t); };
  auto gloo = [&](torch::Tensor& t) { pg->allreduce_sum(t).wait(); };
  const std::string sizes_env = env_or("REPLICA_SHM_BENCH_MB", "1,4,16,64,256");
  std::vector<int> mbs;
  for (std::size_t pos = 0; pos < sizes_env.size();) {
    std::size_t comma = sizes_env.find(',', pos);
    mbs.push_back(std::stoi(sizes_env.substr(pos, comma - pos)));
    pos = comma == std::string::npos ? sizes_env.size() : comma + 1;
  }
  const bool with_gloo = env_or("REPLICA_SHM_BENCH_GLOO", "1") == "1";
  const bool bf16 = env_or("REPLICA_SHM_BENCH_DTYPE", "float32") == "bfloat16";
  if (rank == 0) {
    std::fprintf(stderr, "world %d, %s, median of %d after %d warm-up; busbw = bytes*2(n-1)/n/time\n",
                 size, bf16 ? "bfloat16" : "float32", iters, warmup);
  }
  if (rank == 0) std::fprintf(stderr, "%8s %22s %22s\n", "latency", "shm", "gloo");
  for (std::int64_t numel : {1, 1024, 65536}) {
    torch::Tensor p = torch::ones({numel});
    const double ts = measure(p, shm);
    const double tg = with_gloo ? measure(p, gloo) : 0.0;
    if (rank == 0) {
      std::fprintf(stderr, "%7lldB %19.1f us %19.1f us\n", static_cast<long long>(numel * 4), ts * 1e6,
                   tg * 1e6);
    }
  }
  if (rank == 0) std::fprintf(stderr, "%8s %22s %22s %22s\n", "MB", "shm alloc()'ed", "shm plain", "gloo");
  for (int mb : mbs) {
    const std::int64_t numel = std::int64_t(mb) * 1000 * 1000 / 4;
    torch::Tensor a = ar.alloc(numel, torch::kFloat);
    torch::Tensor p = torch::ones({numel});
    if (bf16) {  // the same bytes as bfloat16: twice the elements
      a = ar.alloc(numel * 2, torch::kBFloat16);
      p = torch::ones({numel * 2}, torch::kBFloat16);
    }
    const double ta = measure(a, shm);
    const double tp = measure(p, shm);
    const double tg = with_gloo && !bf16 ? measure(p, gloo) : 0.0;
    const double bytes = double(numel) * 4 * 2.0 * (size - 1) / size;
    if (rank == 0) {
      std::fprintf(stderr, "%8d %9.2f ms %6.2f GB/s %9.2f ms %6.2f GB/s %9.2f ms %6.2f GB/s\n", mb,
                   ta * 1e3, bytes / ta / 1e9, tp * 1e3, bytes / tp / 1e9, tg * 1e3,
                   tg > 0 ? bytes / tg / 1e9 : 0.0);
    }
  }
  pg->barrier();
}

}  // namespace

// The worker side of the process tests (skipped unless started by them).
TEST(ShmAllreduceWorker, DISABLED_Run) {
  const std::string mode = env_or("REPLICA_SHM_WORKER", "");
  if (mode.empty()) GTEST_SKIP() << "started by ShmAllreduceProcess tests only";
  const int rank = std::stoi(env_or("REPLICA_SHM_RANK", "0"));
  const int size = std::stoi(env_or("REPLICA_SHM_SIZE", "2"));
  const int port = std::stoi(env_or("REPLICA_SHM_PORT", "0"));
  const std::string job = env_or("REPLICA_SHM_JOB", "job");
  if (mode == "dead_peer") {
    dead_peer_worker(rank, size, port, job, std::stoi(env_or("REPLICA_SHM_VICTIM", "1")));
  } else if (mode == "bench") {
    bench_worker(rank, size, port, job);
  }
}

// A SIGKILLed rank makes the others fail with a clear error naming it, well within the
// timeout (3 s), and no segment is left in /dev/shm.
TEST(ShmAllreduceProcess, SigkilledPeerIsNamedAndNothingLeaks) {
  const int size = 3, victim = 1;
  const std::string job = unique_job();
  const int port = free_port();
  Children kids;
  kids.pids.assign(size, -1);
  std::vector<pid_t>& pids = kids.pids;
  std::vector<int> result_read(size, -1);
  int notify[2];
  ASSERT_EQ(pipe2(notify, O_CLOEXEC), 0);
  for (int r = 0; r < size; ++r) {
    int res[2];
    ASSERT_EQ(pipe2(res, O_CLOEXEC), 0);
    std::map<std::string, std::string> env = {
        {"REPLICA_SHM_WORKER", "dead_peer"}, {"REPLICA_SHM_RANK", std::to_string(r)},
        {"REPLICA_SHM_SIZE", std::to_string(size)}, {"REPLICA_SHM_PORT", std::to_string(port)},
        {"REPLICA_SHM_JOB", job}, {"REPLICA_SHM_VICTIM", std::to_string(victim)}};
    pids[r] = spawn_worker(env, {r == victim ? notify[1] : -1, res[1]});
    ASSERT_GT(pids[r], 0);
    close(res[1]);
    result_read[r] = res[0];
  }
  close(notify[1]);
  std::string ready;
  char c;
  pollfd p{notify[0], POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 60'000), 1) << "victim never reported";
  ASSERT_EQ(read(notify[0], &c, 1), 1);
  const pid_t victim_pid = pids[victim];
  const auto t_kill = Clock::now();
  ASSERT_EQ(kill(victim_pid, SIGKILL), 0);
  int status = kids.reap(victim);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  const std::regex expected("shm all-reduce: local rank 1 \\(pid " + std::to_string(victim_pid) +
                            "\\) died during collective #[0-9]+");
  for (int r = 0; r < size; ++r) {
    if (r == victim) continue;
    std::string msg;
    EXPECT_TRUE(read_all(result_read[r], msg, 20s)) << "rank " << r << " did not finish";
    const double waited = std::chrono::duration<double>(Clock::now() - t_kill).count();
    EXPECT_TRUE(std::regex_search(msg, expected)) << "rank " << r << ": " << msg;
    EXPECT_LT(waited, 3.0) << "rank " << r;
    std::printf("local rank %d after %.3f s: %s\n", r, waited, msg.c_str());
    status = kids.reap(r);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "rank " << r << " status " << status;
    close(result_read[r]);
  }
  close(notify[0]);
  EXPECT_EQ(shm_leftovers(job), std::vector<std::string>{});
}

// Bus bandwidth with two processes (run by hand; prints a table).
TEST(ShmAllreduceProcess, DISABLED_Bandwidth) {
  const int size = std::stoi(env_or("REPLICA_SHM_BENCH_WORLD", "2"));
  const std::string job = unique_job();
  const int port = free_port();
  Children kids;
  for (int r = 0; r < size; ++r) {
    kids.pids.push_back(spawn_worker({{"REPLICA_SHM_WORKER", "bench"}, {"REPLICA_SHM_RANK", std::to_string(r)},
                                 {"REPLICA_SHM_SIZE", std::to_string(size)},
                                 {"REPLICA_SHM_PORT", std::to_string(port)}, {"REPLICA_SHM_JOB", job}},
                                {}));
  }
  for (std::size_t i = 0; i < kids.pids.size(); ++i) {
    const int status = kids.reap(i);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  EXPECT_EQ(shm_leftovers(job), std::vector<std::string>{});
}

// More than 1 GB per rank, plain and alloc()'ed (slow here: run by hand).
TEST(ShmAllreduce, DISABLED_MoreThanOneGigabyte) {
  const std::int64_t numel = 290'000'000;  // 1.16 GB of float32
  const std::int64_t piece = 10'000'000;
  // (i mod 1000) + r: exact in float32, as is the sum over two ranks, 2 (i mod 1000) + 1.
  auto pattern = [](std::int64_t from, std::int64_t len, float mul, float add) {
    return torch::arange(from, from + len, torch::kLong).remainder(1000).to(torch::kFloat).mul_(mul).add_(add);
  };
  for (bool use_alloc : {false, true}) {
    std::vector<double> secs(2, 0);
    std::vector<std::int64_t> wrong(2, -1);
    run_ranks(2, [&](ShmAllreduce& ar, int r) {
      torch::Tensor t = use_alloc ? ar.alloc(numel, torch::kFloat) : torch::empty({numel});
      for (std::int64_t i = 0; i < numel; i += piece) {
        t.narrow(0, i, std::min(piece, numel - i)).copy_(pattern(i, std::min(piece, numel - i), 1, float(r)));
      }
      torch::Tensor one = torch::ones({1});
      ar.allreduce_sum(one);  // start together
      const auto t0 = Clock::now();
      ar.allreduce_sum(t);
      secs[r] = std::chrono::duration<double>(Clock::now() - t0).count();
      wrong[r] = 0;
      for (std::int64_t i = 0; i < numel; i += piece) {
        const std::int64_t len = std::min(piece, numel - i);
        wrong[r] += t.narrow(0, i, len).ne(pattern(i, len, 2, 1)).sum().item<std::int64_t>();
      }
    });
    for (int r = 0; r < 2; ++r) EXPECT_EQ(wrong[r], 0) << "rank " << r << (use_alloc ? " alloc()'ed" : " plain");
    std::printf("%s: %.3f s for %.2f GB per rank (busbw %.2f GB/s)\n", use_alloc ? "alloc()'ed" : "plain",
                secs[0], numel * 4 / 1e9, numel * 4 / secs[0] / 1e9);
  }
}
