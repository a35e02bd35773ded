// main() of the test binaries that double as the worker program of their multi-process tests
// (replica/testing/launch_scenario.h): `<binary> --worker NAME` runs one rank of scenario NAME
// and exits 0 when that rank's checks pass; otherwise the binary runs its GoogleTest suites.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

// One rank of scenario `name`; defined by the suite (its *_multiprocess_test.cpp).
int run_test_worker(const std::string& name);

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "--worker") == 0) return run_test_worker(argv[2]);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
