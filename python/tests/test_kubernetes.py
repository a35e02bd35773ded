"""A PyTorchJob's pods (Kubeflow's training operator) running docs/python.md's manifest: each pod is a
process with the environment the operator gives it (pkg/controller.v1/pytorch/envvar.go and
master.go: MASTER_ADDR/MASTER_PORT, PET_MASTER_ADDR/PET_MASTER_PORT, WORLD_SIZE = pods x
nprocPerNode, RANK = the pod's index, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_NNODES) and the
container's command from docs/python.md, each in a mount namespace of its own with a private /dev/shm
(pods share no shared memory), 127.0.0.1 standing in for the master's service. They end with the
weights of `replica launch --nproc-per-node 2`, bit for bit."""

import copy
import os
import re
import shutil
import subprocess

import pytest

import replica
from replica import _binary

from conftest import MLP_OVERRIDES, SOURCE, flags, need, need_fashion_mnist, same_bytes

CONFIG_PATH = "/etc/replica/run.yaml"  # where the manifest mounts its ConfigMap
TOKEN = "0123456789abcdef" * 4


@pytest.fixture(scope="module")
def manifest():
    """The ConfigMap's run.yaml and the PyTorchJob of docs/python.md's Kubernetes section."""
    yaml = need("yaml")
    readme = (SOURCE / "docs" / "python.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", readme, re.DOTALL)
    block = next((b for b in blocks if "kind: PyTorchJob" in b), None)
    assert block, "docs/python.md shows no PyTorchJob manifest"
    docs = list(yaml.safe_load_all(block))
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    job = next(d for d in docs if d["kind"] == "PyTorchJob")
    return config_map["data"]["run.yaml"], job


def private_shm_available():
    if not shutil.which("unshare"):
        return False
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          "mount -t tmpfs tmpfs /dev/shm"], capture_output=True)
    return out.returncode == 0


def operator_env(job, rtype, index, port, master_addr="127.0.0.1"):
    """What the training operator sets in pod `rtype`-`index` (nprocPerNode's default: auto)."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    pods = sum(s["replicas"] for s in specs.values())
    nproc = str(job["spec"].get("nprocPerNode", "auto"))
    rank = index + (1 if rtype == "Worker" else 0)
    return {
        "PYTHONUNBUFFERED": "0",
        "MASTER_PORT": str(port), "PET_MASTER_PORT": str(port),
        "MASTER_ADDR": master_addr, "PET_MASTER_ADDR": master_addr,
        "WORLD_SIZE": str(pods * (int(nproc) if nproc.isdigit() else 1)), "RANK": str(rank),
        "PET_NPROC_PER_NODE": nproc, "PET_NODE_RANK": str(rank), "PET_NNODES": str(pods),
    }


def container_env(container):
    """The container's own variables (secrets: the test's token)."""
    env = {}
    for e in container.get("env", []):
        env[e["name"]] = e.get("value", TOKEN if "secretKeyRef" in e.get("valueFrom", {}) else "")
    return env


def expand(word, env):
    """Kubernetes' $(VAR) in command and args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), word)


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pods(job, config_file, project, extra_flags=(), master_addr_for_master=None, isolate=True):
    """Every pod of the job at once; their exit codes and output."""
    port = free_port()
    pods = []
    for rtype, spec in job["spec"]["pytorchReplicaSpecs"].items():
        for index in range(spec["replicas"]):
            container = spec["template"]["spec"]["containers"][0]
            addr = master_addr_for_master if (rtype == "Master" and master_addr_for_master) else "127.0.0.1"
            env = {**container_env(container), **operator_env(job, rtype, index, port, addr)}
            words = [expand(w, env) for w in container["command"] + container.get("args", [])]
            words = [replica.binary() if w == "replica" else config_file if w == CONFIG_PATH else w for w in words]
            words += [*flags(MLP_OVERRIDES), "--project-name", str(project), "--rdzv-timeout", "60"]
            words += list(extra_flags)
            if isolate:
                words = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                         'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "pod", *words]
            pods.append(subprocess.Popen(words, env=_binary.environment(env), stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True))
    results = []
    for pod in pods:
        try:
            out, _ = pod.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for p in pods:
                p.kill()
            raise
        results.append((pod.returncode, out))
    return results


@pytest.fixture(scope="module")
def config_file(manifest, tmp_path_factory):
    need_fashion_mnist()
    path = tmp_path_factory.mktemp("configmap") / "run.yaml"
    path.write_text(manifest[0])
    return str(path)


@pytest.fixture(scope="module")
def isolate():
    return private_shm_available()


def check(results, project, reference_model):
    for code, out in results:
        assert code == 0, out[-3000:]
    assert same_bytes(project / "final" / "model.safetensors", reference_model)


def test_readme_manifest_two_pods(manifest, config_file, isolate, reference_model, tmp_path):
    _, job = manifest
    assert job["spec"]["nprocPerNode"] == "1"
    results = run_pods(job, config_file, tmp_path / "run", isolate=isolate)
    check(results, tmp_path / "run", reference_model)
    master_out = results[0][1]
    assert "PyTorchJob pod 0 of 2: 1 worker(s) here" in master_out


def test_replica_launch_in_the_pods(manifest, config_file, isolate, reference_model, tmp_path):
    job = copy.deepcopy(manifest[1])
    for spec in job["spec"]["pytorchReplicaSpecs"].values():
        c = spec["template"]["spec"]["containers"][0]
        assert c["command"][:2] == ["replica", "--config"]
        c["command"] = ["replica", "launch", "--"] + c["command"]  # docs/python.md's alternative
    check(run_pods(job, config_file, tmp_path / "run", isolate=isolate), tmp_path / "run", reference_model)


def test_one_pod_with_two_workers(manifest, config_file, isolate, reference_model, tmp_path):
    job = copy.deepcopy(manifest[1])
    job["spec"]["nprocPerNode"] = "2"
    del job["spec"]["pytorchReplicaSpecs"]["Worker"]
    check(run_pods(job, config_file, tmp_path / "run", isolate=isolate), tmp_path / "run", reference_model)


def test_master_pod_told_localhost(manifest, config_file, isolate, reference_model, tmp_path):
    # Some operators give the master pod MASTER_ADDR=localhost: it listens on its host name.
    results = run_pods(manifest[1], config_file, tmp_path / "run", master_addr_for_master="localhost",
                       isolate=isolate)
    check(results, tmp_path / "run", reference_model)


def test_elastic_range_is_refused(manifest, config_file):
    env = {**operator_env(manifest[1], "Master", 0, 29400), "PET_NNODES": "1:2"}
    out = subprocess.run(_binary.command(["--config", config_file, "--project-name", "unused"]),
                         env=_binary.environment(env), capture_output=True, text=True)
    assert out.returncode == 1
    assert "PET_NNODES='1:2' is not a number of pods (an elastic range such as 1:4 is not supported" in out.stderr
