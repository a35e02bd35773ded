// The ZeRO-3 test binary doubles as the worker program its multi-process tests start through
// the launcher: `replica_zero_tests --worker NAME` runs one rank of scenario NAME and exits 0
// when that rank's checks pass.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

int run_zero_worker(const std::string& name);  // zero3_multiprocess_test.cpp

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "--worker") == 0) return run_zero_worker(argv[2]);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
