"""Referee for the decoder families of issue 19 (Olmo 2/3, Gemma 3, sliding windows):
transformers and PEFT themselves (run with the project's .venv). The models are
hf_referee.py's FAMILY_VARIANTS, made with `hf_referee.py make`.

  grads --model DIR --ref FILE --out FILE
      One training step's loss and gradients: from_pretrained(DIR, dtype=float32) in train
      mode (no dropout in these configs) on FILE's input_ids and labels (hf_referee.py's
      reference file), loss = ForCausalLMLoss (mean over counted targets; plus
      router_aux_loss_coef x the load-balancing loss where the config has output_router_logits),
      backward. Writes FILE (safetensors): loss [1], aux_loss [1] (the load-balancing loss,
      without its coefficient, where there is one) and grad.NAME for every parameter the text model trains, NAME
      as replica names it (a gemma3 checkpoint's model.language_model.X is model.X; its vision
      tower and projector are left out). Prints one JSON line.

  peft --base DIR --adapter DIR --ref FILE --out FILE
      replica's adapter into PEFT: the base loaded with transformers (fp32; a gemma3 checkpoint
      as Gemma3ForCausalLM, its text model, which is what replica trains), the adapter with
      PeftModel.from_pretrained, checked as peft_referee.py checks it (every tensor taken as
      written, scaling, fp32). Writes FILE: logits.peft [B, T, V] on FILE's input_ids. Prints
      one JSON line: {"problems": [...], "all_linear": [...]} where all_linear lists the
      modules get_peft_model(base, LoraConfig(target_modules="all-linear")) adapts on a fresh
      base (PEFT's meaning of all-linear for that model), as module names without PEFT's
      base_model.model. prefix.
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
from peft_referee import check_adapter  # noqa: E402


def load_text_model(model_dir):
    """The causal LM replica compares with: a gemma3 checkpoint's text model
    (Gemma3ForCausalLM reads its text_config and language_model.* weights), else the
    AutoModelForCausalLM of the directory."""
    with open(os.path.join(model_dir, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    if model_type == "gemma3":
        return transformers.Gemma3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def replica_name(name):
    """replica's name of a transformers parameter ("" for what replica does not load)."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("model.vision_tower.") or name.startswith("model.multi_modal_projector."):
        return ""
    return name


def grads(args):
    ref = load_file(args.ref)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.train()
    out = model(input_ids=ref["input_ids"].to(torch.int64), labels=ref["labels"].to(torch.int64))
    out.loss.backward()
    tensors = {"loss": out.loss.detach().float().reshape(1)}
    if getattr(out, "aux_loss", None) is not None:
        # output_router_logits: loss = ForCausalLMLoss + router_aux_loss_coef x aux_loss
        tensors["aux_loss"] = out.aux_loss.detach().float().reshape(1)
    for name, p in model.named_parameters():
        mapped = replica_name(name)
        if mapped and p.grad is not None:
            tensors["grad." + mapped] = p.grad.detach().float().contiguous()
    save_file(tensors, args.out)
    print(json.dumps({"model": args.model, "loss": out.loss.item(), "gradients": len(tensors) - 1,
                      "transformers": transformers.__version__}))


@torch.no_grad()
def peft_load(args):
    ref = load_file(args.ref)
    base = load_text_model(args.base).eval()
    model = PeftModel.from_pretrained(base, args.adapter).eval()
    problems = check_adapter(model, load_file(os.path.join(args.adapter, "adapter_model.safetensors")))
    logits = model(input_ids=ref["input_ids"].to(torch.int64)).logits.float().contiguous()
    save_file({"logits.peft": logits}, args.out)
    fresh = get_peft_model(load_text_model(args.base), LoraConfig(r=2, target_modules="all-linear"))
    prefix = "base_model.model."
    all_linear = sorted(name[len(prefix):] for name, module in fresh.named_modules()
                        if isinstance(module, peft.tuners.lora.LoraLayer))
    print(json.dumps({"problems": problems, "all_linear": all_linear, "peft": peft.__version__}))


def main():
    torch.set_num_threads(1)
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grads")
    g.add_argument("--model", required=True)
    g.add_argument("--ref", required=True)
    g.add_argument("--out", required=True)
    pl = sub.add_parser("peft")
    pl.add_argument("--base", required=True)
    pl.add_argument("--adapter", required=True)
    pl.add_argument("--ref", required=True)
    pl.add_argument("--out", required=True)
    args = p.parse_args()
    {"grads": grads, "peft": peft_load}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
