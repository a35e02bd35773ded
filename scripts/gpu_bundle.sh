#!/usr/bin/env bash
# Packs what scripts/gpu_check.sh needs onto a GPU machine that has PyTorch but none of Debian's
# C++ libraries (the `device` machines): the binaries it runs and the shared libraries they
# load that are neither LibTorch's (the machine's own PyTorch provides those: same version,
# 2.11) nor glibc's, into gpu-bundle/ (git-ignored; carry it with the run).
#   scripts/gpu_bundle.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
OUT=gpu-bundle
rm -rf "$OUT"
mkdir -p "$OUT/bin" "$OUT/lib"
for b in replica replica_gpu_tests bench/bench_llama_step bench/bench_memory_llm bench/bench_ddp_mlp; do
  [ -x "$BUILD/$b" ] || { echo "gpu_bundle: $BUILD/$b is missing (scripts/setup.sh builds it)" >&2; exit 1; }
  cp "$BUILD/$b" "$OUT/bin/"
done
# glibc's and the loader's stay the machine's; LibTorch's and NVIDIA's come from its PyTorch.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|libutil\.so|libtorch|libc10|libnvidia|libcuda\.so|libgomp)'
for b in "$OUT"/bin/*; do
  ldd "$b" | awk '$3 ~ /^\// {print $1, $3}' | while read -r name path; do
    [[ "$name" =~ $skip ]] && continue
    [[ "$path" == *site-packages* ]] && continue
    cp -Ln "$path" "$OUT/lib/$name" 2>/dev/null || true
  done
done
du -sh "$OUT" | awk '{print "gpu_bundle: " $1 " in gpu-bundle/ (bin: replica, replica_gpu_tests, bench_llama_step, bench_memory_llm, bench_ddp_mlp)"}'
