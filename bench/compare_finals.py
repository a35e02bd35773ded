"""Whether replica runs at different world sizes (or engines) trained the same model: their loss
curves (metrics.jsonl) and final weights (PROJECT/final/model*.safetensors) against a reference run,
for scripts/gpu_check.sh's multi-GPU section (world N against world 1 at the same global batch).

  compare_finals.py --init MODEL_DIR --tol T REF_PROJECT OTHER_PROJECT...

Per other run, one line: the largest relative difference of the per-step losses, and the weights'
difference measured against the update: max over tensors of max|w - w_ref| / max|w_ref - w_init|
(the training's own change of the reference; a difference of plain weights would be small next to
the weights whatever the update did). PASS when both are <= T, else FAIL; exits 1 on any FAIL.
"""
import argparse
import glob
import json
import os
import sys

sys.dont_write_bytecode = True


def weights(directory):
    from safetensors.torch import load_file
    out = {}
    for f in sorted(glob.glob(os.path.join(directory, "model*.safetensors"))):
        out.update(load_file(f))
    if not out:
        raise SystemExit("compare_finals: no model*.safetensors in %s" % directory)
    return {k: v.double() for k, v in out.items()}


def losses(project):
    with open(os.path.join(project, "metrics.jsonl")) as f:
        return {m["step"]: m["loss"] for m in map(json.loads, f) if "loss" in m and "step" in m}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--init", required=True, help="the model both started from")
    p.add_argument("--tol", type=float, default=1e-2)
    p.add_argument("ref")
    p.add_argument("others", nargs="+")
    a = p.parse_args()
    init, ref, ref_loss = weights(a.init), weights(os.path.join(a.ref, "final")), losses(a.ref)
    update = {k: float((ref[k] - init[k]).abs().max()) for k in ref if k in init}
    failed = False
    for other in a.others:
        w, l = weights(os.path.join(other, "final")), losses(other)
        if set(w) != set(ref):
            print("%s: tensors differ from %s: %s" % (other, a.ref, sorted(set(w) ^ set(ref))[:4]))
            failed = True
            continue
        steps = sorted(set(l) & set(ref_loss))
        dl = max(abs(l[s] - ref_loss[s]) / max(abs(ref_loss[s]), 1e-12) for s in steps) if steps else float("inf")
        worst, name = 0.0, ""
        for k in ref:
            d = float((w[k] - ref[k]).abs().max()) / max(update.get(k, 0.0), 1e-30)
            if d > worst:
                worst, name = d, k
        ok = dl <= a.tol and worst <= a.tol and len(steps) == len(ref_loss)
        failed |= not ok
        print("%s vs %s: %d steps, loss max rel diff %.2e (last %.5f vs %.5f); weights max |diff| / max |update| %.2e (%s): %s"
              % (os.path.basename(os.path.normpath(other)), os.path.basename(os.path.normpath(a.ref)), len(steps), dl,
                 l[steps[-1]] if steps else float("nan"), ref_loss[steps[-1]] if steps else float("nan"), worst, name,
                 "PASS" if ok else "FAIL (tolerance %g)" % a.tol))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
