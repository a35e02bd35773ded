#!/usr/bin/env bash
# The same SFT job through `replica llm --train` and through TRL 0.13's SFTTrainer under
# `accelerate launch`: tokens/s, peak memory, the loss curves side by side and one referee's
# held-out loss of both results. Measured as bench/README.md asks of side-by-side runs (one
# sitting, alternating rounds, replica first in each, medians, ratios replica / TRL).
#
#   bench/sft_vs_trl.sh [ROUNDS] [JOB...]
#       ROUNDS (default 3) alternating rounds per job; JOBs default to "lora full":
#       lora = LoRA r 16 / alpha 32 / dropout 0 on every linear (both sides start from the same
#       adapter, PEFT's own init made once: --init-adapter on both); full = every weight trains.
#
# The job (both sides; bench/sft_trl_side.py says how each piece is made):
#   model  a LlamaForCausalLM with random weights made by transformers, in Llama-3.2-1B's family
#          (head_dim 64, 4:1 grouped-query attention, SwiGLU 4x, tied embeddings). CPU (default):
#          hidden 512, 8 layers, 8 heads / 2 KV heads, intermediate 2048, the repository's Llama 2
#          tokenizer (vocab 32000): 46.8M parameters. DEVICE=cuda: Llama-3.2-1B's own shape (hidden
#          2048, 16 layers, 32 / 8 heads, intermediate 8192) with the repository's Llama 3 tokenizer
#          (vocab 128256): 1.236B.
#   data   text rows ({"text"}) each exactly BLOCK tokens with BOS and the appended EOS, so both
#          trainers' packing gives the same rows: TRL's ConstantLengthDataset (SFTConfig packing=True,
#          max_seq_length BLOCK) concatenates BOS+text+EOS of the samples and cuts BLOCK-token rows
#          (here one sample per row), replica packs samples first-fit into rows of block_size BLOCK
#          (one per row). STEPS x WORLD x BATCH x GRAD_ACCUM rows: one epoch, each row once.
#   order  no shuffling: replica --shuffle false; TRL's ConstantLengthDataset(shuffle=False) and a
#          SequentialSampler (its two shuffles only reorder rows); step s trains the same rows on
#          both sides (the scripts prints the step-1 losses: with LoRA's B = 0 and the same model
#          they are the base model's loss on those rows).
#   steps  batch BATCH per worker, GRAD_ACCUM micro-steps, WORLD workers, AdamW (betas 0.9/0.999,
#          eps 1e-8, weight decay 0), lr LR constant, no warm-up, max_grad_norm 1, seed 42,
#          gradient checkpointing off on both sides (replica --disable-gradient-checkpointing;
#          CHECKPOINTING=1 leaves replica's default on, an unequal job), no checkpoints.
#   CPU    fp32; WORLD 2 workers of 1 thread each (replica --nproc-per-node 2 --threads-per-worker 1;
#          TRL: 2 processes under accelerate launch over Gloo, OMP_NUM_THREADS=1 and
#          torch.set_num_threads(1); accelerate's `--cpu --num_processes 2` would start one process,
#          so the launch is trl_referee.py's: --multi_gpu on a machine without GPUs, which
#          accelerate runs as MULTI_CPU).
#   CUDA   DEVICE=cuda: bf16 on both, WORLD 1, one process on cuda:0. LoRA: bf16 autocast, the base
#          held in bf16, adapters fp32. Full: FULL_WEIGHTS=bf16 (the default on CUDA) holds the
#          weights in bf16 on both sides (replica --torch-dtype bfloat16: fp32 masters stepped by
#          the optimizer; TRL: the model loaded in bf16, its bf16 weights stepped in place, as TRL
#          users run it); FULL_WEIGHTS=fp32: fp32 weights under bf16 autocast on both.
# What differs: TRL (transformers 4.57's Trainer) divides each step's summed token loss by the
# number of label tokens including each row's first, which is never predicted (BLOCK per row, where
# the mean has BLOCK - 1): its logged loss and its gradients are (BLOCK - 1) / BLOCK of replica's
# (255/256 at BLOCK 256). The loss table shows TRL's logged loss and that loss x BLOCK/(BLOCK-1);
# AdamW's step is invariant to the scale (up to eps) and clipping at norm 1 cuts both to the same
# norm, so the two jobs train alike.
#
# Counting (bench/preference_tokens_per_s.py, as for the preference trainers): the tokens every
# step feeds the model (BLOCK per row, padding excluded; none here), summed over the workers,
# divided by the wall time from the end of step WARMUP to the end of the last step (startup,
# loading and the first WARMUP steps out). replica: metrics.jsonl (--logging-steps 1); TRL: the
# helper's timing.jsonl (on_step_end times; CUDA synchronized first). The script prints each side's
# token count of the measured steps; they must be equal.
# Memory: CPU: peak RSS of the largest process of the run (/usr/bin/time -v: replica's largest
# worker, TRL's largest rank); CUDA: the caching allocator's peak allocated (replica: its memory
# line at the end of the run; TRL: torch.cuda.max_memory_allocated after train()).
# Held-out loss: `sft_trl_side.py heldout`, one script (transformers + peft) loading both sides'
# last-round results (replica PROJECT/final, TRL's save_model directory) and the base, the mean
# token cross-entropy over the same HELDOUT rows (never trained on).
# MFU (DEVICE=cuda, full): 6 x parameters x tokens/s / (PEAK_TFLOPS x 1e12), bench/llama_step's
# formula (PEAK_TFLOPS from nvidia-smi's name: H100/H200 989, A100 312; 0: none).
#
# Output: one line per run (job, round, side, tokens/s, tokens counted, seconds measured, peak
# memory MiB, wall time incl. startup, CPU seconds user + system of the whole run incl. startup: on
# a machine shared with other work the wall-clock figures depend on each side's share of the cores), per job the step-1 losses, the loss curves side by side
# (round 1), the held-out losses, then per job the medians and ratios (tokens/s > 1: replica
# faster; memory < 1: replica smaller). Raw outputs under WORK (default /tmp/sft_vs_trl).
#
# KEEP_FINALS=1 keeps every round's trained weights (by default only the last round's, which the
# referee reads, stay: a 1.24B full fine-tune writes 5 GB a run).
# SIDES ("replica trl"): SIDES=replica runs replica alone (no TRL needed: tokens/s, memory, loss,
# held-out loss of its result; scripts/gpu_check.sh's scaling runs). HELDOUT_EVAL=0: no referee.
# Environment: STEPS (CPU 20, CUDA 30), WARMUP (2; CUDA 5), BLOCK (CPU 256, CUDA 2048), BATCH (CPU 2,
# CUDA 4), GRAD_ACCUM (1), WORLD (CPU 2, CUDA 1), LR (3e-4), HELDOUT (16 rows), DEVICE (cpu|cuda),
# WORK, PYTHON (.venv/bin/python: torch, transformers, peft, trl 0.13, datasets, accelerate),
# REPLICA (default build/replica; copied into WORK first, so a rebuild during the sitting does not
# change the program), TOKENIZER (a directory with tokenizer.json + tokenizer_config.json, for a
# machine without zstd; default the repository's), REPLICA_ARGS / TRL_ARGS (extra flags for one side).
# Smoke: STEPS=2 WARMUP=1 bench/sft_vs_trl.sh 1
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
shift || true
JOBS=${*:-lora full}
DEVICE=${DEVICE:-cpu}
if [ "$DEVICE" = cuda ]; then
  STEPS=${STEPS:-30} WARMUP=${WARMUP:-5} BLOCK=${BLOCK:-2048} BATCH=${BATCH:-4} WORLD=${WORLD:-1}
  SHAPE=llama-3.2-1b PRECISION=bf16 BF16=--bf16 FULL_WEIGHTS=${FULL_WEIGHTS:-bf16}
else
  STEPS=${STEPS:-20} WARMUP=${WARMUP:-2} BLOCK=${BLOCK:-256} BATCH=${BATCH:-2} WORLD=${WORLD:-2}
  SHAPE=cpu PRECISION=fp32 BF16= FULL_WEIGHTS=${FULL_WEIGHTS:-fp32}
fi
# Full fine-tuning with bf16 weights: each side's flag for it.
weights_args() {  # job side
  [ "$1" = full ] && [ "$FULL_WEIGHTS" = bf16 ] || return 0
  if [ "$2" = replica ]; then echo --torch-dtype bfloat16; else echo --weights-bf16; fi
}
GRAD_ACCUM=${GRAD_ACCUM:-1}
LR=${LR:-3e-4}
HELDOUT=${HELDOUT:-16}
WORK=${WORK:-/tmp/sft_vs_trl}
PY=${PYTHON:-.venv/bin/python}
SIDE=bench/sft_trl_side.py
PER_STEP=$((WORLD * BATCH * GRAD_ACCUM))
ROWS=$((STEPS * PER_STEP))
SIDES=${SIDES:-replica trl}
if [[ " $SIDES " == *" trl "* ]]; then
  "$PY" -c 'import trl, peft, accelerate, transformers, datasets' 2>/dev/null || {
    echo "sft_vs_trl: needs trl, peft, accelerate, datasets and transformers in $PY (scripts/test.sh; or set PYTHON; SIDES=replica runs replica alone)" >&2; exit 1; }
else
  "$PY" -c 'import peft, transformers' 2>/dev/null || { echo "sft_vs_trl: needs peft and transformers in $PY" >&2; exit 1; }
fi
TIMER=()
if [ -x /usr/bin/time ]; then TIMER=(/usr/bin/time -v -o); elif [ "$DEVICE" = cpu ]; then
  echo "sft_vs_trl: needs /usr/bin/time (GNU time) for peak RSS on the CPU" >&2; exit 1; fi
peak_tflops=0
if [ "$DEVICE" = cuda ]; then
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" in
    *H100*|*H200*) peak_tflops=989 ;; *A100*) peak_tflops=312 ;; *L40S*) peak_tflops=362 ;; *A10*) peak_tflops=125 ;;
  esac
fi
PEAK_TFLOPS=${PEAK_TFLOPS:-$peak_tflops}
mkdir -p "$WORK/logs"
cp "${REPLICA:-build/replica}" "$WORK/replica"
BIN=$WORK/replica

# Model, data and the starting adapter (made once per shape and size; delete WORK to remake).
tag=$SHAPE-b$BLOCK-r$ROWS
MODEL=$WORK/model-$SHAPE
DATA=$WORK/data-$tag
if [ ! -f "$MODEL/config.json" ]; then
  "$PY" $SIDE make-model --out "$MODEL" --shape $SHAPE ${TOKENIZER:+--tokenizer "$TOKENIZER"} > "$WORK/logs/make-model-$SHAPE.out" 2>&1 ||
    { tail -5 "$WORK/logs/make-model-$SHAPE.out" >&2; exit 1; }
fi
PARAMS=$(sed -n 's/.*"parameters": \([0-9]*\).*/\1/p' "$WORK/logs/make-model-$SHAPE.out" | tail -1)
if [ ! -f "$DATA/train.jsonl" ]; then
  "$PY" $SIDE make-data --model "$MODEL" --out "$DATA" --block "$BLOCK" --rows "$ROWS" --heldout "$HELDOUT" \
    > "$WORK/logs/make-data.out" 2>&1 || { tail -5 "$WORK/logs/make-data.out" >&2; exit 1; }
fi
if [[ " $JOBS " == *" lora "* ]] && [ ! -f "$WORK/init-lora-$SHAPE/adapter_model.safetensors" ]; then
  "$PY" $SIDE make-adapter --model "$MODEL" --out "$WORK/init-lora-$SHAPE" --r 16 --alpha 32 \
    > "$WORK/logs/make-adapter.out" 2>&1 || { tail -5 "$WORK/logs/make-adapter.out" >&2; exit 1; }
fi
ckpt_flag=--disable-gradient-checkpointing
[ "${CHECKPOINTING:-0}" = 1 ] && ckpt_flag=

peft_args() {  # job side
  [ "$1" = lora ] || return 0
  if [ "$2" = replica ]; then echo "--peft --init-adapter $WORK/init-lora-$SHAPE --lora-r 16 --lora-alpha 32 --lora-dropout 0"
  else echo "--peft --init-adapter $WORK/init-lora-$SHAPE --lora-r 16 --lora-alpha 32"; fi
}
timed() {  # out command...: the run under /usr/bin/time when there is one, its wall time either way
  local out=$1; shift
  local t0; t0=$(date +%s.%N)
  local rc=0
  if [ ${#TIMER[@]} -gt 0 ]; then "${TIMER[@]}" "$out.time" "$@" >"$out.out" 2>&1 || rc=$?
  else "$@" >"$out.out" 2>&1 || rc=$?; fi
  awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f\n", b - a}' > "$out.wall"
  return $rc
}
run_replica() {  # job out
  rm -rf "$2"
  # shellcheck disable=SC2046,SC2086
  timed "$2" "$BIN" llm --train --model "$MODEL" --data-path "$DATA" --project-name "$2" --trainer sft \
    $(peft_args "$1" replica) $(weights_args "$1" replica) --device "$DEVICE" --nproc-per-node "$WORLD" \
    $([ "$DEVICE" = cpu ] && echo --threads-per-worker 1) --batch-size "$BATCH" \
    --gradient-accumulation "$GRAD_ACCUM" --max-steps "$STEPS" --block-size "$BLOCK" --packing true --shuffle false \
    --checkpoint-every 0 --logging-steps 1 --mixed-precision $PRECISION --optimizer adamw --lr "$LR" \
    --scheduler constant --warmup-ratio 0 --warmup-steps 0 --weight-decay 0 --max-grad-norm 1 --seed 42 \
    $ckpt_flag ${REPLICA_ARGS:-}
}
run_trl() {  # job out
  rm -rf "$2"
  # shellcheck disable=SC2046,SC2086
  timed "$2" "$PY" $SIDE train --model "$MODEL" --data "$DATA/train.jsonl" --out "$2" $(peft_args "$1" trl) $(weights_args "$1" trl) \
    --steps "$STEPS" --lr "$LR" --world "$WORLD" --batch "$BATCH" --grad-accum "$GRAD_ACCUM" --block "$BLOCK" \
    --device "$DEVICE" --seed 42 $BF16 ${TRL_ARGS:-}
}
field() { sed -n "s/.*$1=\([0-9.]*\).*/\1/p"; }
mem_mib() {  # side out: CUDA peak allocated, else the peak RSS of the largest process
  if [ "$DEVICE" = cuda ]; then
    if [ "$1" = replica ]; then sed -n 's/.*rank 0:.* peak allocated \([0-9.]*\) MiB.*/\1/p' "$2.out" | tail -1
    else "$PY" -c 'import json, sys; print("%.1f" % json.load(open(sys.argv[1]))["max_allocated_mib"])' "$2/memory.json"; fi
  else awk -F': ' '/Maximum resident/ {printf "%.0f", $2 / 1024}' "$2.time"; fi
}
cpu_s() {  # out: user + system seconds of the whole run (startup included), from /usr/bin/time
  if [ -f "$1.time" ]; then awk -F': ' '/User time/ {u = $2} /System time/ {s = $2} END {printf "%.1f", u + s}' "$1.time"
  else echo -; fi
}
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
busy() { ps -eo comm= | grep -cE '^(cc1plus|ninja|ld|c\+\+|clang|make)$' || true; }

echo "# $(date -u +%FT%TZ) load: $(cut -d' ' -f1-3 /proc/loadavg)  compilers running: $(busy)  replica: $(sha256sum "$BIN" | cut -c1-12)"
echo "# DEVICE=$DEVICE model $SHAPE ($PARAMS parameters) STEPS=$STEPS WARMUP=$WARMUP BLOCK=$BLOCK BATCH=$BATCH GRAD_ACCUM=$GRAD_ACCUM WORLD=$WORLD LR=$LR precision $PRECISION, full fine-tuning weights $FULL_WEIGHTS"
mem_name=rss_MiB; [ "$DEVICE" = cuda ] && mem_name=alloc_MiB
printf "%-5s %5s %-8s %10s %8s %8s %10s %7s %7s\n" job round side "tokens/s" tokens seconds "$mem_name" "wall_s" "cpu_s"
declare -A RT TT RM TM
for j in $JOBS; do
  for i in $(seq "$ROUNDS"); do
    for side in $SIDES; do
      out=$WORK/logs/$j-$side-$i
      if ! "run_$side" "$j" "$out"; then
        echo "sft_vs_trl: $side $j round $i failed; its output: $out.out" >&2; tail -5 "$out.out" >&2; exit 1
      fi
      line=$("$PY" bench/preference_tokens_per_s.py "$side" "$out" --warmup "$WARMUP" --samples-per-step $PER_STEP)
      tps=$(echo "$line" | field tokens_per_s)
      mem=$(mem_mib "$side" "$out")
      printf "%-5s %5s %-8s %10.1f %8s %8s %10s %7.1f %7s\n" "$j" "$i" "$side" "$tps" "$(echo "$line" | field tokens)" \
        "$(echo "$line" | field seconds)" "$mem" "$(cat "$out.wall")" "$(cpu_s "$out")"
      # Only the last round's results are read again (the referee): the others' weights go.
      [ "$i" -lt "$ROUNDS" ] && [ "${KEEP_FINALS:-0}" != 1 ] && rm -rf "$out/final" "$out"/*.safetensors
      if [ $side = replica ]; then RT[$j]+="$tps "; RM[$j]+="$mem "
      else TT[$j]+="$tps "; TM[$j]+="$mem "; fi
    done
  done
done
echo "# end load: $(cut -d' ' -f1-3 /proc/loadavg)  compilers running: $(busy)"
for j in $JOBS; do
  echo
  echo "# $j: loss per step, round 1 (TRL's logged loss, and x $BLOCK/$((BLOCK - 1)) for replica's mean over predicted tokens)"
  trl_log=-; [[ " $SIDES " == *" trl "* ]] && trl_log=$WORK/logs/$j-trl-1/log.jsonl
  "$PY" - "$WORK/logs/$j-replica-1/metrics.jsonl" "$trl_log" "$BLOCK" <<'EOF'
import json, os, sys
rep = {m["step"]: m["loss"] for m in map(json.loads, open(sys.argv[1])) if "loss" in m and "step" in m}
trl = {m["step"]: m["loss"] for m in map(json.loads, open(sys.argv[2])) if "loss" in m} if os.path.exists(sys.argv[2]) else {}
b = int(sys.argv[3])
print("%5s %10s %10s %12s %9s" % ("step", "replica", "TRL", "TRL x b/b-1", "diff"))
for s in sorted(rep):
    t = trl.get(s)
    print("%5d %10.4f %10s %12s %9s" % (s, rep[s], "%.4f" % t if t is not None else "-",
          "%.4f" % (t * b / (b - 1)) if t is not None else "-", "%+.4f" % (rep[s] - t * b / (b - 1)) if t is not None else "-"))
EOF
  [ "${HELDOUT_EVAL:-1}" = 1 ] || continue
  echo "# $j: held-out loss (one referee: bench/sft_trl_side.py heldout, $HELDOUT rows of $BLOCK tokens, last round's results)"
  finals=()
  for side in $SIDES; do
    if [ "$side" = replica ]; then finals+=(--final "$WORK/logs/$j-replica-$ROUNDS/final" --label replica)
    else finals+=(--final "$WORK/logs/$j-trl-$ROUNDS" --label trl); fi
  done
  # shellcheck disable=SC2086
  "$PY" $SIDE heldout --model "$MODEL" --data "$DATA/heldout.jsonl" --device "$DEVICE" $BF16 "${finals[@]}" \
    2>"$WORK/logs/heldout-$j.err" | grep '^heldout' || { echo "(the referee failed:)"; tail -3 "$WORK/logs/heldout-$j.err"; }
done
echo
printf "%-5s %12s %12s %7s %12s %12s %7s\n" job "replica t/s" "TRL t/s" ratio "replica MiB" "TRL MiB" ratio
for j in $JOBS; do
  # shellcheck disable=SC2086
  r=$(printf "%s\n" ${RT[$j]} | median); rm_=$(printf "%s\n" ${RM[$j]} | median)
  if [[ " $SIDES " != *" trl "* ]]; then
    printf "%-5s %12.1f %12s %7s %12s %12s %7s\n" "$j" "$r" - - "$rm_" - -
    [ "$j" = full ] && [ "$PEAK_TFLOPS" != 0 ] && awk -v n="$PARAMS" -v r="$r" -v peak="$PEAK_TFLOPS" \
      'BEGIN {printf "full  MFU (6 x %d parameters x tokens/s / %s TFLOP/s): replica %.3f\n", n, peak, 6 * n * r / (peak * 1e12)}'
    continue
  fi
  # shellcheck disable=SC2086
  p=$(printf "%s\n" ${TT[$j]} | median); pm=$(printf "%s\n" ${TM[$j]} | median)
  awk -v j="$j" -v r="$r" -v p="$p" -v rm="$rm_" -v pm="$pm" \
    'BEGIN {printf "%-5s %12.1f %12.1f %7.3f %12s %12s %7.3f\n", j, r, p, r / p, rm, pm, rm / pm}'
  if [ "$j" = full ] && [ "$PEAK_TFLOPS" != 0 ]; then
    awk -v n="$PARAMS" -v r="$r" -v p="$p" -v peak="$PEAK_TFLOPS" 'BEGIN {printf "full  MFU (6 x %d parameters x tokens/s / %s TFLOP/s): replica %.3f, TRL %.3f\n", n, peak, 6 * n * r / (peak * 1e12), 6 * n * p / (peak * 1e12)}'
  fi
done
