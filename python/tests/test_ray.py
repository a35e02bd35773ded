"""replica.ray.run on a local Ray cluster (2 CPUs): the MLP example on two Ray workers ends with
the weights of `replica launch --nproc-per-node 2`, bit for bit; a failing worker fails the job
with replica's message; the environment each worker gets."""

import pytest

import replica

from conftest import MLP_OVERRIDES, MLP_YAML, need, need_fashion_mnist, same_bytes


@pytest.fixture(scope="module")
def ray_cluster():
    ray = need("ray")
    need_fashion_mnist()
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    yield ray
    ray.shutdown()


def test_mlp_world_2_equals_replica_launch(ray_cluster, reference_model, tmp_path):
    import replica.ray

    project = tmp_path / "ray"
    result = replica.ray.run(str(MLP_YAML), num_workers=2, use_gpu=False,
                             overrides={**MLP_OVERRIDES, "project_name": str(project)})
    assert [m["step"] for m in result.metrics if "loss" in m][-1] == MLP_OVERRIDES["max_steps"]
    assert same_bytes(project / "final" / "model.safetensors", reference_model), \
        "the Ray run's weights differ from replica launch's"


def test_failed_worker_fails_the_job_with_replicas_message(ray_cluster, tmp_path):
    import replica.ray

    missing = tmp_path / "no-such-data"
    with pytest.raises(replica.WorkerError) as e:
        replica.ray.run(str(MLP_YAML), num_workers=2,
                        overrides={**MLP_OVERRIDES, "project_name": str(tmp_path / "bad"), "data_path": str(missing)})
    assert e.value.rank in (0, 1) and e.value.exit_code == 1
    assert e.value.message == f"rank {e.value.rank}: --data-path: data.path '{missing}' does not exist"
    # The job's actors are gone and its resources free again: the next job gets both CPUs.
    result = replica.ray.run(str(MLP_YAML), num_workers=2,
                             overrides={**MLP_OVERRIDES, "max_steps": 2, "project_name": str(tmp_path / "after")})
    assert result.metrics


def test_worker_environments():
    from replica.ray import worker_environments

    # Bundles 0..3 on nodes a, b, a, b: ranks contiguous per node, node of bundle 0 first.
    infos = [{"ip": "10.0.0.1"}, {"ip": "10.0.0.2"}, {"ip": "10.0.0.1"}, {"ip": "10.0.0.2"}]
    envs = worker_environments(infos, 29400, "t" * 64, 2)
    assert [e["RANK"] for e in envs] == ["0", "2", "1", "3"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0", "1", "1"]
    assert [e["GROUP_RANK"] for e in envs] == ["0", "1", "0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"} and {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.1"} and {e["MASTER_PORT"] for e in envs} == {"29400"}
    assert {e["REPLICA_THREADS_PER_WORKER"] for e in envs} == {"2"}
