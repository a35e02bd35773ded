#include "replica/testing/paths.h"

// REPLICA_TEST_* are set on this file alone (CMakeLists.txt, replica_test_paths).
namespace replica::testing {

const char* source_dir() { return REPLICA_TEST_SOURCE_DIR; }
const char* replica_bin() { return REPLICA_TEST_BIN; }
const char* python() { return REPLICA_TEST_PYTHON; }

}  // namespace replica::testing
