#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and runs the whole test suite under CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build}
# Tests start multi-process jobs on a 2-core machine: run test programs one at a time.
ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 600 "$@"
