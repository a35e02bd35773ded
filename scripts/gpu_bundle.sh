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
# glibc's, the loader's and the C++ runtime (libstdc++, libgcc_s: the machine's is as new or
# newer, and its own libraries need it) stay the machine's; LibTorch's and NVIDIA's come from its PyTorch.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|libutil\.so|libstdc\+\+|libgcc_s|libtorch|libc10|libnvidia|libcuda\.so|libgomp)'
for b in "$OUT"/bin/*; do
  ldd "$b" | awk '$3 ~ /^\// {print $1, $3}' | while read -r name path; do
    [[ "$name" =~ $skip ]] && continue
    [[ "$path" == *site-packages* ]] && continue
    [[ "$path" == /usr/local/cuda* ]] && continue  # the CUDA runtime: the one its PyTorch loads
    cp -Ln "$path" "$OUT/lib/$name" 2>/dev/null || true
  done
done
# Opened with dlopen (replica/text/sentencepiece.cpp), so ldd does not list them: the versions
# replica was compiled against (the machine's own may differ in its C++ ABI).
for so in libsentencepiece.so.0 libsentencepiece_train.so.0; do
  path=$(ldconfig -p | awk -v n="$so" '$1 == n && $NF ~ /^\// {print $NF; exit}')
  [ -n "$path" ] || { echo "gpu_bundle: $so is missing (scripts/setup.sh installs libsentencepiece0)" >&2; exit 1; }
  cp -L "$path" "$OUT/lib/$so"
done
tar -C "$OUT" -cJf "$OUT/bundle.tar.xz" bin lib
rm -rf "$OUT/bin" "$OUT/lib"
du -sh "$OUT/bundle.tar.xz" | awk '{print "gpu_bundle: " $1 " in gpu-bundle/bundle.tar.xz (bin: replica, replica_gpu_tests, bench_llama_step, bench_memory_llm, bench_ddp_mlp)"}'
