#!/usr/bin/env bash
# Installs what replica needs and builds it. Idempotent: a second run installs nothing and
# rebuilds only what changed.
#  - Debian's packages for the C++ libraries and tools (only when something is missing).
#  - LibTorch from PyTorch's own wheel on PyPI (scripts/requirements-torch.txt, the CUDA build
#    with the C++11 ABI), pip-installed into the project-local virtual environment .venv; CMake
#    finds Torch there (torch.utils.cmake_prefix_path). The wheel's nvidia-* dependencies bring
#    the CUDA runtime, cuDNN and NCCL that libtorch_cuda.so loads.
# Another LibTorch (an official archive, CPU or CUDA): REPLICA_LIBTORCH=/path/to/libtorch
# skips the wheel (docs/getting-started.md, "Building").
# `scripts/setup.sh --deps-only` installs Debian's packages and stops: what `pip install .`
# (the Python package, pyproject.toml) needs on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config zstd
  libgloo-dev          # Gloo's headers, for ProcessGroupGloo.hpp only (see replica/distributed/c10d_compat.cpp)
  libopenblas0-pthread                            # BLAS for the data tools
  libopenblas0-serial  # the CPU GEMMs of model layers on non-Intel CPUs (replica/core/cpu_gemm.h)
  dataset-fashion-mnist                           # the default data set of the demo
  libyaml-cpp-dev libcli11-dev nlohmann-json3-dev libfmt-dev libspdlog-dev zlib1g-dev
  libpcre2-dev libsentencepiece-dev libicu-dev  # tokenizers: pre-tokenizer regexes, tokenizer.model, Unicode normalization
  libzstd-dev  # MDS shard compression (Mosaic Streaming format)
  libgtest-dev libgmock-dev libbenchmark-dev
  iproute2 procps bc
  openmpi-bin                                     # mpirun tests (replica workers under mpirun)
  gnuplot-nox                                   # replica plot: training curves as PNG/SVG
  libssl-dev                                      # OpenSSL: HMAC-locked rendezvous, checkpoint SHA-256
  openjdk-17-jre-headless                         # Spark's JVM: the Python package's tests (PySpark)
)
# Fuzzing is opt-in (CI does not fuzz): REPLICA_FUZZ=1 scripts/setup.sh adds clang and libFuzzer.
if [ "${REPLICA_FUZZ:-0}" = 1 ]; then
  PACKAGES+=(clang-14 libclang-rt-14-dev)
fi
# A python3 without venv/ensurepip (Debian's own) needs python3-venv.
command -v python3 >/dev/null || PACKAGES+=(python3)
python3 -c 'import ensurepip, venv' 2>/dev/null || PACKAGES+=(python3-venv python3-pip)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ "${1:-}" = "--deps-only" ]; then
  echo "setup: Debian's packages are installed (--deps-only: nothing built)"
  exit 0
fi

CMAKE_ARGS=()
if [ -n "${REPLICA_LIBTORCH:-}" ]; then
  CMAKE_ARGS+=(-DCMAKE_PREFIX_PATH="$REPLICA_LIBTORCH")
else
  VENV=${REPLICA_VENV:-.venv}
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  # pip skips what is already installed at the pinned version.
  if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r scripts/requirements-torch.txt; then
    echo "setup: could not install LibTorch from PyPI (scripts/requirements-torch.txt)" >&2
    exit 1
  fi
  CMAKE_ARGS+=(-DCMAKE_PREFIX_PATH="$("$VENV/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null)"
               -DREPLICA_PYTHON="$(pwd)/$VENV/bin/python")
fi
# The CUDA build of LibTorch looks for the toolkit (nvcc); NVIDIA's default install path.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi

BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "${CMAKE_ARGS[@]}" >"${TMPDIR:-/tmp}/replica-cmake.log" 2>&1 || {
  cat "${TMPDIR:-/tmp}/replica-cmake.log" >&2; echo "setup: cmake configure failed" >&2; exit 1; }
grep -E "^-- replica:" "${TMPDIR:-/tmp}/replica-cmake.log" || true
cmake --build "$BUILD_DIR" -j"$(nproc)"
echo "setup: built $BUILD_DIR/replica"
