// Conformance: replica's tokenizer against Hugging Face's Rust engine on real vocabularies.
//
// The vocabularies (Llama 3, Qwen 3, Llama 2 / Mistral) are in the repository, compressed:
// conformance/vocab/ (read through vocab.h, which checks their sha256). The expected ids and
// decoded texts are committed in conformance/references/, written by conformance/reference.py
// with the PyPI package `tokenizers` (Hugging Face's Rust engine), so the comparison with them
// needs no Python. The live referee test runs reference.py again with the project's Python
// (replica/testing/referee.h) and checks that it still writes exactly the committed files and
// that replica agrees with what it wrote.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "replica/testing/referee.h"
#include "replica/text/tests/vocab.h"
#include "replica/text/tokenizer.h"
#include "replica/testing/program_runner.h"

namespace fs = std::filesystem;
using nlohmann::json;
using replica::text::Tokenizer;
namespace vocab = replica::testing::vocab;

namespace {

const fs::path kDir = vocab::conformance_dir();

using replica::testing::read_file;

const json& spec() {
  static const json j = json::parse(read_file(kDir / "variants.json"));
  return j;
}

// variants.json's "vocabularies" name folders vocab/<name>; vocab.h reads them by name.
std::string vocab_name(const std::string& name) {
  return fs::path(spec()["vocabularies"][name].get<std::string>()).filename().string();
}

std::vector<std::string> corpus() {
  std::vector<std::string> texts;
  std::ifstream in(kDir / "corpus.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) texts.push_back(json::parse(line).get<std::string>());
  }
  return texts;
}

// The tokenizer.json of a vocabulary or a variant (variants.json), as text.
std::string tokenizer_json(const std::string& name) {
  const json& s = spec();
  auto base = [&](const std::string& vocabulary) {
    return json::parse(vocab::tokenizer_json(vocab_name(vocabulary)));
  };
  if (s["vocabularies"].contains(name)) return base(name).dump();
  for (const auto& v : s["variants"]) {
    if (v["name"] != name) continue;
    json j = base(v["base"].get<std::string>());
    if (v.contains("set")) {
      for (const auto& [k, val] : v["set"].items()) j[k] = val;
    }
    if (v.contains("add_tokens")) {
      for (const auto& t : v["add_tokens"]) j["added_tokens"].push_back(t);
    }
    return j.dump();
  }
  throw std::runtime_error("no tokenizer named " + name);
}

std::string show(const std::vector<int32_t>& ids) {
  std::string s = "[";
  for (size_t k = 0; k < ids.size(); ++k) s += (k ? "," : "") + std::to_string(ids[k]);
  return s + "]";
}

std::vector<std::string> tokenizer_names() {
  std::vector<std::string> names;
  for (const auto& [name, rel] : spec()["vocabularies"].items()) names.push_back(name);
  for (const auto& v : spec()["variants"]) names.push_back(v["name"].get<std::string>());
  return names;
}

// Compares replica's tokenizer `name` with the references in `refs` (one JSON line per text
// of the corpus, as reference.py writes them); records a failure (at most 8 detailed) for
// every text where it differs. Returns whether all agreed.
bool agrees_with_references(const std::string& name, const fs::path& refs_path) {
  const Tokenizer tok = Tokenizer::from_json_string(tokenizer_json(name), name);
  const auto texts = corpus();
  std::ifstream refs(refs_path);
  if (!refs) {
    ADD_FAILURE() << "cannot read " << refs_path;
    return false;
  }
  size_t n = 0, ids_eq = 0, plain_eq = 0, dec_eq = 0, dec_skip_eq = 0, hf_round = 0, round = 0;
  std::string line;
  int reported = 0;
  for (const auto& text : texts) {
    if (!std::getline(refs, line)) {
      ADD_FAILURE() << refs_path << " is shorter than the corpus";
      return false;
    }
    const json r = json::parse(line);
    const auto want_ids = r["ids"].get<std::vector<int32_t>>();
    const auto want_plain = r["plain"].get<std::vector<int32_t>>();
    const auto ids = tok.encode(text, true);
    const auto plain = tok.encode(text, false);
    const std::string dec = tok.decode(want_ids, false);
    const std::string dec_skip = tok.decode(want_ids, true);
    ++n;
    ids_eq += ids == want_ids;
    plain_eq += plain == want_plain;
    dec_eq += dec == r["dec"].get<std::string>();
    dec_skip_eq += dec_skip == r["dec_skip"].get<std::string>();
    if (r["dec_skip"].get<std::string>() == text) {
      ++hf_round;
      round += tok.decode(plain, true) == text;
    }
    const bool ok = ids == want_ids && plain == want_plain && dec == r["dec"].get<std::string>() &&
                    dec_skip == r["dec_skip"].get<std::string>();
    if (!ok && reported++ < 8) {
      ADD_FAILURE() << name << " text " << n << " " << json(text).dump() << "\n  ids  " << show(ids)
                    << "\n  want " << show(want_ids) << "\n  plain " << show(plain) << "\n  want  "
                    << show(want_plain) << "\n  dec " << json(dec).dump() << "\n  want "
                    << r["dec"].dump() << "\n  dec_skip " << json(dec_skip).dump() << "\n  want     "
                    << r["dec_skip"].dump();
    }
  }
  std::cout << "[conformance] " << name << ": " << n << " texts; encode " << ids_eq << "/" << n
            << ", encode without special tokens " << plain_eq << "/" << n << ", decode " << dec_eq
            << "/" << n << ", decode skipping special tokens " << dec_skip_eq << "/" << n
            << ", decode(encode(x)) == x " << round << "/" << hf_round
            << " (texts where Hugging Face's does)" << std::endl;
  EXPECT_EQ(ids_eq, n) << name;
  EXPECT_EQ(plain_eq, n) << name;
  EXPECT_EQ(dec_eq, n) << name;
  EXPECT_EQ(dec_skip_eq, n) << name;
  EXPECT_EQ(round, hf_round) << name;
  return ids_eq == n && plain_eq == n && dec_eq == n && dec_skip_eq == n && round == hf_round;
}

class TokenizerConformance : public ::testing::TestWithParam<std::string> {};

// Against the committed references (no Python needed).
TEST_P(TokenizerConformance, EqualsHuggingFace) {
  const std::string name = GetParam();
  agrees_with_references(name, kDir / "references" / (name + ".jsonl"));
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, TokenizerConformance, ::testing::ValuesIn(tokenizer_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string s = info.param;
                           for (char& c : s) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return s;
                         });

// The live referee: reference.py, run now with the PyPI `tokenizers` of the project's Python,
// writes exactly the committed references, and replica agrees with what it wrote.
TEST(TokenizerReferee, LiveTokenizersWritesTheCommittedReferencesAndReplicaAgrees) {
  REPLICA_REQUIRE_PYTHON("tokenizers");
  std::string pattern = (fs::temp_directory_path() / "replica_tokref_XXXXXX").string();
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  const fs::path out = pattern;
  const auto run = replica::testing::run_python(kDir / "reference.py", {"--out", out.string()});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  std::cout << run.output;
  std::vector<std::string> files = {"summary.json"};
  for (const auto& name : tokenizer_names()) files.push_back(name + ".jsonl");
  for (const auto& f : files) {
    const std::string live = read_file(out / f);
    const std::string committed = read_file(kDir / "references" / f);
    ASSERT_FALSE(live.empty()) << "reference.py wrote no " << f;
    if (live != committed) {
      // Name the first text that differs.
      std::istringstream a(live), b(committed);
      std::string la, lb;
      size_t line = 0;
      while (true) {
        ++line;
        const bool ga = static_cast<bool>(std::getline(a, la));
        const bool gb = static_cast<bool>(std::getline(b, lb));
        if (!ga || !gb || la != lb) break;
      }
      ADD_FAILURE() << "references/" << f << " is not what reference.py writes today (first difference on line "
                    << line << "):\n  live      " << la.substr(0, 400) << "\n  committed " << lb.substr(0, 400)
                    << "\nregenerate with: .venv/bin/python replica/text/tests/conformance/reference.py";
    }
  }
  for (const auto& name : tokenizer_names()) {
    EXPECT_TRUE(agrees_with_references(name, out / (name + ".jsonl"))) << name;
  }
  fs::remove_all(out);
}

// The vocabularies in the repository are the ones the references were written from.
TEST(TokenizerVocabularies, ChecksumsMatch) {
  EXPECT_EQ(vocab::sha256_hex(vocab::tokenizer_json("llama2")),
            "fc4f0bd70b3709312d9d1d9e5ba674794b6bc5abc17429897a540f93882f25fc");
  EXPECT_EQ(vocab::sha256_hex(vocab::tokenizer_json("llama3")),
            "c05a3c2174e9edd5be19dc5a0748c42a9037bec2811ce062728bfd71f8702d78");
  EXPECT_EQ(vocab::sha256_hex(vocab::tokenizer_json("qwen3")),
            "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4");
  // What is not there (compressed) is an error, not an empty vocabulary.
  EXPECT_THROW(vocab::file("llama3", "LICENSE.package"), std::runtime_error);
}

// The packaged directories load through from_dir with their tokenizer_config.json.
TEST(TokenizerVocabularies, FromDirReadsConfig) {
  const Tokenizer llama3 = Tokenizer::from_dir(vocab::dir("llama3").string());
  EXPECT_EQ(llama3.bos_id(), 128000);
  EXPECT_EQ(llama3.eos_id(), 128001);
  EXPECT_EQ(llama3.pad_id(), std::nullopt);
  EXPECT_EQ(llama3.vocab_size(), 128256);
  // The package's post-processor adds no BOS: neither do we.
  EXPECT_EQ(llama3.encode("Hello world"), (std::vector<int32_t>{9906, 1917}));
  EXPECT_TRUE(llama3.is_special(128000));
  EXPECT_FALSE(llama3.is_special(9906));

  const Tokenizer qwen3 = Tokenizer::from_dir(vocab::dir("qwen3").string());
  EXPECT_EQ(qwen3.bos_id(), std::nullopt);
  EXPECT_EQ(qwen3.eos_id(), 151645);
  EXPECT_EQ(qwen3.pad_id(), 151643);
  EXPECT_EQ(qwen3.token_to_id("<|im_start|>"), 151644);
  EXPECT_EQ(qwen3.id_to_token(151644), "<|im_start|>");
  EXPECT_FALSE(qwen3.is_special(151667));  // <think> is added but not special

  const Tokenizer llama2 = Tokenizer::from_dir(vocab::dir("llama2").string());
  EXPECT_EQ(llama2.bos_id(), 1);
  EXPECT_EQ(llama2.eos_id(), 2);
  EXPECT_EQ(llama2.vocab_size(), 32000);
  EXPECT_EQ(llama2.encode("Hello world"), (std::vector<int32_t>{1, 22557, 1526}));
  EXPECT_EQ(llama2.id_to_token(13), "<0x0A>");
}

// 1 MB of mixed text in well under a second, for every vocabulary.
TEST(TokenizerVocabularies, EncodesOneMegabyteQuickly) {
  std::string text;
  const auto texts = corpus();
  while (text.size() < (1u << 20)) {
    for (const auto& t : texts) {
      text += t;
      text += '\n';
    }
  }
  text.resize(1u << 20);
  while (!text.empty() && (static_cast<unsigned char>(text.back()) & 0xC0) == 0x80) text.pop_back();
  if (!text.empty() && static_cast<unsigned char>(text.back()) >= 0xC0) text.pop_back();
  for (const char* name : {"llama3", "qwen3", "llama2"}) {
    const Tokenizer tok = Tokenizer::from_json_string(tokenizer_json(name), name);
    const auto t0 = std::chrono::steady_clock::now();
    const auto ids = tok.encode(text, false);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::cout << "[conformance] " << name << ": 1 MiB -> " << ids.size() << " tokens in " << s
              << " s" << std::endl;
    // Byte-level BPE without a normalizer is lossless (Qwen 3 normalizes to NFC; Mistral's
    // decoder turns a "▁" of the text into a space).
    if (std::string(name) == "llama3") EXPECT_TRUE(tok.decode(ids) == text) << name;
#ifdef NDEBUG
    EXPECT_LT(s, 1.0) << name;
#endif
  }
}

// One tokenizer used from several threads gives the same ids as from one.
TEST(TokenizerVocabularies, ThreadSafe) {
  const Tokenizer tok = Tokenizer::from_json_string(tokenizer_json("qwen3"), "qwen3");
  const auto texts = corpus();
  std::vector<std::vector<int32_t>> expected;
  for (const auto& t : texts) expected.push_back(tok.encode(t));
  std::vector<std::thread> threads;
  std::vector<size_t> mismatches(4, 0);
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (size_t i = 0; i < texts.size(); ++i) {
        const size_t j = (i * 7 + static_cast<size_t>(k) * 13) % texts.size();
        if (tok.encode(texts[j]) != expected[j]) ++mismatches[static_cast<size_t>(k)];
      }
    });
  }
  for (auto& t : threads) t.join();
  for (size_t m : mismatches) EXPECT_EQ(m, 0u);
}

}  // namespace
