#!/usr/bin/env bash
# Packs what scripts/gpu_check.sh needs onto a GPU machine that has PyTorch but none of Debian's
# C++ libraries (the `device` machines): the binaries it runs and the shared libraries they
# load that are neither LibTorch's (the machine's own PyTorch provides those: same version,
# 2.11) nor glibc's, into gpu-bundle/ (git-ignored; carry it with the run).
# Also the Python side of bench/sft_vs_trl.sh for gpu_check.sh's `trainer` section: wheels of TRL
# 0.13 and what it needs that the GPU machine's Python (3.12, with transformers 5.x) lacks or has
# in a version TRL 0.13 does not run with, pinned to this checkout's .venv, into gpu-bundle/wheels
# (gpu_check.sh installs them into a private directory for that section alone), and the Llama 3
# tokenizer decompressed into gpu-bundle/llama3-tokenizer (that machine may have no zstd).
#   scripts/gpu_bundle.sh [BUILD_DIR]        (WHEELS=0: no wheels, e.g. without network)
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
mkdir -p "$OUT/llama3-tokenizer"
for f in tokenizer.json tokenizer_config.json; do
  zstd -qdc "replica/text/tests/conformance/vocab/llama3/$f.zst" > "$OUT/llama3-tokenizer/$f"
done
# The wheels: trl and datasets, datasets' dill and multiprocess (the machine has pyarrow, xxhash,
# pandas, fsspec, requests, httpx, rich), and transformers 4.57 with the huggingface_hub and
# tokenizers its import-time version check accepts (the machine's transformers 5.x, hub 1.x and
# tokenizers 0.23.2 do not satisfy TRL 0.13 / transformers 4.57), and peft (its newer releases
# follow transformers 5). accelerate 1.15.0 is the machine's own. --no-deps: exactly these.
if [ "${WHEELS:-1}" = 1 ]; then
  VENV_PY=${PYTHON:-.venv/bin/python}
  pins=$("$VENV_PY" -c 'import importlib.metadata as m
print(" ".join("%s==%s" % (n, m.version(n)) for n in ("trl", "datasets", "dill", "multiprocess", "transformers",
                                                      "huggingface_hub", "tokenizers", "peft")))') || {
    echo "gpu_bundle: cannot read the pinned versions from $VENV_PY (set PYTHON or WHEELS=0)" >&2; exit 1; }
  # shellcheck disable=SC2086
  "$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$OUT/wheels" $pins || { echo "gpu_bundle: pip download of $pins failed (WHEELS=0 to skip)" >&2; exit 1; }
  echo "gpu_bundle: wheels for the trainer section: $pins ($(du -sh "$OUT/wheels" | cut -f1))"
fi
du -sh "$OUT/bundle.tar.xz" | awk '{print "gpu_bundle: " $1 " in gpu-bundle/bundle.tar.xz (bin: replica, replica_gpu_tests, bench_llama_step, bench_memory_llm, bench_ddp_mlp)"}'
