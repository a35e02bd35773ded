"""Referee for replica's GPT-OSS parts (replica/models/moe.h, mxfp4.h, attention_sinks.h):
transformers' own GptOssMLP, load_balancing_loss_func, eager attention with sinks and MXFP4
dequantization, on a tiny random configuration.

  python gpt_oss_parts_referee.py --out FILE [--seed S]

Writes FILE (safetensors, fp32 unless said):
  mlp.<param>            GptOssMLP's parameters (router.weight/bias, experts.*)
  mlp.x [B, T, H]        input; mlp.y its output; mlp.scores the router scores [B T, E]
  mlp.grad.<param>, mlp.grad.x   gradients of sum(y * mlp.dy) (mlp.dy random)
  aux.loss [1]           load_balancing_loss_func over (scores, scores2) without a mask
  aux.scores2            a second layer's scores; aux.mask [B, T]; aux.loss_masked [1]
  attn.q, attn.k, attn.v, attn.sinks, attn.mask (bool [1, 1, T, T], sliding window 3)
  attn.out, attn.grad.sinks, attn.grad.q   eager_attention_forward with sinks; grads of
                          sum(out * attn.dout)
  yarn.<case>.inv_freq, yarn.<case>.attention: _compute_yarn_parameters for GPT-OSS's default
                          rope_scaling at head_dim 8 (case gpt_oss) and a truncated one with
                          mscale (case mscale)
  mxfp4.blocks (uint8 [E, C, G, 16]), mxfp4.scales (uint8 [E, C, G]), mxfp4.weight
                          convert_moe_packed_tensors(blocks, scales, dtype=float32)
"""
import argparse

import torch
from safetensors.torch import save_file
from transformers import GptOssConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss import modeling_gpt_oss as m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    cfg = GptOssConfig(hidden_size=16, intermediate_size=12, num_local_experts=5, num_experts_per_tok=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2,
                       vocab_size=64)
    out = {}

    mlp = m.GptOssMLP(cfg).float()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 0.5)
    for name, p in mlp.named_parameters():
        out[f"mlp.{name}"] = p.detach().clone()
    x = torch.randn(2, 7, 16, requires_grad=True)
    y, scores = mlp(x)
    dy = torch.randn_like(y)
    (y * dy).sum().backward()
    out.update({"mlp.x": x.detach(), "mlp.y": y.detach(), "mlp.scores": scores.detach(), "mlp.dy": dy,
                "mlp.grad.x": x.grad})
    for name, p in mlp.named_parameters():
        out[f"mlp.grad.{name}"] = p.grad.clone()

    scores2 = torch.softmax(torch.randn(14, 5), -1)
    out["aux.scores2"] = scores2
    out["aux.loss"] = m.load_balancing_loss_func((scores.detach(), scores2), 5, 2).reshape(1)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    out["aux.mask"] = mask
    out["aux.loss_masked"] = m.load_balancing_loss_func((scores.detach(), scores2), 5, 2, mask).reshape(1)

    class Stub(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sinks = torch.nn.Parameter(torch.randn(4))
            self.num_key_value_groups = 2

    stub = Stub()
    T = 9
    q = torch.randn(1, 4, T, 8, requires_grad=True)
    k = torch.randn(1, 2, T, 8)
    v = torch.randn(1, 2, T, 8)
    i = torch.arange(T)
    allowed = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 3)
    bias = torch.zeros(T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    o, _ = m.eager_attention_forward(stub, q, k, v, bias, scaling=8 ** -0.5)
    o = o.transpose(1, 2)  # back to [B, h, T, D]
    dout = torch.randn_like(o)
    (o * dout).sum().backward()
    out.update({"attn.q": q.detach(), "attn.k": k, "attn.v": v, "attn.sinks": stub.sinks.detach().clone(),
                "attn.mask": allowed[None, None].contiguous(), "attn.out": o.detach().contiguous(),
                "attn.dout": dout.contiguous(), "attn.grad.sinks": stub.sinks.grad, "attn.grad.q": q.grad})

    from transformers.modeling_rope_utils import _compute_yarn_parameters
    yarn_cases = {
        "gpt_oss": GptOssConfig(head_dim=8, num_attention_heads=4, hidden_size=16),
        "mscale": GptOssConfig(head_dim=16, num_attention_heads=4, hidden_size=16, rope_theta=10000.0,
                               max_position_embeddings=4096,
                               rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 0.707,
                                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 1024}),
    }
    for case, c in yarn_cases.items():
        inv_freq, attention = _compute_yarn_parameters(c, "cpu")
        out[f"yarn.{case}.inv_freq"] = inv_freq.float()
        out[f"yarn.{case}.attention"] = torch.tensor([attention], dtype=torch.float64)

    blocks = torch.randint(0, 256, (3, 6, 2, 16), dtype=torch.uint8)
    scales = torch.randint(120, 135, (3, 6, 2), dtype=torch.uint8)
    out["mxfp4.blocks"] = blocks
    out["mxfp4.scales"] = scales
    out["mxfp4.weight"] = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.float32)
    save_file({k: v.contiguous() for k, v in out.items()}, args.out)


if __name__ == "__main__":
    main()
