#!/usr/bin/env bash
# LoRA SFT throughput of `replica llm --train` on a tiny model of each architecture (README
# "Model architectures"): the demo's size (hidden 256, 4 layers, 8 heads over 4 kv heads,
# vocabulary 1000, tied; GPT-OSS: 8 experts of 128, top 2, untied as it ships), the demo's data
# and tokenizer, fp32, 2 workers x 1 thread, block 256, batch 2, 40 steps. The models are made
# by transformers from configs (random weights, .venv). Families run in turn, ROUNDS rounds, and
# each family's tokens/s is the median of the logging windows of steps 11-40 over the rounds.
#
#   bench/families_sft.sh [ROUNDS] [FAMILIES...]    (default: 2 rounds, every family)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${REPLICA_BIN:-$ROOT/build/replica}
PY=${PYTHON:-$ROOT/.venv/bin/python}
ROUNDS=${1:-2}
shift || true
FAMILIES=("$@")
[ ${#FAMILIES[@]} -gt 0 ] || FAMILIES=(llama olmo2 olmo3 gemma3_text gpt_oss)
WORK=$(mktemp -d /tmp/replica-families-sft-XXXXXX)
trap 'rm -rf "$WORK"' EXIT

"$BIN" llm init-demo "$WORK/demo" >/dev/null
"$PY" - "$WORK" "${FAMILIES[@]}" <<'EOF'
import os, shutil, sys
import torch, transformers
work, families = sys.argv[1], sys.argv[2:]
demo = os.path.join(work, "demo", "model")
common = dict(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=2048,
              tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=None)
windows = dict(sliding_window=64, layer_types=["sliding_attention"] * 3 + ["full_attention"])
configs = {
    "olmo2": transformers.Olmo2Config(**common),
    "olmo3": transformers.Olmo3Config(**common, **windows),
    "gemma3_text": transformers.Gemma3TextConfig(**common, **windows),
    "gpt_oss": transformers.GptOssConfig(**dict(common, intermediate_size=128, tie_word_embeddings=False),
                                         num_local_experts=8, num_experts_per_tok=2, sliding_window=64,
                                         layer_types=["sliding_attention", "full_attention"] * 2,
                                         rope_scaling=None),
}
for family in families:
    out = os.path.join(work, family)
    if family == "llama":
        shutil.copytree(demo, out)
        continue
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(configs[family]).save_pretrained(out)
    for f in os.listdir(demo):
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            shutil.copy(os.path.join(demo, f), out)
EOF

for round in $(seq "$ROUNDS"); do
  for family in "${FAMILIES[@]}"; do
    project="$WORK/run_${family}_$round"
    "$BIN" llm --train --model "$WORK/$family" --data-path "$WORK/demo/data" --project-name "$project" \
      --trainer sft --peft --lr 5e-3 --max-steps 40 --block-size 256 --batch-size 2 --gradient-accumulation 1 \
      --logging-steps 10 --nproc-per-node 2 --threads-per-worker 1 --checkpoint-every 0 >/dev/null 2>"$project.log" \
      || { cat "$project.log" >&2; exit 1; }
  done
done

"$PY" - "$WORK" "$ROUNDS" "${FAMILIES[@]}" <<'EOF'
import json, statistics, sys
work, rounds, families = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
print("| model | tokens/s, median (range) |")
print("|---|---|")
for family in families:
    rates = []
    for r in range(1, rounds + 1):
        with open(f"{work}/run_{family}_{r}/metrics.jsonl") as f:
            for line in f:
                j = json.loads(line)
                if "tokens_per_s" in j and j.get("step", 0) > 10:
                    rates.append(j["tokens_per_s"])
    print(f"| `{family}` | {statistics.median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f}) |")
EOF
