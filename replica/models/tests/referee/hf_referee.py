"""Referee for replica's Llama-family models: Hugging Face transformers itself.

Subcommands (run with the project's .venv, see replica/testing/referee.h):

  make --variant NAME --out DIR [--vocab-size V] [--tokenizer-from DIR] [--logits FILE --dtype D,...]
      A tiny random model made by transformers from a small config (VARIANTS below) and
      written with save_pretrained(DIR) (safetensors; fp32 or bf16 as the variant says).
      The weights are drawn larger than transformers' init (and norms / biases away from
      1 / 0) so that every term of the network shows in the logits. FAMILY_VARIANTS (Olmo 2/3,
      Gemma 3, windows of 8 on Mistral / Qwen2) have their logits taken on 24 tokens. --tokenizer-from copies
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
# hidden / heads, Mistral's sliding_window (larger than any sequence here; FAMILY_VARIANTS
# below have windows shorter than theirs).
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

# The families of issue 19 and sliding windows shorter than the sequence (24 tokens, window 8),
# each with every feature of its family switched on; families_conformance_test.cpp runs them.
FAMILY_COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                     max_position_embeddings=128)
WINDOW_LENGTH = 24  # the test sequences: three windows long

# The GPT-OSS variants' shared config (gpt_oss; gpt_oss_aux and gpt_oss_bf16 change a few fields).
GPT_OSS_CONFIG = dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                      num_experts_per_tok=2, sliding_window=8, rope_theta=150000.0,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 32},
                      attention_bias=True, tie_word_embeddings=False, pad_token_id=0, eos_token_id=2,
                      bos_token_id=1)

FAMILY_VARIANTS = {
    # Mistral and Qwen2 with a window of 8: every layer slides (Mistral), the layers from
    # max_window_layers on (Qwen2 with use_sliding_window).
    "mistral_window": dict(
        cls="MistralConfig", dtype=torch.float32, seed=31,
        config=dict(num_hidden_layers=2, num_key_value_heads=2, sliding_window=8, rope_theta=10000.0,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
    "qwen2_window": dict(
        cls="Qwen2Config", dtype=torch.float32, seed=32,
        config=dict(num_hidden_layers=3, num_key_value_heads=1, use_sliding_window=True, sliding_window=8,
                    max_window_layers=1, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1,
                    eos_token_id=2)),
    # Olmo 2: norms after attention and MLP, q/k RMSNorm over the whole projection, GQA, untied.
    "olmo2": dict(
        cls="Olmo2Config", dtype=torch.float32, seed=33,
        config=dict(num_hidden_layers=2, num_key_value_heads=2, rope_theta=500000.0, tie_word_embeddings=False,
                    pad_token_id=1, eos_token_id=2)),
    # Olmo 2 tied with attention_bias, saved in bf16.
    "olmo2_tied_bf16": dict(
        cls="Olmo2Config", dtype=torch.bfloat16, seed=34,
        config=dict(num_hidden_layers=2, num_key_value_heads=4, attention_bias=True, tie_word_embeddings=True,
                    pad_token_id=1, eos_token_id=2)),
    # Olmo 3: its default pattern (three sliding layers, one full) with window 8, YaRN
    # rope_scaling on the full layer (the sliding ones rotate with plain RoPE).
    "olmo3": dict(
        cls="Olmo3Config", dtype=torch.float32, seed=35,
        config=dict(num_hidden_layers=4, num_key_value_heads=2, sliding_window=8, rope_theta=500000.0,
                    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
                    tie_word_embeddings=False, pad_token_id=1, eos_token_id=2)),
    # Olmo 3 with its own layer_types, tied, attention_bias, bf16.
    "olmo3_bf16": dict(
        cls="Olmo3Config", dtype=torch.bfloat16, seed=36,
        config=dict(num_hidden_layers=2, num_key_value_heads=1, sliding_window=8, attention_bias=True,
                    layer_types=["full_attention", "sliding_attention"], tie_word_embeddings=True,
                    pad_token_id=1, eos_token_id=2)),
    # Gemma 3: sliding (local base 10000) and full layers (rope_theta 1e6 with linear
    # rope_scaling), head_dim 24 != hidden / heads, query_pre_attn_scalar 20, GQA,
    # final_logit_softcapping, attention_bias, tied; embeddings times sqrt(64).
    "gemma3_text": dict(
        cls="Gemma3TextConfig", dtype=torch.float32, seed=37,
        config=dict(num_hidden_layers=4, num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=20,
                    sliding_window=8, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                    rope_scaling={"rope_type": "linear", "factor": 4.0}, final_logit_softcapping=8.0,
                    attention_bias=True,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                    pad_token_id=0, eos_token_id=1, bos_token_id=2)),
    # Gemma 3 untied, saved in bf16, its default pattern (sliding_window_pattern 2).
    "gemma3_text_bf16": dict(
        cls="Gemma3TextConfig", dtype=torch.bfloat16, seed=38,
        config=dict(num_hidden_layers=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                    sliding_window=8, sliding_window_pattern=2, tie_word_embeddings=False,
                    pad_token_id=0, eos_token_id=1, bos_token_id=2)),
    # A gemma3 (Gemma3ForConditionalGeneration) checkpoint: gemma3_text's text model with a
    # one-layer vision tower; replica loads the text part. Without final_logit_softcapping,
    # which Gemma3ForConditionalGeneration does not apply (Gemma3ForCausalLM does; replica
    # refuses it in a gemma3 checkpoint).
    "gemma3": dict(
        cls="Gemma3Config", dtype=torch.float32, seed=39, text="gemma3_text",
        text_overrides=dict(final_logit_softcapping=None),
        config=dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=28, patch_size=14),
                    mm_tokens_per_image=4)),
    # GPT-OSS (issue 19): 4 experts, top-2, attention sinks, q/k/v/o bias, YaRN (not
    # truncated, as GPT-OSS ships it), alternating sliding (window 8) and full layers, GQA.
    "gpt_oss": dict(cls="GptOssConfig", dtype=torch.float32, seed=40, config=GPT_OSS_CONFIG),
    # GPT-OSS with the router's load-balancing loss in the training loss (output_router_logits,
    # router_aux_loss_coef 0.5): 8 experts, top-3, 3 layers.
    "gpt_oss_aux": dict(cls="GptOssConfig", dtype=torch.float32, seed=41,
                        config=dict(GPT_OSS_CONFIG, num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=3,
                                    output_router_logits=True, router_aux_loss_coef=0.5)),
    # GPT-OSS saved in bf16 (as the published checkpoints' non-expert weights are), one KV head.
    "gpt_oss_bf16": dict(cls="GptOssConfig", dtype=torch.bfloat16, seed=42,
                         config=dict(GPT_OSS_CONFIG, num_key_value_heads=1)),
}
VARIANTS.update(FAMILY_VARIANTS)


def make_config(variant):
    """The transformers config object of a variant."""
    v = VARIANTS[variant]
    if variant in FAMILY_VARIANTS:
        cfg = dict(v["config"])
        if "text" in v:  # a multimodal wrapper around another variant's text config
            cfg["text_config"] = dict(make_config(v["text"]).to_dict(), **v.get("text_overrides", {}))
        else:
            cfg = dict(FAMILY_COMMON, **cfg)
    else:
        cfg = dict(COMMON)
        cfg.update(v["config"])
    return getattr(transformers, v["cls"])(**cfg)

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
    config = make_config(args.variant)
    if args.vocab_size:
        config.get_text_config().vocab_size = args.vocab_size
    torch.manual_seed(v["seed"])
    model = AutoModelForCausalLM.from_config(config)
    randomize(model, torch.Generator().manual_seed(v["seed"]))
    model = model.to(v["dtype"])
    if config.get_text_config().tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    model.save_pretrained(args.out, safe_serialization=True)
    if args.tokenizer_from:
        for f in TOKENIZER_FILES:
            src = os.path.join(args.tokenizer_from, f)
            if os.path.exists(src):
                shutil.copyfile(src, os.path.join(args.out, f))
    print(json.dumps({"variant": args.variant, "model_type": config.model_type,
                      "dtype": str(v["dtype"]).replace("torch.", ""), "vocab_size": config.get_text_config().vocab_size,
                      "transformers": transformers.__version__}))
    if args.logits:
        length = WINDOW_LENGTH if args.variant in FAMILY_VARIANTS else 12
        print(json.dumps(compute_logits(args.out, args.logits, args.dtype.split(","), seed=args.seed,
                                        length=length)))


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
                vocab_size = model.config.get_text_config().vocab_size
                tensors["input_ids"] = torch.randint(3, vocab_size, (batch, length), generator=g)
        input_ids = tensors["input_ids"]
        if "labels" not in tensors:
            labels = input_ids.clone()
            labels[0, :3] = -100  # ignored targets (prompt tokens)
            tensors["labels"] = labels
        result = model(input_ids=input_ids, labels=tensors["labels"])
        tensors["logits." + name] = result.logits.float().contiguous()
        tensors["loss." + name] = result.loss.float().reshape(1)  # ForCausalLMLoss: mean over counted targets
        if new_tokens > 0:
            # Greedy decoding as transformers does it (KV cache), exactly new_tokens tokens. Without
            # the router's loss: transformers' load_balancing_loss_func fails under a KV cache
            # (the cached steps' router logits against the whole attention mask).
            extra = {"output_router_logits": False} if getattr(model.config, "output_router_logits", False) else {}
            tensors["greedy." + name] = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, num_beams=1,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
                **extra).contiguous()
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
