"""DOCSTRING PLACEHOLDER"""
import argparse
import copy
import json
import os
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree

import torch
from safetensors.torch import save_file

import transformers
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
CHATML = os.path.join(HERE, "..", "..", "..", "..", "text", "tests", "chat_templates", "chatml.jinja")

# ---------------------------------------------------------------------------------------------
# make-model: the tiny Llama and its tokenizer
# ---------------------------------------------------------------------------------------------

# ids 0..3; then the 256 ByteLevel byte pieces; then the learned merges.
SPECIALS = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>"]
VOCAB_SIZE = 384

WORDS = ("apple river planet garden silver window forest rocket yellow pencil music bridge summer winter "
         "orange castle dragon button candle family market jungle mirror number pocket rabbit school tomato "
         "turtle violin cloud stone light water green house table chair bread horse train ocean paper smile "
         "tiger zebra lemon storm dance honey cat dog sun moon star tree fish bird book road blue red fire snow "
         "rain wind king ship milk gold").split()

# Prompts and answers of make-data (and the tokenizer's training corpus).
QUESTIONS = [
    "What is 2 + 3?",
    "Reverse the word \"cat\".",
    "Write the word \"moon\" in capital letters, please, and do not add anything else to the answer.",
    "How many letters are in \"river\"?",
    "Continue the sequence: 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, and then what comes next?",
    "Name a color.",
    "What is 12 + 30?",
    "You are a helpful assistant. Think about the question carefully. Which animal is larger, a cat or a horse?",
    "Say hi.",
    "Spell \"tree\" backwards.",
    "What is the opposite of summer, and what is the opposite of light, and what is the opposite of fire?",
    "Pick a fruit.",
]
CHOSEN = [
    "2 + 3 = 5",
    "\"cat\" reversed is \"tac\".",
    "MOON",
    "\"river\" has 5 letters: r, i, v, e and r. That is five letters in all, counted one by one.",
    "33",
    "Blue.",
    "12 + 30 = 42, because 10 + 30 = 40 and 2 more is 42.",
    "A horse is larger than a cat.",
    "Hi!",
    "\"eert\"",
    "The opposite of summer is winter, of light is dark, and of fire is water or snow.",
    "An apple, or an orange, or a lemon.",
]
REJECTED = [
    "2 + 3 = 6, I think, but I am not sure about it at all, so please check it yourself.",
    "tac",
    "moon",
    "Four.",
    "32, 33, 34",
    "The color of the sea is green, and the color of the sun is red, and the moon is blue.",
    "40",
    "A cat.",
    "Hello there, my friend! How are you today? I hope the weather is nice where you are.",
    "tree",
    "Winter.",
    "A tomato is a fruit.",
]


def corpus():
    lines = QUESTIONS + CHOSEN + REJECTED + [" ".join(WORDS)] + WORDS + [" " + w for w in WORDS]
    return lines + ["user assistant system the of and to in is that it for on with as was"]


def make_tokenizer():
    """A Llama 3 style byte-level BPE: ByteLevel pre-tokenizer (GPT-2 regex), merges learned on
    corpus(), ByteLevel decoder, TemplateProcessing "<s> $A" (BOS with add_special_tokens)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIALS, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", SPECIALS.index("<s>"))])
    with open(CHATML) as f:
        template = f.read()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                   pad_token="<pad>", additional_special_tokens=["<|im_start|>"],
                                   model_max_length=128, padding_side="right")
    fast.chat_template = template
    return fast


def make_model(args):
    tokenizer = make_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, attention_dropout=0.0, attention_bias=False,
        mlp_bias=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():  # larger than _init_weights' std 0.02, so that the logits are not flat
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out, save_jinja_files=False)
    print(json.dumps({"out": args.out, "vocab_size": len(tokenizer), "bos": tokenizer.bos_token_id,
                      "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id,
                      "transformers": transformers.__version__}))
    return 0


def make_data(args):
    n = len(QUESTIONS)
    with open(args.out, "w") as f:
        for i in range(args.rows):
            q, c, r = QUESTIONS[i % n], CHOSEN[i % n], REJECTED[i % n]
            if args.kind == "text":
                row = {"prompt": q, "chosen": " " + c, "rejected": " " + r}
            else:
                row = {"prompt": [{"role": "user", "content": q}],
                       "chosen": [{"role": "assistant", "content": c}],
                       "rejected": [{"role": "assistant", "content": r}]}
            f.write(json.dumps(row) + "\n")
    print(json.dumps({"out": args.out, "kind": args.kind, "rows": args.rows}))
    return 0


def main():
    torch.set_num_threads(1)
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    mm = sub.add_parser("make-model")
    mm.add_argument("--out", required=True)
    mm.add_argument("--seed", type=int, default=0)
    md = sub.add_parser("make-data")
    md.add_argument("--out", required=True)
    md.add_argument("--kind", default="text", choices=["text", "chat"])
    md.add_argument("--rows", type=int, default=8)
    args = p.parse_args()
    return {"make-model": make_model, "make-data": make_data}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
