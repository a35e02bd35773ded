#!/usr/bin/env python3
"""Start-up overhead of each way to start a run: seconds from the call to the first training
step (the first line of metrics.jsonl; logging_steps 1), for the MLP example at world 2:

    replica launch --nproc-per-node 2 -- replica --config ...   (a subprocess, the reference)
    replica.Project(params, backend="local").create()
    replica.spark.run(..., local_mode=True)    torchrun on the driver
    replica.spark.run(..., local_mode=False)   torchrun in 2 barrier tasks (Spark local[2])
    replica.ray.run(..., num_workers=2)        2 actors on a local Ray cluster

The Spark session and the Ray cluster are started once, before (their own start-up is printed
separately). Each way runs REPEATS times, alternating; medians are printed. A watcher thread
polls the project's metrics.jsonl every 5 ms (this is a measurement, not a test).

    PYTHONPATH=build/python/site .venv/bin/python python/tools/startup_overhead.py [REPEATS]
"""

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import replica
from replica import _binary
from replica._job import override_flags

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "examples" / "fashion_mnist_mlp.yaml"
OVERRIDES = {"max_steps": 20, "valid_split": None, "checkpoint_every": 0, "threads_per_worker": 1, "logging_steps": 1}


def first_step_after(project: Path, start: float, done: threading.Event, out: dict) -> None:
    metrics = project / "metrics.jsonl"
    while not done.is_set():
        try:
            if metrics.stat().st_size > 0:
                out["first_step"] = time.time() - start
                return
        except OSError:
            pass
        time.sleep(0.005)


def timed(name, project: Path, call):
    shutil.rmtree(project, ignore_errors=True)
    done, out = threading.Event(), {}
    start = time.time()
    watcher = threading.Thread(target=first_step_after, args=(project, start, done, out), daemon=True)
    watcher.start()
    call()
    total = time.time() - start
    done.set()
    watcher.join()
    return out.get("first_step", float("nan")), total


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    scratch = Path(tempfile.mkdtemp(prefix="replica-startup-"))
    program = replica.binary()
    flags = override_flags(OVERRIDES)

    def launch(project):
        subprocess.run(_binary.command(["launch", "--nproc-per-node", "2", "--", program, "--config", str(MLP),
                                        *flags, "--project-name", str(project)]),
                       env=_binary.environment(), check=True, capture_output=True)

    def local(project):
        params = replica.ImageClassificationParams(project_name=str(project), nproc_per_node=2, batch_size=32,
                                                   warmup_steps=100, **OVERRIDES)
        replica.Run(params, echo=False).wait()

    ways = {"replica launch (subprocess)": launch, "Project(backend=local)": local}

    t = time.time()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark_start = time.time() - t
    from replica import spark as replica_spark

    ways["spark.run local_mode=True"] = lambda p: replica_spark.run(
        str(MLP), num_processes=2, local_mode=True, overrides={**OVERRIDES, "project_name": str(p)})
    ways["spark.run local_mode=False"] = lambda p: replica_spark.run(
        str(MLP), num_processes=2, local_mode=False, overrides={**OVERRIDES, "project_name": str(p)})

    t = time.time()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    ray_start = time.time() - t
    from replica import ray as replica_ray

    ways["ray.run num_workers=2"] = lambda p: replica_ray.run(
        str(MLP), num_workers=2, overrides={**OVERRIDES, "project_name": str(p)})

    results = {name: [] for name in ways}
    try:
        for i in range(repeats):
            for name, call in ways.items():
                project = scratch / f"run-{i}"
                results[name].append(timed(name, project, lambda: call(project)))
                print(f"  {name}: first step {results[name][-1][0]:.2f} s, end {results[name][-1][1]:.2f} s",
                      file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
        spark.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"Spark session start (local[2]): {spark_start:.1f} s; ray.init(num_cpus=2): {ray_start:.1f} s")
    base = statistics.median(r[0] for r in results["replica launch (subprocess)"])
    print(f"| way | call -> first step (median of {repeats}) | over replica launch | call -> end |")
    print("|---|---|---|---|")
    for name, rows in results.items():
        first = statistics.median(r[0] for r in rows)
        end = statistics.median(r[1] for r in rows)
        print(f"| {name} | {first:.2f} s | {first - base:+.2f} s | {end:.2f} s |")


if __name__ == "__main__":
    main()
