#!/usr/bin/env python3
"""Independent reference for replica's Llama-family models (replica/models/llama.cpp).

A plain-PyTorch transcription of the Hugging Face eager code path
(transformers/models/llama/modeling_llama.py and the qwen2, qwen3 and mistral variants,
modeling_rope_utils.py for Llama 3's rope_scaling, loss_utils.py ForCausalLMLoss): nn.Linear /
nn.Embedding modules named exactly like HF's, LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half /
apply_rotary_pos_emb, repeat_kv, eager_attention_forward with an additive finfo.min causal mask,
SwiGLU MLP.

It builds tiny random models, writes each as a Hugging Face model directory (config.json,
model.safetensors or sharded model-0000X-of-0000Y.safetensors + model.safetensors.index.json,
weights in fp32 or bf16) with a small pure-Python safetensors writer, and records the
reference outputs next to it:
  expected.safetensors  input_ids [2,12], logits (fp32 compute), position_ids + logits_pos,
                        logits_bf16 (parameters cast to bf16, HF numerics in bf16),
                        labels + batch loss inputs
  expected.json         samples / loss_mask and mean token losses (replica llm --eval
                        semantics), the batch loss (ForCausalLMLoss, mean over labels != -100)

It needs only torch. Run it from the repository root with the project's virtual environment
(torch 2.11, scripts/requirements-torch.txt):
    .venv/bin/python replica/models/tests/reference/llama_reference.py [--out DIR]
It rewrites replica/models/tests/reference/fixtures/ (or DIR) deterministically. The committed
fixtures were written with Debian's python3-torch 1.13 (gone with the move to the 2.11 wheel) and
are kept: torch 2.11 writes the same config.json and weight files and the same ids, labels and
samples; the fp32 expectations (logits, losses) move by at most 1e-6, the bf16 logits by up to
0.016 (torch's bf16 kernels changed; replica_models_tests bound those by max|logit| / 64).

transformers itself is the referee of this transcription: the conformance test
TransformersReferenceFixtures.AgreeWithTransformers (replica/models/tests/hf_conformance_test.cpp)
runs transformers (4.57) on these fixtures and requires their logits (fp32 within 1e-4: it
measures 8e-7; bf16 against transformers' eager attention within max|logit| / 64).
"""
import argparse
import json
import math
import os
import shutil
import struct

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures")

# --------------------------------------------------------------------------------------
# safetensors (https://github.com/huggingface/safetensors): u64 little-endian header size,
# JSON header {name: {dtype, shape, data_offsets}} padded with spaces to 8 bytes, raw data.

_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
}


def save_safetensors(path, tensors, metadata=None):
    header = {}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            raw = t.view(torch.int16).numpy().tobytes()
        else:
            raw = t.numpy().tobytes()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


# --------------------------------------------------------------------------------------
# Model, after transformers' modeling_llama.py (eager attention).

class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def _compute_default_rope_parameters(config):
    base = config["rope_theta"]
    dim = config["head_dim"]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, 1.0


def _compute_llama3_parameters(config):
    inv_freq, attention_factor = _compute_default_rope_parameters(config)
    rs = config["rope_scaling"]
    factor = rs["factor"]
    low_freq_factor = rs["low_freq_factor"]
    high_freq_factor = rs["high_freq_factor"]
    old_context_len = rs["original_max_position_embeddings"]

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    # wavelen < high_freq_wavelen: do nothing
    # wavelen > low_freq_wavelen: divide by factor
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # otherwise: interpolate between the two, using a smooth factor
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    inv_freq_llama = torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    return inv_freq_llama, attention_factor


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        rs = config.get("rope_scaling")
        if rs is not None and rs.get("rope_type", rs.get("type")) == "llama3":
            inv_freq, self.attention_scaling = _compute_llama3_parameters(config)
        else:
            inv_freq, self.attention_scaling = _compute_default_rope_parameters(config)
        # from_pretrained(torch_dtype=bf16) keeps this fp32 (it is computed explicitly in
        # float); a plain attribute so module.to(bfloat16) below leaves it alone as well.
        self.inv_freq = inv_freq

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().to(x.device).expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = attn_weights + causal_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        mt = config["model_type"]
        self.head_dim = config["head_dim"]
        self.num_key_value_groups = config["num_attention_heads"] // config["num_key_value_heads"]
        self.scaling = self.head_dim ** -0.5
        H = config["hidden_size"]
        if mt == "qwen2":
            qkv_bias, o_bias = True, False
        elif mt == "mistral":
            qkv_bias = o_bias = False
        else:  # llama, qwen3
            qkv_bias = o_bias = config.get("attention_bias", False)
        self.q_proj = nn.Linear(H, config["num_attention_heads"] * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(H, config["num_key_value_heads"] * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(H, config["num_key_value_heads"] * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(config["num_attention_heads"] * self.head_dim, H, bias=o_bias)
        self.qk_norm = mt == "qwen3"
        if self.qk_norm:
            self.q_norm = LlamaRMSNorm(self.head_dim, eps=config["rms_norm_eps"])
            self.k_norm = LlamaRMSNorm(self.head_dim, eps=config["rms_norm_eps"])

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        if self.qk_norm:  # Qwen3Attention
            query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
            key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        else:
            query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        attn_output = eager_attention_forward(self, query_states, key_states, value_states, attention_mask,
                                              self.scaling)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        bias = config.get("mlp_bias", False)
        H, I = config["hidden_size"], config["intermediate_size"]
        self.gate_proj = nn.Linear(H, I, bias=bias)
        self.up_proj = nn.Linear(H, I, bias=bias)
        self.down_proj = nn.Linear(I, H, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = LlamaRMSNorm(config["hidden_size"], eps=config["rms_norm_eps"])
        self.post_attention_layernorm = LlamaRMSNorm(config["hidden_size"], eps=config["rms_norm_eps"])

    def forward(self, hidden_states, attention_mask, position_embeddings):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_embeddings, attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"], config.get("pad_token_id"))
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config["num_hidden_layers"])])
        self.norm = LlamaRMSNorm(config["hidden_size"], eps=config["rms_norm_eps"])
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, input_ids, position_ids=None, segment_ids=None):
        inputs_embeds = self.embed_tokens(input_ids)
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).unsqueeze(0).expand(B, T)
        # The 4D additive mask HF builds for eager attention: 0 where allowed, finfo.min
        # elsewhere (causal; block-diagonal when segments are given).
        dtype = inputs_embeds.dtype
        min_dtype = torch.finfo(dtype).min
        allowed = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()[None].expand(B, T, T)
        if segment_ids is not None:
            allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])
        mask = torch.zeros(B, 1, T, T, dtype=dtype, device=input_ids.device).masked_fill(~allowed[:, None], min_dtype)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, position_embeddings)
        return self.norm(hidden_states)


class ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = Model(config)
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        if config.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, position_ids=None, segment_ids=None):
        return self.lm_head(self.model(input_ids, position_ids, segment_ids))


def for_causal_lm_loss(logits, labels, ignore_index=-100):
    """transformers.loss.loss_utils.ForCausalLMLoss (mean over labels != -100)."""
    logits = logits.float()
    labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
    shift_labels = labels[..., 1:].contiguous()
    logits = logits.view(-1, logits.shape[-1])
    shift_labels = shift_labels.view(-1)
    return F.cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="mean")


@torch.no_grad()
def mean_token_loss(model, samples, loss_mask=None):
    """`replica llm --eval`: each sample alone, sum of fp32 cross-entropy of every predicted
    token over all samples / their count."""
    total, count = 0.0, 0
    for i, ids in enumerate(samples):
        if len(ids) < 2:
            continue
        x = torch.tensor([ids])
        logits = model(x).float()[0]
        labels = torch.tensor(ids[1:])
        if loss_mask is not None:
            keep = torch.tensor(loss_mask[i][1:], dtype=torch.bool)
            labels = torch.where(keep, labels, torch.full_like(labels, -100))
        n = int((labels != -100).sum())
        if n == 0:
            continue
        total += float(F.cross_entropy(logits[:-1], labels, ignore_index=-100, reduction="sum"))
        count += n
    return total / count


# --------------------------------------------------------------------------------------
# Fixtures

def hf_config(name, **kw):
    """A config.json as transformers writes it for the model type."""
    mt = kw["model_type"]
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM"}[mt]
    c = {
        "architectures": [arch],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.46.0",
        "use_cache": True,
    }
    c.update(kw)
    return c


def randomize(model, generator, std=0.08):
    """HF-like init, with larger weights and non-trivial norms/biases so every term matters."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=generator))
            elif n.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(std * torch.randn(p.shape, generator=generator))


def hf_state_dict(model, config):
    sd = {k: v for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings", False):
        del sd["lm_head.weight"]  # save_pretrained drops tied weights
    return sd


def write_model_dir(path, config, model, dtype, shards):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    sd = {k: v.to(dtype) for k, v in hf_state_dict(model, config).items()}
    if shards == 1:
        save_safetensors(os.path.join(path, "model.safetensors"), sd, {"format": "pt"})
        return
    names = list(sd.keys())
    per = (len(names) + shards - 1) // shards
    weight_map = {}
    total = 0
    for s in range(shards):
        fname = "model-%05d-of-%05d.safetensors" % (s + 1, shards)
        part = {n: sd[n] for n in names[s * per:(s + 1) * per]}
        save_safetensors(os.path.join(path, fname), part, {"format": "pt"})
        for n, t in part.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
        f.write("\n")


def make_fixture(name, config, weight_dtype=torch.float32, shards=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    full = dict(config)
    if "head_dim" not in full:
        full["head_dim"] = full["hidden_size"] // full["num_attention_heads"]
    model = ForCausalLM(full)
    randomize(model, g)
    # The stored weights are what both implementations see: round them through the
    # checkpoint dtype first.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(weight_dtype).float())
    path = os.path.join(FIXTURES, name)
    if os.path.exists(path):
        shutil.rmtree(path)
    write_model_dir(path, config, model, weight_dtype, shards)

    V = config["vocab_size"]
    B, T = 2, 12
    input_ids = torch.randint(0, V, (B, T), generator=g)
    position_ids = torch.stack([torch.arange(T) + 5, torch.arange(T) + 300])
    labels = input_ids.clone()
    labels[0, :3] = -100
    labels[1, 7:] = -100
    with torch.no_grad():
        logits = model(input_ids)
        logits_pos = model(input_ids, position_ids)
        batch_loss = for_causal_lm_loss(logits, labels)
        samples = [torch.randint(0, V, (n,), generator=g).tolist() for n in (7, 12, 1, 5)]
        loss_mask = [[0] * 3 + [1] * (len(s) - 3) if len(s) > 3 else [1] * len(s) for s in samples]
        loss = mean_token_loss(model, samples)
        loss_masked = mean_token_loss(model, samples, loss_mask)
        # Same model with bf16 parameters: HF numerics in bf16 (activations bf16, norms and
        # softmax in fp32 then cast back).
        model_bf16 = ForCausalLM(full)
        model_bf16.load_state_dict(model.state_dict())
        model_bf16.to(torch.bfloat16)
        logits_bf16 = model_bf16(input_ids).float()

    save_safetensors(os.path.join(path, "expected.safetensors"), {
        "input_ids": input_ids,
        "logits": logits.float(),
        "position_ids": position_ids,
        "logits_pos": logits_pos.float(),
        "labels": labels,
        "logits_bf16": logits_bf16,
    })
    with open(os.path.join(path, "expected.json"), "w") as f:
        json.dump({
            "samples": samples,
            "loss_mask": loss_mask,
            "mean_token_loss": loss,
            "mean_token_loss_masked": loss_masked,
            "batch_loss": float(batch_loss),
        }, f, indent=1)
        f.write("\n")
    size = sum(os.path.getsize(os.path.join(path, x)) for x in os.listdir(path))
    print("%-28s %7d bytes  loss %.6f  masked %.6f" % (name, size, loss, loss_masked))


def main():
    global FIXTURES
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=FIXTURES, help="directory for the fixtures (default: %(default)s)")
    FIXTURES = parser.parse_args().out
    torch.set_num_threads(1)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4)
    # Llama 3.x: GQA (4 query heads, 2 kv heads), rope_theta 500000 and llama3 rope_scaling
    # whose original context (256) puts head_dim 8's four frequencies in all three bands
    # (kept, smoothed, divided by factor); untied head; fp32 weights.
    make_fixture("llama3_gqa", hf_config(
        "llama3_gqa", model_type="llama", num_key_value_heads=2, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 256, "rope_type": "llama3"},
        attention_bias=False, mlp_bias=False, head_dim=8, pretraining_tp=1, **common), seed=1)
    # Llama with tied embeddings, attention_bias (q/k/v/o) and mlp_bias, bf16 weights,
    # sharded in three files with model.safetensors.index.json.
    make_fixture("llama_tied_bf16_sharded", hf_config(
        "llama_tied_bf16_sharded", model_type="llama", num_key_value_heads=4, tie_word_embeddings=True,
        attention_bias=True, mlp_bias=True, torch_dtype="bfloat16", rope_scaling=None, **common),
        weight_dtype=torch.bfloat16, shards=3, seed=2)
    # Qwen2: q/k/v biases; 4 query heads share 1 kv head; sliding_window present but off
    # (use_sliding_window false), as in Qwen2's released configs.
    make_fixture("qwen2", hf_config(
        "qwen2", model_type="qwen2", num_key_value_heads=1, rope_theta=1000000.0, use_sliding_window=False,
        sliding_window=4, max_window_layers=2, **common), seed=3)
    # Qwen3: q_norm/k_norm, head_dim 16 != hidden_size / heads (8), tied embeddings.
    make_fixture("qwen3", hf_config(
        "qwen3", model_type="qwen3", num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        attention_bias=False, rope_theta=1000000.0, use_sliding_window=False, sliding_window=None,
        max_window_layers=2, rope_scaling=None, **common), seed=4)
    # Mistral: the Llama network; sliding_window (4096) covers every sequence.
    make_fixture("mistral", hf_config(
        "mistral", model_type="mistral", num_key_value_heads=2, sliding_window=4096, **common), seed=5)


if __name__ == "__main__":
    main()
