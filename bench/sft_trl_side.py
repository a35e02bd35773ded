"""The Python side of bench/sft_vs_trl.sh: the model, the data, TRL 0.13's SFTTrainer, and the
referee of both sides' results. Run with the project's .venv (torch, transformers, peft; trl,
datasets and accelerate for `train`).

  make-model --out DIR [--shape cpu|llama-3.2-1b] [--tokenizer llama2|llama3|DIR] [--seed 0]
      A LlamaForCausalLM with random weights, made by transformers (from_config under
      torch.manual_seed(seed): transformers' own init, std 0.02), save_pretrained(DIR) in fp32
      safetensors, with a tokenizer of the repository. Shapes (Llama-3.2-1B's family: head_dim 64,
      grouped-query attention 4:1, SwiGLU 4x, RMSNorm 1e-5, tied embeddings, rope_theta 500000):
        cpu           hidden 512, 8 layers, 8 heads / 2 KV heads, intermediate 2048, vocab 32000
                      (the Llama 2 tokenizer: replica/text/tests/conformance/vocab/llama2), 47.2M
        llama-3.2-1b  hidden 2048, 16 layers, 32 heads / 8 KV heads, intermediate 8192, vocab
                      128256 (the Llama 3 tokenizer: .../vocab/llama3), 1.236B
      --tokenizer DIR: a directory holding tokenizer.json and tokenizer_config.json (e.g. the
      decompressed copy scripts/gpu_bundle.sh puts into gpu-bundle/, for machines without zstd).
      Prints one JSON line (parameters, vocab).

  make-data --model DIR --out DIR --block B [--rows 64] [--heldout 16] [--seed 0]
      DIR/train.jsonl (--rows rows) and DIR/heldout.jsonl (--heldout rows, another seed), each
      {"text": str} whose tokenization by the model's tokenizer is exactly B tokens with the BOS
      the tokenizer adds and the EOS both trainers append. So both trainers' packing gives the same
      rows: TRL's ConstantLengthDataset concatenates BOS+text+EOS of every sample and cuts the stream
      into B-token rows (one sample each here), replica packs each sample first-fit into a row of
      block_size B (one sample fills it). Texts: sentences drawn from 48 fixed ones (random words of
      the tokenizer's vocabulary), so that the loss falls; the last words fill the row exactly (the
      tokenizers here split at spaces, so token counts add; every row is checked).

  make-adapter --model DIR --out DIR [--r 16] [--alpha 32] [--seed 42]
      PEFT's own init (get_peft_model under torch.manual_seed(seed): A kaiming-uniform, B = 0) of a
      LoRA on every linear, save_pretrained(DIR): the common starting adapter (--init-adapter on both
      sides), so that both LoRA jobs train the same weights.

  train --model DIR --data FILE --out DIR [--peft --init-adapter DIR --lora-r 16 --lora-alpha 32]
        [--steps 20] [--lr 1e-4] [--world 2] [--batch 2] [--grad-accum 1] [--block B]
        [--bf16] [--device cpu|cuda] [--seed 42]
      TRL's SFTTrainer (SFTConfig packing=True, max_seq_length B, dataset_text_field "text") under
      `accelerate launch`: on CPU --world processes as trl_referee.py starts them (--multi_gpu with
      --num_cpu_threads_per_process 1, which on a machine without GPUs is MULTI_CPU over Gloo; `--cpu
      --num_processes 2` would run one process), on CUDA `--num_processes WORLD` (--multi_gpu when >1).
      AdamW (adamw_torch), lr constant, no warm-up, weight_decay 0, max_grad_norm 1, seed, max_steps,
      logging every step, no gradient checkpointing; two changes to TRL's defaults, both only the
      row order: ConstantLengthDataset(shuffle=False) (TRL shuffles its buffer and its rows with
      Python's random) and a SequentialSampler (Trainer's is random), so step s trains rows
      [(s-1) W B G, s W B G) of train.jsonl, the rows replica's step s trains with shuffle false.
      dtype: CPU fp32; --bf16: SFTConfig(bf16=True) (autocast), the base loaded in bf16 with --peft
      (the adapters stay fp32, PEFT's autocast_adapter_dtype) and in fp32 for full fine-tuning (fp32
      master weights), as replica's mixed_precision bf16 holds them.
      The loss: transformers 4.57's Trainer divides each step's summed token loss by the count of
      label tokens, each row's first included although nothing predicts it (B per row where the
      mean over predicted tokens has B - 1): logged loss and gradients are (B-1)/B of the mean's.
      Writes DIR: the final adapter or model (trainer.save_model), log.jsonl (rank 0's log_history,
      one line per step), timing.jsonl / timing.rankR.jsonl (per step: t_begin, t_end at the
      Trainer's on_step_begin/on_step_end, tokens = the tokens of the rank's micro-batches of the
      step, padding excluded), memory.json (rank 0: torch.cuda.max_memory_allocated /
      max_memory_reserved in MiB on CUDA).

  heldout --model BASE --data FILE --final DIR [--final DIR ...] [--label NAME ...] [--bf16]
      The referee: one script loads each result (a PEFT adapter directory, adapter_config.json,
      over BASE; else a full model directory) with transformers + peft and prints the mean token
      cross-entropy of the rows of FILE (labels = input_ids, every token but each row's first
      predicted, batch of 4 rows, eval mode, no_grad; fp32, or bf16 autocast with --bf16), one line
      for each, and the base's own loss.
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time

sys.dont_write_bytecode = True

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = os.path.join(HERE, "..", "replica", "text", "tests", "conformance", "vocab")
SHAPES = {
    "cpu": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                intermediate_size=2048, tokenizer="llama2"),
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=8192, tokenizer="llama3"),
}


def tokenizer_files(name, dst):
    """tokenizer.json and tokenizer_config.json of the repository's vocabulary NAME (zstd-compressed
    there) or of the directory NAME, into dst."""
    if os.path.isdir(name):
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if os.path.exists(os.path.join(name, f)):
                shutil.copy(os.path.join(name, f), dst)
        return
    for f in ("tokenizer.json", "tokenizer_config.json"):
        src = os.path.join(VOCAB, name, f + ".zst")
        with open(os.path.join(dst, f), "wb") as out:
            try:
                subprocess.run(["zstd", "-dc", src], stdout=out, check=True)
            except FileNotFoundError:
                import zstandard  # no zstd program: the Python module, if there is one
                out.write(zstandard.ZstdDecompressor().stream_reader(open(src, "rb")).read())


def make_model(args):
    import torch
    import transformers
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    shape = dict(SHAPES[args.shape])
    tok_name = args.tokenizer or shape.pop("tokenizer")
    shape.pop("tokenizer", None)
    os.makedirs(args.out, exist_ok=True)
    tokenizer_files(tok_name, args.out)
    tok = AutoTokenizer.from_pretrained(args.out)
    config = LlamaConfig(vocab_size=len(tok), max_position_embeddings=args.max_positions, rms_norm_eps=1e-5,
                         rope_theta=500000.0, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, head_dim=64, **shape)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(args.out)  # safetensors, the default
    print(json.dumps({"out": args.out, "shape": args.shape, "parameters": sum(p.numel() for p in model.parameters()),
                      "vocab": len(tok), "tokenizer": tok_name, "transformers": transformers.__version__}))
    return 0


def make_data(args):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.model)
    vocab = tok.get_vocab()
    # Whole lower-case words of the vocabulary ("▁word" in SentencePiece's, "Ġword" in byte-level's).
    words = sorted({p[1:] for p in vocab if p[:1] in ("\u2581", "\u0120") and p[1:].isalpha() and p[1:].islower()
                    and 3 <= len(p) <= 9})
    one = [w for w in words if len(tok("a " + w, add_special_tokens=False)["input_ids"]) == 2]

    def ntok(text):  # the tokens a trainer feeds: the tokenizer's (BOS) + the appended EOS
        return len(tok(text)["input_ids"]) + 1

    def cont(piece):  # the tokens " piece" adds after a word
        return len(tok("x " + piece, add_special_tokens=False)["input_ids"]) - \
            len(tok("x", add_special_tokens=False)["input_ids"])

    def rows(n, seed):
        rng = random.Random(0)  # the sentences are the same for train and held-out rows
        pool = rng.sample(words, min(600, len(words)))
        sentences = [(" ".join(rng.choice(pool) for _ in range(rng.randint(5, 12))) + ".").capitalize()
                     for _ in range(48)]
        first, more = [ntok(s) for s in sentences], [cont(s) for s in sentences]
        rng = random.Random(seed)
        out = []
        while len(out) < n:
            k = rng.randrange(len(sentences))
            text, count = sentences[k], first[k]
            while True:  # counted piece by piece (the tokenizers here split at spaces), checked at the end
                k = rng.randrange(len(sentences))
                if count + more[k] > args.block - 6:
                    break
                text, count = text + " " + sentences[k], count + more[k]
            while count < args.block:
                text, count = text + " " + rng.choice(one), count + 1
            if ntok(text) == args.block:  # else a merge across words: draw another row
                out.append(text)
        return out

    os.makedirs(args.out, exist_ok=True)
    for name, n, seed in (("train", args.rows, args.seed), ("heldout", args.heldout, args.seed + 1000)):
        with open(os.path.join(args.out, name + ".jsonl"), "w") as f:
            for text in rows(n, seed):
                f.write(json.dumps({"text": text}) + "\n")
    print(json.dumps({"out": args.out, "rows": args.rows, "heldout": args.heldout, "block": args.block,
                      "words": len(words), "one_token_words": len(one)}))
    return 0


def lora_config(r, alpha):
    from peft import LoraConfig
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                      target_modules="all-linear")


def make_adapter(args):
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    torch.manual_seed(args.seed)
    model = get_peft_model(model, lora_config(args.r, args.alpha))
    model.save_pretrained(args.out)  # safetensors, the default
    print(json.dumps({"out": args.out, "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}))
    return 0


def train(args):
    if os.environ.get("SFT_TRL_SIDE_CHILD") != "1":  # the parent: the same command under accelerate launch
        os.makedirs(args.out, exist_ok=True)
        launch = ["--num_processes", str(args.world), "--num_machines", "1", "--mixed_precision", "no",
                  "--dynamo_backend", "no", "--main_process_port", "0"]
        if args.device == "cpu" or args.world > 1:
            launch.append("--multi_gpu")  # CPU: torchrun's WORLD processes, MULTI_CPU over Gloo
        if args.device == "cpu":
            launch += ["--num_cpu_threads_per_process", "1"]
        cmd = [sys.executable, "-m", "accelerate.commands.launch"] + launch + [os.path.abspath(__file__)] + sys.argv[1:]
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", SFT_TRL_SIDE_CHILD="1")
        if args.device == "cpu":
            env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        env.setdefault("HF_DATASETS_CACHE", os.path.join(args.out, "hf-datasets-cache"))
        return subprocess.run(cmd, env=env).returncode

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import trl.trainer.sft_trainer as sft_module

    rank = int(os.environ.get("RANK", 0))  # one process (accelerate's simple launcher) sets none
    if args.device == "cpu":
        torch.set_num_threads(1)

    class Unshuffled(trl.trainer.ConstantLengthDataset):  # TRL's packing, its rows in data order
        def __init__(self, *a, **k):
            k["shuffle"] = False
            super().__init__(*a, **k)

    sft_module.ConstantLengthDataset = Unshuffled
    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:  # AutoTrain's get_tokenizer; no row is padded here
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    with open(args.data) as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    # --weights-bf16: the whole model in bf16, its weights stepped in place (TRL's full
    # fine-tuning with torch_dtype=bfloat16).
    dtype = torch.bfloat16 if ((args.bf16 and args.peft) or args.weights_bf16) else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
    peft_config = lora_config(args.lora_r, args.lora_alpha) if args.peft else None
    cfg = trl.SFTConfig(
        output_dir=os.path.join(args.out, "trainer"), packing=True, max_seq_length=args.block,
        dataset_text_field="text", per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_ratio=0.0, optim="adamw_torch", weight_decay=0.0,
        max_grad_norm=1.0, max_steps=args.steps, num_train_epochs=1, logging_steps=1, save_strategy="no",
        eval_strategy="no", report_to="none", seed=args.seed, gradient_checkpointing=False, bf16=args.bf16,
        use_cpu=args.device == "cpu", disable_tqdm=True, ddp_find_unused_parameters=False, dataloader_drop_last=False)
    trainer = trl.SFTTrainer(model=model, args=cfg, train_dataset=Dataset.from_dict({"text": texts}),
                             processing_class=tok, peft_config=peft_config)
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    if args.init_adapter:  # the common starting adapter (trl_referee.py's --init-adapter)
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file
        state = load_file(os.path.join(args.init_adapter, "adapter_model.safetensors"))
        res = set_peft_model_state_dict(trainer.model, state)
        if res.unexpected_keys:
            raise SystemExit("--init-adapter: tensors not placed: %s" % res.unexpected_keys[:4])
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)

    timing = {"steps": [], "pending": 0}
    collate = trainer.data_collator

    def counting(examples):
        batch = collate(examples)
        mask = batch.get("attention_mask")
        timing["pending"] += int(mask.sum()) if mask is not None else int(batch["input_ids"].numel())
        return batch

    trainer.data_collator = counting
    cuda = torch.cuda.is_available() and args.device == "cuda"

    class Timing(transformers.TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            timing["steps"].append({"t_begin": time.perf_counter()})

        def on_step_end(self, a, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            timing["steps"][-1]["t_end"] = time.perf_counter()

    trainer.add_callback(Timing())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    # Per step: the tokens of its G micro-batches, padding excluded. Every row is whole (B tokens,
    # no padding), so each micro-batch holds batch x block; the collator's count (which includes
    # micro-batches the dataloader fetched ahead) must cover that.
    nsteps = len(timing["steps"])
    micro = nsteps * args.grad_accum
    per_micro = args.batch * args.block
    name = "timing.jsonl" if rank == 0 else "timing.rank%d.jsonl" % rank
    with open(os.path.join(args.out, name), "w") as f:
        for k, t in enumerate(timing["steps"]):
            f.write(json.dumps(dict(t, step=k + 1, tokens=per_micro * args.grad_accum)) + "\n")
    if timing["pending"] < micro * per_micro:
        raise SystemExit("train: the collator saw %d tokens, fewer than %d steps x %d" %
                         (timing["pending"], nsteps, per_micro * args.grad_accum))
    logs = [dict(h) for h in trainer.state.log_history if "loss" in h]
    if rank == 0:
        with open(os.path.join(args.out, "log.jsonl"), "w") as f:
            for h in logs:
                f.write(json.dumps(h) + "\n")
        mem = {}
        if cuda:
            mem = {"max_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
                   "max_reserved_mib": torch.cuda.max_memory_reserved() / 2**20}
        with open(os.path.join(args.out, "memory.json"), "w") as f:
            json.dump(mem, f)
        trainer.save_model(args.out)
        shutil.rmtree(os.path.join(args.out, "trainer"), ignore_errors=True)
        print(json.dumps({"steps": len(logs), "first": logs[0] if logs else None, "last": logs[-1] if logs else None,
                          "memory": mem, "trl": trl.__version__}))
    return 0


def heldout(args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    device = "cuda" if torch.cuda.is_available() and args.device == "cuda" else "cpu"
    tok = AutoTokenizer.from_pretrained(args.model)
    with open(args.data) as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    rows = [tok(t)["input_ids"] + [tok.eos_token_id] for t in texts]

    def loss_of(model):
        model.to(device).eval()
        total, count = 0.0, 0
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=args.bf16):
            for i in range(0, len(rows), 4):
                width = max(len(r) for r in rows[i:i + 4])
                ids = torch.tensor([r + [0] * (width - len(r)) for r in rows[i:i + 4]], device=device)
                labels = torch.tensor([r + [-100] * (width - len(r)) for r in rows[i:i + 4]], device=device)
                logits = model(input_ids=ids, attention_mask=(labels != -100).long()).logits.float()
                n = int((labels[:, 1:] != -100).sum())
                total += float(torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum"))
                count += n
        return total / count, count

    labels = args.label or [os.path.basename(os.path.normpath(d)) for d in args.final]
    base_loss, count = loss_of(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32))
    print("heldout base %.5f (%d tokens, %d rows)" % (base_loss, count, len(rows)))
    for label, final in zip(labels, args.final):
        if os.path.exists(os.path.join(final, "adapter_config.json")):
            from peft import PeftModel
            base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
            model = PeftModel.from_pretrained(base, final)
        else:
            model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
        loss, _ = loss_of(model)
        print("heldout %s %.5f" % (label, loss))
        del model
    return 0


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model")
    m.add_argument("--out", required=True)
    m.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    m.add_argument("--tokenizer", default=None)
    m.add_argument("--max-positions", type=int, default=2048)
    m.add_argument("--seed", type=int, default=0)
    d = sub.add_parser("make-data")
    d.add_argument("--model", required=True)
    d.add_argument("--out", required=True)
    d.add_argument("--block", type=int, required=True)
    d.add_argument("--rows", type=int, default=64)
    d.add_argument("--heldout", type=int, default=16)
    d.add_argument("--seed", type=int, default=0)
    a = sub.add_parser("make-adapter")
    a.add_argument("--model", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--r", type=int, default=16)
    a.add_argument("--alpha", type=int, default=32)
    a.add_argument("--seed", type=int, default=42)
    t = sub.add_parser("train")
    t.add_argument("--model", required=True)
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--peft", action="store_true")
    t.add_argument("--init-adapter")
    t.add_argument("--lora-r", type=int, default=16)
    t.add_argument("--lora-alpha", type=int, default=32)
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--world", type=int, default=2)
    t.add_argument("--batch", type=int, default=2)
    t.add_argument("--grad-accum", type=int, default=1)
    t.add_argument("--block", type=int, default=256)
    t.add_argument("--bf16", action="store_true")
    t.add_argument("--weights-bf16", action="store_true")
    t.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    t.add_argument("--seed", type=int, default=42)
    h = sub.add_parser("heldout")
    h.add_argument("--model", required=True)
    h.add_argument("--data", required=True)
    h.add_argument("--final", action="append", required=True)
    h.add_argument("--label", action="append")
    h.add_argument("--bf16", action="store_true")
    h.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args()
    return {"make-model": make_model, "make-data": make_data, "make-adapter": make_adapter, "train": train,
            "heldout": heldout}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
