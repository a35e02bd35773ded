"""The LLM fine-tuning demo from Python: ``replica llm init-demo`` (a small Llama, its tokenizer
and synthetic chats) and the run it suggests, as ``LLMTrainingParams``."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from . import _binary
from .errors import ReplicaError
from .params import LLMTrainingParams
from .project import Project, Run


def _init_demo(directory: str) -> str:
    """Runs ``replica llm init-demo DIRECTORY``; its stdout."""
    out = subprocess.run(_binary.command(["llm", "init-demo", directory]), env=_binary.environment(),
                         capture_output=True, text=True)
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        message = lines[-1] if lines else "replica llm init-demo failed"
        raise ReplicaError(message[len("error: "):] if message.startswith("error: ") else message,
                           returncode=out.returncode, output=out.stderr)
    return out.stdout


def init_llm_demo(directory: str = "replica-demo", **changes: Any) -> LLMTrainingParams:
    """Writes the demo to ``directory`` (kept when it holds one already) and returns the
    parameters of the fine-tuning command ``replica llm init-demo`` prints (the same run), with
    ``changes`` applied."""
    directory = str(Path(directory).resolve())
    if (Path(directory) / "model").is_dir() and (Path(directory) / "data").is_dir():
        # The demo is there: learn its command from a fresh copy elsewhere.
        with tempfile.TemporaryDirectory(prefix="replica-demo-") as scratch:
            printed = _init_demo(os.path.join(scratch, "demo")).replace(os.path.join(scratch, "demo"), directory)
    else:
        printed = _init_demo(directory)
    match = re.search(r"^\s*replica (llm --train .*)$", printed, re.MULTILINE)
    if not match:
        raise ReplicaError(f"replica llm init-demo printed no training command:\n{printed}")
    params = LLMTrainingParams.from_args(match.group(1))
    for name, value in changes.items():
        setattr(params, name, value)
    return params


def demo(directory: str = "replica-demo", **changes: Any) -> Run:
    """The demo end to end: writes it, fine-tunes it (LoRA, one worker per core) and returns the
    finished run (``run.metrics``, ``run.final_dir``). ``changes`` go over the demo's
    parameters, e.g. ``demo(max_steps=20)``."""
    params = init_llm_demo(directory, **changes)
    if Path(params.project_name).exists() and "overwrite" not in changes:
        params.overwrite = True
    return Project(params, backend="local", process=True).create()
