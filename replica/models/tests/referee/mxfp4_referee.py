"""Referee for replica's loading of GPT-OSS checkpoints whose experts are stored in MXFP4, the
way the published openai/gpt-oss checkpoints store them (replica/models/mxfp4.h,
hf_model_dir.cpp): transformers itself (run with the project's .venv).

  python mxfp4_referee.py --out DIR --ref FILE [--seed S]

Makes DIR, a tiny random GPT-OSS checkpoint (4 experts, top-2, hidden 64, experts of 64,
attention sinks, q/k/v/o bias, YaRN, a sliding and a full layer) in the published layout:

  config.json   GptOssConfig's, with quantization_config {"quant_method": "mxfp4",
                "modules_to_not_convert": [...]} as openai/gpt-oss-20b's config.json has it,
                torch_dtype bfloat16
  model-0000N-of-00002.safetensors + model.safetensors.index.json
                every tensor but the experts' weights in bf16; for each layer L
                  model.layers.L.mlp.experts.gate_up_proj_blocks [E, 2I, H/32, 16] uint8
                  model.layers.L.mlp.experts.gate_up_proj_scales [E, 2I, H/32]     uint8
                  model.layers.L.mlp.experts.down_proj_blocks    [E, H, I/32, 16]  uint8
                  model.layers.L.mlp.experts.down_proj_scales    [E, H, I/32]      uint8
                (two FP4 E2M1 codes per byte, low nibble first; a block of 32 values along
                the weight's input dimension shares one scale byte, the exponent biased by 127),
                quantized here from random weights (round to the nearest FP4 value, the
                block's largest magnitude scaled into [4, 8) and clamped at 6). Layer 1's
                gate_up_proj_scales sits in the first shard and its blocks in the second,
                so a loader must pair the halves across files.

Then loads DIR with AutoModelForCausalLM.from_pretrained(DIR, dtype=float32,
quantization_config=Mxfp4Config(dequantize=True)) (what transformers 4.57 does on a machine
without a supported GPU: GptOssExperts with the experts dequantized by
convert_moe_packed_tensors) and writes FILE (safetensors):

  input_ids [2, 24] int64                  random ids from --seed
  logits [2, 24, V] fp32                   its forward (eval, sdpa)
  greedy [2, 24 + 8] int64                 generate(do_sample=False), 8 new tokens
  experts.L.gate_up_proj [E, H, 2I] fp32, experts.L.down_proj [E, I, H] fp32
                                           the model's dequantized expert parameters
  quantized.L.gate_up_proj, quantized.L.down_proj
                                           this script's own dequantization of what it
                                           wrote (FP4 table times 2^(scale-127)), fp32
  original.L.gate_up_proj, original.L.down_proj
                                           the random weights before quantization, fp32
Prints one JSON line.
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file

import transformers
from transformers import AutoModelForCausalLM, GptOssConfig, Mxfp4Config

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_referee import randomize  # noqa: E402

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # E2M1 magnitudes, codes 0..7 (8..15: negative)
LENGTH = 24
NEW_TOKENS = 8

CONFIG = dict(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
              max_position_embeddings=128, rope_theta=150000.0,
              rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 32},
              attention_bias=True, tie_word_embeddings=False, pad_token_id=0, eos_token_id=2, bos_token_id=1)
# openai/gpt-oss-20b's config.json.
QUANTIZATION_CONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                  "model.embed_tokens", "lm_head"],
                       "quant_method": "mxfp4"}


def quantize_mxfp4(w):
    """w [E, R, C] (R a multiple of 32) -> (blocks [E, C, R/32, 16] uint8, scales [E, C, R/32] uint8):
    blocks of 32 consecutive values along R, as the published checkpoints group them."""
    e, r, c = w.shape
    x = w.transpose(1, 2).reshape(e, c, r // 32, 32).double()
    amax = x.abs().amax(-1).clamp_min(2.0 ** -100)
    exponent = torch.floor(torch.log2(amax)) - 2  # amax / 2^exponent in [4, 8)
    v = (x / torch.pow(2.0, exponent).unsqueeze(-1)).clamp(-6.0, 6.0)
    magnitude = (v.abs().unsqueeze(-1) - FP4.double()).abs().argmin(-1)  # nearest FP4 magnitude
    codes = (magnitude + 8 * (v < 0).long()).to(torch.uint8)              # sign bit
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)                   # low nibble first
    scales = (exponent + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def dequantize_mxfp4(blocks, scales):
    """This script's own inverse of quantize_mxfp4, in fp32: [E, C, G, 16], [E, C, G] -> [E, G*32, C]."""
    table = torch.cat([FP4, -FP4]).float()
    codes = torch.stack([blocks & 0x0F, blocks >> 4], -1).flatten(-2).long()  # [E, C, G, 32]
    values = table[codes] * torch.pow(2.0, scales.float() - 127).unsqueeze(-1)
    e, c, g, _ = values.shape
    return values.reshape(e, c, g * 32).transpose(1, 2).contiguous()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="the checkpoint directory to make")
    ap.add_argument("--ref", required=True, help="the reference safetensors file to write")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)

    config = GptOssConfig(**CONFIG)
    model = AutoModelForCausalLM.from_config(config).float()
    # hf_referee's weights (every parameter shows in the logits), the experts twice as large:
    # their FP4 codes then span more of the format.
    randomize(model, g)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                p.mul_(2.0)

    ref = {}
    tensors = {}
    for name, p in model.state_dict().items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            layer = name.split(".")[2]
            short = name.rsplit(".", 1)[1]
            blocks, scales = quantize_mxfp4(p.float())
            tensors[name + "_blocks"] = blocks
            tensors[name + "_scales"] = scales
            ref[f"original.{layer}.{short}"] = p.float().contiguous()
            ref[f"quantized.{layer}.{short}"] = dequantize_mxfp4(blocks, scales)
        else:
            tensors[name] = p.to(torch.bfloat16).contiguous()

    # Two shards, as the published checkpoints come; layer 1's gate_up_proj scales and blocks
    # in different ones.
    os.makedirs(args.out, exist_ok=True)
    first = "model-00001-of-00002.safetensors"
    second = "model-00002-of-00002.safetensors"
    weight_map = {}
    for name in tensors:
        in_second = name.startswith("model.layers.1.") and name != "model.layers.1.mlp.experts.gate_up_proj_scales"
        in_second = in_second or name in ("model.norm.weight", "lm_head.weight")
        weight_map[name] = second if in_second else first
    for shard in (first, second):
        save_file({k: v for k, v in tensors.items() if weight_map[k] == shard}, os.path.join(args.out, shard),
                  metadata={"format": "pt"})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    cfg = config.to_dict()
    cfg["quantization_config"] = QUANTIZATION_CONFIG
    cfg["torch_dtype"] = "bfloat16"
    cfg.pop("dtype", None)
    cfg["architectures"] = ["GptOssForCausalLM"]
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)

    # transformers reads the directory back, dequantizing the experts.
    loaded = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32,
                                                  quantization_config=Mxfp4Config(dequantize=True)).eval()
    # transformers 4.57 leaves the dequantized experts in bf16 (convert_moe_packed_tensors'
    # default dtype) beside the fp32 rest, and its fp32 forward then fails on the mixed
    # matmul. bf16 holds them exactly (an FP4 value times a power of two has at most two
    # significant bits), so fp32 changes no value: checked here, then converted.
    expert_dtypes = sorted({str(p.dtype) for n, p in loaded.named_parameters() if n.endswith("_proj")})
    for layer, block in enumerate(loaded.model.layers):
        for short in ("gate_up_proj", "down_proj"):
            as_loaded = getattr(block.mlp.experts, short).detach()
            assert torch.equal(as_loaded.float(), ref[f"quantized.{layer}.{short}"]), (layer, short)
    loaded = loaded.float()
    ids = torch.randint(3, CONFIG["vocab_size"], (2, LENGTH), generator=torch.Generator().manual_seed(args.seed + 1))
    with torch.no_grad():
        ref["input_ids"] = ids
        ref["logits"] = loaded(input_ids=ids).logits.float().contiguous()
        ref["greedy"] = loaded.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                                        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, eos_token_id=None,
                                        pad_token_id=0).contiguous()
    for layer, block in enumerate(loaded.model.layers):
        experts = block.mlp.experts
        ref[f"experts.{layer}.gate_up_proj"] = experts.gate_up_proj.detach().float().contiguous()
        ref[f"experts.{layer}.down_proj"] = experts.down_proj.detach().float().contiguous()
    save_file(ref, args.ref)
    quant_error = max((ref[f"original.{n}"] - ref[f"quantized.{n}"]).abs().max().item()
                      for n in ("0.gate_up_proj", "0.down_proj", "1.gate_up_proj", "1.down_proj"))
    print(json.dumps({"transformers": transformers.__version__, "experts": type(loaded.model.layers[0].mlp.experts).__name__,
                      "expert_dtypes_as_loaded": expert_dtypes, "quantization_max_abs_error": quant_error,
                      "quantization_config_after_load": getattr(loaded.config, "quantization_config", None) is not None}))


if __name__ == "__main__":
    main()
