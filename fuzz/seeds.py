#!/usr/bin/env python3
"""Writes the hand-made seeds of the fuzz targets (fuzz/README.md): real files (chat templates,
model configs, DeepSpeed and MDS files) and the hostile classes of issue 35 (nesting deep enough
to pass every bound, sizes that would allocate terabytes or wrap, templates that loop or recurse),
each a few KB at most so that libFuzzer's input length stays small.

    fuzz/seeds.py [OUT]    # OUT/<target>/seed-<name>; default /tmp/seeds

The seeds are not committed: fuzz/corpus/<target>/ keeps the inputs that add coverage beyond
them, and a run names both directories.
"""
import json
import os
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPTH = 1000  # past every nesting bound (JSON 128, templates 200), still only a few KB


def nested(open_, close, inner="1", depth=None):
    """inner inside `depth` levels of open_ ... close: by default 1000 levels, fewer (at least
    300) for long openers, so that a seed stays near 4 KB."""
    if depth is None:
        depth = max(300, min(DEPTH, 4000 // len(open_)))
    return open_ * depth + inner + close * depth


def compact(value):
    return json.dumps(value, separators=(",", ":"))


def records():
    deep = nested("[", "]")
    out = {
        "jsonl-messages-deep-array": '{"messages": %s}\n' % deep,
        "jsonl-deep-object": nested('{"a":', "}") + "\n",
        "jsonl-text-deep": '{"text": "ok"}\n{"text": %s}\n' % nested('{"t":', "}"),
        "jsonl-long-line": '{"text": "%s"}\n' % ("x" * 6000),
        "jsonl-huge-numbers": '{"text": "a", "n": 1e999}\n{"text": "b", "n": -1e400, "m": 18446744073709551616}\n',
        "jsonl-messages": compact({"messages": [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "hello"}]}) + "\n",
        "csv-long-field": "text,label\n\"%s\",1\n" % ("y" * 6000),
        "csv-quoted-newlines": 'text,label\n"a\n""b""\nc",1\n"%s",2\n' % ('""' * 500),
        "csv-many-columns": ",".join("c%d" % i for i in range(500)) + "\n" + ",".join("1" * 500) + "\n",
    }
    return {name: bytes([1 if name.startswith("csv") else 0]) + text.encode() for name, text in out.items()}


def safetensors_file(header, data=b""):
    h = header if isinstance(header, bytes) else header.encode()
    return struct.pack("<Q", len(h)) + h + data


def safetensors():
    ok = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
    out = {
        "valid": safetensors_file(compact(ok), b"\0" * 16),
        "shape-nested-deep": safetensors_file(
            '{"w":{"dtype":"F32","shape":%s,"data_offsets":[0,4]}}' % nested("[", "]"), b"\0" * 4),
        "metadata-nested-deep": safetensors_file('{"__metadata__":%s}' % nested('{"a":', "}", '"x"')),
        "header-length-huge": struct.pack("<Q", 1 << 62) + b"{}",
        "header-length-2^31": struct.pack("<Q", 1 << 31) + b'{"w":{}}',
    }
    for i, shape in enumerate([[2147483648, 2147483648], [1e12], [-1], [9223372036854775807, 2],
                               [4294967296, 4294967296, 4294967296], [0, 18446744073709551615],
                               [2147483647]]):
        h = compact({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 16]}})
        out["shape-huge-%d" % i] = safetensors_file(h, b"\0" * 16)
    for i, offsets in enumerate([[0, 18446744073709551615], [18446744073709551600, 18446744073709551615],
                                 [0, 1e12], [-16, 0]]):
        h = compact({"w": {"dtype": "U8", "shape": [16], "data_offsets": offsets}})
        out["offsets-huge-%d" % i] = safetensors_file(h, b"\0" * 16)
    return out


TOKENIZER = {
    "version": "1.0",
    "added_tokens": [{"id": 0, "content": "<s>", "special": True, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False}],
    "normalizer": {"type": "NFC"},
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    "post_processor": None,
    "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
              "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
              "vocab": {"<s>": 0, "H": 1, "e": 2, "l": 3, "o": 4, "He": 5, "ll": 6, "Hell": 7, "Hello": 8,
                        "\u0120": 9, "w": 10, "r": 11, "d": 12},
              "merges": ["H e", "l l", "He ll", "Hell o"]},
}


def tokenizer_with(**changes):
    t = json.loads(json.dumps(TOKENIZER))
    t.update(changes)
    return compact(t).encode()


def tokenizer():
    seq = {"type": "NFC"}
    for _ in range(100):  # two JSON levels each
        seq = {"type": "Sequence", "normalizers": [seq]}
    pre = {"type": "Whitespace"}
    for _ in range(100):
        pre = {"type": "Sequence", "pretokenizers": [pre]}
    added = lambda i: {"id": i, "content": "<x>", "special": True, "single_word": False, "lstrip": False,
                       "rstrip": False, "normalized": False}
    out = {
        "valid": tokenizer_with(),
        "normalizer-sequence-deep": tokenizer_with(normalizer=seq),
        "pretokenizer-sequence-deep": tokenizer_with(pre_tokenizer=pre),
        "added-token-id-2e9": tokenizer_with(added_tokens=[added(2000000000)]),
        "added-token-id-2^53": tokenizer_with(added_tokens=[added(9007199254740993)]),
        "added-token-id-negative": tokenizer_with(added_tokens=[added(-1)]),
        "vocab-id-2^31": tokenizer_with(model=dict(TOKENIZER["model"], vocab={"<s>": 0, "H": 2147483648})),
        "vocab-id-1e12": tokenizer_with(model=dict(TOKENIZER["model"], vocab={"<s>": 0, "H": 1e12})),
    }
    raw = compact(TOKENIZER)
    out["model-nested-deep"] = raw.replace('"dropout":null', '"dropout":' + nested("[", "]")).encode()
    out["array-nested-deep"] = nested("[", "]").encode()
    return out


CONFIG = """task: image-classification
model: mlp
project_name: runs/p
data:
  path: /usr/share/datasets/fashion-mnist
params:
  epochs: 1
  hidden_sizes: [32, 16]
"""


def config():
    out = {
        "valid": CONFIG,
        "hidden-sizes-2^31-1": CONFIG.replace("[32, 16]", "[2147483647]"),
        "hidden-sizes-1e12": CONFIG.replace("[32, 16]", "[1e12, 2147483648, -1]"),
        "hidden-sizes-nested-flow": CONFIG.replace("[32, 16]", nested("[", "]")),
        "params-nested-flow": CONFIG.replace("  hidden_sizes: [32, 16]\n", "  lr: %s\n" % nested("{a: ", "}")),
        "params-nested-block": CONFIG + "".join(" " * (i + 2) + "k:\n" for i in range(100)) + " " * 102 + "1\n",
        "sizes-wrap": CONFIG + "  batch_size: 1e18\n  max_steps: 9223372036854775808\n  gradient_accumulation: 4294967297\n",
        "anchors": CONFIG.replace("[32, 16]", "&a [1, 2]") + "  x: &b [*a, *a, *a, *a]\n  y: [*b, *b, *b, *b]\n",
        "two-tower": "task: two-tower\nmodel: two-tower\nproject_name: p\ndata:\n  path: /tmp\nparams:\n"
                     "  hidden_sizes: [2147483647, 2147483647]\n  embedding_dim: 9223372036854775807\n",
        "llm": "task: llm-sft\nbase_model: /tmp\nproject_name: p\ndata:\n  path: /tmp\n  chat_template: chatml\n"
               "params:\n  block_size: 2147483648\n  lora_r: 1e12\n  target_modules: %s\n" % nested("[", "]", "q"),
    }
    return {k: v.encode() for k, v in out.items()}


def deepspeed():
    real = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": 1.0, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5,
                                                          "warmup_num_steps": 10, "total_num_steps": "auto"}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "offload_param": {"device": "none"}, "overlap_comm": True,
                              "contiguous_gradients": True, "reduce_bucket_size": 5e8,
                              "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
                              "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                              "stage3_gather_16bit_weights_on_model_save": True, "sub_group_size": 1e9},
        "steps_per_print": 100, "wall_clock_breakdown": False,
    }
    fp16 = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 2000,
                     "hysteresis": 1, "min_loss_scale": 1, "auto_cast": False},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5, "cos_min_ratio": 0}}}
    out = {
        "real-zero3": compact(real),
        "real-fp16": compact(fp16),
        "batch-1e18": '{"train_micro_batch_size_per_gpu": 1e18, "train_batch_size": 1e18}',
        "batch-2^31": '{"train_micro_batch_size_per_gpu": 2147483648, "gradient_accumulation_steps": -1}',
        "warmup-huge": '{"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1e300}}}',
        "zero-nested-deep": '{"zero_optimization": %s}' % nested('{"stage":', "}"),
        "array-nested-deep": nested("[", "]"),
        "nan-like": '{"gradient_clipping": 1e999, "zero_optimization": {"reduce_bucket_size": -1e999}}',
    }
    # Byte 0: task 0-2, bit 2 through a YAML config (fuzz_deepspeed.cpp).
    seeds = {}
    for name, text in out.items():
        seeds[name] = bytes([0]) + text.encode()
        seeds[name + "-yaml"] = bytes([5]) + text.encode()
    return seeds


def model_config():
    out = {}
    fixtures = os.path.join(ROOT, "replica/models/tests/reference/fixtures")
    for family in sorted(os.listdir(fixtures)):
        path = os.path.join(fixtures, family, "config.json")
        if os.path.exists(path):
            with open(path, "rb") as f:
                out["fixture-" + family] = f.read()
    base = json.loads(out["fixture-llama3_gqa"]) if "fixture-llama3_gqa" in out else {
        "model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    small = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 256, "torch_dtype": "float32"}
    families = {
        "olmo2": dict(small, model_type="olmo2", architectures=["Olmo2ForCausalLM"], num_hidden_layers=2),
        "olmo3": dict(small, model_type="olmo3", architectures=["Olmo3ForCausalLM"], num_hidden_layers=4,
                      sliding_window=16),
        "gpt_oss": dict(small, model_type="gpt_oss", architectures=["GptOssForCausalLM"], num_hidden_layers=2,
                        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                        layer_types=["sliding_attention", "full_attention"], attention_bias=True,
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "truncate": False,
                                      "original_max_position_embeddings": 64},
                        quantization_config={"quant_method": "mxfp4"}),
        "gemma3_text": dict(small, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
                            num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                            layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=30.0),
        "gemma3": {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                   "text_config": dict(small, model_type="gemma3_text", num_hidden_layers=2,
                                       sliding_window_pattern=2)},
        "llama3-rope": dict(base, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "qwen2-sliding": dict(small, model_type="qwen2", num_hidden_layers=3, use_sliding_window=True,
                              sliding_window=8, max_window_layers=1),
    }
    for name, value in families.items():
        out["family-" + name] = compact(value).encode()
    huge = {"hidden-1e12": {"hidden_size": 1e12}, "hidden-negative": {"hidden_size": -4096},
            "hidden-2^31": {"hidden_size": 2147483648}, "hidden-2^63": {"hidden_size": 9223372036854775808},
            "vocab-2^31-1": {"vocab_size": 2147483647}, "layers-2^31": {"num_hidden_layers": 2147483648},
            "layers-huge-layer-types": {"num_hidden_layers": 100000, "layer_types": ["full_attention"] * 3},
            "heads-zero": {"num_attention_heads": 0, "num_key_value_heads": 0},
            "intermediate-1e308": {"intermediate_size": 1e308}, "positions-2^40": {"max_position_embeddings": 2 ** 40},
            "eos-list-huge": {"eos_token_id": [2 ** 62, -(2 ** 62), 1e300]},
            "sliding-2^62": {"sliding_window": 2 ** 62, "model_type": "mistral"},
            "rope-factor-inf": {"rope_scaling": {"rope_type": "yarn", "factor": 1e308,
                                                 "original_max_position_embeddings": 2 ** 40}}}
    for name, change in huge.items():
        out["size-" + name] = compact(dict(base, **change)).encode()
    raw = compact(base)
    out["nested-array"] = nested("[", "]").encode()
    out["nested-rope-scaling"] = raw.replace("{", '{"rope_scaling":%s,' % nested('{"a":', "}"), 1).encode()
    out["nested-text-config"] = (nested('{"model_type":"gemma3","text_config":', "}", raw, 140)).encode()
    out["nested-hidden-size"] = raw.replace('"hidden_size":', '"hidden_size":' + nested("[", "]", "32") + ',"x":').encode()
    return out


MESSAGES = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]


def chat_template():
    out = {}
    templates = os.path.join(ROOT, "replica/text/tests/chat_templates")
    for name in sorted(os.listdir(templates)):
        if name.endswith(".jinja"):
            with open(os.path.join(templates, name), "rb") as f:
                text = f.read()
            out["template-" + name[:-6]] = bytes([4]) + text  # mode 0, add_generation_prompt
    with open(os.path.join(templates, "llama3_2.jinja")) as f:
        llama = f.read()
    config = {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>", "special": True},
              "chat_template": llama}
    out["tokenizer-config-llama3_2"] = bytes([5]) + compact(config).encode()
    out["tokenizer-config-list"] = bytes([1]) + compact(
        {"chat_template": [{"name": "tool_use", "template": "{{ tools }}"},
                           {"name": "default", "template": "{% for m in messages %}{{ m.content }}{% endfor %}"}],
         "bos_token": "<s>", "additional_special_tokens": ["<a>", {"content": "<b>"}]}).encode()
    out["tokenizer-config-nested"] = bytes([1]) + ('{"chat_template":"{{ bos_token }}","bos_token":%s}'
                                                   % nested('{"content":', "}", '"<s>"')).encode()
    out["messages-real"] = bytes([2]) + compact(MESSAGES).encode()
    out["messages-llama3"] = bytes([10]) + compact(MESSAGES).encode()
    out["messages-nested-content"] = bytes([2]) + ('[{"role":"user","content":%s}]' % nested("[", "]", '"x"')).encode()
    out["messages-nested-shallow"] = bytes([2]) + ('[{"role":"user","content":%s}]'
                                                   % nested("[", "]", '"x"', 100)).encode()
    out["messages-tool-calls"] = bytes([6]) + compact(MESSAGES + [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"a": [1, {"b": None}]}}}]}]).encode()
    nesting = {
        "not-chain": "{{ " + "not " * 1000 + "x }}",
        "parens": "{{ " + nested("(", ")") + " }}",
        "lists": "{{ " + nested("[", "]") + " }}",
        "dicts": "{{ " + nested("{'a': ", "}") + " }}",
        "attr-chain": "{{ x" + ".a" * 1000 + " }}",
        "plus-chain": "{{ " + "+".join(["1"] * 1000) + " }}",
        "filter-chain": "{{ 'x'" + "|upper" * 500 + " }}",
        "if-blocks": "{% if true %}" * 210 + "x" + "{% endif %}" * 210,
        "for-blocks": "{% for i in range(1) %}" * 210 + "x" + "{% endfor %}" * 210,
        "nested-range-loops": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        "range-huge-list": "{{ range(10**12) | list | length }}",
        "string-times-huge": "{{ 'x' * 10**12 }}",
        "list-times-huge": "{{ ([1] * 10**6) * 10**6 }}",
        "recursive-macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                    "{% endfor %}{{ ns.s | length }}",
        "list-nesting-loop": "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = [ns.l] %}"
                             "{% endfor %}{{ ns.l | tojson }}",
        "pow-huge": "{{ 10 ** 10 ** 10 }}",
        "format-width": "{{ '%999999999999d' % 1 }}{{ '{:>999999999999}'.format(1) }}",
        "center-huge": "{{ 'x'.center(10**12) }}{{ 'x' | indent(10**12) }}",
    }
    for name, text in nesting.items():
        out["nesting-" + name] = bytes([4]) + text.encode()
    out["template-and-messages"] = bytes([7]) + b"{% for m in messages %}{{ m.content | tojson }}{% endfor %}\0" + \
        ('[{"role":"user","content":%s}]' % nested('{"a":', "}", "1", 120)).encode()
    return out


def mds_shard(samples, columns=(("id", "int64", 8), ("text", "str", None)), compression=None):
    """An MDS shard as mds.h describes it: count, offsets, the shard's config, the samples."""
    config = {"column_encodings": [c[1] for c in columns], "column_names": [c[0] for c in columns],
              "column_sizes": [c[2] for c in columns], "compression": compression, "format": "mds",
              "hashes": [], "size_limit": 1 << 26, "version": 2}
    config_text = json.dumps(config, sort_keys=True).encode()
    encoded = []
    for values in samples:
        head, body = b"", b""
        for (name, encoding, fixed), value in zip(columns, values):
            datum = struct.pack("<q", value) if encoding == "int64" else value.encode()
            if fixed is None:
                head += struct.pack("<I", len(datum))
            body += datum
        encoded.append(head + body)
    start = 4 + 4 * (len(encoded) + 1) + len(config_text)
    offsets = [start]
    for e in encoded:
        offsets.append(offsets[-1] + len(e))
    data = struct.pack("<I", len(encoded)) + b"".join(struct.pack("<I", o) for o in offsets) + config_text
    return config, data + b"".join(encoded)


def mds_input(index, shard):
    """fuzz_mds's input: index.json's length (2 bytes), index.json, the shard."""
    text = index if isinstance(index, bytes) else json.dumps(index).encode()
    return struct.pack("<H", len(text)) + text + shard


def mds_index(config, shard, **changes):
    entry = dict(config, samples=3, raw_data={"basename": "shard.00000.mds", "bytes": len(shard), "hashes": {}},
                 zip_data=None)
    entry.update(changes)
    return {"version": 2, "shards": [entry]}


def mds():
    import subprocess
    config, shard = mds_shard([(1, "hello"), (2, "world"), (3, "")])
    out = {
        "valid": mds_input(mds_index(config, shard), shard),
        "samples-10^12": mds_input(mds_index(config, shard, samples=10 ** 12), shard),
        "raw-bytes-2^63": mds_input(mds_index(config, shard, raw_data={"basename": "shard.00000.mds",
                                                                        "bytes": 2 ** 63, "hashes": {}}), shard),
        "basename-outside": mds_input(mds_index(config, shard, raw_data={
            "basename": "../../outside/shard.00000.mds", "bytes": len(shard), "hashes": {}}), shard),
        "basename-absolute": mds_input(mds_index(config, shard, raw_data={
            "basename": "/etc/passwd", "bytes": len(shard), "hashes": {}}), shard),
        "column-size-huge": mds_input(mds_index(dict(config, column_sizes=[2 ** 40, None]), shard), shard),
        "ndarray-shape-huge": mds_input(mds_index(dict(config, column_encodings=["ndarray:float32:1000000,1000000",
                                                                                 "str"]), shard), shard),
        "index-nested-deep": mds_input(nested('{"shards":', "}", "[]", 300).encode(), shard),
        "shard-count-huge": mds_input(mds_index(config, shard), struct.pack("<I", 0xFFFFFFFF) + shard[4:]),
    }
    # zstd: a real compressed shard, and one that expands far past what index.json says (a bomb:
    # 64 MiB of zeros in a few KB).
    zipped = subprocess.run(["zstd", "-q", "-c"], input=shard, stdout=subprocess.PIPE, check=True).stdout
    zip_config = dict(config, compression="zstd")
    zip_data = {"basename": "shard.00000.mds.zstd", "bytes": len(zipped), "hashes": {}}
    out["zstd-valid"] = mds_input(mds_index(zip_config, shard, zip_data=zip_data), zipped)
    bomb = subprocess.run(["zstd", "-q", "-19", "-c"], input=shard + b"\0" * (64 << 20), stdout=subprocess.PIPE,
                          check=True).stdout
    out["zstd-bomb"] = mds_input(mds_index(zip_config, shard, zip_data=dict(zip_data, bytes=len(bomb))), bomb)
    return out


TARGETS = {"fuzz_records": records, "fuzz_safetensors": safetensors, "fuzz_tokenizer": tokenizer,
           "fuzz_config": config, "fuzz_deepspeed": deepspeed, "fuzz_model_config": model_config,
           "fuzz_chat_template": chat_template, "fuzz_mds": mds,
           # No hand-made seeds; the directory exists so that every target's command is the same.
           "fuzz_idx": dict, "fuzz_rendezvous": dict}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/seeds"
    for target, make in TARGETS.items():
        d = os.path.join(out, target)
        os.makedirs(d, exist_ok=True)
        for name, data in make().items():
            with open(os.path.join(d, "seed-" + name), "wb") as f:
                f.write(data if isinstance(data, bytes) else data.encode())


if __name__ == "__main__":
    main()
