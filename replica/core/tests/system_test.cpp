// keep_freed_memory_in_process / keep_freed_memory_for (core/system.h): which blocks glibc
// serves from the kept heap and which with a per-block mmap, read from mallinfo2's count of
// mapped bytes (Note [which freed blocks the process keeps] in system.cpp).
#include "replica/core/system.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <cstring>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace {

#if defined(__GLIBC__)
// Whether glibc serves a block of `bytes` with its own mmap now.
bool served_by_mmap(int64_t bytes) {
  const size_t before = mallinfo2().hblkhd;
  void* p = std::malloc(static_cast<size_t>(bytes));
  EXPECT_NE(p, nullptr);
  std::memset(p, 1, 4096);
  const bool mapped = mallinfo2().hblkhd >= before + static_cast<size_t>(bytes);
  std::free(p);
  return mapped;
}
#endif

constexpr int64_t kMiB = int64_t{1} << 20;

// One test, sizes rising: glibc serves a request from freed heap memory first, whatever the
// threshold, so each request is larger than anything freed before it.
TEST(KeepFreedMemory, BlocksOf32MibAndMoreAreMappedUnlessATrainableParameterIsHalfTheirSize) {
#if defined(__GLIBC__)
  replica::keep_freed_memory_in_process(1 * kMiB);  // LoRA adapters: activations are the large blocks
  EXPECT_FALSE(served_by_mmap(20 * kMiB));
  EXPECT_TRUE(served_by_mmap(40 * kMiB));
  replica::keep_freed_memory_in_process(64 * kMiB);  // MLP-54M's 4096 x 4096 fp32 weights
  EXPECT_FALSE(served_by_mmap(100 * kMiB));
  EXPECT_TRUE(served_by_mmap(160 * kMiB));
  // A model: 64 MiB trained, 256 MiB frozen (never touched, so no memory): sized by the trained.
  const auto trained = torch::empty({16 * kMiB}).set_requires_grad(true);
  const auto frozen = torch::empty({64 * kMiB});
  replica::keep_freed_memory_for({trained, frozen});
  EXPECT_TRUE(served_by_mmap(200 * kMiB));
  replica::keep_freed_memory_for({torch::empty({32 * kMiB}).set_requires_grad(true)});  // 128 MiB trained
  EXPECT_FALSE(served_by_mmap(240 * kMiB));
  replica::keep_freed_memory_for({frozen});  // nothing trained
  EXPECT_TRUE(served_by_mmap(300 * kMiB));
  replica::keep_freed_memory_in_process(int64_t{2} << 30);  // a 2 GiB parameter: nothing mapped
  EXPECT_FALSE(served_by_mmap(400 * kMiB));
  replica::keep_freed_memory_in_process(1 * kMiB);  // and mapping again after that
  EXPECT_TRUE(served_by_mmap(500 * kMiB));
#else
  GTEST_SKIP() << "the allocator policy is glibc's only";
#endif
}

}  // namespace
