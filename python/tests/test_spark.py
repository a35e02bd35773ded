"""replica.spark.run on PySpark's TorchDistributor, Spark local mode (local[2], the machine's
Java): the MLP example at world 2 ends with the weights of `replica launch --nproc-per-node 2`,
bit for bit, with torchrun on the driver (local_mode=True) and on two barrier tasks
(local_mode=False); a failing worker fails the job with replica's message."""

import os
import sys

import pytest

import replica

from conftest import MLP_OVERRIDES, MLP_YAML, need, need_fashion_mnist, same_bytes


@pytest.fixture(scope="module")
def spark():
    need("pyspark")
    need("pandas")
    need("pyarrow")
    need_fashion_mnist()
    # The executors' Python workers: this interpreter (with replica on its path).
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[2]").appName("replica-integration")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.mark.parametrize("local_mode", [True, False], ids=["driver", "executors"])
def test_mlp_world_2_equals_replica_launch(spark, reference_model, tmp_path, local_mode):
    import replica.spark

    project = tmp_path / "spark"
    result = replica.spark.run(str(MLP_YAML), num_processes=2, local_mode=local_mode, use_gpu=False,
                               overrides={**MLP_OVERRIDES, "project_name": str(project)})
    assert result.project_dir == project
    assert [m["step"] for m in result.metrics if "loss" in m][-1] == MLP_OVERRIDES["max_steps"]
    assert same_bytes(project / "final" / "model.safetensors", reference_model), \
        "the Spark run's weights differ from replica launch's"


def test_params_object_through_spark(spark, reference_model, tmp_path):
    import replica.spark

    # The example's own values where they differ from the task's defaults (max_steps wins over epochs).
    params = replica.ImageClassificationParams(project_name=str(tmp_path / "params"), batch_size=32,
                                               warmup_steps=100, **MLP_OVERRIDES)
    result = replica.Project(params, backend="spark", num_processes=2, local_mode=True).create()
    assert same_bytes(result.final_dir / "model.safetensors", reference_model)


@pytest.mark.parametrize("local_mode", [True, False], ids=["driver", "executors"])
def test_failed_worker_fails_the_job_with_replicas_message(spark, tmp_path, local_mode):
    import replica.spark

    with pytest.raises(replica.WorkerError) as e:
        replica.spark.run(str(MLP_YAML), num_processes=2, local_mode=local_mode,
                          overrides={**MLP_OVERRIDES, "project_name": str(tmp_path / "bad"),
                                     "data_path": str(tmp_path / "no-such-data")})
    assert e.value.rank in (0, 1) and e.value.exit_code == 1
    assert e.value.message == f"rank {e.value.rank}: --data-path: data.path '{tmp_path / 'no-such-data'}' does not exist"
