"""Referee for replica's Llama-family models: Hugging Face transformers itself.

Subcommands (run with the project's .venv, see replica/testing/referee.h):

  make --variant NAME --out DIR [--vocab-size V] [--tokenizer-from DIR] [--logits FILE --dtype D,...]
      A tiny random model made by transformers from a small config (VARIANTS below) and
      written with save_pretrained(DIR) (safetensors; fp32 or bf16 as the variant says).
      The weights are drawn larger than transformers' init (and norms / biases away from
      1 / 0) so that every term of the network shows in the logits. --tokenizer-from copies
      a tokenizer (tokenizer.model / tokenizer.json, tokenizer_config.json,
      special_tokens_map.json) next to the weights so that `replica llm --train` can use it;
      --vocab-size overrides the variant's vocabulary (the tokenizer's). --logits runs
      `logits` on the saved directory in the same process.

  logits --model DIR --out FILE [--dtype float32[,bfloat16]] [--seed S] [--batch B] [--length T]
         [--new-tokens N] [--ids FILE]
      from_pretrained(DIR, dtype=D) for each D, and transformers' own forward (its default
      attention, sdpa) on input ids (random ids from --seed, or input_ids of the safetensors
      FILE --ids), and greedy decoding with generate(do_sample=False). Writes FILE
      (safetensors): input_ids [B, T] int64, logits.D [B, T, V] fp32 (converted from the
      model's dtype D), greedy.D [B, T + N] int64, labels [B, T] (input_ids, the first three
      of row 0 -100) with loss.D [1] (the model's loss on them: ForCausalLMLoss, shifted,
      mean over targets != -100), and for D other than float32 also
      logits.D.eager (attn_implementation="eager"). Prints one JSON line.

  fixtures --dir FIXTURES --out FILE
      transformers' logits on the committed fixtures of tests/reference/llama_reference.py
      (a plain-PyTorch transcription of transformers): for each fixture NAME, NAME.logits
      (input_ids, fp32), NAME.logits_pos (with position_ids) and NAME.logits_bf16 (the model
      in bf16), as the fixture's expected.safetensors has them, and NAME.logits_bf16_eager
      (bf16 with attn_implementation="eager", the path the transcription follows).
"""
import argparse
import json
import os
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file

import transformers
from transformers import AutoModelForCausalLM

# Tiny configs. Every variant exercises GQA except where noted; each one a property of its
# family: llama3 rope_scaling and a large rope_theta, tied embeddings with attention_bias and
# mlp_bias (and bf16 weights), Qwen2's q/k/v bias, Qwen3's q/k RMSNorm with head_dim !=
# hidden / heads, Mistral's sliding_window (larger than any sequence here: replica has no
# sliding-window attention and refuses sequences longer than the window).
COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)

VARIANTS = {
    # Llama 3.x style: 4 query heads over 2 kv heads, rope_theta 500000, llama3 rope_scaling
    # with a short original context so that head_dim 8's frequencies fall in all three bands.
    "llama_gqa": dict(
        cls="LlamaConfig", dtype=torch.float32, seed=11,
        config=dict(num_key_value_heads=2, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # Llama, tied embeddings, attention_bias (q/k/v/o) and mlp_bias, kv heads 1.
    "llama_tied_bias": dict(
        cls="LlamaConfig", dtype=torch.float32, seed=12,
        config=dict(num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                    rope_theta=10000.0)),
    # The same family saved in bf16 (save_pretrained of a bf16 model: torch_dtype bfloat16).
    "llama_tied_bf16": dict(
        cls="LlamaConfig", dtype=torch.bfloat16, seed=13,
        config=dict(num_key_value_heads=2, tie_word_embeddings=True, attention_bias=True, rope_theta=10000.0)),
    # Qwen2: q/k/v biases (o_proj none), 4 query heads share 1 kv head, rope_theta 1e6, untied.
    "qwen2": dict(
        cls="Qwen2Config", dtype=torch.float32, seed=14,
        config=dict(num_key_value_heads=1, rope_theta=1000000.0, tie_word_embeddings=False,
                    use_sliding_window=False, rms_norm_eps=1e-6)),
    # Qwen2 tied, bf16 weights.
    "qwen2_tied_bf16": dict(
        cls="Qwen2Config", dtype=torch.bfloat16, seed=15,
        config=dict(num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False)),
    # Qwen3: q_norm / k_norm over each head, head_dim 16 (hidden 32 / 4 heads would be 8), tied.
    "qwen3": dict(
        cls="Qwen3Config", dtype=torch.float32, seed=16,
        config=dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rope_theta=1000000.0,
                    attention_bias=False)),
    # Qwen3 untied, with attention_bias, no GQA (kv heads = heads).
    "qwen3_untied": dict(
        cls="Qwen3Config", dtype=torch.float32, seed=17,
        config=dict(num_key_value_heads=4, head_dim=8, tie_word_embeddings=False, rope_theta=20000.0,
                    attention_bias=True)),
    # Mistral: the Llama network with sliding_window 64 (every sequence here is shorter).
    "mistral": dict(
        cls="MistralConfig", dtype=torch.float32, seed=18,
        config=dict(num_key_value_heads=2, sliding_window=64, rope_theta=1000000.0, tie_word_embeddings=False,
                    head_dim=8)),
}

TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja")


def randomize(model, generator):
    """Larger weights than _init_weights (std 0.02 gives near-uniform logits), norm weights
    around 1 and non-zero biases, so that every parameter shows in the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=generator))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))


def make(args):
    v = VARIANTS[args.variant]
    cfg = dict(COMMON)
    cfg.update(v["config"])
    if args.vocab_size:
        cfg["vocab_size"] = args.vocab_size
    config = getattr(transformers, v["cls"])(**cfg)
    torch.manual_seed(v["seed"])
    model = AutoModelForCausalLM.from_config(config)
    randomize(model, torch.Generator().manual_seed(v["seed"]))
    model = model.to(v["dtype"])
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(args.out, safe_serialization=True)
    if args.tokenizer_from:
        for f in TOKENIZER_FILES:
            src = os.path.join(args.tokenizer_from, f)
            if os.path.exists(src):
                shutil.copyfile(src, os.path.join(args.out, f))
    print(json.dumps({"variant": args.variant, "model_type": config.model_type,
                      "dtype": str(v["dtype"]).replace("torch.", ""), "vocab_size": config.vocab_size,
                      "transformers": transformers.__version__}))
    if args.logits:
        print(json.dumps(compute_logits(args.out, args.logits, args.dtype.split(","), seed=args.seed)))


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@torch.no_grad()
def compute_logits(model_dir, out, dtypes, ids="", seed=0, batch=2, length=12, new_tokens=8):
    """from_pretrained(model_dir) in each dtype: logits.<dtype> of the forward on the ids,
    greedy.<dtype> of generate(do_sample=False)."""
    tensors = {}
    info = {"model": model_dir, "transformers": transformers.__version__}
    for name in dtypes:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[name]).eval()
        if "input_ids" not in tensors:
            if ids:
                tensors["input_ids"] = load_file(ids)["input_ids"].to(torch.int64).contiguous()
            else:
                g = torch.Generator().manual_seed(seed)
                tensors["input_ids"] = torch.randint(3, model.config.vocab_size, (batch, length), generator=g)
        input_ids = tensors["input_ids"]
        if "labels" not in tensors:
            labels = input_ids.clone()
            labels[0, :3] = -100  # ignored targets (prompt tokens)
            tensors["labels"] = labels
        result = model(input_ids=input_ids, labels=tensors["labels"])
        tensors["logits." + name] = result.logits.float().contiguous()
        tensors["loss." + name] = result.loss.float().reshape(1)  # ForCausalLMLoss: mean over counted targets
        if new_tokens > 0:
            # Greedy decoding as transformers does it (KV cache), exactly new_tokens tokens.
            tensors["greedy." + name] = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, num_beams=1,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0).contiguous()
        info["attn_implementation"] = model.config._attn_implementation
        if name != "float32":
            # Below fp32 the attention kernels round differently: also the eager path (what
            # replica mirrors: matmul, fp32 softmax cast back, matmul).
            eager = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[name], attn_implementation="eager")
            tensors["logits." + name + ".eager"] = eager.eval()(input_ids=input_ids).logits.float().contiguous()
        info[name] = str(next(model.parameters()).dtype)
    save_file(tensors, out)
    return info


def logits(args):
    info = compute_logits(args.model, args.out, args.dtype.split(","), args.ids, args.seed, args.batch, args.length,
                          args.new_tokens)
    print(json.dumps(info))


@torch.no_grad()
def fixtures(args):
    tensors = {}
    for name in sorted(os.listdir(args.dir)):
        d = os.path.join(args.dir, name)
        expected = load_file(os.path.join(d, "expected.safetensors"))
        ids = expected["input_ids"].to(torch.int64)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        tensors[name + ".logits"] = model(input_ids=ids).logits.float().contiguous()
        tensors[name + ".logits_pos"] = model(input_ids=ids, position_ids=expected["position_ids"].to(torch.int64)) \
            .logits.float().contiguous()
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
        tensors[name + ".logits_bf16"] = model(input_ids=ids).logits.float().contiguous()
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, attn_implementation="eager").eval()
        tensors[name + ".logits_bf16_eager"] = model(input_ids=ids).logits.float().contiguous()
    save_file(tensors, args.out)
    print(json.dumps({"fixtures": sorted({k.split(".")[0] for k in tensors}), "transformers": transformers.__version__}))


def main():
    torch.set_num_threads(1)
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--variant", required=True, choices=sorted(VARIANTS))
    m.add_argument("--out", required=True)
    m.add_argument("--vocab-size", type=int, default=0)
    m.add_argument("--tokenizer-from", default="")
    m.add_argument("--logits", default="", help="also run `logits` on the saved directory into this file")
    m.add_argument("--dtype", default="float32")
    m.add_argument("--seed", type=int, default=0)
    lg = sub.add_parser("logits")
    lg.add_argument("--model", required=True)
    lg.add_argument("--out", required=True)
    lg.add_argument("--dtype", default="float32", help="comma-separated: float32,bfloat16")
    lg.add_argument("--ids", default="")
    lg.add_argument("--seed", type=int, default=0)
    lg.add_argument("--batch", type=int, default=2)
    lg.add_argument("--length", type=int, default=12)
    lg.add_argument("--new-tokens", type=int, default=8)
    fx = sub.add_parser("fixtures")
    fx.add_argument("--dir", required=True)
    fx.add_argument("--out", required=True)
    args = p.parse_args()
    {"make": make, "logits": logits, "fixtures": fixtures}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
