// The DDP test binary doubles as the worker program the multi-process tests start through
// the launcher: `replica_ddp_tests --worker NAME` runs one rank of scenario NAME and exits
// 0 when that rank's checks pass.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

int run_ddp_worker(const std::string& name);  // ddp_multiprocess_test.cpp

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "--worker") == 0) return run_ddp_worker(argv[2]);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
