"""Referee for replica's LoRA adapters: Hugging Face PEFT itself (run with the project's .venv).

  load --base DIR --adapter DIR --out FILE --merged-out DIR
       [--merge-dtype float32|bfloat16] [--seed S] [--batch B] [--length T] [--new-tokens N]
      replica's adapter into PEFT. Loads the base model with transformers
      (from_pretrained(DIR, dtype=float32)) and the adapter directory with
      PeftModel.from_pretrained(base, adapter), and checks that PEFT took the adapter as
      written: every tensor of adapter_model.safetensors is a LoRA weight of the PeftModel
      with the same value, the PeftModel has no LoRA weight the file lacks (a different
      expansion of target_modules would add zero-initialised adapters that change nothing in
      the logits), each adapted layer's scaling is lora_alpha / r (/ sqrt(r) with rslora)
      and its adapter fp32. Then, on random ids (--seed), writes FILE (safetensors):
          input_ids [B, T] int64
          logits.peft    [B, T, V] fp32   the PeftModel's forward (eval mode: no dropout)
          greedy.peft    [B, T + N]       generate(do_sample=False) of the PeftModel
          logits.merged  [B, T, V] fp32   forward of merge_and_unload()'s model (in fp32)
      and merge_and_unload()'s model with save_pretrained(--merged-out). The merge is done
      on a base loaded in --merge-dtype (a bf16 checkpoint is merged in bf16, as one loaded
      for inference would be: PEFT keeps the adapter fp32 and adds the fp32 delta into the
      bf16 weight). Prints one JSON line.

  make --variant NAME --out DIR --r R --alpha A --targets all-linear|q_proj,v_proj,...
       [--dropout P] [--rslora] [--seed S]
      PEFT's adapter into replica. DIR/base: hf_referee.py's model NAME (save_pretrained);
      DIR/adapter: get_peft_model(base, LoraConfig(...)) with random A and B (B is zero at
      init, which would hide a wrong merge or scaling), saved with save_pretrained as PEFT
      writes it; DIR/reference.safetensors: input_ids, logits.peft (fp32), greedy.peft,
      logits.merged; DIR/peft_merged: merge_and_unload() saved.
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

import peft
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_referee  # noqa: E402  (the tiny model variants)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_adapter(model, saved):
    """Problems (strings) between a PeftModel and the adapter tensors it was loaded from."""
    state = {k.replace(".default.", "."): v for k, v in model.state_dict().items() if ".lora_" in k}
    problems = []
    for name, t in saved.items():
        if name not in state:
            problems.append("%s: in the file, not in the PeftModel" % name)
        elif not torch.equal(state[name].cpu(), t.to(state[name].dtype)):
            problems.append("%s: PeftModel's value differs from the file's" % name)
    for name in state:
        if name not in saved:
            problems.append("%s: a LoRA weight of the PeftModel that the file lacks" % name)
    config = model.peft_config["default"]
    expected_scaling = config.lora_alpha / (config.r ** 0.5 if config.use_rslora else config.r)
    for name, module in model.named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            if abs(module.scaling["default"] - expected_scaling) > 1e-12:
                problems.append("%s: scaling %r, expected %r" % (name, module.scaling["default"], expected_scaling))
            if module.lora_A["default"].weight.dtype != torch.float32:
                problems.append("%s: adapter dtype %s" % (name, module.lora_A["default"].weight.dtype))
    return problems


def random_ids(vocab_size, args):
    g = torch.Generator().manual_seed(args.seed)
    return torch.randint(3, vocab_size, (args.batch, args.length), generator=g)


@torch.no_grad()
def outputs(model, input_ids, new_tokens):
    """logits.peft and greedy.peft of a PeftModel (eval mode)."""
    out = {"input_ids": input_ids, "logits.peft": model(input_ids=input_ids).logits.float().contiguous()}
    if new_tokens > 0:
        out["greedy.peft"] = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, num_beams=1,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0).contiguous()
    return out


@torch.no_grad()
def merge(model, out, merged_dir):
    merged = model.merge_and_unload()
    merged.eval()
    merged.save_pretrained(merged_dir, safe_serialization=True)
    dtype = str(next(merged.parameters()).dtype)
    out["logits.merged"] = merged.float()(input_ids=out["input_ids"]).logits.float().contiguous()
    return dtype


def summary(model):
    config = model.peft_config["default"]
    adapted = sum(isinstance(m, peft.tuners.lora.LoraLayer) for m in model.modules())
    targets = config.target_modules
    return {"peft": peft.__version__, "transformers": transformers.__version__, "adapted": adapted, "r": config.r,
            "lora_alpha": config.lora_alpha, "lora_dropout": config.lora_dropout, "use_rslora": config.use_rslora,
            "target_modules": targets if isinstance(targets, str) else sorted(targets)}


@torch.no_grad()
def load(args):
    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, args.adapter)
    model.eval()
    problems = check_adapter(model, load_file(os.path.join(args.adapter, "adapter_model.safetensors")))
    if problems:
        print("\n".join(problems))
        return 1
    out = outputs(model, random_ids(base.config.vocab_size, args), args.new_tokens)
    if args.merge_dtype != "float32":
        base = AutoModelForCausalLM.from_pretrained(args.base, dtype=DTYPES[args.merge_dtype])
        model = PeftModel.from_pretrained(base, args.adapter)
        model.eval()
    info = summary(model)
    info["merged_dtype"] = merge(model, out, args.merged_out)
    save_file(out, args.out)
    print(json.dumps(info))
    return 0


@torch.no_grad()
def make(args):
    base_dir = os.path.join(args.out, "base")
    hf_referee.make(argparse.Namespace(variant=args.variant, out=base_dir, vocab_size=0, tokenizer_from="",
                                       logits="", dtype="float32", seed=0))
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
    model = get_peft_model(base, LoraConfig(r=args.r, lora_alpha=args.alpha, lora_dropout=args.dropout,
                                            target_modules=targets, use_rslora=args.rslora, task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(args.seed + 1)
    for name, p in model.named_parameters():
        if ".lora_" in name:
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    adapter_dir = os.path.join(args.out, "adapter")
    model.save_pretrained(adapter_dir, safe_serialization=True)
    model.eval()
    out = outputs(model, random_ids(base.config.vocab_size, args), args.new_tokens)
    info = summary(model)
    info["merged_dtype"] = merge(model, out, os.path.join(args.out, "peft_merged"))
    save_file(out, os.path.join(args.out, "reference.safetensors"))
    print(json.dumps(info))
    return 0


def main():
    torch.set_num_threads(1)
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    ld = sub.add_parser("load")
    ld.add_argument("--base", required=True)
    ld.add_argument("--adapter", required=True)
    ld.add_argument("--out", required=True)
    ld.add_argument("--merged-out", required=True)
    ld.add_argument("--merge-dtype", default="float32", choices=sorted(DTYPES))
    mk = sub.add_parser("make")
    mk.add_argument("--variant", required=True, choices=sorted(hf_referee.VARIANTS))
    mk.add_argument("--out", required=True)
    mk.add_argument("--r", type=int, required=True)
    mk.add_argument("--alpha", type=int, required=True)
    mk.add_argument("--targets", required=True)
    mk.add_argument("--dropout", type=float, default=0.0)
    mk.add_argument("--rslora", action="store_true")
    for sp in (ld, mk):
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--batch", type=int, default=2)
        sp.add_argument("--length", type=int, default=12)
        sp.add_argument("--new-tokens", type=int, default=8)
    args = p.parse_args()
    return {"load": load, "make": make}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
