#include "replica/testing/paths.h"

#include <cstdlib>

// REPLICA_TEST_* are set on this file alone (CMakeLists.txt, replica_test_paths). The same names
// in the environment win: tests run from a bundle on another machine (scripts/gpu_check.sh on a
// GPU machine, where neither this build's checkout nor its build tree exists) name the copies
// there.
namespace replica::testing {

namespace {
const char* from_env_or(const char* name, const char* built_in) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : built_in;
}
}  // namespace

const char* checkout_dir() { return from_env_or("REPLICA_TEST_SOURCE_DIR", REPLICA_TEST_SOURCE_DIR); }
const char* built_replica() { return from_env_or("REPLICA_TEST_BIN", REPLICA_TEST_BIN); }
const char* configured_python() { return REPLICA_TEST_PYTHON; }

}  // namespace replica::testing
