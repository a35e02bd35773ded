// Worker scenarios registered by name from any test file of a binary whose main is
// replica/testing/worker_main.cpp, so that a suite can add multi-process scenarios in a file
// of its own beside the one defining run_test_worker:
//
//   const replica::testing::WorkerScenario my_scenario("my_scenario", [] { ...; return 0; });
//   TEST(Suite, Case) { EXPECT_EQ(replica::testing::launch_scenario("my_scenario", 2), 0); }
//
// worker_main runs a registered scenario by that name (an exception is printed and exits 1)
// before it asks run_test_worker.
#pragma once

#include <functional>
#include <map>
#include <string>

namespace replica::testing {

inline std::map<std::string, std::function<int()>>& worker_scenarios() {
  static std::map<std::string, std::function<int()>> scenarios;
  return scenarios;
}

struct WorkerScenario {
  WorkerScenario(const std::string& name, std::function<int()> run) { worker_scenarios()[name] = std::move(run); }
};

}  // namespace replica::testing
