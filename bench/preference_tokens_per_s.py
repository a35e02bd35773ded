"""Tokens/s of one preference run (bench/preference_vs_trl.sh), counted the same way on both sides.

  preference_tokens_per_s.py replica PROJECT_DIR --warmup W --samples-per-step S
  preference_tokens_per_s.py trl OUT_DIR --warmup W

Tokens: those of the chosen and rejected sequences every step feeds the model (padding excluded),
summed over the workers; time: the wall time from the end of step W to the end of the last step
(startup, model loading and the first W steps left out). Prints one line:
  tokens_per_s=.. tokens=.. seconds=.. steps=..

replica: metrics.jsonl (--logging-steps 1): each line's window is one step, from the end of the
previous step's log line to this one's; its tokens are tokens_per_s * seconds, its seconds
S / samples_per_s (S = batch x workers, every batch full).
TRL (trl_referee.py train --timing): timing.jsonl (rank 0) and timing.rank1.jsonl, the ranks'
tokens added per step; the time is rank 0's on_step_end of the last step minus that of step W
(each interval holds the batch's loading and the previous step's logging, as replica's does).
"""
import argparse
import json
import os
import sys


def lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def replica(args):
    steps = [m for m in lines(os.path.join(args.dir, "metrics.jsonl")) if "tokens_per_s" in m and "step" in m]
    measured = [m for m in steps if m["step"] > args.warmup]
    seconds = sum(args.samples_per_step / m["samples_per_s"] for m in measured)
    tokens = sum(m["tokens_per_s"] * args.samples_per_step / m["samples_per_s"] for m in measured)
    return round(tokens), seconds, len(measured)


def trl(args):
    ranks = [lines(os.path.join(args.dir, "timing.jsonl"))]
    k = 1
    while os.path.exists(os.path.join(args.dir, "timing.rank%d.jsonl" % k)):
        ranks.append(lines(os.path.join(args.dir, "timing.rank%d.jsonl" % k)))
        k += 1
    steps = ranks[0]
    if any(len(r) != len(steps) for r in ranks):
        sys.exit("preference_tokens_per_s: the ranks logged different step counts")
    tokens = sum(r[i]["tokens"] for r in ranks for i in range(args.warmup, len(steps)))
    seconds = steps[-1]["t_end"] - steps[args.warmup - 1]["t_end"] if args.warmup > 0 else \
        steps[-1]["t_end"] - steps[0]["t_begin"]
    return tokens, seconds, len(steps) - args.warmup


def main():
    p = argparse.ArgumentParser()
    p.add_argument("side", choices=["replica", "trl"])
    p.add_argument("dir")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--samples-per-step", type=int, default=8)
    args = p.parse_args()
    tokens, seconds, steps = (replica if args.side == "replica" else trl)(args)
    if steps <= 0 or seconds <= 0:
        sys.exit("preference_tokens_per_s: no measured steps in %s" % args.dir)
    print("tokens_per_s=%.1f tokens=%d seconds=%.3f steps=%d" % (tokens / seconds, tokens, seconds, steps))


if __name__ == "__main__":
    sys.dont_write_bytecode = True
    main()
