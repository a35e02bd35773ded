"""The errors of the Python package. Each carries replica's own message (the program's
``error: ...`` line) so that a notebook shows what the command line would have said."""

from __future__ import annotations

from typing import List, Optional


class ReplicaError(Exception):
    """A replica run or command failed. ``message`` is replica's message; ``returncode`` the
    program's exit code when there was one; ``output`` the tail of its stderr."""

    def __init__(self, message: str, returncode: Optional[int] = None, output: str = ""):
        super().__init__(message)
        self.message = message
        self.returncode = returncode
        self.output = output


class ConfigError(ReplicaError, ValueError):
    """The parameters were refused before any worker started: an unknown field (with the
    nearest valid name), a wrong type, or a value replica refuses (its own message, naming the
    flag or key)."""


class WorkerError(ReplicaError, RuntimeError):
    """A worker of the job failed. ``rank`` is the failed worker's rank (None when unknown),
    ``exit_code`` its exit code (128 + signal for a signal), ``message`` replica's message from
    that worker, and ``records`` every error record the job left (``project_name/errors/``:
    message, rank, pid, restart, time)."""

    def __init__(
        self,
        message: str,
        rank: Optional[int] = None,
        exit_code: Optional[int] = None,
        returncode: Optional[int] = None,
        output: str = "",
        records: Optional[List[dict]] = None,
    ):
        super().__init__(message, returncode=returncode, output=output)
        self.rank = rank
        self.exit_code = exit_code
        self.records = records or []
