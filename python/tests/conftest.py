"""Shared pieces of the Python package's tests (CTest label `integration`).

They run against the package as `python.wheel` installed it (PYTHONPATH=build/python/site); by
hand: ``PYTHONPATH=python REPLICA_BINARY=build/replica .venv/bin/python -m pytest python/tests``.
Under scripts/test.sh (REPLICA_REQUIRE_REFEREES=1) a missing engine (pyspark, ray) fails its
tests instead of skipping them.
"""

import importlib
import os
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

import pytest

import replica
from replica import _binary

SOURCE = Path(os.environ.get("REPLICA_SOURCE_DIR", Path(__file__).resolve().parents[2]))
MLP_YAML = SOURCE / "examples" / "fashion_mnist_mlp.yaml"
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
REQUIRED = os.environ.get("REPLICA_REQUIRE_REFEREES") == "1"

# The MLP example, short: 20 steps of batch 32 per worker (global batch 64 at world 2), no
# evaluation or checkpoints, one thread per worker, a metrics line every step.
MLP_OVERRIDES = {"max_steps": 20, "valid_split": None, "checkpoint_every": 0, "threads_per_worker": 1,
                 "logging_steps": 1}


def need(module: str):
    """The module, or a skip (a failure under scripts/test.sh) naming the missing package."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        message = f"{module} is not installed ({e}); pip install -r scripts/requirements-test.txt"
        if REQUIRED:
            pytest.fail(message)
        pytest.skip(message)


def need_fashion_mnist() -> None:
    if not (FASHION_MNIST / "train-images-idx3-ubyte.gz").exists() and not any(FASHION_MNIST.glob("train*")):
        message = f"Fashion-MNIST is not in {FASHION_MNIST} (Debian's dataset-fashion-mnist; scripts/setup.sh)"
        if REQUIRED:
            pytest.fail(message)
        pytest.skip(message)


def flags(overrides: Dict[str, object]) -> List[str]:
    from replica._job import override_flags

    return override_flags(overrides)


def cli(args: List[str], env: Optional[Dict[str, str]] = None, check: bool = True, cwd=None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """The packaged program with ``args`` (the same binary the API runs)."""
    out = subprocess.run(_binary.command(args), env=_binary.environment(env), capture_output=True, text=True,
                         cwd=cwd, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"replica {' '.join(args)} exited {out.returncode}:\n{out.stderr[-4000:]}")
    return out


def launch_mlp(project: Path, nproc: int = 2) -> Path:
    """``replica launch --nproc-per-node N -- replica --config MLP --flags``: the reference."""
    program = replica.binary()
    cli(["launch", "--nproc-per-node", str(nproc), "--", program, "--config", str(MLP_YAML),
         *flags(MLP_OVERRIDES), "--project-name", str(project)])
    return project / "final" / "model.safetensors"


def same_bytes(a: Path, b: Path) -> bool:
    return Path(a).read_bytes() == Path(b).read_bytes()


@pytest.fixture(scope="session")
def reference_model(tmp_path_factory) -> Path:
    """final/model.safetensors of the MLP example under ``replica launch --nproc-per-node 2``."""
    need_fashion_mnist()
    return launch_mlp(tmp_path_factory.mktemp("launch") / "run")
