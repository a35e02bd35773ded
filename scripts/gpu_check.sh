#!/usr/bin/env bash
# The GPU check of issue 17, on a machine with an NVIDIA GPU and PyTorch (2.11, CUDA). Writes a
# report (default $OUT/gpu-report.md, else ./gpu-report.md) with:
#   - the GPUs, driver, CUDA and NCCL (`replica env`, nvidia-smi);
#   - the `gpu` tests (replica_gpu_tests: the fused kernels against the ops they replace, DDP and
#     ZeRO-3 at world 1 on cuda:0 over NCCL equal to
#     the CPU run, ZeRO-3 with its masters offloaded to pinned host memory too, world 2 sharing
#     the one GPU over Gloo (ddp_backend gloo) equal to world 1 at the same global batch, LoRA
#     SFT in bf16 on CUDA training, QLoRA codes and steps on CUDA, env naming the GPU);
#   - the LLM SFT demo in bf16 on CUDA (tokens/s from its metrics.jsonl);
#   - a Llama-shape model of 503M parameters, full fine-tune step in bf16 autocast and in bf16
#     weights with fp32 masters (8 x 1024 and 16 x 1024 tokens), replica against PyTorch eager
#     with SDPA on the same GPU (bench/llama_step.{cpp,py}), alternating, medians, with model
#     FLOPs utilisation, and replica once without its fused kernels (REPLICA_FUSED_KERNELS=0);
#   - DDP step time of MLP-54M (4 x 4096, batch 256) at world 1 over NCCL, replica against PyTorch
#     DDP on the same GPU (bench/ddp_mlp.cpp, bench/ddp_mlp_peer.py), alternating, medians;
#   - LoRA SFT memory and tokens/s of a 349M Llama shape at batch 1 x 2048 tokens, bf16 and fp32,
#     replica against transformers + peft (bench/memory_compare.sh: the CUDA allocator's peaks);
#   - `trainer` (issue 39): the same SFT job through `replica llm --train` and TRL 0.13's SFTTrainer
#     under `accelerate launch` (bench/sft_vs_trl.sh with DEVICE=cuda): Llama-3.2-1B's shape (1.24B,
#     random weights, the repository's Llama 3 tokenizer), bf16, world 1, 4 x 2048 packed tokens a
#     step, LoRA (r 16, alpha 32, every linear) and full fine-tuning (bf16 weights on both sides:
#     replica --torch-dtype bfloat16 with fp32 masters, TRL the model in bf16), alternating SFT_ROUNDS (2)
#     rounds of SFT_STEPS (20) steps: tokens/s, the CUDA allocator's peak allocated, the loss per
#     step of both, one referee's held-out loss of both results, and the full fine-tune's MFU
#     (6 x parameters x tokens/s / 989 TFLOP/s on H100/H200). TRL, datasets and the transformers
#     4.57 / huggingface_hub / tokenizers / peft versions TRL 0.13 runs with come as wheels
#     (scripts/gpu_bundle.sh: gpu-bundle/wheels), installed into a private directory for this
#     section; without them the TRL side is skipped (the report says why) and replica runs alone.
#     About 5-6 minutes on an H100 (estimate: model build ~1 min, per round ~2 min);
#   - `multigpu`, only when two or more GPUs are visible (else the report says it was skipped): (a)
#     DDP and ZeRO-3 (deepspeed, zero_stage 3) over NCCL at world N against world 1 at the same global
#     batch (the demo model, full fine-tune, fp32, 8 steps: loss curves and final weights,
#     bench/compare_finals.py); (b) all-reduce bus bandwidth per message size: torch.distributed's
#     NCCL (bench/nccl_allreduce.py), `replica bench allreduce` (its host transports, shm and gloo:
#     it has no NCCL transport) and nccl-tests' all_reduce_perf when installed; (c) scaling of the
#     LLM SFT step (the trainer section's 1.24B model, full fine-tune, 4 x 2048 tokens per GPU):
#     tokens/s at N / (N x tokens/s at 1).
# Time: a lent GPU session has 15 minutes of device time, so the default is the ~9-minute check of
# issue 39, `tests trainer multigpu` (the tests ~3.5 min, the trainer ~5.5 min); SECTIONS=all
# runs every section (longer than 10 minutes on an H100), or name the ones wanted.
# Binaries: BUILD_DIR (default build/) when they run here, else gpu-bundle/ (scripts/gpu_bundle.sh
# on the build machine; carry it). LibTorch's libraries come from this machine's PyTorch.
#   scripts/gpu_check.sh [REPORT]
set -uo pipefail
cd "$(dirname "$0")/.."
REPORT=${1:-${OUT:-.}/gpu-report.md}
LOG=$(dirname "$REPORT")/gpu-check.log  # every step's whole output, for what the report only sums up
REAL_PY=${PYTHON:-$(command -v python3 || echo python3)}
ROUNDS=${ROUNDS:-3}
TORCH_LIB=$("$REAL_PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null) || {
  echo "gpu_check: no PyTorch in $REAL_PY (set PYTHON)" >&2; exit 1; }
NVIDIA_LIBS=$("$REAL_PY" - <<'PY' 2>/dev/null
import glob, os, site
dirs = []
for s in site.getsitepackages():
    dirs += glob.glob(os.path.join(s, "nvidia", "*", "lib"))
print(":".join(dirs))
PY
)
mkdir -p "$(dirname "$REPORT")"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# Python runs with the environment it came with: the library path below (a bundle's own
# libstdc++, zlib, OpenSSL, ...) is for replica's binaries alone.
PY=$WORK/python
printf '#!/bin/sh\nLD_LIBRARY_PATH=%q exec %q "$@"\n' "${LD_LIBRARY_PATH:-}" "$REAL_PY" > "$PY"
chmod +x "$PY"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$TORCH_LIB${NVIDIA_LIBS:+:$NVIDIA_LIBS}"
BIN=${BUILD_DIR:-build}
BENCH=$BIN/bench
if ! "$BIN/replica" --version >/dev/null 2>&1; then
  [ -d gpu-bundle ] || { echo "gpu_check: $BIN/replica does not run here and there is no gpu-bundle/ (scripts/gpu_bundle.sh)" >&2; exit 1; }
  if [ -f gpu-bundle/bundle.tar.xz ] && [ ! -d gpu-bundle/bin ]; then
    tar -C gpu-bundle -xJf gpu-bundle/bundle.tar.xz 2>/dev/null || "$REAL_PY" -m tarfile -e gpu-bundle/bundle.tar.xz gpu-bundle ||
      { echo "gpu_check: cannot unpack gpu-bundle/bundle.tar.xz" >&2; exit 1; }
  fi
  export LD_LIBRARY_PATH="$PWD/gpu-bundle/lib:$LD_LIBRARY_PATH"
  BIN=gpu-bundle/bin
  BENCH=gpu-bundle/bin
  "$BIN/replica" --version || { echo "gpu_check: gpu-bundle/bin/replica does not run here" >&2; exit 1; }
fi
# NCCL's own warnings into the log (an init or transport failure names its cause there).
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# The tests' program and checkout (replica/testing/paths.h): this machine's copies.
export REPLICA_TEST_BIN="$PWD/$BIN/replica" REPLICA_TEST_SOURCE_DIR="$PWD"
# SECTIONS: which parts run (default: tests trainer multigpu; all: tests llama ddp sft zero3 memory
# trainer multigpu); PROFILE=1 adds a Chrome
# trace of each side's Llama step (llama-{replica,pytorch}-MODE.json beside the report);
# GPU_TESTS: a gtest filter for the tests; LLAMA_RUNS: the Llama step's precision:batch pairs
# (default bf16:8 bf16-weights:8 bf16-weights:16).
SECTIONS=${SECTIONS:-tests trainer multigpu}
[ "$SECTIONS" = all ] && SECTIONS="tests llama ddp sft zero3 memory trainer multigpu"
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
# Each step is bounded (timeout) so that one that hangs leaves the others their time.
bounded() { local s=$1; shift; echo "### $* (at most ${s}s)" >> "$LOG"; timeout -k 10 "$s" "$@"; }
say() { echo "$@" | tee -a "$REPORT"; }
: > "$REPORT"
: > "$LOG"
say "# replica GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
say
say '```'
nvidia-smi -L 2>&1 | tee -a "$REPORT"
"$BIN/replica" env 2>&1 | grep -E "replica version|LibTorch|GPUs|cuda:|CUDA runtime|nccl" | grep -v "_PATH=" | tee -a "$REPORT"
say '```'

if want tests; then
say
say "## gpu tests"
say '```'
bounded 200 "$BIN/replica_gpu_tests" ${GPU_TESTS:+--gtest_filter="$GPU_TESTS"} > "$WORK/tests.log" 2>&1
echo "(exit $?)" >> "$WORK/tests.log"
cat "$WORK/tests.log" >> "$LOG"
grep -E "^\[ *(OK|FAILED|SKIPPED|PASSED) *\]|Failure|rror|^\(exit" "$WORK/tests.log" | head -60 | tee -a "$REPORT"
say '```'

fi
# Peak dense bf16 TFLOP/s of the GPU, for MFU.
name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$name" in
  *H100*|*H200*) peak=989 ;; *A100*) peak=312 ;; *A10*) peak=125 ;; *L40S*) peak=362 ;; *) peak=0 ;;
esac
# The median of KEY=<number> over a file's lines.
median() {
  "$PY" - "$1" "$2" <<'PY'
import re, statistics, sys
vals = [float(m.group(1)) for l in open(sys.argv[1]) for m in [re.search(sys.argv[2] + r"=([0-9.]+)", l)] if m]
print(statistics.median(vals) if vals else "nan")
PY
}
# One run (at most BOUND seconds, default 120): its result line (the last line that holds KEY,
# without a log line's "[time level] " prefix) into FILE and the report, or its last lines into
# the report when it has none (a failure, which the medians then leave out).
bench_run() {
  local key=$1 file=$2; shift 2
  bounded "${BOUND:-120}" "$@" > "$WORK/run.log" 2>&1
  local rc=$?
  cat "$WORK/run.log" >> "$LOG"
  if grep -q "$key" "$WORK/run.log"; then
    grep "$key" "$WORK/run.log" | tail -1 | sed 's/^\[[^]]*\] //' | tee -a "$file" "$REPORT"
  else
    { echo "($* failed, exit $rc:)"; tail -4 "$WORK/run.log"; } | tee -a "$REPORT"
  fi
}
touch "$WORK/replica.txt" "$WORK/torch.txt" "$WORK/ddp_replica.txt" "$WORK/ddp_torch.txt"

if want llama; then
# Two precisions, each side in the same one: bf16 = autocast over fp32 weights (the trainer's
# mixed_precision: bf16, PyTorch's torch.autocast); bf16-weights = the model in bf16, AdamW on
# fp32 master copies (FSDP2's param_dtype=bf16; bench/llama_step.{cpp,py}). Then replica once
# without its fused kernels (REPLICA_FUSED_KERNELS=0, Note [fused kernels]), for their share.
for run in ${LLAMA_RUNS:-bf16:8 bf16-weights:8 bf16-weights:16}; do
mode=${run%%:*} batch=${run##*:}
say
say "## Llama-shape 503M, full fine-tune step ($mode), batch $batch x 1024 tokens, cuda:0 ($name, peak $peak TFLOP/s)"
say "replica against PyTorch eager with SDPA, alternating $ROUNDS rounds, medians:"
say '```'
args="--device cuda --dtype $mode --preset 500m --batch $batch --seq 1024 --steps 10 --warmup 3 --peak-tflops $peak"
: > "$WORK/replica.txt"; : > "$WORK/torch.txt"
for i in $(seq "$ROUNDS"); do
  bench_run "tokens/s=" "$WORK/replica.txt" "$BENCH/bench_llama_step" $args
  bench_run "tokens/s=" "$WORK/torch.txt" "$PY" bench/llama_step.py --attn sdpa $args
done
if [ "$batch" = 8 ]; then
  say "replica without its fused kernels (REPLICA_FUSED_KERNELS=0), once:"
  bench_run "tokens/s=" "$WORK/unfused.txt" env REPLICA_FUSED_KERNELS=0 "$BENCH/bench_llama_step" $args
fi
r=$(median "$WORK/replica.txt" tokens/s) t=$(median "$WORK/torch.txt" tokens/s)
rm_=$(median "$WORK/replica.txt" mfu) tm=$(median "$WORK/torch.txt" mfu)
"$PY" -c "import sys; r, t = float(sys.argv[1]), float(sys.argv[2]); print(f'{sys.argv[5]}: replica {r:.0f} tokens/s (MFU {sys.argv[3]}), PyTorch eager+SDPA {t:.0f} tokens/s (MFU {sys.argv[4]}): ratio {r / t:.2f} (goals: >= 1.0, MFU >= 0.40)')" \
  "$r" "$t" "$rm_" "$tm" "$mode, batch $batch" | tee -a "$REPORT"
say '```'
if [ "${PROFILE:-0}" = 1 ] && [ "$batch" = 8 ]; then
  pargs="--device cuda --dtype $mode --preset 500m --batch 8 --seq 1024 --steps 2 --warmup 3"
  bounded 120 "$BENCH/bench_llama_step" $pargs --profile "$(dirname "$REPORT")/llama-replica-$mode.json" >> "$LOG" 2>&1
  bounded 120 "$PY" bench/llama_step.py --attn sdpa $pargs --profile "$(dirname "$REPORT")/llama-pytorch-$mode.json" >> "$LOG" 2>&1
fi
done

fi
# MLP-54M (784 -> 4 x 4096 -> 10, SGD with momentum) DDP step, world 1 on cuda:0: replica's DDP
# over NCCL (bench_ddp_mlp under `replica launch`) against PyTorch's DDP over NCCL in a world-1
# process group (bench/ddp_mlp_peer.py --ddp), so both sides pay DDP's own per-step costs. Batch
# 256 per rank keeps the GPU busy (compare.sh's 16 would mostly time kernel launches); synthetic
# data of Fashion-MNIST's shape, as this machine has no dataset package.
if want ddp; then
say
say "## MLP-54M (4 x 4096) DDP step time, batch 256/rank, world 1, cuda:0 ($name)"
say "replica against PyTorch DDP (NCCL), alternating $ROUNDS rounds, medians:"
say '```'
args="--device cuda --synthetic --hidden 4096 --layers 4 --batch 256 --steps 200 --warmup 20"
for i in $(seq "$ROUNDS"); do
  bench_run "peer=" "$WORK/ddp_replica.txt" "$BIN/replica" launch --nproc-per-node 1 -- "$BENCH/bench_ddp_mlp" $args
  # torchrun's environment for one worker, on a port free now.
  port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  bench_run "peer=" "$WORK/ddp_torch.txt" env MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" RANK=0 WORLD_SIZE=1 \
    LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 "$PY" bench/ddp_mlp_peer.py --ddp $args
done
r=$(median "$WORK/ddp_replica.txt" steps/s) t=$(median "$WORK/ddp_torch.txt" steps/s)
"$PY" -c "import sys; r, t = 1000 / float(sys.argv[1]), 1000 / float(sys.argv[2]); print(f'replica {r:.2f} ms/step, PyTorch DDP {t:.2f} ms/step: ratio replica/PyTorch step time {r / t:.2f} (goal <= 1.0)')" \
  "$r" "$t" | tee -a "$REPORT"
say '```'

fi
if want sft; then
say
say "## LLM SFT demo, LoRA, bf16, cuda:0"
say '```'
"$BIN/replica" llm init-demo "$WORK/demo" >> "$LOG" 2>&1
bounded 180 "$BIN/replica" llm --train --model "$WORK/demo/model" --data-path "$WORK/demo/data" --project-name "$WORK/sft" \
  --trainer sft --peft --mixed-precision bf16 --device cuda --nproc-per-node 1 --max-steps 60 --logging-steps 10 \
  > "$WORK/sft.log" 2>&1
sft_rc=$?
cat "$WORK/sft.log" >> "$LOG"
if [ $sft_rc -eq 0 ]; then
  "$PY" - "$WORK/sft/metrics.jsonl" <<'PY' | tee -a "$REPORT"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
tps = sorted(r.get("tokens_per_s", 0) for r in rows[1:]) or [0]
print(f"steps {rows[-1]['step']}, loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}, median tokens/s {tps[len(tps)//2]:.0f}")
PY
else
  { echo "(failed, exit $sft_rc:)"; tail -5 "$WORK/sft.log"; } | tee -a "$REPORT"
fi
say '```'

fi
# ZeRO-3 against DDP, full fine-tune (no LoRA) of a Llama shape of ~0.3B parameters (hidden 1024,
# 24 layers, the demo's tokenizer and data; made here with transformers, random weights), two
# workers sharing the one GPU over Gloo (NCCL refuses two ranks on one device), bf16 autocast,
# 3 steps: each worker's model state and the CUDA allocator's peaks, from the trainer's own
# end-of-run line. Over Gloo the collectives cross the host, so no step times here.
if want zero3; then
say
say "## ZeRO-3 against DDP memory per worker, full fine-tune of a 0.3B Llama shape, 2 workers on cuda:0 over Gloo"
say '```'
[ -d "$WORK/demo" ] || "$BIN/replica" llm init-demo "$WORK/demo" >> "$LOG" 2>&1
ZMODEL=${ZERO3_MODEL:-hidden=1024,layers=24,heads=16,kv=8,intermediate=2816}
"$PY" - "$WORK/demo/model" "$WORK/big" "$ZMODEL" >> "$LOG" 2>&1 <<'PY'
import json, os, shutil, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
src, dst, shape = sys.argv[1], sys.argv[2], dict(kv.split("=") for kv in sys.argv[3].split(","))
base = json.load(open(os.path.join(src, "config.json")))
config = LlamaConfig(vocab_size=base["vocab_size"], hidden_size=int(shape["hidden"]), num_hidden_layers=int(shape["layers"]),
                     num_attention_heads=int(shape["heads"]), num_key_value_heads=int(shape["kv"]),
                     intermediate_size=int(shape["intermediate"]), max_position_embeddings=2048,
                     bos_token_id=base.get("bos_token_id"), eos_token_id=base.get("eos_token_id"),
                     pad_token_id=base.get("pad_token_id"), tie_word_embeddings=False)
torch.manual_seed(0)
LlamaForCausalLM(config).save_pretrained(dst, safe_serialization=True)
for f in os.listdir(src):
    if f.startswith("tokenizer") or f.startswith("special_tokens"):
        shutil.copy(os.path.join(src, f), dst)
print(f"{dst}: {sum(p.numel() for p in LlamaForCausalLM(config).parameters()) / 1e9:.2f}B parameters")
PY
tail -1 "$LOG" | tee -a "$REPORT"
for backend in ddp zero3; do
  BOUND=110 bench_run "rank 0: backend" "$WORK/zero3.txt" env CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" \
    "$BIN/replica" llm --train --model "$WORK/big" --data-path "$WORK/demo/data" --project-name "$WORK/z-$backend" \
    --trainer sft --mixed-precision bf16 --distributed-backend "$backend" --device "${ZERO3_DEVICE:-cuda}" \
    --nproc-per-node 2 --ddp-backend gloo --max-steps 3 --block-size 256 --batch-size 2 --logging-steps 1
done
say '```'
fi
# bench/memory_compare.sh: LoRA SFT of a 349M Llama shape (hidden 1024, 24 layers, 16 heads / 8 KV
# heads, SwiGLU 2816, vocabulary 32000), batch 1 x 2048 tokens, gradient checkpointing and SDPA on,
# replica (bench_memory_llm) against transformers + peft (bench/memory_llm.py) on this GPU; the
# memory figure compared is the CUDA caching allocator's peak allocated (reserved and the host's
# peak RSS are listed too). Needs transformers and peft in $PY.
if want memory; then
for dtype in bf16 fp32; do
  say
  say "## LoRA SFT memory, Llama-shape 349M, $dtype, batch 1 x 2048 tokens, cuda:0 ($name)"
  say "replica against transformers + peft, gradient checkpointing and SDPA on, alternating $ROUNDS rounds, medians:"
  say '```'
  PYTHON="$PY" BENCH="$BENCH" bounded 150 bench/memory_compare.sh "$ROUNDS" --device cuda --dtype "$dtype" --steps 10 --warmup 3 \
    2>&1 | tee -a "$REPORT" "$LOG"
  say '```'
done
say
say "## LoRA SFT over an NF4 (int4) base, replica alone, bf16, same model and sequence"
say '```'
bench_run "tokens/s=" "$WORK/int4.txt" "$BENCH/bench_memory_llm" --device cuda --dtype bf16 --quantization int4 --steps 10 --warmup 3
say '```'
fi
# Issue 39: replica's trainer against TRL 0.13's SFTTrainer on the same job (bench/sft_vs_trl.sh
# says what is equal and what differs). TRL and datasets are not on the GPU machine and its
# transformers is 5.x: the wheels of gpu-bundle/wheels go into a private directory, on
# PYTHONPATH for this section's Python only.
TRL_PY=$WORK/python-trl
printf '#!/bin/sh\nPYTHONPATH=%q${PYTHONPATH:+:$PYTHONPATH} exec %q "$@"\n' "$WORK/pylib" "$PY" > "$TRL_PY"
chmod +x "$TRL_PY"
SFT_WORK=$WORK/sft-trl
SFT_TOK=
[ -f gpu-bundle/llama3-tokenizer/tokenizer.json ] && SFT_TOK=$PWD/gpu-bundle/llama3-tokenizer
if want trainer; then
say
say "## SFT trainer: replica against TRL 0.13 SFTTrainer (accelerate launch), Llama-3.2-1B shape, bf16, world 1, cuda:0 ($name)"
sides="replica trl" why=
if ! ls gpu-bundle/wheels/trl-*.whl > /dev/null 2>&1; then
  why="there is no gpu-bundle/wheels/trl-*.whl (scripts/gpu_bundle.sh downloads the wheels)"
elif ! "$REAL_PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/pylib" \
    gpu-bundle/wheels/*.whl >> "$LOG" 2>&1; then
  why="pip install --target of gpu-bundle/wheels failed (its output is in the log)"
elif ! "$TRL_PY" -c 'import trl, datasets, peft, accelerate, transformers; print("trl", trl.__version__, "datasets", datasets.__version__, "transformers", transformers.__version__, "peft", peft.__version__, "accelerate", accelerate.__version__)' \
    > "$WORK/trl-versions.txt" 2>> "$LOG"; then
  why="trl, datasets, peft, accelerate or transformers do not import with the wheels (the log has the error)"
fi
if [ -n "$why" ]; then
  sides=replica
  say "TRL side skipped: $why. replica alone:"
else
  say "TRL side: $(cat "$WORK/trl-versions.txt") (from gpu-bundle/wheels; accelerate is the machine's)"
fi
say "\`bench/sft_vs_trl.sh ${SFT_ROUNDS:-2} ${SFT_JOBS:-lora full}\` with DEVICE=cuda STEPS=${SFT_STEPS:-20}, alternating, medians:"
say '```'
SIDES="$sides" PYTHON="$TRL_PY" REPLICA="$BIN/replica" DEVICE=cuda WORK="$SFT_WORK" TOKENIZER="$SFT_TOK" \
  STEPS="${SFT_STEPS:-20}" bounded "${SFT_BOUND:-480}" bench/sft_vs_trl.sh "${SFT_ROUNDS:-2}" ${SFT_JOBS:-lora full} \
  > "$WORK/trainer.log" 2>&1
echo "(exit $?)" >> "$WORK/trainer.log"
tee -a "$REPORT" < "$WORK/trainer.log" >> "$LOG"
say '```'
fi
# Several GPUs: world N against world 1, all-reduce bandwidth, scaling. On one GPU it says so.
if want multigpu; then
say
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "${ngpu:-0}" -ge 1 ] || ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "$ngpu" -lt 2 ]; then
  say "multi-GPU section skipped: $ngpu GPU(s) visible, needs 2 or more"
else
  say "## Multi-GPU ($ngpu x $name): world $ngpu against world 1 over NCCL, all-reduce bandwidth, SFT scaling"
  say
  say "### (a) DDP and ZeRO-3 at world $ngpu equal world 1 at the same global batch (demo model, full fine-tune, fp32, 8 steps)"
  say '```'
  [ -d "$WORK/demo" ] || "$BIN/replica" llm init-demo "$WORK/demo" >> "$LOG" 2>&1
  common=(llm --train --model "$WORK/demo/model" --data-path "$WORK/demo/data" --trainer sft --device cuda
          --mixed-precision fp32 --shuffle false --max-steps 8 --logging-steps 1 --checkpoint-every 0 --lr 1e-4
          --scheduler constant --warmup-ratio 0 --seed 42 --block-size 256 --gradient-accumulation 1)
  for run in "w1 1 $((2 * ngpu)) ddp" "ddp-w$ngpu $ngpu 2 ddp" "zero3-w$ngpu $ngpu 2 deepspeed"; do
    read -r tag nproc batch backend <<< "$run"
    extra=(); [ "$backend" = deepspeed ] && extra=(--zero-stage 3)
    bounded 150 "$BIN/replica" "${common[@]}" --project-name "$WORK/mg-$tag" --nproc-per-node "$nproc" \
      --batch-size "$batch" --distributed-backend "$backend" "${extra[@]}" > "$WORK/mg-$tag.log" 2>&1
    echo "$tag: world $nproc x batch $batch, $backend: exit $?; $(grep -E 'done:' "$WORK/mg-$tag.log" | tail -1 | sed 's/^\[[^]]*\] //')" | tee -a "$REPORT"
    cat "$WORK/mg-$tag.log" >> "$LOG"
  done
  "$PY" bench/compare_finals.py --init "$WORK/demo/model" --tol "${MG_TOL:-1e-2}" "$WORK/mg-w1" "$WORK/mg-ddp-w$ngpu" \
    "$WORK/mg-zero3-w$ngpu" 2>&1 | tee -a "$REPORT"
  say '```'
  say
  say "### (b) all-reduce bus bandwidth per message size, $ngpu GPUs"
  say '```'
  bounded 120 "$PY" -m torch.distributed.run --nproc-per-node "$ngpu" bench/nccl_allreduce.py --backend nccl \
    > "$WORK/nccl.log" 2>&1; cat "$WORK/nccl.log" >> "$LOG"
  grep -E '^#|^ +[0-9]' "$WORK/nccl.log" | tee -a "$REPORT"
  say "replica bench allreduce (host transports: replica's NCCL groups call NCCL itself, it has no NCCL transport of its own to time):"
  bounded 120 "$BIN/replica" bench allreduce --nproc-per-node "$ngpu" --max-bytes 67108864 > "$WORK/rba.log" 2>&1
  cat "$WORK/rba.log" >> "$LOG"
  grep -E '^#|^ +[0-9]' "$WORK/rba.log" | tee -a "$REPORT"
  if command -v all_reduce_perf > /dev/null 2>&1; then
    say "nccl-tests all_reduce_perf -b 4K -e 256M -f 2 -g $ngpu:"
    bounded 120 all_reduce_perf -b 4K -e 256M -f 2 -g "$ngpu" 2>&1 | tee -a "$LOG" | grep -vE '^#  *Rank|^$' | tail -30 | tee -a "$REPORT"
  else
    say "nccl-tests are not installed (no all_reduce_perf on PATH): no NCCL-tests figure quoted."
  fi
  say '```'
  say
  say "### (c) scaling of the SFT step, 1 -> $ngpu GPUs (replica, full fine-tune of the 1.24B Llama-3.2-1B shape, bf16, 4 x 2048 tokens per GPU)"
  say '```'
  for w in 1 "$ngpu"; do
    SIDES=replica HELDOUT_EVAL=0 PYTHON="$TRL_PY" REPLICA="$BIN/replica" DEVICE=cuda WORK="$SFT_WORK" \
      TOKENIZER="$SFT_TOK" WORLD="$w" STEPS="${SFT_STEPS:-20}" bounded 240 bench/sft_vs_trl.sh 1 full \
      > "$WORK/scale-$w.log" 2>&1
    cat "$WORK/scale-$w.log" >> "$LOG"
    awk '$1 == "full" && $2 ~ /^[0-9.]+$/ {print $2}' "$WORK/scale-$w.log" | tail -1 > "$WORK/scale-$w.tps"
    say "world $w: $(cat "$WORK/scale-$w.tps") tokens/s"
  done
  "$PY" -c 'import sys
t1, tn, n = (float(x) if x.strip() else float("nan") for x in (open(sys.argv[1]).read(), open(sys.argv[2]).read(), sys.argv[3]))
print("scaling efficiency 1 -> %d GPUs: %.3f (tokens/s at %d / (%d x tokens/s at 1))" % (n, tn / (n * t1), n, n))' \
    "$WORK/scale-1.tps" "$WORK/scale-$ngpu.tps" "$ngpu" 2>&1 | tee -a "$REPORT"
  say '```'
fi
fi
echo "gpu_check: report in $REPORT, every step's output in $LOG"
