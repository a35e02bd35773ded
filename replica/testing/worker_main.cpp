// main() of the test binaries that double as the worker program of their multi-process tests
// (replica/testing/launch_scenario.h): `<binary> --worker NAME` runs one rank of scenario NAME
// and exits 0 when that rank's checks pass; otherwise the binary runs its GoogleTest suites.
// Scenarios registered with WorkerScenario (worker_scenarios.h) come first, then the suite's
// run_test_worker.
#include "replica/testing/worker_scenarios.h"

#include <gtest/gtest.h>

#include <cstring>
#include <exception>
#include <iostream>
#include <string>

// One rank of scenario `name`; defined by the suite (its *_multiprocess_test.cpp).
int run_test_worker(const std::string& name);

int main(int argc, char** argv) {
  if (argc == 3 && std::strcmp(argv[1], "--worker") == 0) {
    auto it = replica::testing::worker_scenarios().find(argv[2]);
    if (it == replica::testing::worker_scenarios().end()) return run_test_worker(argv[2]);
    try {
      return it->second();
    } catch (const std::exception& e) {
      std::cerr << "worker failed: " << e.what() << "\n";
      return 1;
    }
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
