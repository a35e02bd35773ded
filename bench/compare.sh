#!/usr/bin/env bash
# replica vs PyTorch DDP (PyTorch 2.x from the same wheel replica builds against, in .venv;
# Gloo, CPU) on the peer's workloads, alternating
# runs in one sitting. Prints samples/s of each side, the ratio, and each side's scaling
# efficiency (world-2 samples/s over twice world-1 samples/s). See bench/README.md.
#   bench/compare.sh [ROUNDS] [small|large|all]
# REPLICA_BENCH_ARGS adds flags to replica's side (e.g. "--shard-optimizer false" for plain DDP,
# --torch-sgd).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-3}
WHICH=${2:-all}
PEER=${PEER_DIR:-../shared/bench}
BIN=${BUILD_DIR:-build}
PY=${PEER_PYTHON:-.venv/bin/python}
"$PY" -c 'import torch, numpy' 2>/dev/null || {
  echo "compare: needs torch and numpy in $PY (scripts/test.sh installs both into .venv; or set PEER_PYTHON)" >&2; exit 1; }

small="--hidden 1024 --layers 2 --batch 128 --steps 200"
large="--hidden 4096 --layers 4 --batch 16 --steps 20 --warmup 3"
workloads=()
[ "$WHICH" = small ] || [ "$WHICH" = all ] && workloads+=("MLP-1.8M|$small")
[ "$WHICH" = large ] || [ "$WHICH" = all ] && workloads+=("MLP-54M|$large")

port=29700
sps() { sed -n 's/.*samples\/s=\([0-9.]*\).*/\1/p'; }
run_peer() { port=$((port + 1)); "$PEER/spawn.sh" "$1" $port "$PY" "$PEER/ddp_mlp.py" $2 2>/dev/null | sps; }
run_replica() {
  if [ "$1" = 1 ]; then OMP_NUM_THREADS=1 "$BIN/bench/bench_ddp_mlp" $2 ${REPLICA_BENCH_ARGS:-} | sps
  else "$BIN/replica" launch --nproc-per-node "$1" --threads-per-worker 1 -- "$BIN/bench/bench_ddp_mlp" $2 ${REPLICA_BENCH_ARGS:-} | sps; fi
}
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

printf "%-9s %5s %14s %14s %7s\n" workload world "pytorch-ddp" replica ratio
for w in "${workloads[@]}"; do
  name=${w%%|*}; args=${w#*|}
  declare -A P R
  for world in 1 2; do
    p=(); r=()
    for i in $(seq "$ROUNDS"); do p+=("$(run_peer $world "$args")"); r+=("$(run_replica $world "$args")"); done
    P[$world]=$(printf "%s\n" "${p[@]}" | median); R[$world]=$(printf "%s\n" "${r[@]}" | median)
    printf "%-9s %5s %14.1f %14.1f %7.2f\n" "$name" $world "${P[$world]}" "${R[$world]}" "$(echo "${R[$world]} / ${P[$world]}" | bc -l)"
  done
  printf "%-9s %5s %14.2f %14.2f\n" "$name" "eff." "$(echo "${P[2]} / (2 * ${P[1]})" | bc -l)" "$(echo "${R[2]} / (2 * ${R[1]})" | bc -l)"
done
