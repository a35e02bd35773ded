"""``Project(params, backend="local", process=True).create()``: AutoTrain's way to start a run.

``backend="local"`` runs the ``replica`` program on this machine: one worker per device, as the
command line does (``nproc_per_node``, auto by default). With ``process=True`` ``create()``
returns when the run ends (the output goes to stderr as it comes); with ``process=False`` it
returns at once a ``Run`` handle with ``wait()``, ``logs`` and ``metrics``. ``backend="spark"``
and ``backend="ray"`` hand the run to ``replica.spark.run`` / ``replica.ray.run`` (the keyword
arguments of ``Project`` beyond these go to them).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from ._process import Process, failure
from .errors import ConfigError
from .params import Params


class Result:
    """A finished run: its project directory and what the run left there."""

    def __init__(self, project_dir: Optional[str], seconds: float = 0.0, output: str = ""):
        self.project_dir = Path(project_dir) if project_dir else None
        self.seconds = seconds
        self._output = output

    @property
    def logs(self) -> str:
        return self._output

    @property
    def metrics(self) -> List[Dict[str, Any]]:
        """Every row of project_name/metrics.jsonl (steps and evaluations) written so far."""
        if self.project_dir is None:
            return []
        path = self.project_dir / "metrics.jsonl"
        rows = []
        try:
            text = path.read_text()
        except OSError:
            return []
        for line in text.splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass  # a line being written
        return rows

    @property
    def training_params(self) -> Dict[str, Any]:
        """project_name/training_params.json (the resolved parameters, AutoTrain's file)."""
        if self.project_dir is None:
            return {}
        return json.loads((self.project_dir / "training_params.json").read_text())

    @property
    def final_dir(self) -> Optional[Path]:
        return self.project_dir / "final" if self.project_dir else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(project_dir={str(self.project_dir)!r}, seconds={self.seconds:.1f})"


class Run(Result):
    """A run of the ``replica`` program on this machine. ``wait()`` raises ``WorkerError`` or
    ``ConfigError`` with replica's message when it fails."""

    def __init__(self, params: Params, echo: bool = True, env: Optional[Dict[str, str]] = None):
        super().__init__(params.project_dir)
        self.params = params
        self._scratch = None
        config_file = None
        if params.config_yaml() is not None:
            self._scratch = tempfile.mkdtemp(prefix="replica-")
            config_file = os.path.join(self._scratch, f"{params.task}.yaml")
            Path(config_file).write_text(params.config_yaml())
        self.args = params.command(config_file)
        self._process = Process(self.args, env=env, echo=echo)
        self.returncode: Optional[int] = None

    @property
    def command(self) -> List[str]:
        return self._process.command

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def logs(self) -> str:
        """The program's output so far (stdout and stderr, as they came)."""
        return self._process.output

    def poll(self) -> Optional[int]:
        return self._process.poll()

    def running(self) -> bool:
        return self.poll() is None

    def wait(self, timeout: Optional[float] = None) -> "Run":
        """Waits for the end of the run; raises WorkerError / ConfigError when it failed."""
        code = self._process.wait(timeout)
        self.returncode = code
        self.seconds = time.time() - self._process.started_at
        if self._scratch:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        if code != 0:
            raise failure(self._process.lines, code, str(self.project_dir) if self.project_dir else None,
                          self._process.started_at)
        return self

    def stop(self) -> None:
        """Stops the run (SIGTERM to the program, which passes it to every worker)."""
        self._process.terminate()

    def __repr__(self) -> str:
        state = "running" if self.returncode is None and self.running() else f"returncode={self.poll()}"
        return f"Run(project_dir={str(self.project_dir)!r}, {state})"


class Project:
    """AutoTrain's ``AutoTrainProject``: ``Project(params, backend="local", process=True).create()``."""

    BACKENDS = ("local", "spark", "ray")

    def __init__(self, params: Params, backend: str = "local", process: bool = True, **options: Any):
        if not isinstance(params, Params):
            raise ConfigError(f"Project takes LLMTrainingParams, ImageClassificationParams or TwoTowerParams, "
                              f"got {type(params).__name__}")
        if backend not in self.BACKENDS:
            raise ConfigError(f"backend '{backend}' is not one of {', '.join(self.BACKENDS)}")
        if backend == "local" and options:
            raise ConfigError(f"backend local takes no options, got {', '.join(sorted(options))}")
        self.params = params
        self.backend = backend
        self.process = process
        self.options = options

    def create(self):
        """Starts the run. local: returns the finished ``Run`` (``process=True``) or the running
        one (``process=False``); spark and ray: the finished job's ``Result``."""
        if self.backend == "spark":
            from . import spark
            return spark.run(self.params, **self.options)
        if self.backend == "ray":
            from . import ray as replica_ray
            return replica_ray.run(self.params, **self.options)
        run = Run(self.params, echo=self.process)
        if self.process:
            run.wait()
        return run
