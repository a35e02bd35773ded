"""Starting the ``replica`` program, following its output, and turning a failure into a typed
error that carries replica's own message."""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List, Mapping, Optional

from . import _binary
from .errors import ConfigError, ReplicaError, WorkerError

_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before any fork
except (OSError, AttributeError):  # not Linux
    _prctl = None


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the Python process that started it dies, so that a
    killed driver, executor or actor leaves no worker behind (the launcher does the same)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def die_with_parent_self() -> None:
    """This process gets SIGKILL when its parent dies (a torchrun worker whose agent is gone)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Process:
    """The program running, its merged stdout and stderr kept line by line (and echoed to
    this process's stderr when ``echo``)."""

    def __init__(self, args: List[str], env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
                 echo: bool = True, base_env: Optional[Mapping[str, str]] = None):
        self.command = _binary.command(args)
        self.started_at = time.time()
        self._lines: List[str] = []
        self._lock = threading.Lock()
        self._echo = echo
        self._proc = subprocess.Popen(
            self.command, env=_binary.environment(env, base=base_env), cwd=cwd, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        self._reader = threading.Thread(target=self._read, name="replica-output", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for raw in iter(self._proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace")
            with self._lock:
                self._lines.append(line)
            if self._echo:
                sys.stderr.write(line)
                sys.stderr.flush()
        self._proc.stdout.close()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def lines(self) -> List[str]:
        with self._lock:
            return list(self._lines)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def poll(self) -> Optional[int]:
        return self._proc.poll()

    def wait(self, timeout: Optional[float] = None) -> int:
        code = self._proc.wait(timeout)
        self._reader.join()
        return code

    def terminate(self) -> None:
        """SIGTERM: the launcher passes it to every worker."""
        if self._proc.poll() is None:
            self._proc.terminate()


_LAUNCH_EXIT = re.compile(
    r"^replica launch: rank (\d+) \(local rank \d+, pid \d+\) (?:exited with code (\d+)|was killed by (\S+))")


def error_lines(lines: List[str]) -> List[str]:
    """replica's ``error: ...`` messages, without the prefix."""
    return [line.rstrip("\n")[len("error: "):] for line in lines if line.startswith("error: ")]


def read_error_records(project_dir: Optional[str], since: float) -> List[dict]:
    """The error files a run left in project_dir/errors/ since ``since`` (oldest first)."""
    if not project_dir:
        return []
    records = []
    for path in sorted(Path(project_dir, "errors").glob("rank-*.json")):
        try:
            if path.stat().st_mtime + 1 < since:
                continue
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return records


def _tail(lines: List[str], n: int = 40) -> str:
    return "".join(lines[-n:])


def failure(lines: List[str], returncode: int, project_dir: Optional[str], started_at: float) -> ReplicaError:
    """The typed error of a failed ``replica`` run: WorkerError when workers had started (the
    launcher reported a rank, error files were written, or the run wrote its config.yaml),
    else ConfigError, each with replica's message."""
    errors = error_lines(lines)
    records = read_error_records(project_dir, started_at)
    exits = [m for m in (_LAUNCH_EXIT.match(line) for line in lines) if m]
    config_written = False
    if project_dir:
        try:
            config_written = Path(project_dir, "config.yaml").stat().st_mtime + 1 >= started_at
        except OSError:
            pass
    if not exits and not records and not config_written:
        message = errors[-1] if errors else (lines[-1].strip() if lines else f"replica exited with code {returncode}")
        return ConfigError(message, returncode=returncode, output=_tail(lines))
    rank = int(exits[0].group(1)) if exits else (records[0].get("rank") if records else None)
    exit_code = None
    if exits:
        exit_code = int(exits[0].group(2)) if exits[0].group(2) else 128 + getattr(signal, exits[0].group(3), 0)
    message = None
    for r in records:
        if r.get("rank") == rank and r.get("message"):
            message = r["message"]
            break
    if message is None:
        own = [e for e in errors if rank is not None and e.startswith(f"rank {rank}: ")]
        message = own[0] if own else (errors[0] if errors else (exits[0].group(0) if exits else f"replica exited with code {returncode}"))
    if rank is not None and not message.startswith(f"rank {rank}: "):
        message = f"rank {rank}: {message}"
    return WorkerError(message, rank=rank, exit_code=exit_code if exit_code is not None else returncode,
                       returncode=returncode, output=_tail(lines), records=records)
