"""A small Gemma-style tokenizer (the real Gemma 3 tokenizer cannot be downloaded here), and
transformers' own view of it as the referee for replica's tokenizer and chat template.

  make --out DIR
      Builds, with the PyPI `tokenizers`, a BPE tokenizer laid out as transformers'
      GemmaConverter lays out Gemma's (convert_slow_tokenizer.py): ids 0-3 <pad> <eos> <bos>
      <unk>, the special <start_of_turn> / <end_of_turn>, the 256 byte pieces <0x00>..<0xFF>
      (byte_fallback), then pieces and merges learned from a small corpus; normalizer
      Replace(" ", "▁"), pre_tokenizer Split(" ", merged_with_previous), decoder
      Replace("▁", " ") + ByteFallback + Fuse, unk_token <unk> fused. Wrapped in
      GemmaTokenizerFast (add_bos_token true: "<bos> $A") with Gemma 3's chat template
      (replica/text/tests/chat_templates/gemma3.jinja, google/gemma-3-*-it's) and saved with
      save_pretrained into DIR: tokenizer.json, tokenizer_config.json (the chat template in it),
      special_tokens_map.json. The committed fixture is this command's output (deterministic).

  check --dir DIR --out FILE
      AutoTokenizer.from_pretrained(DIR) on the texts and chats below: for each text its ids
      (add_special_tokens True and False) and decode; for each chat apply_chat_template's
      rendering (tokenize=False, with and without add_generation_prompt) and its ids
      (tokenize=True). Writes FILE (JSON).
"""
import argparse
import json
import os
import sys

from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATE = os.path.join(HERE, "..", "chat_templates", "gemma3.jinja")
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
WORDS = ("apple river planet garden silver window forest rocket yellow pencil music bridge summer winter "
         "orange castle dragon button candle family market jungle mirror number pocket rabbit school tomato "
         "turtle violin cloud stone light water green house table chair bread horse train ocean paper smile "
         "tiger zebra lemon storm dance honey cat dog sun moon star tree fish bird book road blue red fire snow "
         "rain wind king ship milk gold").split()
SENTENCES = [
    "What is 12 + 7?", "Reverse the word \"apple\".", "Write \"river\" in capital letters.",
    "How many letters are in \"planet\"?", "Continue the sequence: 3, 5, 7", "You are a helpful assistant.",
    "The quick brown fox jumps over the lazy dog.", "Hello, world! How are you today?",
    "user model system assistant the of and to in is that it for on with as was", "reversed is has letters",
]


def corpus():
    lines = [" " + s for s in SENTENCES] + [" " + w for w in WORDS] + [" " + " ".join(WORDS)]
    return [line.replace(" ", "\u2581") for line in lines]


def make(args):
    from transformers import GemmaTokenizerFast
    # Pieces and merges learned from the corpus (already normalised: spaces as ▁).
    trainer = BpeTrainer(vocab_size=160, min_frequency=2, special_tokens=[], show_progress=False,
                         initial_alphabet=["\u2581"])
    learner = Tokenizer(BPE())
    learner.train_from_iterator(corpus(), trainer)
    learned = json.loads(learner.to_str())["model"]
    pieces = sorted(learned["vocab"].items(), key=lambda kv: kv[1])
    vocab = {}
    for token in SPECIALS + ["<0x%02X>" % b for b in range(256)] + [p for p, _ in pieces]:
        if token not in vocab:
            vocab[token] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    with open(TEMPLATE) as f:
        template = f.read()
    fast = GemmaTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                              pad_token="<pad>", add_bos_token=True, add_eos_token=False,
                              additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
    fast.chat_template = template
    os.makedirs(args.out, exist_ok=True)
    fast.save_pretrained(args.out, save_jinja_files=False)
    print(json.dumps({"out": args.out, "vocab_size": len(fast), "merges": len(merges)}))


TEXTS = [
    "What is 12 + 7?", "Reverse the word \"dragon\".", "  two  spaces and a tab\there", "ünïcödé ✓ 日本語",
    "<start_of_turn>user\nhi<end_of_turn>\n", "", " ", "line one\nline two", "zebra-tiger_lemon 1234567890",
    "<bos>already a bos", "emoji 🙂 and <unk> text",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "  Reverse the word \"cat\".  "},
     {"role": "assistant", "content": "\"cat\" reversed is \"tac\"."},
     {"role": "user", "content": "And \"dog\"?"}],
    [{"role": "user", "content": [{"type": "text", "text": "Count the letters in \"moon\"."}]},
     {"role": "assistant", "content": [{"type": "text", "text": "\"moon\" has 4 letters."}]}],
]


def check(args):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.dir)
    out = {"class": type(tok).__name__, "vocab_size": len(tok), "texts": [], "chats": []}
    for t in TEXTS:
        ids = tok(t)["input_ids"]
        plain = tok(t, add_special_tokens=False)["input_ids"]
        out["texts"].append({"text": t, "ids": ids, "plain": plain, "decoded": tok.decode(ids),
                             "decoded_skip": tok.decode(ids, skip_special_tokens=True)})
    for chat in CHATS:
        entry = {"messages": chat}
        for gen in (False, True):
            key = "generation" if gen else "plain"
            entry[key] = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            entry[key + "_ids"] = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen)
        out["chats"].append(entry)
    with open(args.out, "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
    print(json.dumps({"class": out["class"], "vocab_size": out["vocab_size"], "texts": len(TEXTS),
                      "chats": len(CHATS)}))


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    c = sub.add_parser("check")
    c.add_argument("--dir", required=True)
    c.add_argument("--out", required=True)
    args = p.parse_args()
    {"make": make, "check": check}[args.cmd](args)


if __name__ == "__main__":
    sys.dont_write_bytecode = True
    sys.exit(main())
