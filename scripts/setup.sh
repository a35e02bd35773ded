#!/usr/bin/env bash
# Installs what replica needs from Debian (only when something is missing) and builds it.
# Idempotent: a second run installs nothing and rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config
  libtorch-dev libgloo-dev libopenblas0-pthread   # LibTorch 1.13 (CPU, c10d + Gloo) and a fast BLAS
  dataset-fashion-mnist                           # the default data set of the demo
  libyaml-cpp-dev libcli11-dev nlohmann-json3-dev libfmt-dev libspdlog-dev zlib1g-dev
  libpcre2-dev libsentencepiece-dev libicu-dev  # tokenizers: pre-tokenizer regexes, tokenizer.model, Unicode normalization
  libzstd-dev  # MDS shard compression (Mosaic Streaming format)
  libgtest-dev libgmock-dev libbenchmark-dev python3-jinja2
  iproute2 procps
  openmpi-bin                                     # mpirun tests (replica workers under mpirun)
  gnuplot-nox                                   # replica plot: training curves as PNG/SVG
  libssl-dev                                      # OpenSSL: HMAC-locked rendezvous, checkpoint SHA-256
)
# Fuzzing is opt-in (CI does not fuzz): REPLICA_FUZZ=1 scripts/setup.sh adds clang and libFuzzer.
if [ "${REPLICA_FUZZ:-0}" = 1 ]; then
  PACKAGES+=(clang-14 libclang-rt-14-dev)
fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD_DIR" -j"$(nproc)"
echo "setup: built $BUILD_DIR/replica"
