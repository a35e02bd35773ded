"""replica.spark.run on a Spark standalone cluster: a master and a worker (2 cores) started
here from PySpark's own jars, the session connected to spark://; the MLP example through two
barrier tasks on the cluster's executor ends with the weights of `replica launch
--nproc-per-node 2`, bit for bit, and a failing worker fails the job with replica's message.
The daemons are waited for by reading their logs (no sleeping) and stopped afterwards."""

import os
import re
import subprocess
import sys
import threading

import pytest

import replica

from conftest import MLP_OVERRIDES, MLP_YAML, need, need_fashion_mnist, same_bytes


def start_daemon(spark_home, args, ready):
    """A Spark daemon in the foreground; returns it and the match of `ready` in its log."""
    env = dict(os.environ, SPARK_HOME=spark_home, SPARK_NO_DAEMONIZE="1", PYSPARK_PYTHON=sys.executable)
    process = subprocess.Popen([os.path.join(spark_home, "bin", "spark-class"), *args], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env)
    seen = []
    for line in process.stdout:
        seen.append(line)
        match = re.search(ready, line)
        if match:
            # Keep draining its log so that it never blocks on a full pipe.
            threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
            return process, match
    process.wait()
    raise AssertionError(f"{args[0]} exited with {process.returncode}:\n{''.join(seen[-30:])}")


def stop(process):
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def standalone():
    pyspark = need("pyspark")
    need("pandas")
    need("pyarrow")
    need_fashion_mnist()
    home = os.path.dirname(pyspark.__file__)
    master, match = start_daemon(home, ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", "0",
                                        "--webui-port", "0"], r"Starting Spark master at (spark://\S+)")
    url = match.group(1)
    try:
        worker, _ = start_daemon(home, ["org.apache.spark.deploy.worker.Worker", url, "--host", "127.0.0.1",
                                        "--port", "0", "--webui-port", "0", "--cores", "2", "--memory", "2g"],
                                 r"Successfully registered with master")
    except BaseException:
        stop(master)
        raise
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master(url).appName("replica-standalone")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.executor.cores", "2").config("spark.task.cpus", "1")
               .config("spark.driver.host", "127.0.0.1").getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
    stop(worker)
    stop(master)


def test_mlp_world_2_on_a_standalone_cluster_equals_replica_launch(standalone, reference_model, tmp_path):
    import replica.spark

    project = tmp_path / "standalone"
    replica.spark.run(str(MLP_YAML), num_processes=2, local_mode=False,
                      overrides={**MLP_OVERRIDES, "project_name": str(project)})
    assert same_bytes(project / "final" / "model.safetensors", reference_model)


def test_failed_worker_on_a_standalone_cluster(standalone, tmp_path):
    import replica.spark

    missing = tmp_path / "no-such-data"
    with pytest.raises(replica.WorkerError) as e:
        replica.spark.run(str(MLP_YAML), num_processes=2, local_mode=False,
                          overrides={**MLP_OVERRIDES, "project_name": str(tmp_path / "bad"), "data_path": str(missing)})
    assert e.value.message == f"rank {e.value.rank}: --data-path: data.path '{missing}' does not exist"
