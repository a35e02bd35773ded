// The dist test binary doubles as the worker program the multi-process tests start through
// `replica launch`: `replica_dist_tests --rdzv-worker` is one rank of the locked-rendezvous
// scenario (rendezvous_lock_test.cpp) and exits 0 when its checks pass.
#include <gtest/gtest.h>

#include <cstring>

int run_rdzv_worker();  // rendezvous_lock_test.cpp

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], "--rdzv-worker") == 0) return run_rdzv_worker();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
