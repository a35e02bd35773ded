// `replica llm init-demo DIR`: a small Llama with a real tokenizer and an instruction data
// set with learnable structure, all made here (nothing downloaded).
#include "replica/core/error.h"
#include "replica/io/files.h"
#include "replica/models/hf_model_dir.h"
#include "replica/text/tokenizer.h"
#include "replica/tasks/llm_sft/llm_sft.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <unistd.h>

namespace fs = std::filesystem;

namespace replica::train {
namespace {

using ordered_json = nlohmann::ordered_json;

// ChatML with the model's BOS in front, as Qwen/TRL write it (the template writes BOS, so
// a rendered chat is encoded without adding special tokens).
constexpr const char* kDemoTemplate =
    "{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}";

constexpr const char* kSystem = "You are a helpful assistant.";

const std::vector<std::string>& words() {
  static const std::vector<std::string> w = {
      "apple",  "river",  "planet", "garden", "silver", "window", "forest", "rocket", "yellow", "pencil",
      "music",  "bridge", "summer", "winter", "orange", "castle", "dragon", "button", "candle", "family",
      "market", "jungle", "mirror", "number", "pocket", "rabbit", "school", "tomato", "turtle", "violin",
      "cloud",  "stone",  "light",  "water",  "green",  "house",  "table",  "chair",  "bread",  "horse",
      "train",  "ocean",  "paper",  "smile",  "tiger",  "zebra",  "lemon",  "storm",  "dance",  "honey",
      "cat",    "dog",    "sun",    "moon",   "star",   "tree",   "fish",   "bird",   "book",   "road",
      "blue",   "red",    "fire",   "snow",   "rain",   "wind",   "king",   "ship",   "milk",   "gold"};
  return w;
}

struct Turn {
  std::string user, assistant;
  std::string wrong;  // a plausible wrong answer (the demo's preference data rejects it)
};

// One question and its answer; the kinds have a fixed, learnable form.
Turn make_turn(std::mt19937& rng) {
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const auto& w = words();
  const std::string word = w[static_cast<size_t>(uniform(0, static_cast<int>(w.size()) - 1))];
  switch (uniform(0, 5)) {
    case 0: {
      const int a = uniform(0, 99), b = uniform(0, 99);
      return {fmt::format("What is {} + {}?", a, b), fmt::format("{} + {} = {}", a, b, a + b),
              fmt::format("{} + {} = {}", a, b, a + b + 1 + a % 9)};
    }
    case 1: {
      int a = uniform(0, 99), b = uniform(0, 99);
      if (a < b) std::swap(a, b);
      return {fmt::format("What is {} - {}?", a, b), fmt::format("{} - {} = {}", a, b, a - b),
              fmt::format("{} - {} = {}", a, b, a + b)};
    }
    case 2: {
      std::string r(word.rbegin(), word.rend());
      return {fmt::format("Reverse the word \"{}\".", word), fmt::format("\"{}\" reversed is \"{}\".", word, r),
              fmt::format("\"{}\" reversed is \"{}\".", word, word)};
    }
    case 3: {
      std::string up = word;
      std::transform(up.begin(), up.end(), up.begin(), [](unsigned char c) { return std::toupper(c); });
      return {fmt::format("Write \"{}\" in capital letters.", word), up, word};
    }
    case 4:
      return {fmt::format("How many letters are in \"{}\"?", word),
              fmt::format("\"{}\" has {} letters.", word, word.size()),
              fmt::format("\"{}\" has {} letters.", word, word.size() + 2)};
    default: {
      const int s = uniform(1, 20), d = uniform(1, 9);
      return {fmt::format("Continue the sequence: {}, {}, {}", s, s + d, s + 2 * d),
              fmt::format("{}, {}, {}", s + 3 * d, s + 4 * d, s + 5 * d),
              fmt::format("{}, {}, {}", s + 3 * d + 1, s + 4 * d + 2, s + 5 * d + 3)};
    }
  }
}

ordered_json message(const std::string& role, const std::string& content) {
  ordered_json m;
  m["role"] = role;
  m["content"] = content;
  return m;
}

// A chat: sometimes a system message, one turn, sometimes a second.
ordered_json make_chat(std::mt19937& rng) {
  ordered_json messages = ordered_json::array();
  if (std::uniform_int_distribution<int>(0, 3)(rng) == 0) messages.push_back(message("system", kSystem));
  const int turns = std::uniform_int_distribution<int>(0, 9)(rng) == 0 ? 2 : 1;
  for (int t = 0; t < turns; ++t) {
    const Turn turn = make_turn(rng);
    messages.push_back(message("user", turn.user));
    messages.push_back(message("assistant", turn.assistant));
  }
  return messages;
}

// A preference row in TRL's conversational form: the question, the right answer chosen, a
// wrong one rejected.
ordered_json make_preference(std::mt19937& rng) {
  const Turn turn = make_turn(rng);
  ordered_json row;
  row["prompt"] = ordered_json::array({message("user", turn.user)});
  row["chosen"] = ordered_json::array({message("assistant", turn.assistant)});
  row["rejected"] = ordered_json::array({message("assistant", turn.wrong)});
  return row;
}

void write_rows(const fs::path& file, const std::vector<ordered_json>& rows) {
  std::string text;
  for (const auto& row : rows) text += row.dump() + "\n";
  write_file_atomically(file.string(), text);
}

void write_jsonl(const fs::path& file, const std::vector<ordered_json>& chats) {
  std::string text;
  for (const auto& chat : chats) {
    ordered_json record;
    record["messages"] = chat;
    text += record.dump() + "\n";
  }
  write_file_atomically(file.string(), text);
}

std::string shell_quote(const std::string& s) {
  if (s.find_first_of(" \t\n'\"\\$`") == std::string::npos) return s;
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

}  // namespace

LlmDemo write_llm_demo(const std::string& dir, uint64_t seed) {
  const fs::path root(dir);
  const fs::path model_dir = root / "model", data_dir = root / "data";
  for (const auto& d : {model_dir, data_dir}) {
    if (fs::exists(d) && !fs::is_empty(d)) fail("{} already exists and is not empty", d.string());
  }
  fs::create_directories(model_dir);
  fs::create_directories(data_dir);

  // The data: 640 training chats, 64 validation chats.
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::vector<ordered_json> train, valid;
  for (int i = 0; i < 640; ++i) train.push_back(make_chat(rng));
  for (int i = 0; i < 64; ++i) valid.push_back(make_chat(rng));
  write_jsonl(data_dir / "train.jsonl", train);
  write_jsonl(data_dir / "valid.jsonl", valid);
  // The preference data (dpo, orpo, reward): 256 training rows, 32 validation rows, drawn
  // from a generator of their own (the chats above stay what they were).
  const fs::path preference_dir = data_dir / "preference";
  fs::create_directories(preference_dir);
  {
    std::mt19937 prng(static_cast<uint32_t>(seed + 1));
    std::vector<ordered_json> ptrain, pvalid;
    for (int i = 0; i < 256; ++i) ptrain.push_back(make_preference(prng));
    for (int i = 0; i < 32; ++i) pvalid.push_back(make_preference(prng));
    write_rows(preference_dir / "train.jsonl", ptrain);
    write_rows(preference_dir / "valid.jsonl", pvalid);
  }

  // The tokenizer: SentencePiece BPE trained on the training chats' text, Llama-style
  // (byte fallback, digits split) but without the dummy prefix space, so that a text encodes
  // to the same ids in pieces as in one go; the chat markers are single pieces.
  std::string tmpl = (fs::temp_directory_path() / "replica-demo-spm-XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) fail("cannot create a temporary directory in {}", fs::temp_directory_path().string());
  const fs::path work(tmpl);
  {
    std::ofstream corpus(work / "corpus.txt", std::ios::binary);
    for (const auto& chat : train) {
      for (const auto& m : chat) {
        corpus << m["role"].get<std::string>() << "\n" << m["content"].get<std::string>() << "\n";
      }
    }
    for (const auto& w : words()) corpus << w << "\n";
  }
  try {
    text::train_sentencepiece(fmt::format(
        "--input={} --model_prefix={} --model_type=bpe --vocab_size=1000 --hard_vocab_limit=false "
        "--character_coverage=1.0 --byte_fallback=true --split_digits=true --add_dummy_prefix=false "
        "--normalization_rule_name=identity --remove_extra_whitespaces=false --allow_whitespace_only_pieces=true "
        "--user_defined_symbols=<|im_start|>,<|im_end|> --unk_id=0 --bos_id=1 --eos_id=2 --pad_id=-1 "
        "--num_threads=1 --minloglevel=3",
        (work / "corpus.txt").string(), (work / "tokenizer").string()));
    fs::copy_file(work / "tokenizer.model", model_dir / "tokenizer.model", fs::copy_options::overwrite_existing);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(work, ec);
    throw;
  }
  std::error_code ec;
  fs::remove_all(work, ec);

  auto added = [](const std::string& content) {
    ordered_json t;
    t["content"] = content;
    t["lstrip"] = false;
    t["normalized"] = false;
    t["rstrip"] = false;
    t["single_word"] = false;
    t["special"] = true;
    return t;
  };
  ordered_json config;
  config["add_bos_token"] = true;
  config["add_eos_token"] = false;
  ordered_json decoder;
  decoder["0"] = added("<unk>");
  decoder["1"] = added("<s>");
  decoder["2"] = added("</s>");
  decoder["3"] = added("<|im_start|>");
  decoder["4"] = added("<|im_end|>");
  config["added_tokens_decoder"] = decoder;
  config["additional_special_tokens"] = {"<|im_start|>", "<|im_end|>"};
  config["bos_token"] = "<s>";
  config["chat_template"] = kDemoTemplate;
  config["clean_up_tokenization_spaces"] = false;
  config["eos_token"] = "</s>";
  config["legacy"] = true;
  config["model_max_length"] = 2048;
  config["pad_token"] = nullptr;
  config["sp_model_kwargs"] = ordered_json::object();
  config["spaces_between_special_tokens"] = false;
  config["tokenizer_class"] = "LlamaTokenizer";
  config["unk_token"] = "<unk>";
  config["use_default_system_prompt"] = false;
  write_file_atomically((model_dir / "tokenizer_config.json").string(), config.dump(2) + "\n");
  ordered_json special;
  special["additional_special_tokens"] = {"<|im_start|>", "<|im_end|>"};
  special["bos_token"] = "<s>";
  special["eos_token"] = "</s>";
  special["unk_token"] = "<unk>";
  write_file_atomically((model_dir / "special_tokens_map.json").string(), special.dump(2) + "\n");

  const text::Tokenizer tok = text::Tokenizer::from_dir(model_dir.string());
  const auto im_start = tok.token_to_id("<|im_start|>"), im_end = tok.token_to_id("<|im_end|>");
  if (im_start != 3 || im_end != 4) fail("the demo tokenizer placed its chat markers at unexpected ids");

  // The model: a small Llama (random init, fp32), its vocabulary the tokenizer's.
  models::TinyLlamaOptions options;
  options.bos_token_id = 1;
  options.eos_token_ids = {2, *im_end};
  options.seed = seed;
  models::make_tiny_llama(model_dir.string(), tok.vocab_size(), options);

  LlmDemo demo;
  demo.model_dir = model_dir.string();
  demo.data_dir = data_dir.string();
  demo.train_samples = static_cast<int64_t>(train.size());
  demo.valid_samples = static_cast<int64_t>(valid.size());
  demo.vocab_size = tok.vocab_size();
  const std::string run = (root / "run").string();
  demo.train_command = fmt::format(
      "replica llm --train --model {} --data-path {} --project-name {} --trainer sft --peft "
      "--lr 5e-3 --epochs 4 --block-size 256 --batch-size 2 --gradient-accumulation 1 --valid-split valid "
      "--logging-steps 10",
      shell_quote(demo.model_dir), shell_quote(demo.data_dir), shell_quote(run));
  demo.preference_dir = preference_dir.string();
  demo.dpo_command = fmt::format(
      "replica llm --train --model {} --data-path {} --project-name {} --trainer dpo --peft "
      "--lr 5e-3 --epochs 1 --block-size 128 --batch-size 4 --gradient-accumulation 1 --valid-split valid "
      "--logging-steps 10",
      shell_quote(demo.model_dir), shell_quote(demo.preference_dir), shell_quote((root / "run-dpo").string()));
  demo.eval_command = fmt::format("replica llm --eval --model {} --data-path {} --adapter {}",
                                  shell_quote(demo.model_dir), shell_quote((data_dir / "valid.jsonl").string()),
                                  shell_quote((fs::path(run) / "final").string()));
  return demo;
}

}  // namespace replica::train
