"""replica on Spark: ``replica.spark.run(config_or_params, num_processes=N, local_mode=..., use_gpu=...)``.

The run goes through PySpark's ``TorchDistributor`` (pyspark.ml.torch): it starts torchrun on
the driver (``local_mode=True``) or one torchrun per barrier task on the executors
(``local_mode=False``), and torchrun starts the workers. Each worker is replica
(``replica.torchrun.run_job``: ``replica --config ...`` or ``replica llm --train ...`` with the
environment torchrun gave it; see that module for the rendezvous). The job carries the YAML as
text, so the executors need the ``replica`` package (and the data and project paths, resolved
against the driver's working directory) but not the driver's files.

A worker that fails fails the Spark job, and ``run`` raises ``replica.WorkerError`` with that
worker's rank and replica's message.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, List, Mapping, Optional, Union

from . import torchrun as _torchrun
from ._job import job_of
from .errors import ReplicaError, WorkerError
from .params import Params
from .project import Result


class _Capture:
    """sys.stdout and sys.stderr teed into a buffer while TorchDistributor runs: it prints the
    workers' output there (local mode: the torchrun output; executors: the lines its log
    streaming server receives), replica's failure lines included."""

    class _Tee:
        def __init__(self, stream, sink):
            self._stream, self._sink = stream, sink

        def write(self, text):
            self._sink(text)
            return self._stream.write(text)

        def __getattr__(self, name):
            return getattr(self._stream, name)

    def __init__(self):
        self._parts: List[str] = []
        self._lock = threading.Lock()

    def _add(self, text: str) -> None:
        with self._lock:
            self._parts.append(text)

    @property
    def text(self) -> str:
        with self._lock:
            return "".join(self._parts)

    def __enter__(self):
        self._saved = sys.stdout, sys.stderr
        sys.stdout = self._Tee(sys.stdout, self._add)
        sys.stderr = self._Tee(sys.stderr, self._add)
        return self

    def __exit__(self, *exc):
        sys.stdout, sys.stderr = self._saved
        return False


def _records_in(text: str) -> List[dict]:
    out = []
    for line in text.replace("\\n", "\n").splitlines():
        at = line.find(_torchrun.MARKER)
        if at < 0:
            continue
        try:
            out.append(json.loads(line[at + len(_torchrun.MARKER):].strip()))
        except ValueError:
            continue
    return out


def _worker_failure(error: BaseException, output: str, failure_dir: str) -> ReplicaError:
    """The WorkerError of a failed TorchDistributor job: the failed workers' records (files in
    ``failure_dir``, ``replica-worker-failed:`` lines in the output or the error), the earliest
    first. PySpark's own message when no worker reported (the job failed around them)."""
    records = []
    for path in sorted(Path(failure_dir).glob("rank-*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass
    records += _records_in(output) + _records_in(str(error))
    text = str(error).strip()
    if not records:
        first = text.splitlines()[0] if text else type(error).__name__
        return WorkerError(f"the Spark job failed and no replica worker reported why: {first}",
                           output=(output + text)[-4000:])
    first = min(records, key=lambda r: r.get("time", float("inf")))
    return WorkerError(first["message"], rank=first.get("rank"), exit_code=first.get("exit_code"),
                       output=(output + text)[-4000:], records=records)


def run(config_or_params: Union[str, Params], num_processes: int = 1, local_mode: bool = True,
        use_gpu: bool = False, overrides: Optional[Mapping[str, Any]] = None) -> Result:
    """Runs a YAML file or a params object with ``num_processes`` workers through
    TorchDistributor (an active SparkSession is needed). ``use_gpu=False`` also sets
    ``--device cpu`` (unless ``overrides`` gives a device). ``overrides`` are flags over the
    config (``{"max_steps": 20}``). Returns when the run ends; raises WorkerError with replica's
    message when a worker fails."""
    from pyspark.ml.torch.distributor import TorchDistributor

    job = job_of(config_or_params, overrides, device=None if use_gpu else "cpu")
    distributor = TorchDistributor(num_processes=num_processes, local_mode=local_mode, use_gpu=use_gpu)
    started = time.time()
    job.failure_dir = tempfile.mkdtemp(prefix="replica-spark-")
    capture = _Capture()
    try:
        with capture:
            distributor.run(_torchrun.run_job, job.to_dict())
    except Exception as e:  # RuntimeError (local mode), Py4JJavaError / PythonException (executors)
        raise _worker_failure(e, capture.text, job.failure_dir) from e
    finally:
        shutil.rmtree(job.failure_dir, ignore_errors=True)
    return Result(job.project_dir, seconds=time.time() - started)
