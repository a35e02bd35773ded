#!/usr/bin/env bash
# The GPU check of issue 17, on a machine with an NVIDIA GPU and PyTorch (2.11, CUDA). Writes a
# report (default $OUT/gpu-report.md, else ./gpu-report.md) with:
#   - the GPUs, driver, CUDA and NCCL (`replica env`, nvidia-smi);
#   - the `gpu` tests (replica_gpu_tests: DDP and ZeRO-3 at world 1 on cuda:0 over NCCL equal to
#     the CPU run, ZeRO-3 with its masters offloaded to pinned host memory too, world 2 sharing
#     the one GPU over Gloo (ddp_backend gloo) equal to world 1 at the same global batch, LoRA
#     SFT in bf16 on CUDA training, QLoRA codes and steps on CUDA, env naming the GPU);
#   - the LLM SFT demo in bf16 on CUDA (tokens/s from its metrics.jsonl);
#   - a Llama-shape model of 503M parameters, bf16 full fine-tune step, replica against PyTorch
#     eager with SDPA on the same GPU (bench/llama_step.{cpp,py}), alternating, medians, with
#     model FLOPs utilisation;
#   - DDP step time of MLP-54M (4 x 4096, batch 256) at world 1 over NCCL, replica against PyTorch
#     DDP on the same GPU (bench/ddp_mlp.cpp, bench/ddp_mlp_peer.py), alternating, medians;
#   - LoRA SFT memory and tokens/s of a 349M Llama shape at batch 1 x 2048 tokens, bf16 and fp32,
#     replica against transformers + peft (bench/memory_compare.sh: the CUDA allocator's peaks).
# Binaries: BUILD_DIR (default build/) when they run here, else gpu-bundle/ (scripts/gpu_bundle.sh
# on the build machine; carry it). LibTorch's libraries come from this machine's PyTorch.
#   scripts/gpu_check.sh [REPORT]
set -uo pipefail
cd "$(dirname "$0")/.."
REPORT=${1:-${OUT:-.}/gpu-report.md}
PY=${PYTHON:-$(command -v python3 || echo python3)}
ROUNDS=${ROUNDS:-3}
TORCH_LIB=$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null) || {
  echo "gpu_check: no PyTorch in $PY (set PYTHON)" >&2; exit 1; }
NVIDIA_LIBS=$("$PY" - <<'PY' 2>/dev/null
import glob, os, site
dirs = []
for s in site.getsitepackages():
    dirs += glob.glob(os.path.join(s, "nvidia", "*", "lib"))
print(":".join(dirs))
PY
)
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$TORCH_LIB${NVIDIA_LIBS:+:$NVIDIA_LIBS}"
BIN=${BUILD_DIR:-build}
BENCH=$BIN/bench
if ! "$BIN/replica" --version >/dev/null 2>&1; then
  [ -d gpu-bundle ] || { echo "gpu_check: $BIN/replica does not run here and there is no gpu-bundle/ (scripts/gpu_bundle.sh)" >&2; exit 1; }
  export LD_LIBRARY_PATH="$PWD/gpu-bundle/lib:$LD_LIBRARY_PATH"
  BIN=gpu-bundle/bin
  BENCH=gpu-bundle/bin
  "$BIN/replica" --version >/dev/null || { echo "gpu_check: gpu-bundle/bin/replica does not run here" >&2; exit 1; }
fi
export REPLICA_TEST_BIN="$PWD/$BIN/replica"
mkdir -p "$(dirname "$REPORT")"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
say() { echo "$@" | tee -a "$REPORT"; }
: > "$REPORT"
say "# replica GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
say
say '```'
nvidia-smi -L 2>&1 | tee -a "$REPORT"
"$BIN/replica" env 2>&1 | grep -E "replica version|LibTorch|GPUs|cuda:|CUDA runtime|nccl" | tee -a "$REPORT"
say '```'

say
say "## gpu tests"
say '```'
"$BIN/replica_gpu_tests" 2>&1 | grep -E "^\[ *(OK|FAILED|SKIPPED|PASSED) *\]|Failure|error" | tee -a "$REPORT"
say '```'

say
say "## LLM SFT demo, LoRA, bf16, cuda:0"
"$BIN/replica" llm init-demo "$WORK/demo" >/dev/null 2>&1
"$BIN/replica" llm --train --model "$WORK/demo/model" --data-path "$WORK/demo/data" --project-name "$WORK/sft" \
  --trainer sft --peft --mixed-precision bf16 --device cuda --nproc-per-node 1 --max-steps 60 --logging-steps 10 \
  > "$WORK/sft.log" 2>&1
sft_rc=$?
say '```'
if [ $sft_rc -eq 0 ]; then
  "$PY" - "$WORK/sft/metrics.jsonl" <<'PY' | tee -a "$REPORT"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
tps = sorted(r.get("tokens_per_s", 0) for r in rows[1:]) or [0]
print(f"steps {rows[-1]['step']}, loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}, median tokens/s {tps[len(tps)//2]:.0f}")
PY
else
  tail -5 "$WORK/sft.log" | tee -a "$REPORT"
fi
say '```'

# Peak dense bf16 TFLOP/s of the GPU, for MFU.
name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$name" in
  *H100*|*H200*) peak=989 ;; *A100*) peak=312 ;; *A10*) peak=125 ;; *L40S*) peak=362 ;; *) peak=0 ;;
esac
say
say "## Llama-shape 503M, bf16 full fine-tune step, batch 8 x 1024 tokens, cuda:0 ($name, peak $peak TFLOP/s)"
say "alternating $ROUNDS rounds, medians:"
say '```'
args="--device cuda --dtype bf16 --preset 500m --batch 8 --seq 1024 --steps 10 --warmup 3 --peak-tflops $peak"
for i in $(seq "$ROUNDS"); do
  "$BENCH/bench_llama_step" $args 2>&1 | tail -1 | tee -a "$WORK/replica.txt" "$REPORT"
  "$PY" bench/llama_step.py --attn sdpa $args 2>&1 | tail -1 | tee -a "$WORK/torch.txt" "$REPORT"
done
"$PY" - "$WORK/replica.txt" "$WORK/torch.txt" <<'PY' | tee -a "$REPORT"
import re, statistics, sys
def med(path, key):
    vals = [float(m.group(1)) for l in open(path) for m in [re.search(key + r"=([0-9.]+)", l)] if m]
    return statistics.median(vals) if vals else float("nan")
r, t = med(sys.argv[1], "tokens/s"), med(sys.argv[2], "tokens/s")
print(f"replica {r:.0f} tokens/s (MFU {med(sys.argv[1], 'mfu'):.3f}), PyTorch eager+SDPA {t:.0f} tokens/s "
      f"(MFU {med(sys.argv[2], 'mfu'):.3f}): ratio {r / t:.2f}")
PY
say '```'

# MLP-54M (784 -> 4 x 4096 -> 10, SGD with momentum) DDP step, world 1 on cuda:0: replica's DDP
# over NCCL (bench_ddp_mlp under `replica launch`) against PyTorch's DDP over NCCL in a world-1
# process group (bench/ddp_mlp_peer.py --ddp), so both sides pay DDP's own per-step costs. Batch
# 256 per rank keeps the GPU busy (compare.sh's 16 would mostly time kernel launches); synthetic
# data of Fashion-MNIST's shape, as this machine has no dataset package.
say
say "## MLP-54M (4 x 4096) DDP step time, batch 256/rank, world 1, cuda:0 ($name)"
say "replica against PyTorch DDP (NCCL), alternating $ROUNDS rounds, medians:"
say '```'
args="--device cuda --synthetic --hidden 4096 --layers 4 --batch 256 --steps 200 --warmup 20"
# The result line of a run, or its last lines when it failed (into the report, not the medians).
result_line() { grep "peer=" "$1" | tail -1 | tee -a "$2" "$REPORT"; grep -q "peer=" "$1" || tail -3 "$1" | tee -a "$REPORT"; }
for i in $(seq "$ROUNDS"); do
  "$BIN/replica" launch --nproc-per-node 1 -- "$BENCH/bench_ddp_mlp" $args > "$WORK/ddp_run.log" 2>&1
  result_line "$WORK/ddp_run.log" "$WORK/ddp_replica.txt"
  # torchrun's environment for one worker, on a port free now.
  port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$port RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
    "$PY" bench/ddp_mlp_peer.py --ddp $args > "$WORK/ddp_run.log" 2>&1
  result_line "$WORK/ddp_run.log" "$WORK/ddp_torch.txt"
done
"$PY" - "$WORK/ddp_replica.txt" "$WORK/ddp_torch.txt" <<'PY' | tee -a "$REPORT"
import re, statistics, sys
def med(path, key):
    vals = [float(m.group(1)) for l in open(path) for m in [re.search(key + r"=([0-9.]+)", l)] if m]
    return statistics.median(vals) if vals else float("nan")
r, t = 1000 / med(sys.argv[1], "steps/s"), 1000 / med(sys.argv[2], "steps/s")
print(f"replica {r:.2f} ms/step, PyTorch DDP {t:.2f} ms/step: ratio replica/PyTorch step time {r / t:.2f} (goal <= 1.0)")
PY
say '```'

# bench/memory_compare.sh: LoRA SFT of a 349M Llama shape (hidden 1024, 24 layers, 16 heads / 8 KV
# heads, SwiGLU 2816, vocabulary 32000), batch 1 x 2048 tokens, gradient checkpointing and SDPA on,
# replica (bench_memory_llm) against transformers + peft (bench/memory_llm.py) on this GPU; the
# memory figure compared is the CUDA caching allocator's peak allocated (reserved and the host's
# peak RSS are listed too). Needs transformers and peft in $PY.
for dtype in bf16 fp32; do
  say
  say "## LoRA SFT memory, Llama-shape 349M, $dtype, batch 1 x 2048 tokens, cuda:0 ($name)"
  say "replica against transformers + peft, gradient checkpointing and SDPA on, alternating $ROUNDS rounds, medians:"
  say '```'
  PYTHON="$PY" BENCH="$BENCH" bench/memory_compare.sh "$ROUNDS" --device cuda --dtype "$dtype" --steps 10 --warmup 3 \
    2>&1 | tee -a "$REPORT"
  say '```'
done
say
say "## LoRA SFT over an NF4 (int4) base, replica alone, bf16, same model and sequence"
say '```'
"$BENCH/bench_memory_llm" --device cuda --dtype bf16 --quantization int4 --steps 10 --warmup 3 2>&1 | tail -1 | tee -a "$REPORT"
say '```'
echo "gpu_check: report in $REPORT"
