// Where tests find the checkout, the built `replica` program and the referees' Python. These
// are absolute paths of one build, so they live in one small library compiled with them
// (replica/testing/paths.cpp, CMake target replica_test_paths) instead of in the compile command
// of every test: a checkout in another folder (CI's clean clone) then compiles every test with
// the same command as this one, and the compiler cache (ccache with CCACHE_BASEDIR at the
// checkout, CMakeLists.txt) answers for it.
#pragma once

namespace replica::testing {

// The environment variables REPLICA_TEST_SOURCE_DIR and REPLICA_TEST_BIN, where set, name them
// instead (a bundle run on another machine: scripts/gpu_check.sh).
const char* checkout_dir();   // the checkout (CMAKE_SOURCE_DIR)
const char* built_replica();  // the built program (<build>/replica)
const char* configured_python();  // REPLICA_PYTHON: the interpreter with the referees, "" when not configured

}  // namespace replica::testing

#define REPLICA_SOURCE_DIR (::replica::testing::checkout_dir())
#define REPLICA_BIN (::replica::testing::built_replica())
#define REPLICA_PYTHON (::replica::testing::configured_python())
