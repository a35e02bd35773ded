"""Referee for replica::data::DistributedSampler: torch.utils.data.DistributedSampler itself.

Usage: sampler_referee.py CASES.json OUT.json

CASES.json is a list of {"n", "world", "rank", "shuffle", "seed", "drop_last", "epoch"};
OUT.json gets, for each case in order, {"num_samples", "total_size", "indices"}: what
DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
drop_last=drop_last) yields after set_epoch(epoch).
"""
import json
import sys

import torch
from torch.utils.data import DistributedSampler


def main() -> int:
    torch.set_num_threads(1)
    cases_path, out_path = sys.argv[1], sys.argv[2]
    with open(cases_path) as f:
        cases = json.load(f)
    out = []
    for c in cases:
        sampler = DistributedSampler(range(c["n"]), num_replicas=c["world"], rank=c["rank"],
                                     shuffle=c["shuffle"], seed=c["seed"], drop_last=c["drop_last"])
        sampler.set_epoch(c["epoch"])
        indices = list(iter(sampler))
        if len(indices) != len(sampler):
            raise AssertionError(f"{c}: DistributedSampler yielded {len(indices)} != len {len(sampler)}")
        out.append({"num_samples": sampler.num_samples, "total_size": sampler.total_size,
                    "indices": [int(i) for i in indices]})
    with open(out_path, "w") as f:
        json.dump(out, f)
    print(f"torch {torch.__version__}: {len(cases)} samplers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
