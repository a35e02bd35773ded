#!/usr/bin/env bash
# The library as a package: installs replica under $BUILD_DIR/install (cmake --install), builds
# examples/downstream against it with find_package(replica), and trains it with 2 workers under
# `replica launch`. Run by scripts/test.sh after the test suite; needs a built $BUILD_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
PREFIX="$(pwd)/$BUILD_DIR/install"
cmake --install "$BUILD_DIR" --prefix "$PREFIX" >/dev/null
LAUNCHER=()
command -v ccache >/dev/null && LAUNCHER=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S examples/downstream -B "$BUILD_DIR/downstream" -G Ninja -DCMAKE_PREFIX_PATH="$PREFIX" "${LAUNCHER[@]}" >/dev/null
cmake --build "$BUILD_DIR/downstream"
"$PREFIX/bin/replica" launch --nproc-per-node 2 --threads-per-worker 1 -- "$BUILD_DIR/downstream/downstream_ddp"
echo "downstream: examples/downstream built against $PREFIX and trained with 2 workers"
