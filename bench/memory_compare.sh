#!/usr/bin/env bash
# Peak memory and tokens/s of a LoRA SFT step, replica (build/bench/bench_memory_llm) against
# transformers + peft (bench/memory_llm.py) on the same Llama-shape model; see bench/README.md,
# "Memory (LoRA SFT, seq 2048)".
#
#   bench/memory_compare.sh [ROUNDS] [ARGS...]
#       ROUNDS (default 3) alternating rounds, one process per run (so each run's peak RSS is its
#       own), replica first in each round; ARGS go to both sides (--device, --dtype, the shape,
#       --seq, --steps, --threads, ...), REPLICA_ARGS / PEER_ARGS to one side only. Prints every
#       run's line, then the medians of each side and replica / peer for tokens/s and each memory
#       figure (peak RSS on the CPU, the CUDA allocator's peaks on a GPU). PEER_ENV: variables for
#       the peer's process only, e.g. PEER_ENV=MALLOC_MMAP_THRESHOLD_=131072 (glibc then maps every
#       block over 128 KiB and unmaps it on free: the peer's peak RSS falls, its steps slow down).
#
#   bench/memory_compare.sh fit [LIMIT_GIB] [ARGS...]
#       The largest Llama-shape model whose one LoRA SFT step (batch 1, --seq, default 2048)
#       completes with peak RSS <= LIMIT_GIB (default 16) on this machine, for each base in
#       FIT_QUANT (default "none int4"; --dtype bf16 unless ARGS say otherwise). For each width in
#       FIT_WIDTHS it measures one step at FIT_PROBE layers (default "2 6"; with checkpointing the
#       peak grows with the depth by the parameters, adapters and one saved input per layer, plus
#       what the allocator keeps, so shallow probes give a rough line), fits the
#       line, and takes the deepest model under the limit; then it runs the largest of those
#       (FIT_VERIFY=1, the default) and refines the depth through the measured peaks (up to
#       FIT_TRIES runs) until N layers fit and N + 1 are measured not to. Every run is stopped by
#       --max-rss-gib as soon as its RSS passes the limit (the refining runs: the limit times
#       FIT_OVERSHOOT, 1.15, so that they still measure their peak) or MemAvailable falls under
#       1 GiB, so a model that does not fit never reaches the OOM killer. FIT_SIDES="replica peer"
#       searches transformers + peft too (unquantized only).
#
# PYTHON (default .venv/bin/python) runs the peer, BENCH (default build/bench) holds bench_memory_llm.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BENCH=${BENCH:-build/bench}
[ -x "$BENCH/bench_memory_llm" ] || { echo "memory_compare: $BENCH/bench_memory_llm is missing (ninja -C build bench/bench_memory_llm)" >&2; exit 1; }

if [ "${1:-}" = fit ]; then
  shift
  LIMIT=16
  if [[ "${1:-}" =~ ^[0-9]+([.][0-9]+)?$ ]]; then LIMIT=$1; shift; fi
  exec "$PY" - "$LIMIT" "$@" <<'PY'
import os, re, subprocess, sys

limit_gib, args = float(sys.argv[1]), sys.argv[2:]
if "--device" in args and args[args.index("--device") + 1] == "cuda":
    sys.exit("memory_compare fit: CPU only (it measures the machine's RSS)")
if "--dtype" not in args:
    args += ["--dtype", "bf16"]
bench, py = os.path.join(os.environ.get("BENCH", "build/bench"), "bench_memory_llm"), os.environ.get("PYTHON", ".venv/bin/python")
quants = os.environ.get("FIT_QUANT", "none int4").split()
sides = os.environ.get("FIT_SIDES", "replica").split()
probe = [int(x) for x in os.environ.get("FIT_PROBE", "2 6").split()]
verify = os.environ.get("FIT_VERIFY", "1") == "1"
# Llama-family widths: hidden, heads, KV heads, SwiGLU size (Llama 2's 7B/13B/30B MLP ratios,
# grouped-query attention with 8 KV heads as in Llama 3).
shapes = {1024: (16, 8, 2816), 2048: (32, 8, 5632), 3072: (24, 8, 8192), 4096: (32, 8, 11008),
          5120: (40, 8, 13824), 6656: (52, 4, 17920), 8192: (64, 8, 28672)}
widths = [int(w) for w in os.environ.get("FIT_WIDTHS", "2048 3072 4096 5120 6656 8192").split()]
limit_mib = limit_gib * 1024.0
# Verification runs may pass the limit by this much before they are stopped, so that a run just
# over it still measures its peak (the next guess is drawn through it).
cap_gib = limit_gib * float(os.environ.get("FIT_OVERSHOOT", "1.15"))


def run(side, quant, hidden, layers, cap):
    heads, kv, inter = shapes[hidden]
    shape = ["--hidden", str(hidden), "--layers", str(layers), "--heads", str(heads), "--kv-heads", str(kv),
             "--intermediate", str(inter)]
    cmd = ([bench] if side == "replica" else [py, "bench/memory_llm.py"]) + shape + [
        "--steps", "1", "--warmup", "0", "--max-rss-gib", f"{cap:g}", "--quantization", quant] + args
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [l for l in out.stdout.splitlines() if l.startswith("side=")]
    kv_ = dict(f.split("=", 1) for f in lines[-1].split()) if lines else {}
    done = out.returncode == 0 and "peak_rss_mib" in kv_
    peak = float(kv_["peak_rss_mib"]) if done else None  # None: stopped at the cap, or failed
    last = lines[-1] if lines else (out.stdout.strip().splitlines() or [""])[-1]
    print(f"  {side} {quant} hidden={hidden} layers={layers}: rc={out.returncode} {last}", flush=True)
    return out.returncode, kv_, peak


def line_through(p, q):  # (layers, peak) points -> (peak at 0 layers, MiB per layer)
    slope = (q[1] - p[1]) / (q[0] - p[0])
    return p[1] - slope * p[0], slope


def deepest_under(intercept, slope):
    return int((limit_mib - intercept) // slope) if slope > 0 else 10**6


for side in sides:
    for quant in quants:
        if side != "replica" and quant != "none":
            continue
        print(f"== {side}, base {quant}, limit {limit_gib:g} GiB, args {' '.join(args)}", flush=True)
        best, runnable = None, True
        for hidden in widths:
            pts = []
            for layers in probe:
                rc, kv_, peak = run(side, quant, hidden, layers, limit_gib)
                if rc == 2:
                    runnable = False
                if peak is None or peak > limit_mib:
                    break
                pts.append((layers, peak, int(kv_["params"])))
            if len(pts) < len(probe):
                break  # not runnable, or this width does not fit even shallow (wider ones neither)
            (l1, m1, p1), (l2, m2, p2) = pts[0], pts[-1]
            intercept, slope = line_through((l1, m1), (l2, m2))
            params_per_layer = (p2 - p1) / (l2 - l1)
            deepest = deepest_under(intercept, slope)
            params = p1 + (deepest - l1) * params_per_layer
            print(f"  hidden {hidden}: {slope:.0f} MiB per layer + {intercept:.0f} MiB; deepest under {limit_gib:g} GiB "
                  f"by the line: {deepest} layers, {params / 1e9:.2f}B parameters", flush=True)
            if best is None or params > best["params"]:
                best = dict(hidden=hidden, deepest=deepest, params=params, slope=slope, pts=[(l, m) for l, m, _ in pts])
        if not runnable:
            print(f"RESULT {side} base={quant}: not runnable (the binary refuses --quantization {quant})")
            continue
        if best is None:
            print(f"RESULT {side} base={quant}: no width fits even at {probe[0]} layers")
            continue
        hidden, pts = best["hidden"], list(best["pts"])
        if not verify:
            print(f"RESULT {side} base={quant}: predicted largest hidden={hidden} layers={best['deepest']} "
                  f"params={best['params'] / 1e9:.2f}B (not measured, FIT_VERIFY=0)")
            continue
        # The line from shallow probes runs a little low at depth (allocator caches grow with the
        # model): run the guess, draw the next line through the two deepest measured points, and
        # stop when a depth fits and the one above it is measured not to.
        lo, hi, fit_kv, layers = max(l for l, _ in pts), None, None, best["deepest"]
        for attempt in range(int(os.environ.get("FIT_TRIES", "5"))):
            if layers <= lo or (hi is not None and layers >= hi):
                break
            rc, kv_, peak = run(side, quant, hidden, layers, cap_gib)
            if peak is not None and peak <= limit_mib:
                lo, fit_kv = layers, kv_
            else:
                hi = layers
            if hi is not None and hi == lo + 1:
                break
            if peak is None:
                # Stopped at the cap: its peak is above it, so the line through the cap runs
                # under the true one and its guess is too deep at worst (hi bounds it).
                deep = [max(p for p in pts if p[0] <= lo), (layers, cap_gib * 1024.0)]
            else:
                pts.append((layers, peak))
                deep = sorted(pts)[-2:]
            intercept, slope = line_through(*deep) if deep[0][0] != deep[1][0] else (0.0, 0.0)
            # Neighbouring depths differ by about one layer's bytes, less than the allocator's
            # noise: never draw a line flatter than half the probes' one.
            if slope < best["slope"] / 2:
                slope = best["slope"] / 2
                intercept = deep[-1][1] - slope * deep[-1][0]
            guess = deepest_under(intercept, slope)
            layers = max(lo + 1, min(guess, (hi - 1) if hi is not None else guess))
        if fit_kv is None:
            print(f"RESULT {side} base={quant}: hidden={hidden}: only the {lo}-layer probe measured to fit")
            continue
        print(f"RESULT {side} base={quant}: largest measured hidden={hidden} layers={lo} "
              f"params={int(fit_kv['params']) / 1e9:.2f}B peak_rss={float(fit_kv['peak_rss_mib']) / 1024:.2f} GiB "
              f"base={float(fit_kv['base_mib']) / 1024:.2f} GiB tokens/s={fit_kv.get('tokens/s')}; "
              + (f"{hi} layers measured over" if hi == lo + 1 else
                 f"{lo + 1} layers not measured" if hi is None else f"{hi} layers measured over, {lo + 1}..{hi - 1} not"),
              flush=True)
PY
fi

ROUNDS=3
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then ROUNDS=$1; shift; fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# shellcheck disable=SC2086
for i in $(seq "$ROUNDS"); do
  "$BENCH/bench_memory_llm" "$@" ${REPLICA_ARGS:-} > "$WORK/r.log" 2>&1
  rc=$?
  grep "^side=" "$WORK/r.log" | tail -1 | tee -a "$WORK/replica.txt"
  [ $rc -eq 0 ] || { echo "replica run $i failed (rc $rc):"; tail -5 "$WORK/r.log"; }
  env ${PEER_ENV:-} "$PY" bench/memory_llm.py "$@" ${PEER_ARGS:-} > "$WORK/p.log" 2>&1
  rc=$?
  grep "^side=" "$WORK/p.log" | tail -1 | tee -a "$WORK/peer.txt"
  [ $rc -eq 0 ] || { echo "transformers+peft run $i failed (rc $rc):"; tail -5 "$WORK/p.log"; }
done
touch "$WORK/replica.txt" "$WORK/peer.txt"
"$PY" - "$WORK/replica.txt" "$WORK/peer.txt" <<'PY'
import statistics, sys

def rows(path):
    return [dict(f.split("=", 1) for f in l.split()) for l in open(path) if l.startswith("side=") and "exceeded=1" not in l]

rep, peer = rows(sys.argv[1]), rows(sys.argv[2])
if not rep or not peer:
    sys.exit("memory_compare: a side produced no result")
def med(rs, key):
    vals = [float(r[key]) for r in rs if key in r]
    return statistics.median(vals) if vals else None
r0 = rep[0]
print(f"\nLoRA SFT step, {r0['params']} parameters ({int(r0['trainable'])} trainable), batch {r0['batch']} x seq {r0['seq']}, "
      f"{r0['device']} {r0['dtype']}, {len(rep)}/{len(peer)} runs, medians:")
print(f"{'':22s} {'transformers+peft':>18s} {'replica':>12s} {'replica/peer':>13s}")
ratios = {}
for key in ["tokens/s", "cpu_tokens/s", "peak_rss_mib", "step_peak_rss_mib", "rss_model_mib", "rss_base_mib",
            "state_mib", "base_mib", "cuda_peak_alloc_mib", "cuda_peak_reserved_mib"]:
    r, p = med(rep, key), med(peer, key)
    if r is None or p is None:
        continue
    ratios[key] = r / p if p else float("nan")
    print(f"{key:22s} {p:18.1f} {r:12.1f} {ratios[key]:13.3f}")
# What the model and the step add to the runtime (interpreter and libraries) each side starts with.
r, p = med(rep, "peak_rss_mib") - med(rep, "rss_base_mib"), med(peer, "peak_rss_mib") - med(peer, "rss_base_mib")
print(f"{'peak_rss - rss_base':22s} {p:18.1f} {r:12.1f} {r / p if p else float('nan'):13.3f}")
mem_key = "cuda_peak_alloc_mib" if r0["device"] == "cuda" else "peak_rss_mib"
m, t = ratios.get(mem_key), ratios.get("tokens/s")
print(f"goals: {mem_key} replica/peer {m:.3f} (<= 0.70: {'met' if m is not None and m <= 0.70 else 'not met'}), "
      f"tokens/s {t:.3f} (>= 1.00: {'met' if t is not None and t >= 1.0 else 'not met'})")
PY
