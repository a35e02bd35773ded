"""Referee of replica/train/tests/optimizers_conformance_test.cpp: the optimizers and learning-rate
schedules of Hugging Face's Trainer, run by the real packages on the tensors the test gives.

  optimizer NAME IN.safetensors OUT.safetensors LR WEIGHT_DECAY STEPS
      NAME is a TrainingArguments.optim (adamw_bnb_8bit, paged_adamw_8bit, adafactor): the optimizer
      class and arguments come from Trainer.get_optimizer_cls_and_kwargs, as the Trainer makes them.
      IN holds the parameters "p.K" and the gradients "g.K.S" of every step S; OUT gets, after
      every step S, "p.K.S" and the optimizer's state tensors "<field>.K.S" (bitsandbytes: state1,
      state2, absmax1, absmax2, qmap1, qmap2; Adafactor: exp_avg_sq_row, exp_avg_sq_col, exp_avg_sq).
  schedule OUT.json
      For every scheduler name and a few (total, warmup) pairs, the rate of transformers'
      get_scheduler at each step 0..total: {"NAME/TOTAL/WARMUP": [lr, ...]}.
"""
import json
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

BASE_LR = 0.4
SCHEDULES = ["constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial"]
SPANS = [(100, 10), (37, 0), (25, 5), (12, 12)]


def optimizer(name, src, dst, lr, weight_decay, steps):
    from transformers import Trainer, TrainingArguments

    tensors = load_file(src)
    params = []
    k = 0
    while f"p.{k}" in tensors:
        params.append(torch.nn.Parameter(tensors[f"p.{k}"].clone()))
        k += 1
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, optim=name, learning_rate=lr, weight_decay=weight_decay,
                                 use_cpu=True, report_to=[])
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    # The Trainer puts weight_decay on its parameter groups; every parameter decays here.
    opt = cls([{"params": params, "weight_decay": weight_decay}], **kwargs)
    result = {}
    for s in range(steps):
        for i, p in enumerate(params):
            p.grad = tensors[f"g.{i}.{s}"].clone()
        opt.step()
        for i, p in enumerate(params):
            result[f"p.{i}.{s}"] = p.detach().clone()
            for field, v in opt.state[p].items():
                if torch.is_tensor(v) and v.dim() > 0:
                    result[f"{field}.{i}.{s}"] = v.detach().clone().contiguous()
    result["class"] = torch.tensor([ord(c) for c in f"{cls.__module__}.{cls.__name__}"], dtype=torch.int32)
    save_file(result, dst)


def schedule(dst):
    from transformers import get_scheduler

    out = {}
    for name in SCHEDULES:
        for total, warmup in SPANS:
            if name == "polynomial" and total == warmup:
                continue  # transformers divides by total - warmup
            p = torch.nn.Parameter(torch.zeros(1))
            opt = torch.optim.SGD([p], lr=BASE_LR)
            sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total)
            rates = []
            for _ in range(total + 1):
                rates.append(opt.param_groups[0]["lr"])
                opt.step()
                sched.step()
            out[f"{name}/{total}/{warmup}"] = rates
    with open(dst, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    if sys.argv[1] == "optimizer":
        optimizer(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]), float(sys.argv[6]), int(sys.argv[7]))
    elif sys.argv[1] == "schedule":
        schedule(sys.argv[2])
    else:
        sys.exit(f"unknown command {sys.argv[1]}")
