"""Referee for the safetensors files replica reads and writes: the safetensors package itself,
with transformers and PEFT saying what the names and dtypes must be.

Usage:
  safetensors_referee.py make-inputs ROOT
      ROOT/llama-fp32 and ROOT/llama-bf16: tiny random LlamaForCausalLM models (hidden 32,
      2 layers, GQA, a byte-level BPE vocabulary of ~300 trained here with the tokenizers
      package; float32 with separate lm_head, bfloat16 with tied embeddings) saved by
      transformers' save_pretrained, with tokenizer.json and tokenizer_config.json;
      ROOT/data.jsonl: a tiny data set ({"text": ...} per line);
      ROOT/dtypes.safetensors: written by safetensors.torch.save_file with a tensor of every
      dtype replica supports (F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL; special values, a 0-d
      and an empty tensor) plus __metadata__, and ROOT/dtypes.json with each tensor's dtype,
      shape and values ("inf", "-inf", "nan" as strings) and the metadata.
  safetensors_referee.py check MANIFEST.json
      MANIFEST.json: {"runs": [{"dir": RUN_DIR, "base_model": DIR}], "extra": [{"file": F,
      "base_model": DIR, "kind": "full"}]}. Opens every *.safetensors under each RUN_DIR with
      safetensors.safe_open and safetensors.torch.load_file and checks, by what the file is:
        adapter_model.safetensors   names and dtypes == PEFT's (get_peft_model_state_dict of the
                                    base model, in its dtype, wrapped with the sibling
                                    adapter_config.json: float32 adapters also on a bf16 base);
        model.safetensors           names == the names transformers' save_pretrained writes for
                                    the base model, dtype == the sibling config.json's torch_dtype,
                                    and in final/ and merged/ the base model's dtype, in checkpoints
                                    float32 (the master weights), metadata format "pt"; final/ and
                                    merged/ must load
                                    with transformers' from_pretrained with no missing or
                                    unexpected keys. A ZeRO-3 checkpoint's model.safetensors
                                    (beside zero/) holds no tensors (docs: the shards hold them);
        anything else               (optimizer, rng_state, zero/rank-K) must load;
      and every floating tensor must be finite. Each "extra" file (replica consolidate's
      output) is checked as a full model in float32.
      Prints one line per file; exits 1 on any failure.
"""
import argparse
import glob
import json
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "data parallel training keeps one copy of the model per worker",
    "a tiny llama learns to repeat short sentences",
    "safetensors files hold named tensors and a json header",
    "every worker sees a different slice of the data set",
    "the optimizer steps after the gradients are averaged",
    "low rank adapters train a small number of parameters",
    "zero stage three shards parameters gradients and optimizer state",
]


def make_model(out_dir, dtype_name, tied):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 4, trainer)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "model_max_length": 256}, f, indent=2)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=tok.token_to_id("<s>"),
                         eos_token_id=tok.token_to_id("</s>"), tie_word_embeddings=tied)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype_name))
    model.save_pretrained(out_dir, safe_serialization=True)
    print(f"{out_dir}: LlamaForCausalLM {dtype_name}, vocab {config.vocab_size}, tied {tied}, "
          f"{sum(p.numel() for p in model.parameters())} parameters")


def make_data(path):
    with open(path, "w") as f:
        for i in range(24):
            f.write(json.dumps({"text": TEXTS[i % len(TEXTS)] + f" number {i}"}) + "\n")


def make_inputs(args):
    os.makedirs(args.root, exist_ok=True)
    make_model(os.path.join(args.root, "llama-fp32"), "float32", tied=False)
    make_model(os.path.join(args.root, "llama-bf16"), "bfloat16", tied=True)
    make_data(os.path.join(args.root, "data.jsonl"))
    write_dtypes(os.path.join(args.root, "dtypes.safetensors"), os.path.join(args.root, "dtypes.json"))
    return 0


def write_dtypes(path, expected_path):
    inf, nan = float("inf"), float("nan")
    floats = [0.0, -0.0, 1.0, -2.5, 3.140625, 1e-3, 65504.0, inf, -inf, nan]
    tensors = {
        "f64": torch.tensor([0.1, -1e300, 5e-324, inf, -inf, nan], dtype=torch.float64).reshape(2, 3),
        "f32": torch.tensor(floats + [1e-40, 3.4e38], dtype=torch.float32).reshape(3, 4),
        "f16": torch.tensor(floats + [6e-8, -65504.0], dtype=torch.float16).reshape(2, 2, 3),
        "bf16": torch.tensor(floats + [1e-40, 3e38], dtype=torch.bfloat16).reshape(12),
        "i64": torch.tensor([0, 1, -1, 2**63 - 1, -2**63, 123456789012345], dtype=torch.int64),
        "i32": torch.tensor([[0, -2**31], [2**31 - 1, 7]], dtype=torch.int32),
        "i16": torch.tensor([0, -32768, 32767, -5], dtype=torch.int16),
        "i8": torch.tensor([0, -128, 127, 3, -3], dtype=torch.int8),
        "u8": torch.tensor([0, 1, 128, 255], dtype=torch.uint8),
        "bool": torch.tensor([[True, False, True], [False, False, True]]),
        "scalar.f32": torch.tensor(2.75, dtype=torch.float32),
        "empty.i64": torch.zeros(0, 3, dtype=torch.int64),
        "model.layers.0.self_attn.q_proj.weight": torch.arange(24, dtype=torch.float32).reshape(4, 6) / 8,
    }
    metadata = {"format": "pt", "written_by": "safetensors.torch.save_file"}
    save_file(tensors, path, metadata=metadata)

    def value(v):
        if isinstance(v, bool):
            return v
        if isinstance(v, float):
            if v != v:
                return "nan"
            if v in (inf, -inf):
                return "inf" if v > 0 else "-inf"
        return v

    names = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}
    expected = {"metadata": metadata, "tensors": {}}
    for name, t in tensors.items():
        flat = t.reshape(-1)
        values = flat.tolist() if t.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                                              torch.bool) else flat.double().tolist()
        # -0.0 is kept apart from 0.0 through its sign.
        signs = [1 if (isinstance(v, float) and v == 0.0 and str(v).startswith("-")) else 0 for v in values]
        expected["tensors"][name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                                     "values": [value(v) for v in values], "negative_zero": signs}
    with open(expected_path, "w") as f:
        json.dump(expected, f, indent=1)
    print(f"{path}: {len(tensors)} tensors written by safetensors.torch.save_file")


# ---------------------------------------------------------------------------------------------
# check

DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def config_dtype(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    return DTYPES[config.get("torch_dtype") or config.get("dtype") or "float32"]


def open_file(path):
    """Reads `path` with both loaders; returns (tensors, metadata) or raises."""
    with safe_open(path, framework="pt") as f:
        keys = list(f.keys())
        metadata = f.metadata()
        by_safe_open = {k: f.get_tensor(k) for k in keys}
    tensors = load_file(path)
    if sorted(tensors) != sorted(by_safe_open):
        raise AssertionError("safe_open and load_file list different tensors")
    def raw(t):
        return t.contiguous().reshape(-1).view(torch.uint8)

    for k, t in tensors.items():
        other = by_safe_open[k]
        if t.dtype != other.dtype or t.shape != other.shape or not torch.equal(raw(t), raw(other)):
            raise AssertionError(f"{k}: safe_open and load_file disagree")
    return tensors, metadata


def non_finite(tensors):
    return sorted(k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all())


class Reference:
    """What transformers and PEFT name things for one base model directory (cached)."""

    def __init__(self):
        self.saved_names = {}
        self.models = {}

    def transformers_names(self, base):
        # The names transformers' save_pretrained wrote for this model (state_dict minus the
        # tied copies it leaves out).
        if base not in self.saved_names:
            files = glob.glob(os.path.join(base, "*.safetensors"))
            names = set()
            for f in files:
                with safe_open(f, framework="pt") as g:
                    names.update(g.keys())
            state = set(self.model(base).state_dict().keys())
            if not names <= state:
                raise AssertionError(f"{base}: save_pretrained wrote names not in state_dict: {names - state}")
            self.saved_names[base] = names
        return self.saved_names[base]

    def model(self, base):
        from transformers import AutoModelForCausalLM
        if base not in self.models:
            self.models[base] = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        return self.models[base]

    def peft_adapter(self, base, adapter_dir):
        """{name: dtype} of what PEFT saves for the base model (in its own dtype) wrapped with
        the adapter_config.json of adapter_dir."""
        from transformers import AutoModelForCausalLM
        from peft import PeftConfig, get_peft_model, get_peft_model_state_dict
        config = PeftConfig.from_pretrained(adapter_dir)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=config_dtype(base)), config)
        return {k: v.dtype for k, v in get_peft_model_state_dict(model).items()}


def check_full(path, tensors, metadata, base, ref, dtype):
    problems = []
    want = ref.transformers_names(base)
    got = set(tensors)
    if got != want:
        problems.append(f"names differ from transformers': extra {sorted(got - want)}, missing {sorted(want - got)}")
    wrong = sorted(f"{k}:{t.dtype}" for k, t in tensors.items() if t.dtype != dtype)
    if wrong:
        problems.append(f"dtype not {dtype}: {wrong[:5]}")
    if (metadata or {}).get("format") != "pt":
        problems.append(f"metadata {metadata!r} lacks format: pt (transformers needs it)")
    return problems


def check_loads_in_transformers(final_dir):
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(final_dir, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    del model
    return [f"from_pretrained: {bad}"] if bad else []


def check(args):
    with open(args.manifest) as f:
        manifest = json.load(f)
    ref = Reference()
    failed = 0
    counted = 0

    def report(path, problems, what):
        nonlocal failed, counted
        counted += 1
        failed += bool(problems)
        print(f"{'ok  ' if not problems else 'FAIL'} {path}: {what}" + ("" if not problems else " -- " + "; ".join(problems)))

    for run in manifest["runs"]:
        files = sorted(glob.glob(os.path.join(run["dir"], "**", "*.safetensors"), recursive=True))
        if not files:
            report(run["dir"], ["no *.safetensors under it"], "run")
        for path in files:
            rel = os.path.relpath(path, os.path.dirname(run["dir"]))
            try:
                tensors, metadata = open_file(path)
            except Exception as e:  # noqa: BLE001 - any failure to read is the finding
                report(rel, [f"cannot be read: {type(e).__name__}: {e}"], "read")
                continue
            problems = []
            bad = non_finite(tensors)
            if bad:
                problems.append(f"non-finite tensors {bad[:5]}")
            parent = os.path.dirname(path)
            name = os.path.basename(path)
            dtypes = sorted({str(t.dtype).replace("torch.", "") for t in tensors.values()})
            what = f"{len(tensors)} tensors {dtypes}"
            if name == "adapter_model.safetensors":
                want = ref.peft_adapter(run["base_model"], parent)
                got = set(tensors)
                if got != set(want):
                    problems.append(f"names differ from PEFT's: extra {sorted(got - set(want))[:5]}, "
                                    f"missing {sorted(set(want) - got)[:5]}")
                wrong = sorted(f"{k}:{t.dtype} (PEFT {want[k]})" for k, t in tensors.items()
                               if k in want and t.dtype != want[k])
                if wrong:
                    problems.append(f"dtypes differ from PEFT's: {wrong[:5]}")
                what = "PEFT adapter, " + what
            elif name == "model.safetensors" and os.path.isdir(os.path.join(parent, "zero")):
                if tensors:
                    problems.append("a ZeRO-3 checkpoint's model.safetensors should be empty (the shards hold it)")
                what = "ZeRO-3 checkpoint placeholder, " + what
            elif name == "model.safetensors":
                # final/ and merged/ (merge_adapter; its files also in the project itself, where
                # AutoTrain writes a merged model): a transformers model directory in the base
                # model's dtype; checkpoints: the float32 master weights. The config.json beside
                # the file must say so.
                final = os.path.basename(parent) in ("final", "merged") or os.path.normpath(parent) == os.path.normpath(run["dir"])
                dtype = config_dtype(run["base_model"]) if final else torch.float32
                if config_dtype(parent) != dtype:
                    problems.append(f"config.json beside it says {config_dtype(parent)}, the file should be {dtype}")
                problems += check_full(path, tensors, metadata, run["base_model"], ref, dtype)
                if final:
                    problems += check_loads_in_transformers(parent)
                what = f"full model ({dtype}), " + what
            report(rel, problems, what)

    for extra in manifest.get("extra", []):
        path = extra["file"]
        try:
            tensors, metadata = open_file(path)
        except Exception as e:  # noqa: BLE001
            report(path, [f"cannot be read: {type(e).__name__}: {e}"], "read")
            continue
        problems = non_finite(tensors)
        problems = [f"non-finite tensors {problems[:5]}"] if problems else []
        problems += check_full(path, tensors, metadata, extra["base_model"], ref, torch.float32)
        report(path, problems, f"full model (float32), {len(tensors)} tensors")

    print(f"{counted} files, {failed} failed")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("make-inputs")
    p.add_argument("root")
    p = sub.add_parser("check")
    p.add_argument("manifest")
    args = parser.parse_args()
    torch.set_num_threads(1)
    return {"make-inputs": make_inputs, "check": check}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
