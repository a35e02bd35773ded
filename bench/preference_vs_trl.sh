#!/usr/bin/env bash
# Tokens/s of replica's preference trainers (dpo, orpo, reward) against TRL 0.13 under
# `accelerate launch` on the same job, 2 CPU workers of 1 thread each, LoRA, fp32; measured
# as bench/README.md asks of side-by-side runs (one sitting, alternating, medians).
#
#   bench/preference_vs_trl.sh [ROUNDS] [TRAINER...]
#       ROUNDS (default 3) alternating rounds per trainer, replica first in each round;
#       TRAINERs default to "dpo orpo reward".
#
# The job (both sides): a Llama-shape model from the referee
# (replica/tasks/llm_preference/tests/referee/trl_referee.py make-model: hidden 256, 4 layers,
# 8 heads over 4 KV heads, SwiGLU 688, its 384-id byte-level BPE, 3.2M parameters), 256 text
# preference rows (make-data --repeat 2: 50-140 tokens a sequence, ~1,300 tokens of chosen +
# rejected sequences a step over both workers), batch 4 per worker, STEPS (default 30) steps,
# LoRA r 16 / alpha 32 / dropout 0 on every linear, AdamW, lr 1e-4 constant, max_grad_norm 1,
# block_size 256, max_prompt_length 128, max_completion_length 128 (nothing is cut), no shuffling,
# no checkpoints. Both start from the same adapter (a TRL run of one step, --random-lora, made
# once per trainer before the rounds: its init/ goes to both as --init-adapter) and read the
# same rows in the same order on each worker (replica deals rows out in turn, TRL gives each rank
# consecutive rows: replica reads a reordered copy, as the conformance test does for ORPO), so
# every step is the same computation (the losses agree; the script prints both first losses).
# Gradient checkpointing is off on both sides (the referee builds TRL without it, as
# AutoTrain's option does; CHECKPOINTING=1 leaves replica's default on, an unequal job).
#
# Counting (bench/preference_tokens_per_s.py): the tokens of the chosen and rejected sequences
# each step feeds the model, padding excluded, summed over the workers, divided by the wall time
# from the end of step WARMUP (default 2) to the end of the last step: startup, model loading and
# the warm-up steps are out. replica: its metrics.jsonl (--logging-steps 1); TRL: the referee's
# `train --timing` (on_step_end times, tokens from each collated batch). Both sides count the
# same tokens (the script prints each side's count of the measured steps; they must be equal).
#
# Output: one line per run (trainer, round, side, tokens/s, tokens counted, seconds measured,
# peak RSS of the largest process of the run from /usr/bin/time -v, the run's wall time incl.
# startup), then per trainer the medians of each side and replica / TRL (> 1: replica faster;
# for RSS < 1: replica smaller). Raw outputs stay under WORK (default /tmp/preference_vs_trl).
#
# Environment: STEPS, WARMUP, WORK, PYTHON (.venv/bin/python: torch, transformers, peft, trl
# 0.13, accelerate), REPLICA (default build/replica; copied into WORK first, so that a rebuild
# during the sitting does not change the program), REPLICA_ARGS / TRL_ARGS (extra flags for one
# side), CHECKPOINTING (0). The machine should be quiet: each run takes both cores.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
shift || true
TRAINERS=${*:-dpo orpo reward}
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-2}
WORK=${WORK:-/tmp/preference_vs_trl}
PY=${PYTHON:-.venv/bin/python}
REFEREE=replica/tasks/llm_preference/tests/referee/trl_referee.py
BATCH=4
WORLD=2
"$PY" -c 'import trl, peft, accelerate, transformers' 2>/dev/null || {
  echo "preference_vs_trl: needs trl, peft, accelerate and transformers in $PY (scripts/test.sh; or set PYTHON)" >&2; exit 1; }
[ -x /usr/bin/time ] || { echo "preference_vs_trl: needs /usr/bin/time (GNU time) for peak RSS" >&2; exit 1; }
mkdir -p "$WORK/logs"
cp "${REPLICA:-build/replica}" "$WORK/replica"
BIN=$WORK/replica

# The model and data (made once; delete WORK to remake).
if [ ! -f "$WORK/model/config.json" ]; then
  "$PY" "$REFEREE" make-model --out "$WORK/model" --hidden 256 --layers 4 --heads 8 --kv-heads 4 \
    --intermediate 688 --max-positions 256 --init-std 0.02 >/dev/null
fi
if [ ! -f "$WORK/data/train.jsonl" ]; then
  mkdir -p "$WORK/data" "$WORK/dealt"
  "$PY" "$REFEREE" make-data --out "$WORK/data/train.jsonl" --rows 256 --repeat 2 >/dev/null
  # replica's worker r reads rows r, r + 2, ..; TRL's rank r the r-th run of BATCH consecutive
  # rows of each group of BATCH x 2: reorder so that each worker of replica gets TRL's rows.
  "$PY" - "$WORK/data/train.jsonl" "$WORK/dealt/train.jsonl" $BATCH <<'EOF'
import sys
rows = open(sys.argv[1]).read().splitlines()
b = int(sys.argv[3])
order = [k for i in range(b) for k in (i, b + i)]
out = [rows[g + k] for g in range(0, len(rows) - len(rows) % (2 * b), 2 * b) for k in order]
open(sys.argv[2], "w").write("\n".join(out) + "\n")
EOF
fi
LENGTHS="--max-prompt-length 128 --max-completion-length 128"
ckpt_flag=--disable-gradient-checkpointing
[ "${CHECKPOINTING:-0}" = 1 ] && ckpt_flag=

run_replica() {  # trainer out
  rm -rf "$2"
  /usr/bin/time -v -o "$2.time" "$BIN" llm --train --model "$WORK/model" --data-path "$WORK/dealt" \
    --project-name "$2" --trainer "$1" --peft --init-adapter "$WORK/init-$1" --lora-r 16 --lora-alpha 32 \
    --lora-dropout 0 --nproc-per-node $WORLD --threads-per-worker 1 --batch-size $BATCH \
    --gradient-accumulation 1 --max-steps "$STEPS" --block-size 256 $LENGTHS --shuffle false \
    --checkpoint-every 0 --logging-steps 1 --mixed-precision fp32 --lr 1e-4 --scheduler constant \
    --warmup-ratio 0 $ckpt_flag ${REPLICA_ARGS:-} >"$2.out" 2>&1
}
run_trl() {  # trainer out
  rm -rf "$2"
  /usr/bin/time -v -o "$2.time" "$PY" "$REFEREE" train --trainer "$1" --model "$WORK/model" \
    --data "$WORK/data/train.jsonl" --out "$2" --peft --lora-r 16 --lora-alpha 32 \
    --init-adapter "$WORK/init-$1" --steps "$STEPS" --lr 1e-4 --world $WORLD --batch $BATCH \
    --max-length 256 $LENGTHS --timing ${TRL_ARGS:-} >"$2.out" 2>&1
}
field() { sed -n "s/.*$1=\([0-9.]*\).*/\1/p"; }
rss_mib() { awk -F': ' '/Maximum resident/ {printf "%.0f", $2 / 1024}' "$1"; }
wall_s() { awk -F': ' '/Elapsed \(wall/ {n = split($2, a, ":"); s = 0; for (i = 1; i <= n; i++) s = s * 60 + a[i]; printf "%.1f", s}' "$1"; }
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

echo "# $(date -u +%FT%TZ) load: $(cut -d' ' -f1-3 /proc/loadavg)  replica: $(sha256sum "$BIN" | cut -c1-12)  STEPS=$STEPS WARMUP=$WARMUP"
printf "%-7s %5s %-8s %10s %8s %8s %9s %7s\n" trainer round side "tokens/s" tokens seconds "rss_MiB" "wall_s"
declare -A RT TT RR TR
for t in $TRAINERS; do
  if [ ! -f "$WORK/init-$t/adapter_model.safetensors" ]; then  # the common starting adapter
    "$PY" "$REFEREE" train --trainer "$t" --model "$WORK/model" --data "$WORK/data/train.jsonl" \
      --out "$WORK/prep-$t" --peft --lora-r 16 --lora-alpha 32 --random-lora --steps 1 --lr 1e-4 \
      --world $WORLD --batch $BATCH --max-length 256 $LENGTHS >"$WORK/logs/prep-$t.out" 2>&1
    rm -rf "$WORK/init-$t"; cp -r "$WORK/prep-$t/init" "$WORK/init-$t"
  fi
  for i in $(seq "$ROUNDS"); do
    for side in replica trl; do
      out=$WORK/logs/$t-$side-$i
      if ! "run_$side" "$t" "$out"; then
        echo "preference_vs_trl: $side $t round $i failed; its output: $out.out" >&2; tail -5 "$out.out" >&2; exit 1
      fi
      line=$("$PY" bench/preference_tokens_per_s.py "$side" "$out" --warmup "$WARMUP" --samples-per-step $((BATCH * WORLD)))
      tps=$(echo "$line" | field tokens_per_s)
      printf "%-7s %5s %-8s %10.1f %8s %8s %9s %7s\n" "$t" "$i" "$side" "$tps" "$(echo "$line" | field tokens)" \
        "$(echo "$line" | field seconds)" "$(rss_mib "$out.time")" "$(wall_s "$out.time")"
      if [ $side = replica ]; then RT[$t]+="$tps "; RR[$t]+="$(rss_mib "$out.time") "
      else TT[$t]+="$tps "; TR[$t]+="$(rss_mib "$out.time") "; fi
    done
  done
  # The same job: step 1's loss (TRL logs it rounded to 4 digits).
  echo "# $t step-1 loss: replica $(head -1 "$WORK/logs/$t-replica-1/metrics.jsonl" | sed 's/.*"loss":\([-0-9.e]*\).*/\1/')," \
    "TRL $(head -1 "$WORK/logs/$t-trl-1/log.jsonl" | sed 's/.*"loss": \([-0-9.e]*\).*/\1/')"
done
echo "# end load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
printf "%-7s %12s %12s %7s %12s %12s %7s\n" trainer "replica t/s" "TRL t/s" ratio "replica MiB" "TRL MiB" ratio
for t in $TRAINERS; do
  r=$(printf "%s\n" ${RT[$t]} | median); p=$(printf "%s\n" ${TT[$t]} | median)
  rm_=$(printf "%s\n" ${RR[$t]} | median); pm=$(printf "%s\n" ${TR[$t]} | median)
  printf "%-7s %12.1f %12.1f %7.3f %12s %12s %7.3f\n" "$t" "$r" "$p" "$(echo "$r / $p" | bc -l)" "$rm_" "$pm" \
    "$(echo "$rm_ / $pm" | bc -l)"
done
