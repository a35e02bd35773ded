"""All-reduce bus bandwidth per message size through torch.distributed, in nccl-tests' terms
(algbw = bytes / time, busbw = algbw x 2(n-1)/n; the slowest rank's median time over --iters), for
scripts/gpu_check.sh's multi-GPU section: NCCL's own figure on the machine's GPUs, next to
`replica bench allreduce` (host transports) and nccl-tests' all_reduce_perf when installed.

  python -m torch.distributed.run --nproc-per-node N bench/nccl_allreduce.py [--backend nccl|gloo]
      [--min-bytes 4096] [--max-bytes 268435456] [--iters 20] [--warmup 5] [--dtype float32|bfloat16]

--backend gloo runs it on CPU tensors (a check of the script without GPUs).
"""
import argparse
import os
import time

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    p.add_argument("--min-bytes", type=int, default=4096)
    p.add_argument("--max-bytes", type=int, default=1 << 28)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    a = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if a.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(a.backend)
    n, rank = dist.get_world_size(), dist.get_rank()
    dtype = getattr(torch, a.dtype)
    elem = torch.tensor([], dtype=dtype).element_size()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if rank == 0:
        print("# torch.distributed all_reduce: backend %s, world %d, dtype %s, %d iterations (median of the slowest rank)"
              % (a.backend, n, a.dtype, a.iters))
        print("%12s %12s %10s %12s %12s" % ("size(B)", "count", "time(us)", "algbw(GB/s)", "busbw(GB/s)"))
    size = a.min_bytes
    while size <= a.max_bytes:
        t = torch.zeros(size // elem, dtype=dtype, device=device)
        times = []
        for i in range(a.warmup + a.iters):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            sync()
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
        worst = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        med = float(worst.cpu().sort().values[len(times) // 2])
        if rank == 0:
            algbw = size / med / 1e9
            print("%12d %12d %10.1f %12.2f %12.2f" % (size, size // elem, med * 1e6, algbw, algbw * 2 * (n - 1) / n),
                  flush=True)
        size *= 2
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
