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

# AutoTrain 0.8.36's LLMTrainingParams (autotrain/trainers/clm/params.py): every field, at its
# default, as AutoTrainParams.save() writes training_params.json (model_dump_json).
AUTOTRAIN_0_8_36_DEFAULTS = {
    "model": "gpt2", "project_name": "project-name", "data_path": "data", "train_split": "train",
    "valid_split": None, "add_eos_token": True, "block_size": -1, "model_max_length": 2048, "padding": "right",
    "trainer": "default", "use_flash_attention_2": False, "log": "none", "disable_gradient_checkpointing": False,
    "logging_steps": -1, "eval_strategy": "epoch", "save_total_limit": 1, "auto_find_batch_size": False,
    "mixed_precision": None, "lr": 3e-05, "epochs": 1, "batch_size": 2, "warmup_ratio": 0.1,
    "gradient_accumulation": 4, "optimizer": "adamw_torch", "scheduler": "linear", "weight_decay": 0.0,
    "max_grad_norm": 1.0, "seed": 42, "chat_template": None, "quantization": "int4",
    "target_modules": "all-linear", "merge_adapter": False, "peft": False, "lora_r": 16, "lora_alpha": 32,
    "lora_dropout": 0.05, "model_ref": None, "dpo_beta": 0.1, "max_prompt_length": 128,
    "max_completion_length": None, "prompt_text_column": None, "text_column": "text",
    "rejected_text_column": None, "push_to_hub": False, "username": None, "token": None, "unsloth": False,
    "distributed_backend": None,
}


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
