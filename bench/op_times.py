#!/usr/bin/env python3
"""Self time per operator from Chrome traces (bench_llama_step --profile, llama_step.py --profile),
side by side: where one implementation spends time the other does not.
usage: bench/op_times.py replica.json pytorch.json [--top 25]"""
import argparse, collections, json


def self_times(path):
    events = json.load(open(path))
    if isinstance(events, dict):
        events = events.get("traceEvents", [])
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            by_thread[e.get("tid")].append((float(e["ts"]), float(e["dur"]), e["name"]))
    totals = collections.Counter()
    for spans in by_thread.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack = []  # [end, name, child time]
        def close(upto):
            while stack and stack[-1][0] <= upto:
                end, name, child, dur = stack.pop()
                totals[name] += dur - child
                if stack:
                    stack[-1][2] += dur
        for ts, dur, name in spans:
            close(ts)
            stack.append([ts + dur, name, 0.0, dur])
        close(float("inf"))
    return totals


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    a, b = self_times(args.a), self_times(args.b)
    ta, tb = sum(a.values()), sum(b.values())
    print(f"{'operator':<48} {'A ms':>10} {'B ms':>10}")
    for name in sorted(set(a) | set(b), key=lambda n: -max(a[n], b[n]))[: args.top]:
        print(f"{name[:48]:<48} {a[name] / 1e3:>10.1f} {b[name] / 1e3:>10.1f}")
    print(f"{'total self time':<48} {ta / 1e3:>10.1f} {tb / 1e3:>10.1f}")


if __name__ == "__main__":
    main()
