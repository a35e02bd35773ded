# PyTorch eager side of bench/llama_step.cpp: the same ~20M Llama (the plain-torch reference
# implementation the model tests compare against), batch x 256 tokens, AdamW, one thread.
# usage: .venv/bin/python bench/llama_step.py [--batch 4 --seq 256 --steps 10 --warmup 2] [--compile]
#        [--attn eager|sdpa] [--device cpu|cuda] [--dtype fp32|bf16|bf16-weights] [--preset small|500m] [--peak-tflops T]
# --dtype bf16: forward and loss under torch.autocast(bf16), fp32 weights and AdamW state (the
# trainer's mixed_precision: bf16). --dtype bf16-weights: the model in bf16 (no autocast), AdamW
# stepping fp32 master copies that are copied back after each step (replica's side does the
# same). --peak-tflops prints MFU = 6 x parameters x tokens/s / peak.
# --compile times torch.compile(model) (Inductor, CPU) instead of eager; the warm-up steps
# include the compilation. --attn sdpa runs attention through F.scaled_dot_product_attention
# (transformers' default attn_implementation, and what replica runs) instead of the reference's
# matmul / softmax / matmul (transformers' "eager" attention).
import argparse, os, sys, time
p = argparse.ArgumentParser()
for k, v in [("batch", 4), ("seq", 256), ("steps", 10), ("warmup", 2), ("threads", 1)]:
    p.add_argument("--" + k, type=int, default=v)
p.add_argument("--profile", default="", help="write a Chrome trace of the timed steps")
p.add_argument("--compile", action="store_true", help="torch.compile the model (Inductor) instead of eager")
p.add_argument("--attn", choices=["eager", "sdpa"], default="eager", help="attention implementation")
p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
p.add_argument("--dtype", choices=["fp32", "bf16", "bf16-weights"], default="fp32")
p.add_argument("--preset", choices=["small", "500m"], default="small", help="small: 20M; 500m: 503M parameters")
p.add_argument("--peak-tflops", type=float, default=0.0, help="the device's peak TFLOP/s: prints MFU")
a = p.parse_args()
# One thread means one: OpenBLAS reads OMP_NUM_THREADS when it loads (as under the peer harness,
# ../shared/bench/spawn.sh), while torch.set_num_threads alone leaves it a second GEMM thread.
os.environ["OMP_NUM_THREADS"] = str(a.threads)
import torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "replica", "models", "tests", "reference"))
import llama_reference as ref
torch.set_num_threads(a.threads)
if a.attn == "sdpa":
    def sdpa_attention_forward(module, query, key, value, attention_mask, scaling):
        # Causal without a mask tensor, grouped-query heads without repeat_kv, as transformers'
        # sdpa path on torch >= 2.5 (the reference's additive mask is plain causal here).
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                               enable_gqa=module.num_key_value_groups > 1)
        return out.transpose(1, 2).contiguous()
    ref.eager_attention_forward = sdpa_attention_forward
torch.manual_seed(0)
shape = (dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=5, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=8192, max_position_embeddings=1024, head_dim=64)
         if a.preset == "small" else
         dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=18, num_attention_heads=12,
              num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096, head_dim=128))
config = ref.hf_config("bench", model_type="llama", tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
                       rope_scaling=None, pad_token_id=None, **shape)
device = torch.device("cuda:0" if a.device == "cuda" else "cpu")
model = ref.ForCausalLM(config)
# transformers' LlamaPreTrainedModel._init_weights (what replica's model does): linears and the
# embedding N(0, 0.02), so both sides start from the same loss (~ln(vocabulary)).
with torch.no_grad():
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            m.weight.normal_(0.0, 0.02)
model = model.to(device)
masters = None
if a.dtype == "bf16-weights":
    model = model.to(torch.bfloat16)
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
opt = torch.optim.AdamW(masters if masters else model.parameters(), lr=1e-4)
forward = torch.compile(model) if a.compile else model
g = torch.Generator().manual_seed(1)
def sync():
    if device.type == "cuda": torch.cuda.synchronize()
def step():
    ids = torch.randint(0, config["vocab_size"], (a.batch, a.seq), generator=g).to(device)
    opt.zero_grad(set_to_none=True); model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
        loss = ref.for_causal_lm_loss(forward(ids), ids)
    loss.backward()
    if masters:
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
    opt.step()
    if masters:
        with torch.no_grad():
            torch._foreach_copy_(list(model.parameters()), masters)
    return loss
for _ in range(a.warmup): step()
sync()
# On CUDA the kernels' own times (Kineto); on the CPU the per-op times bench/op_times.py reads.
prof = None
if a.profile:
    prof = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
            if device.type == "cuda" else torch.autograd.profiler.profile())
if prof: prof.__enter__()
t, c = time.perf_counter(), time.process_time()
for _ in range(a.steps): loss = step()
sync()
dt, cpu = time.perf_counter() - t, time.process_time() - c
if prof:
    prof.__exit__(None, None, None)
    prof.export_chrome_trace(a.profile)
n = sum(p.numel() for p in model.parameters())
tps = a.steps * a.batch * a.seq / dt
mfu = f" mfu={6 * n * tps / (a.peak_tflops * 1e12):.3f}" if a.peak_tflops > 0 else ""
print(f"side=pytorch-{'compile' if a.compile else 'eager'}-{a.attn} device={a.device} dtype={a.dtype} params={n} "
      f"batch={a.batch} seq={a.seq} steps/s={a.steps/dt:.3f} tokens/s={tps:.1f} "
      f"cpu_tokens/s={a.steps*a.batch*a.seq/cpu:.1f} loss={loss.item():.4f}{mfu}")
