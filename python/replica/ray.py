"""replica on Ray: ``replica.ray.run(config_or_params, num_workers=N, use_gpu=...)``.

One Ray actor per worker, placed in a placement group (one bundle of ``cpus_per_worker`` CPUs,
and a GPU with ``use_gpu``, per worker); each actor runs one replica worker with the
environment replica's launcher would give it, derived from Ray's view of the cluster:

- the actors are ordered by node (the node of bundle 0 first), so ranks are contiguous per node;
  RANK is that order, GROUP_RANK the node's index, LOCAL_RANK / LOCAL_WORLD_SIZE the place among
  and the number of the workers on the same node (``ray.util.get_node_ip_address()``);
- MASTER_ADDR is rank 0's node address, MASTER_PORT a port rank 0's actor found free there;
- REPLICA_TOKEN a fresh secret shared by the job's workers; REPLICA_THREADS_PER_WORKER and
  OMP_NUM_THREADS the bundle's CPUs (Ray sets CUDA_VISIBLE_DEVICES for GPU actors).

When a worker exits non-zero the other actors are killed (their replica workers get SIGTERM as
their parent dies) and ``run`` raises ``replica.WorkerError`` with that worker's rank and
replica's message. Paths are resolved against the driver's working directory, which the actors
use when it exists on their node; the YAML travels as text.
"""

from __future__ import annotations

import secrets
import socket
import tempfile
import time
from typing import Any, Dict, List, Mapping, Optional, Union

from ._job import Job, job_of
from ._process import Process, error_lines
from .errors import WorkerError
from .params import Params
from .project import Result


class _Worker:
    """The actor: where it runs, a free port there, and one replica worker."""

    def info(self) -> Dict[str, Any]:
        import ray

        return {"ip": ray.util.get_node_ip_address(), "host": socket.gethostname()}

    def free_port(self, addr: str) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
            return s.getsockname()[1]

    def run(self, job: Dict[str, Any], env: Dict[str, str]) -> Dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="replica-job-") as scratch:
            args, cwd = Job.from_dict(job).materialize(scratch)
            process = Process(args, env=env, cwd=cwd, echo=True)
            code = process.wait()
        return {"rank": int(env["RANK"]), "returncode": code, "errors": error_lines(process.lines),
                "tail": "".join(process.lines[-40:])}


def worker_environments(infos: List[Dict[str, Any]], master_port: int, token: str,
                        cpus_per_worker: float) -> List[Dict[str, str]]:
    """Each actor's (in bundle order) replica environment; see the module's note."""
    nodes: List[str] = []
    for info in infos:
        if info["ip"] not in nodes:
            nodes.append(info["ip"])
    order = sorted(range(len(infos)), key=lambda i: (nodes.index(infos[i]["ip"]), i))
    rank_of = {actor: rank for rank, actor in enumerate(order)}
    per_node = {ip: [i for i in order if infos[i]["ip"] == ip] for ip in nodes}
    master = infos[order[0]]["ip"]
    threads = str(max(1, int(cpus_per_worker)))
    envs = []
    for i, info in enumerate(infos):
        local = per_node[info["ip"]]
        envs.append({
            "RANK": str(rank_of[i]),
            "WORLD_SIZE": str(len(infos)),
            "LOCAL_RANK": str(local.index(i)),
            "LOCAL_WORLD_SIZE": str(len(local)),
            "GROUP_RANK": str(nodes.index(info["ip"])),
            "GROUP_WORLD_SIZE": str(len(nodes)),
            "MASTER_ADDR": master,
            "MASTER_PORT": str(master_port),
            "REPLICA_TOKEN": token,
            "REPLICA_RESTART_COUNT": "0",
            "REPLICA_THREADS_PER_WORKER": threads,
            "OMP_NUM_THREADS": threads,
        })
    return envs


def run(config_or_params: Union[str, Params], num_workers: int = 1, use_gpu: bool = False,
        cpus_per_worker: float = 1, overrides: Optional[Mapping[str, Any]] = None,
        placement_strategy: str = "PACK", timeout_s: Optional[float] = None) -> Result:
    """Runs a YAML file or a params object on ``num_workers`` Ray actors (connects with
    ``ray.init()`` when Ray is not initialised yet). ``use_gpu=False`` also sets ``--device cpu``
    (unless ``overrides`` gives a device). Returns when the run ends; raises WorkerError with
    replica's message when a worker fails."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if num_workers < 1:
        raise ValueError(f"num_workers must be at least 1, got {num_workers}")
    job = job_of(config_or_params, overrides, device=None if use_gpu else "cpu")
    started = time.time()
    if not ray.is_initialized():
        ray.init()
    bundle: Dict[str, float] = {"CPU": cpus_per_worker}
    if use_gpu:
        bundle["GPU"] = 1
    group = placement_group([dict(bundle) for _ in range(num_workers)], strategy=placement_strategy)
    actors: List[Any] = []
    try:
        ray.get(group.ready(), timeout=timeout_s)
        remote = ray.remote(_Worker)
        for i in range(num_workers):
            actors.append(remote.options(
                num_cpus=cpus_per_worker, num_gpus=1 if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
            ).remote())
        infos = ray.get([a.info.remote() for a in actors], timeout=timeout_s)
        nodes: List[str] = []
        for info in infos:
            if info["ip"] not in nodes:
                nodes.append(info["ip"])
        first = min(range(num_workers), key=lambda i: (nodes.index(infos[i]["ip"]), i))
        port = ray.get(actors[first].free_port.remote(infos[first]["ip"]), timeout=timeout_s)
        envs = worker_environments(infos, port, secrets.token_hex(32), cpus_per_worker)
        pending = {actors[i].run.remote(job.to_dict(), envs[i]): int(envs[i]["RANK"]) for i in range(num_workers)}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout_s)
            if not ready:
                raise WorkerError(f"the Ray job did not end within {timeout_s} s")
            ref = ready[0]
            rank = pending.pop(ref)
            try:
                outcome = ray.get(ref)
            except ray.exceptions.RayError as e:  # the actor died (OOM killer, node lost)
                raise WorkerError(f"rank {rank}: the Ray actor running it died: {e}", rank=rank) from None
            if outcome["returncode"] != 0:
                errors = outcome["errors"]
                message = errors[0] if errors else f"replica exited with code {outcome['returncode']}"
                if not message.startswith(f"rank {rank}: "):
                    message = f"rank {rank}: {message}"
                raise WorkerError(message, rank=rank, exit_code=outcome["returncode"], output=outcome["tail"])
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)
    return Result(job.project_dir, seconds=time.time() - started)
