# transformers + peft side of bench/memory_llm.cpp: peak memory and tokens/s of a LoRA SFT step
# of a Llama-shape model made from a config (random weights), batch 1, sequence 2048, gradient
# checkpointing (non-reentrant, as PEFT recommends) and SDPA attention on, AdamW over the adapter.
# usage: .venv/bin/python bench/memory_llm.py [--device cpu|cuda] [--dtype fp32|bf16]
#        [--hidden 1024 --layers 24 --heads 16 --kv-heads 8 --intermediate 2816 --vocab 32000]
#        [--seq 2048 --batch 1 --steps 3 --warmup 1 --threads 1] [--r 16 --alpha 32 --lora-dropout 0.05]
#        [--no-checkpointing] [--max-rss-gib G]
# --dtype bf16: the frozen base held in bf16 (AutoModelForCausalLM.from_config(dtype=bf16), no fp32
# copy first), the adapters fp32 (PEFT's autocast_adapter_dtype), forward under torch.autocast(bf16):
# what replica's llm-sft does with mixed_precision: bf16 and peft. fp32: everything fp32.
# Prints one line of key=value (bench/memory_compare.sh reads it); the memory keys:
#   rss_base_mib       RSS after the imports, before the model (the interpreter and libraries)
#   rss_model_mib      RSS with the model, adapters and optimizer built
#   peak_rss_mib       getrusage's ru_maxrss: the whole process's peak (what the machine must hold)
#   step_peak_rss_mib  the peak over the training steps alone (VmHWM reset before the first step)
#   base_mib           bytes of the frozen base (parameters and buffers); base_vs_fp16 = those over
#                      2 bytes per base parameter
#   state_mib          adapter parameters + their gradients + AdamW's state, after the last step
#   cuda_peak_alloc_mib, cuda_peak_reserved_mib   the caching allocator's peaks over the whole run (CUDA)
# --max-rss-gib stops the run (exit 3, exceeded=1 printed) as soon as the process's RSS passes G GiB or
# the machine's MemAvailable falls under 1 GiB (a guard for the fit search; ulimit -v does not work
# with torch's address-space reservations).
import argparse, os, resource, statistics, sys, threading, time

p = argparse.ArgumentParser()
for k, v in [("hidden", 1024), ("layers", 24), ("heads", 16), ("kv-heads", 8), ("intermediate", 2816),
             ("vocab", 32000), ("seq", 2048), ("batch", 1), ("steps", 3), ("warmup", 1), ("threads", 1), ("r", 16)]:
    p.add_argument("--" + k, type=int, default=v)
p.add_argument("--alpha", type=float, default=32.0)
p.add_argument("--lora-dropout", type=float, default=0.05)
p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
p.add_argument("--quantization", choices=["none"], default="none",
               help="int4/int8 need bitsandbytes: not part of this peer")
p.add_argument("--no-checkpointing", action="store_true", help="gradient checkpointing off")
p.add_argument("--max-rss-gib", type=float, default=0.0, help="stop (exit 3) when RSS passes this")
a = p.parse_args()
# One thread means one (OpenBLAS/OpenMP read OMP_NUM_THREADS when they load), as bench/llama_step.py.
os.environ["OMP_NUM_THREADS"] = str(a.threads)

MIB = 1024.0 * 1024.0
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / MIB


def status_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def mem_available_mib():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024.0
    return float("inf")


def watchdog(limit_mib):
    while True:
        rss = rss_mib()
        if rss > limit_mib or mem_available_mib() < 1024.0:
            print(f"side=transformers-peft exceeded=1 rss_mib={rss:.0f} limit_mib={limit_mib:.0f} "
                  f"mem_available_mib={mem_available_mib():.0f} peak_rss_mib={status_kib('VmHWM') / 1024.0:.0f} "
                  f"hidden={a.hidden} layers={a.layers}", flush=True)
            os._exit(3)
        time.sleep(0.02)


if a.max_rss_gib > 0:
    threading.Thread(target=watchdog, args=(a.max_rss_gib * 1024.0,), daemon=True).start()

import torch
import transformers
import peft
from transformers import AutoModelForCausalLM, LlamaConfig

transformers.logging.set_verbosity_error()
torch.set_num_threads(a.threads)
device = torch.device("cuda:0" if a.device == "cuda" else "cpu")
if device.type == "cuda" and not torch.cuda.is_available():
    sys.exit("memory_llm.py: --device cuda but no GPU is visible")
bf16 = a.dtype == "bf16"
rss_base = rss_mib()

torch.manual_seed(0)
config = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                     num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                     max_position_embeddings=max(4096, a.seq), rms_norm_eps=1e-6, rope_theta=10000.0,
                     tie_word_embeddings=False, hidden_act="silu", use_cache=False)
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if bf16 else torch.float32,
                                         attn_implementation="sdpa")
model.to(device)
model.train()
if not a.no_checkpointing:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
lora = peft.LoraConfig(r=a.r, lora_alpha=a.alpha, lora_dropout=a.lora_dropout, target_modules=targets,
                       bias="none", task_type="CAUSAL_LM")
model = peft.get_peft_model(model, lora)  # adapters fp32 over a bf16 base (autocast_adapter_dtype)
model.train()
trainable = [q for q in model.parameters() if q.requires_grad]
# torch.optim.AdamW's fused kernel (replica's FusedAdamW runs the same one), weight decay 0.01.
opt = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.01, fused=True)
params = sum(q.numel() for q in model.parameters())
n_trainable = sum(q.numel() for q in trainable)
base_params = params - n_trainable
base_bytes = sum(q.numel() * q.element_size() for q in model.parameters() if not q.requires_grad)
base_bytes += sum(b.numel() * b.element_size() for b in model.buffers())
rss_model = rss_mib()

g = torch.Generator().manual_seed(1)


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize()


def step():
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(device)
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        # As the HF Trainer's training_step: the outputs (logits) are dropped before backward.
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()
    return loss


# The peak over the steps alone: VmHWM (and with it ru_maxrss) reset to the current RSS; the
# process's peak is the larger of the build's and the steps'.
build_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step_peak_ok = True
except OSError:
    step_peak_ok = False
times, cpus = [], []
for i in range(a.warmup + a.steps):
    sync()
    t, c = time.perf_counter(), time.process_time()
    loss = step()
    sync()
    if i >= a.warmup:
        times.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
tokens = a.batch * a.seq
state = sum(q.numel() * q.element_size() for q in trainable)
state += sum(q.grad.numel() * q.grad.element_size() for q in trainable if q.grad is not None)
state += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
fields = [
    "side=transformers-peft", f"device={a.device}", f"dtype={a.dtype}", "quantization=none",
    f"params={params}", f"trainable={n_trainable}", f"hidden={a.hidden}", f"layers={a.layers}",
    f"batch={a.batch}", f"seq={a.seq}", f"steps={len(times)}",
    f"tokens/s={tokens / statistics.median(times):.1f}" if times else "tokens/s=nan",
    f"cpu_tokens/s={tokens / statistics.median(cpus):.1f}" if cpus else "cpu_tokens/s=nan",
    "step_s=" + ",".join(f"{x:.2f}" for x in times), f"loss={loss.item():.4f}",
    f"rss_base_mib={rss_base:.0f}", f"rss_model_mib={rss_model:.0f}",
    f"peak_rss_mib={max(build_peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0):.0f}",
]
if step_peak_ok:
    fields.append(f"step_peak_rss_mib={status_kib('VmHWM') / 1024.0:.0f}")
fields += [f"base_mib={base_bytes / MIB:.1f}", f"base_vs_fp16={base_bytes / (2.0 * base_params):.3f}",
           f"state_mib={state / MIB:.1f}"]
if device.type == "cuda":
    fields += [f"cuda_peak_alloc_mib={torch.cuda.max_memory_allocated() / MIB:.0f}",
               f"cuda_peak_reserved_mib={torch.cuda.max_memory_reserved() / MIB:.0f}"]
print(" ".join(fields), flush=True)
