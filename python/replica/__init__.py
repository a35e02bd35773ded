"""replica from Python: data-parallel training in C++ on LibTorch, driven AutoTrain's way.

    import replica
    params = replica.LLMTrainingParams(model="demo/model", data_path="demo/data",
                                       project_name="out/sft", peft=True, max_steps=20)
    run = replica.Project(params, backend="local", process=True).create()
    run.metrics[-1]

``replica.spark.run`` and ``replica.ray.run`` run the same configurations on PySpark's
TorchDistributor and on Ray; ``python -m replica`` is the command line.
"""

from ._binary import binary
from .demo import demo, init_llm_demo
from .errors import ConfigError, ReplicaError, WorkerError
from .params import (PARAMS_CLASSES, ImageClassificationParams, LLMTrainingParams, Params, TwoTowerParams)
from .project import Project, Result, Run

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("replica")
except Exception:  # not installed (a source tree on PYTHONPATH)
    __version__ = "0+unknown"

__all__ = [
    "ConfigError", "ImageClassificationParams", "LLMTrainingParams", "PARAMS_CLASSES", "Params", "Project",
    "ReplicaError", "Result", "Run", "TwoTowerParams", "WorkerError", "binary", "demo", "init_llm_demo",
]
