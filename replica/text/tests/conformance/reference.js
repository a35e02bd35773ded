#!/usr/bin/env node
// Writes the reference token ids for the tokenizer conformance test, from Hugging Face's own
// Rust engine (npm `tokenizers`, its node bindings).
//
//   npm ci --prefix replica/text/tests/conformance     # everything, reference engines included
//   node replica/text/tests/conformance/gen_corpus.js  # corpus.jsonl (only if it changed)
//   node replica/text/tests/conformance/reference.js   # references/<name>.jsonl
//
// For every text of corpus.jsonl and every tokenizer (the three packaged vocabularies and
// the variants of variants.json), one JSON line:
//   {"ids": encode(text, add_special_tokens=true), "plain": encode(text, false),
//    "dec": decode(ids, skip_special_tokens=false), "dec_skip": decode(ids, true)}
// It also reports where transformers.js (@lenml/tokenizers) disagrees with the Rust engine
// (informational: the C++ tokenizer follows the Rust engine).
'use strict';
const fs = require('fs');
const path = require('path');

const here = __dirname;
const nodeModules = path.join(here, 'node_modules');
const { Tokenizer } = require(path.join(nodeModules, 'tokenizers'));

const corpus = fs.readFileSync(path.join(here, 'corpus.jsonl'), 'utf8')
  .split('\n').filter((l) => l.length > 0).map((l) => JSON.parse(l));
const spec = JSON.parse(fs.readFileSync(path.join(here, 'variants.json'), 'utf8'));

function loadJson(name) {
  return JSON.parse(fs.readFileSync(path.join(nodeModules, spec.vocabularies[name]), 'utf8'));
}

function tokenizers() {
  const out = [];
  for (const name of Object.keys(spec.vocabularies)) out.push({ name, json: loadJson(name) });
  for (const v of spec.variants) {
    const json = loadJson(v.base);
    for (const [k, val] of Object.entries(v.set || {})) json[k] = val;
    if (v.add_tokens) json.added_tokens = json.added_tokens.concat(v.add_tokens);
    out.push({ name: v.name, json, variant: v });
  }
  return out;
}

async function main() {
  fs.mkdirSync(path.join(here, 'references'), { recursive: true });
  const summary = {};
  for (const t of tokenizers()) {
    const tok = Tokenizer.fromString(JSON.stringify(t.json));
    if (t.variant && t.variant.add_tokens) {
      for (const a of t.variant.add_tokens) {
        // The Rust engine gives an added token that the model already has the model's id.
        const expected = t.json.model.vocab[a.content] ?? a.id;
        const id = tok.tokenToId(a.content);
        if (id !== expected) throw new Error(`${t.name}: added token ${a.content} got id ${id}, not ${expected}`);
      }
    }
    const rows = [];
    for (const text of corpus) {
      const ids = (await tok.encode(text, null, { addSpecialTokens: true })).getIds();
      const plain = (await tok.encode(text, null, { addSpecialTokens: false })).getIds();
      const dec = await tok.decode(ids, false);
      const decSkip = await tok.decode(ids, true);
      rows.push(JSON.stringify({ ids, plain, dec, dec_skip: decSkip }));
    }
    fs.writeFileSync(path.join(here, 'references', `${t.name}.jsonl`), rows.join('\n') + '\n');
    summary[t.name] = { texts: corpus.length, round_trip: rows.filter((r, i) => JSON.parse(r).dec_skip === corpus[i]).length };
    console.log(`${t.name}: ${corpus.length} texts`);
  }

  // transformers.js, for the record.
  let tjs = null;
  try {
    tjs = require(path.join(nodeModules, '@lenml/tokenizers'));
  } catch (e) {
    console.log('(@lenml/tokenizers not installed: no transformers.js comparison)');
  }
  if (tjs && tjs.TokenizerLoader) {
    for (const name of Object.keys(spec.vocabularies)) {
      const dir = path.dirname(path.join(nodeModules, spec.vocabularies[name]));
      const json = JSON.parse(fs.readFileSync(path.join(dir, 'tokenizer.json'), 'utf8'));
      const config = JSON.parse(fs.readFileSync(path.join(dir, 'tokenizer_config.json'), 'utf8'));
      const tk = tjs.TokenizerLoader.fromPreTrained({ tokenizerJSON: json, tokenizerConfig: config });
      const refs = fs.readFileSync(path.join(here, 'references', `${name}.jsonl`), 'utf8')
        .split('\n').filter((l) => l).map((l) => JSON.parse(l));
      const differ = [];
      corpus.forEach((text, i) => {
        const ids = tk.encode(text, { add_special_tokens: false });
        if (JSON.stringify(ids) !== JSON.stringify(refs[i].plain)) differ.push(i);
      });
      summary[name].transformers_js_differs = differ.length;
      console.log(`${name}: transformers.js differs from the Rust engine on ${differ.length} of ${corpus.length} texts` +
        (differ.length ? ` (e.g. ${differ.slice(0, 5).map((i) => JSON.stringify(corpus[i])).join(', ')})` : ''));
    }
  }
  fs.writeFileSync(path.join(here, 'references', 'summary.json'), JSON.stringify(summary, null, 2) + '\n');
}

main().catch((e) => { console.error(e); process.exit(1); });
