"""Referee for replica's TensorBoard event files: tensorboard's own EventAccumulator.

Usage: tensorboard_referee.py PROJECT_DIR

Loads every events.out.tfevents.* file of PROJECT_DIR with
tensorboard.backend.event_processing.event_accumulator.EventAccumulator (no size limit) and
checks that it holds exactly the scalars of PROJECT_DIR/metrics.jsonl, as docs/yaml.md names
them: each numeric key K of a line other than "step" is the tag "eval/<rest>" when K is
"eval_<rest>", else "train/K", at that line's step, with the value as float32 (what
TensorBoard's simple_value holds). Per tag, steps and values must match in order. Prints a
one-line summary; exits 1 naming every difference.
"""
import glob
import json
import math
import os
import sys

import numpy as np
from tensorboard.backend.event_processing import event_accumulator


def expected_scalars(metrics_path):
    expected = {}
    with open(metrics_path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            step = row["step"]
            for key, value in row.items():
                if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                tag = "eval/" + key[len("eval_"):] if key.startswith("eval_") else "train/" + key
                expected.setdefault(tag, []).append((step, float(np.float32(value))))
    return expected


def main() -> int:
    project = sys.argv[1]
    files = sorted(glob.glob(os.path.join(project, "events.out.tfevents.*")))
    if not files:
        print(f"no events.out.tfevents.* in {project}")
        return 1
    acc = event_accumulator.EventAccumulator(project, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()[event_accumulator.SCALARS]}
    expected = expected_scalars(os.path.join(project, "metrics.jsonl"))

    problems = []
    if acc.file_version != 2.0:
        problems.append(f"file_version {acc.file_version!r}, expected 2.0 (brain.Event:2)")
    if sorted(got) != sorted(expected):
        problems.append(f"tags differ: only in events {sorted(set(got) - set(expected))}, "
                        f"only in metrics.jsonl {sorted(set(expected) - set(got))}")
    for tag in sorted(set(got) & set(expected)):
        g, e = got[tag], expected[tag]
        if [s for s, _ in g] != [s for s, _ in e]:
            problems.append(f"{tag}: steps {[s for s, _ in g]} != metrics.jsonl {[s for s, _ in e]}")
            continue
        for (step, gv), (_, ev) in zip(g, e):
            if not (gv == ev or (math.isnan(gv) and math.isnan(ev))):
                problems.append(f"{tag} step {step}: event value {gv!r} != metrics.jsonl {ev!r} (float32)")
    points = sum(len(v) for v in got.values())
    if problems:
        print("\n".join(problems))
        return 1
    print(f"{len(files)} event file(s), {len(got)} tags, {points} scalars equal to metrics.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
