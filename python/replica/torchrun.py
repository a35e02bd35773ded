"""replica as a torchrun worker: what PySpark's TorchDistributor (and plain torchrun) start.

torchrun gives each worker the environment replica's own launcher gives (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT),
so ``replica --config run.yaml`` started there is that one worker. One thing differs: torchrun
(2.4 and later) keeps its own rendezvous store listening on MASTER_PORT and tells the workers
so with ``TORCHELASTIC_USE_AGENT_STORE=True``, expecting them to join that store; replica's
rank 0 hosts a store of its own (token-checked) and needs a port nobody holds. So here rank 0
takes a free port on MASTER_ADDR and a rendezvous token (REPLICA_TOKEN, or a fresh one) and
hands both to the other ranks through torchrun's store; each worker then runs replica with
MASTER_PORT and REPLICA_TOKEN set to them. Nothing else changes.

Use::

    TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(
        replica.torchrun.run, "--config", "/abs/run.yaml")
    torchrun --nproc-per-node 2 -m replica.torchrun --config run.yaml

A worker whose replica exits non-zero raises ``WorkerError`` with replica's message (and prints
it on a line starting with ``replica-worker-failed:``, which ``replica.spark.run`` reads back
from the job's failure).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import tempfile
import time
from typing import Dict, List, Optional

from ._job import Job
from ._process import Process, die_with_parent_self, error_lines
from .errors import ReplicaError, WorkerError

MARKER = "replica-worker-failed: "


def _rank() -> Optional[int]:
    try:
        return int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None


def _free_port(addr: str) -> int:
    """A TCP port free on ``addr`` right now (replica's rank 0 binds it moments later)."""
    try:
        infos = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ReplicaError(f"MASTER_ADDR {addr} does not resolve: {e}") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((sockaddr[0], 0))
        except OSError as e:
            raise ReplicaError(f"MASTER_ADDR {addr} is not an address of this host, but rank 0 must host "
                               f"the rendezvous there: {e}") from None
        return s.getsockname()[1]


def own_rendezvous(env: Dict[str, str], timeout_s: float = 300.0) -> None:
    """MASTER_PORT and REPLICA_TOKEN for replica's rendezvous, agreed through torchrun's store
    (see the module's note). Changes ``env``; a no-op unless torchrun shares its store."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return
    from datetime import timedelta

    from torch.distributed import TCPStore

    addr, port, rank = env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["RANK"])
    timeout = float(env.get("REPLICA_RDZV_TIMEOUT", timeout_s))
    store = TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout))
    prefix = f"replica/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    if rank == 0:
        token = env.get("REPLICA_TOKEN") or secrets.token_hex(32)
        store.set(prefix + "token", token)
        store.set(prefix + "master_port", str(_free_port(addr)))
    env["REPLICA_TOKEN"] = store.get(prefix + "token").decode()
    env["MASTER_PORT"] = store.get(prefix + "master_port").decode()  # blocks until rank 0 set it
    del store


def _run(args: List[str], cwd: Optional[str] = None, failure_dir: Optional[str] = None) -> dict:
    die_with_parent_self()  # torchrun's agent gone: this worker and its replica go too
    env = dict(os.environ)
    own_rendezvous(env)
    started = time.time()
    process = Process(args, env=env, cwd=cwd, echo=True, base_env={})
    code = process.wait()
    rank = _rank()
    if code != 0:
        errors = error_lines(process.lines)
        message = errors[0] if errors else f"replica exited with code {code}"
        if rank is not None and not message.startswith(f"rank {rank}: "):
            message = f"rank {rank}: {message}"
        record = {"rank": rank, "exit_code": code, "message": message, "time": time.time()}
        # Two ways back to the driver: this line in the logs (TorchDistributor streams them there)
        # and a file in the driver's directory for failures, when this machine sees it.
        print(MARKER + json.dumps(record), file=sys.stderr, flush=True)
        if failure_dir and os.path.isdir(failure_dir):
            with open(os.path.join(failure_dir, f"rank-{rank}.json"), "w") as f:
                json.dump(record, f)
        raise WorkerError(message, rank=rank, exit_code=code, returncode=code,
                          output="".join(process.lines[-40:]))
    return {"rank": rank, "returncode": 0, "seconds": time.time() - started}


def run(*args: str) -> dict:
    """Runs ``replica ARGS`` as this torchrun worker; raises WorkerError when it fails."""
    return _run([str(a) for a in args])


def run_job(job: dict) -> dict:
    """``replica.spark.run``'s worker: the job (replica's arguments, the config as text) run here."""
    with tempfile.TemporaryDirectory(prefix="replica-job-") as scratch:
        spec = Job.from_dict(job)
        args, cwd = spec.materialize(scratch)
        return _run(args, cwd, spec.failure_dir)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m replica.torchrun ARGS`` (``torchrun ... -m replica.torchrun --config run.yaml``)."""
    try:
        run(*(sys.argv[1:] if argv is None else argv))
    except WorkerError:
        return 1  # replica printed its message; the marker line says it again
    return 0


if __name__ == "__main__":
    sys.exit(main())
