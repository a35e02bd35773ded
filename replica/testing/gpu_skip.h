// The first line of every `gpu` test: skip, saying why, where this process sees no GPU (CI has
// none; scripts/gpu_check.sh runs them on a GPU machine).
#pragma once

#include "replica/core/cuda.h"

#include <gtest/gtest.h>

#define REPLICA_SKIP_WITHOUT_GPU()                                                                       \
  if (replica::visible_gpu_count() == 0) {                                                               \
    GTEST_SKIP() << "no GPU visible to this process (CUDA_VISIBLE_DEVICES, driver): GPU tests run where " \
                    "one is (scripts/gpu_check.sh)";                                                     \
  }
