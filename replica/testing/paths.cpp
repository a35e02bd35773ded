#include "replica/testing/paths.h"

// REPLICA_TEST_* are set on this file alone (CMakeLists.txt, replica_test_paths).
namespace replica::testing {

const char* checkout_dir() { return REPLICA_TEST_SOURCE_DIR; }
const char* built_replica() { return REPLICA_TEST_BIN; }
const char* configured_python() { return REPLICA_TEST_PYTHON; }

}  // namespace replica::testing
