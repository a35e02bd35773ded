#!/usr/bin/env python3
"""Writes the reference token ids for the tokenizer conformance test, from Hugging Face's own
Rust engine: the PyPI package `tokenizers`, pinned in scripts/requirements-test.txt.

    .venv/bin/python replica/text/tests/conformance/reference.py [--out DIR]

For every text of corpus.jsonl and every tokenizer (the three vocabularies of vocab/ and the
variants of variants.json), one JSON line in DIR/<name>.jsonl (DIR: references/ beside this
script unless --out says otherwise):

    {"ids": encode(text, add_special_tokens=True).ids,
     "plain": encode(text, add_special_tokens=False).ids,
     "dec": decode(ids, skip_special_tokens=False),
     "dec_skip": decode(ids, skip_special_tokens=True)}

and DIR/summary.json (per tokenizer: texts, and how many decode(ids, skip_special_tokens=True)
gives back exactly). tokenizer_conformance_test.cpp compares replica with the committed files
and, as a live referee, runs this script into a temporary folder and checks that its output
equals them byte for byte.

The vocabularies are vocab/<name>/tokenizer.json.zst (zstd); their sha256 after
decompression must match vocab/SHA256SUMS.
"""
import argparse
import copy
import hashlib
import json
import pathlib
import subprocess
import sys

import tokenizers
from tokenizers import Tokenizer

HERE = pathlib.Path(__file__).resolve().parent


def zstd_decompress(path):
    data = path.read_bytes()
    try:
        import zstd  # python-zstd (installed with mosaicml-streaming)

        return zstd.decompress(data)
    except ImportError:
        # The zstd command (Debian's zstd, installed by scripts/setup.sh).
        return subprocess.run(["zstd", "-dc", str(path)], check=True, capture_output=True).stdout


def checksums():
    sums = {}
    for line in (HERE / "vocab" / "SHA256SUMS").read_text(encoding="utf-8").splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            sums[name.lstrip("*")] = digest
    return sums


def vocab_file(vocab_dir, name):
    """The bytes of vocab_dir/name (stored as name.zst), checked against SHA256SUMS."""
    path = HERE / vocab_dir / (name + ".zst")
    data = zstd_decompress(path)
    rel = f"{pathlib.PurePosixPath(vocab_dir).name}/{name}"
    want = checksums().get(rel)
    got = hashlib.sha256(data).hexdigest()
    if want != got:
        sys.exit(f"{path}: sha256 of the decompressed file is {got}, vocab/SHA256SUMS says {want}")
    return data


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


def tokenizer_specs(spec):
    """(name, tokenizer.json as a dict, variant or None), vocabularies first, as variants.json lists them."""
    base = {name: json.loads(vocab_file(d, "tokenizer.json")) for name, d in spec["vocabularies"].items()}
    out = [(name, base[name], None) for name in spec["vocabularies"]]
    for v in spec["variants"]:
        j = copy.deepcopy(base[v["base"]])
        for k, val in v.get("set", {}).items():
            j[k] = val
        if "add_tokens" in v:
            j["added_tokens"] = j["added_tokens"] + v["add_tokens"]
        out.append((v["name"], j, v))
    return out


def dumps(x, **kw):
    # As JavaScript's JSON.stringify (which wrote the first references): no spaces, UTF-8.
    return json.dumps(x, ensure_ascii=False, separators=(",", ":"), **kw)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, default=HERE / "references")
    args = ap.parse_args()
    corpus = read_jsonl(HERE / "corpus.jsonl")
    spec = json.loads((HERE / "variants.json").read_text(encoding="utf-8"))
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for name, j, variant in tokenizer_specs(spec):
        tok = Tokenizer.from_str(dumps(j))
        for a in (variant or {}).get("add_tokens", []):
            # The Rust engine gives an added token that the model already has the model's id.
            expected = j["model"]["vocab"].get(a["content"], a["id"])
            got = tok.token_to_id(a["content"])
            if got != expected:
                sys.exit(f"{name}: added token {a['content']!r} got id {got}, not {expected}")
        rows = []
        round_trip = 0
        for text in corpus:
            ids = tok.encode(text, add_special_tokens=True).ids
            plain = tok.encode(text, add_special_tokens=False).ids
            dec = tok.decode(ids, skip_special_tokens=False)
            dec_skip = tok.decode(ids, skip_special_tokens=True)
            rows.append(dumps({"ids": ids, "plain": plain, "dec": dec, "dec_skip": dec_skip}))
            round_trip += dec_skip == text
        (args.out / f"{name}.jsonl").write_bytes(("\n".join(rows) + "\n").encode("utf-8"))
        summary[name] = {"texts": len(corpus), "round_trip": round_trip}
        print(f"{name}: {len(corpus)} texts")
    summary_text = json.dumps(summary, ensure_ascii=False, indent=2) + "\n"
    (args.out / "summary.json").write_bytes(summary_text.encode("utf-8"))
    print(f"references from tokenizers {tokenizers.__version__} in {args.out}")


if __name__ == "__main__":
    main()
