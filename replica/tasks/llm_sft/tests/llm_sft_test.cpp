// LLM SFT: the data pipeline (label masks, BOS, EOS, truncation, columns), packing, and the
// `replica llm` / `tokenize` / `merge-adapter` commands end to end through the real program
// (REPLICA_BIN) on the demo that `replica llm init-demo` writes.
#include "replica/tasks/llm_sft/llm_sft.h"
#include "replica/testing/llm_demo.h"
#include "replica/testing/paths.h"

#include "replica/core/error.h"
#include "replica/testing/program_runner.h"
#include "replica/train/tests/tensor_files.h"
#include "replica/io/safetensors.h"
#include "replica/models/hf_model_dir.h"
#include "replica/models/llama.h"
#include "replica/models/lora.h"
#include "replica/text/chat_template.h"
#include "replica/text/tokenizer.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

extern char** environ;

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace replica::train;
using Ids = std::vector<int32_t>;

namespace {

using replica::testing::load_tensors;
using replica::testing::max_abs_diff;

// ---------------------------------------------------------------------------------------
// Running the program (bounded: the child's process group is killed at the deadline).

using replica::testing::Result;

Result replica(const std::vector<std::string>& args, const std::string& stdin_text = "",
               std::chrono::seconds limit = std::chrono::seconds(240)) {
  return replica::testing::run_program(REPLICA_BIN, args, {}, limit, stdin_text);
}

using replica::testing::read_file;

std::vector<json> metrics_of(const fs::path& project) {
  std::vector<json> out;
  std::istringstream in(read_file(project / "metrics.jsonl"));
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(json::parse(line));
  }
  return out;
}

std::vector<double> losses_of(const fs::path& project) {
  std::vector<double> out;
  for (const auto& j : metrics_of(project)) {
    if (j.contains("loss")) out.push_back(j["loss"].get<double>());
  }
  return out;
}

double parse_eval_loss(const std::string& out) {
  const auto at = out.find("eval_loss: ");
  if (at == std::string::npos) return -1;
  return std::stod(out.substr(at + 11));
}

Ids concat(const std::vector<Ids>& parts) {
  Ids out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// ---------------------------------------------------------------------------------------
// The demo (model, tokenizer, data), written once for the whole program.

struct Demo {
  fs::path root;  // this file's runs
  LlmDemo demo;
};

const Demo& demo() {
  static const Demo d{replica::testing::llm_demo().run_dir("sft"), replica::testing::llm_demo().demo};
  return d;
}

// The demo template, ChatML with BOS in front (what init-demo writes).
std::string demo_template() {
  return json::parse(read_file(fs::path(demo().demo.model_dir) / "tokenizer_config.json"))["chat_template"];
}

SftEncoder demo_encoder(SftEncoderOptions options = {}) {
  const auto& d = demo();
  if (options.column_mapping.empty()) options.column_mapping = {{"text_column", "text"}};
  return SftEncoder(replica::text::Tokenizer::from_dir(d.demo.model_dir), demo_template(),
                    replica::text::chat_special_tokens(d.demo.model_dir), options);
}

json chat(std::initializer_list<std::pair<const char*, const char*>> turns) {
  json messages = json::array();
  for (const auto& [role, content] : turns) messages.push_back({{"role", role}, {"content", content}});
  return messages;
}

// ---------------------------------------------------------------------------------------
// Data: label masks, BOS, EOS, truncation, columns.

TEST(LlmSftData, ChatTrainsExactlyTheAssistantTurns) {
  const SftEncoder enc = demo_encoder();
  const auto& tok = enc.tokenizer();
  const json messages = chat({{"system", "Be brief."},
                              {"user", "What is 2 + 3?"},
                              {"assistant", "2 + 3 = 5"},
                              {"user", "Reverse the word \"cat\"."},
                              {"assistant", "\"cat\" reversed is \"tac\"."}});
  const SftSample s = enc.encode_chat(messages);

  // The known template cut by hand: prompts (no loss) and assistant turns through their
  // end marker (loss).
  auto e = [&](const std::string& t) { return tok.encode(t, false); };
  const Ids p1 = e("<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                   "<|im_start|>assistant\n");
  const Ids a1 = e("2 + 3 = 5<|im_end|>\n");
  const Ids p2 = e("<|im_start|>user\nReverse the word \"cat\".<|im_end|>\n<|im_start|>assistant\n");
  const Ids a2 = e("\"cat\" reversed is \"tac\".<|im_end|>\n");
  EXPECT_EQ(s.ids, concat({p1, a1, p2, a2}));
  Ids expected_labels;
  for (const auto& [part, trained] : std::vector<std::pair<Ids, bool>>{{p1, false}, {a1, true}, {p2, false}, {a2, true}}) {
    for (int32_t id : part) expected_labels.push_back(trained ? id : kIgnoreLabel);
  }
  EXPECT_EQ(s.labels, expected_labels);
  EXPECT_EQ(s.predicted(), static_cast<int64_t>(a1.size() + a2.size()));

  // Encoding in segments gives the ids of the whole rendering, and there is exactly one BOS.
  const std::string full = replica::text::ChatTemplate(demo_template())
                               .render(nlohmann::ordered_json(messages), false,
                                       replica::text::chat_special_tokens(demo().demo.model_dir));
  EXPECT_EQ(s.ids, tok.encode(full, false));
  ASSERT_FALSE(s.ids.empty());
  EXPECT_EQ(s.ids[0], *tok.bos_id());
  EXPECT_EQ(std::count(s.ids.begin(), s.ids.end(), *tok.bos_id()), 1);
  // What is trained reads back as the two answers.
  Ids trained;
  for (int32_t l : s.labels) {
    if (l != kIgnoreLabel) trained.push_back(l);
  }
  EXPECT_EQ(tok.decode(trained), "2 + 3 = 5<|im_end|>\n\"cat\" reversed is \"tac\".<|im_end|>\n");
}

TEST(LlmSftData, Qwen3MultiTurnTrainsTheTurnsAfterTheLastUserMessage) {
  // Qwen3's template renders an assistant turn with a <think> block while it is the last
  // answer and without one once a user message follows, so earlier turns are not prefixes of
  // the whole chat: they become context, and the final answer is trained as rendered.
  const auto& d = demo();
  SftEncoderOptions options;
  options.column_mapping = {{"messages_column", "messages"}};
  const std::string qwen3 = read_file(fs::path(REPLICA_SOURCE_DIR) / "replica/text/tests/chat_templates/qwen3.jinja");
  const SftEncoder enc(replica::text::Tokenizer::from_dir(d.demo.model_dir), qwen3,
                       replica::text::chat_special_tokens(d.demo.model_dir), options);
  const json messages = chat({{"user", "What is 2 + 3?"},
                              {"assistant", "<think>\nadd them\n</think>\n\n5"},
                              {"user", "And 4 + 4?"},
                              {"assistant", "8"}});
  const SftSample s = enc.encode_chat(messages);
  const auto& tok = enc.tokenizer();
  const std::string full = replica::text::ChatTemplate(qwen3).render(
      nlohmann::ordered_json(messages), false, replica::text::chat_special_tokens(d.demo.model_dir));
  EXPECT_EQ(full.find("add them"), std::string::npos);  // the earlier reasoning is dropped
  EXPECT_EQ(s.ids, tok.encode(full, false));            // the sample is the whole chat
  Ids trained;
  for (int32_t l : s.labels) {
    if (l != kIgnoreLabel) trained.push_back(l);
  }
  EXPECT_EQ(tok.decode(trained), "<think>\n\n</think>\n\n8<|im_end|>\n");

  // A chat with one answer keeps every answer trained, reasoning included.
  const SftSample one = enc.encode_chat(chat({{"user", "What is 2 + 3?"}, {"assistant", "<think>\nadd\n</think>\n\n5"}}));
  trained.clear();
  for (int32_t l : one.labels) {
    if (l != kIgnoreLabel) trained.push_back(l);
  }
  EXPECT_EQ(tok.decode(trained), "<think>\nadd\n</think>\n\n5<|im_end|>\n");
}

TEST(LlmSftData, BuiltInTemplatesAndTheirMasks) {
  // chatml without BOS (the built-in), through a model directory's settings.
  SftEncoderOptions o;
  o.chat_template = "chatml";
  o.column_mapping = {{"text_column", "text"}};
  const SftEncoder enc(demo().demo.model_dir, o);
  const SftSample s = enc.encode_chat(chat({{"user", "hi"}, {"assistant", "hello"}}));
  const auto& tok = enc.tokenizer();
  const Ids prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", false);
  const Ids answer = tok.encode("hello<|im_end|>\n", false);
  EXPECT_EQ(s.ids, concat({prompt, answer}));
  EXPECT_EQ(std::count(s.ids.begin(), s.ids.end(), *tok.bos_id()), 0);  // chatml writes no BOS
  for (size_t t = 0; t < s.ids.size(); ++t) EXPECT_EQ(s.labels[t] != kIgnoreLabel, t >= prompt.size()) << t;
}

TEST(LlmSftData, TextTrainsEveryTokenWithOneBosAndEos) {
  const SftEncoder enc = demo_encoder();
  const auto& tok = enc.tokenizer();
  const SftSample s = enc.encode_text("What is 2 + 3? 5");
  const Ids body = tok.encode("What is 2 + 3? 5", false);
  EXPECT_EQ(s.ids, concat({{*tok.bos_id()}, body, {*tok.eos_id()}}));
  EXPECT_EQ(s.labels, s.ids);
  EXPECT_EQ(s.predicted(), static_cast<int64_t>(s.ids.size()) - 1);

  SftEncoderOptions no_eos;
  no_eos.add_eos_token = false;
  EXPECT_EQ(demo_encoder(no_eos).encode_text("What is 2 + 3? 5").ids, concat({{*tok.bos_id()}, body}));
}

TEST(LlmSftData, PromptCompletionTrainsOnlyTheCompletion) {
  const SftEncoder enc = demo_encoder();
  const auto& tok = enc.tokenizer();
  const SftSample s = enc.encode({{"prompt", "What is 2 + 3?"}, {"completion", " 5"}}, "record");
  const Ids prompt = concat({{*tok.bos_id()}, tok.encode("What is 2 + 3?", false)});
  const Ids completion = concat({tok.encode(" 5", false), {*tok.eos_id()}});
  EXPECT_EQ(s.ids, concat({prompt, completion}));
  for (size_t t = 0; t < s.ids.size(); ++t) {
    EXPECT_EQ(s.labels[t], t < prompt.size() ? kIgnoreLabel : s.ids[t]) << t;
  }
  // Conversational prompt/completion: a chat whose completion turn is trained.
  const SftSample c = enc.encode({{"prompt", chat({{"user", "hi"}})}, {"completion", chat({{"assistant", "hello"}})}},
                                 "record");
  EXPECT_EQ(c.ids, enc.encode_chat(chat({{"user", "hi"}, {"assistant", "hello"}})).ids);
  EXPECT_EQ(c.labels, enc.encode_chat(chat({{"user", "hi"}, {"assistant", "hello"}})).labels);
}

TEST(LlmSftData, ColumnsAreFoundAndMissingOnesNamed) {
  const SftEncoder enc = demo_encoder();
  const json messages = chat({{"user", "hi"}, {"assistant", "hello"}});
  const Ids chat_ids = enc.encode_chat(messages).ids;
  EXPECT_EQ(enc.encode({{"messages", messages}}, "r").ids, chat_ids);          // a messages column
  EXPECT_EQ(enc.encode({{"text", messages}}, "r").ids, chat_ids);              // AutoTrain: chat in text
  EXPECT_EQ(enc.encode({{"text", "hi"}, {"messages", messages}}, "r").ids, enc.encode_text("hi").ids);
  SftEncoderOptions mapped;
  mapped.column_mapping = {{"messages_column", "conversation"}};
  EXPECT_EQ(demo_encoder(mapped).encode({{"conversation", messages}}, "r").ids, chat_ids);
  try {
    enc.encode({{"question", "x"}}, "train.jsonl record 3");
    FAIL() << "no error";
  } catch (const replica::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("train.jsonl record 3"), std::string::npos) << what;
    EXPECT_NE(what.find("question"), std::string::npos) << what;
  }
  // A chat needs a template.
  const SftEncoder plain(replica::text::Tokenizer::from_dir(demo().demo.model_dir), "", json::object(), {});
  try {
    plain.encode({{"messages", messages}}, "record 1");
    FAIL() << "no error";
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("chat_template is none"), std::string::npos) << e.what();
  }
}

TEST(LlmSftData, TruncatesToMaxLength) {
  SftEncoderOptions o;
  o.max_length = 7;
  const SftSample s = demo_encoder(o).encode_chat(chat({{"user", "What is 12 + 34?"}, {"assistant", "12 + 34 = 46"}}));
  const SftSample full = demo_encoder().encode_chat(chat({{"user", "What is 12 + 34?"}, {"assistant", "12 + 34 = 46"}}));
  ASSERT_GT(full.ids.size(), 7u);
  EXPECT_EQ(s.ids, Ids(full.ids.begin(), full.ids.begin() + 7));
  EXPECT_EQ(s.labels, Ids(full.labels.begin(), full.labels.begin() + 7));
}

// ---------------------------------------------------------------------------------------
// Packing.

// First-fit by brute force: the reference for the tree version.
std::vector<std::vector<int64_t>> naive_first_fit(const std::vector<int64_t>& lengths, int64_t block) {
  std::vector<std::vector<int64_t>> rows;
  std::vector<int64_t> room;
  for (size_t s = 0; s < lengths.size(); ++s) {
    size_t r = 0;
    while (r < rows.size() && room[r] < lengths[s]) ++r;
    if (r == rows.size()) {
      rows.emplace_back();
      room.push_back(block);
    }
    rows[r].push_back(static_cast<int64_t>(s));
    room[r] -= lengths[s];
  }
  return rows;
}

TEST(LlmSftPacking, FirstFitKeepsEverySampleWholeOnce) {
  EXPECT_EQ(pack_first_fit({5, 3, 7, 2, 8, 1, 4}, 10),
            (std::vector<std::vector<int64_t>>{{0, 1, 3}, {2, 5}, {4}, {6}}));
  std::mt19937 rng(3);
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t block = std::uniform_int_distribution<int64_t>(8, 300)(rng);
    std::vector<int64_t> lengths(std::uniform_int_distribution<size_t>(1, 700)(rng));
    for (auto& l : lengths) l = std::uniform_int_distribution<int64_t>(1, block)(rng);
    const auto rows = pack_first_fit(lengths, block);
    EXPECT_EQ(rows, naive_first_fit(lengths, block));
    std::vector<int> seen(lengths.size(), 0);
    for (const auto& row : rows) {
      int64_t used = 0;
      for (int64_t s : row) {
        ++seen[static_cast<size_t>(s)];
        used += lengths[static_cast<size_t>(s)];
      }
      EXPECT_LE(used, block);
    }
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
  }
}

TEST(LlmSftPacking, RowsKeepAttentionInsideEachSampleAndPadOnlyToTheLongestRow) {
  // A tiny random Llama; each packed sample must come out as it does alone.
  replica::models::LlamaConfig c;
  c.vocab_size = 50;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  torch::manual_seed(0);
  replica::models::LlamaForCausalLM model(c);
  model->eval();
  std::vector<SftSample> samples;
  std::mt19937 rng(1);
  for (int64_t len : {5, 3, 7, 2, 6}) {
    SftSample s;
    for (int64_t t = 0; t < len; ++t) {
      s.ids.push_back(std::uniform_int_distribution<int32_t>(1, 49)(rng));
      s.labels.push_back(t % 2 ? s.ids.back() : kIgnoreLabel);
    }
    samples.push_back(s);
  }
  const auto rows = pack_first_fit({5, 3, 7, 2, 6}, 10);  // {0,1,3} {2} {4}
  const PackedBatch b = make_packed_batch(samples, rows, {1, 0}, /*pad_id=*/0);
  ASSERT_EQ(b.input_ids.sizes(), (std::vector<int64_t>{2, 10}));  // longest row: 5 + 3 + 2
  // Row 1 (sample 2, 7 tokens) is padded to 10: pad id, no label, its own segment.
  for (int64_t t = 7; t < 10; ++t) {
    EXPECT_EQ(b.input_ids[0][t].item<int64_t>(), 0);
    EXPECT_EQ(b.labels[0][t].item<int64_t>(), kIgnoreLabel);
    EXPECT_EQ(b.segment_ids[0][t].item<int64_t>(), -1);
  }
  torch::NoGradGuard no_grad;
  const auto packed = model->forward(b.input_ids, {}, b.segment_ids);
  int64_t t = 0;
  for (size_t k = 0; k < rows[0].size(); ++k) {
    const SftSample& s = samples[static_cast<size_t>(rows[0][k])];
    const int64_t n = static_cast<int64_t>(s.ids.size());
    auto ids = torch::tensor(std::vector<int64_t>(s.ids.begin(), s.ids.end())).view({1, n});
    EXPECT_EQ(b.input_ids[1].narrow(0, t, n).equal(ids[0]), true);
    EXPECT_EQ(b.segment_ids[1].narrow(0, t, n).eq(static_cast<int64_t>(k)).all().item<bool>(), true);
    const auto alone = model->forward(ids)[0];
    EXPECT_LE((packed[1].narrow(0, t, n) - alone).abs().max().item<double>(), 1e-5) << "sample " << k;
    t += n;
  }
  // The packed loss is the loss of the samples on their own (no prediction across samples).
  const auto parts = replica::models::causal_lm_loss_sum(packed, b.labels, b.segment_ids);
  double sum = 0;
  int64_t count = 0;
  for (int64_t r : {1, 0}) {
    for (int64_t s : rows[static_cast<size_t>(r)]) {
      const SftSample& x = samples[static_cast<size_t>(s)];
      const int64_t n = static_cast<int64_t>(x.ids.size());
      auto ids = torch::tensor(std::vector<int64_t>(x.ids.begin(), x.ids.end())).view({1, n});
      auto labels = torch::tensor(std::vector<int64_t>(x.labels.begin(), x.labels.end())).view({1, n});
      const auto p = replica::models::causal_lm_loss_sum(model->forward(ids), labels);
      sum += p.sum.item<double>();
      count += p.count.item<int64_t>();
      EXPECT_EQ(p.count.item<int64_t>(), x.predicted());
    }
  }
  EXPECT_EQ(parts.count.item<int64_t>(), count);
  EXPECT_NEAR(parts.sum.item<double>(), sum, 1e-4);
}

// The workload's way to the device (to_device): the ids checked on the host copy, an
// out-of-range id named with the input and vocab_size before anything reaches the model
// (Note [token ids checked on the host]); the packed layout computed there too, and a model
// told so computing what it computes on its own (Note [packed attention]).
TEST(LlmSftPacking, TheBatchIsCheckedAndLaidOutOnTheHostBeforeItMoves) {
  std::vector<SftSample> samples(3);
  samples[0].ids = {1, 2, 3};
  samples[1].ids = {4, 5};
  samples[2].ids = {6, 7, 8, 9};
  for (auto& s : samples) s.labels = s.ids;
  const auto rows = pack_first_fit({3, 2, 4}, 5);  // {0, 1} {2}
  WorkloadContext context;
  const DeviceBatch d = to_device(make_packed_batch(samples, rows, {0, 1}, /*pad_id=*/0), 50, context);
  EXPECT_TRUE(d.facts.ids_checked);
  // Row 0: samples of 3 and 2; row 1: 4 tokens and one pad.
  EXPECT_EQ(d.facts.packed.offsets, (std::vector<int64_t>{0, 3, 5, 9, 10}));
  EXPECT_EQ(d.facts.packed.max_seqlen, 4);

  replica::models::LlamaConfig c;
  c.vocab_size = 50;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  torch::manual_seed(0);
  replica::models::LlamaForCausalLM model(c);
  const auto& b = d.batch;
  const auto told = model->loss_sum(b.input_ids, b.labels, b.segment_ids, 0, d.facts);
  const auto own = model->loss_sum(b.input_ids, b.labels, b.segment_ids);
  EXPECT_EQ(told.sum.item<double>(), own.sum.item<double>());

  samples[2].ids[1] = 77;  // past vocab_size 50
  try {
    to_device(make_packed_batch(samples, rows, {0, 1}, /*pad_id=*/0), 50, context);
    ADD_FAILURE() << "an id past vocab_size went through";
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("llm-sft batch input_ids: token id 77 is out of range for vocab_size 50"),
              std::string::npos)
        << e.what();
  }
}

// packing false: one sample per row, padded on the right or on the left to the micro-batch's
// longest. Each sample's loss (prompt tokens masked as the encoder masks them) and its
// gradients are those of the sample run alone, on either side; no pad is attended, trained
// on or turned into NaN.
TEST(LlmSftPacking, UnpackedRowsPadRightOrLeftWithEachSamplesLossAlone) {
  replica::models::LlamaConfig c;
  c.vocab_size = 50;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  torch::manual_seed(0);
  replica::models::LlamaForCausalLM model(c);
  model->train();
  std::vector<SftSample> samples;
  std::mt19937 rng(2);
  const std::vector<int64_t> lengths = {5, 3, 7, 2, 6};
  for (int64_t len : lengths) {
    SftSample s;
    for (int64_t t = 0; t < len; ++t) {
      s.ids.push_back(std::uniform_int_distribution<int32_t>(1, 49)(rng));
      s.labels.push_back(t >= len / 2 ? s.ids.back() : kIgnoreLabel);  // a prompt, then its completion
    }
    samples.push_back(s);
  }
  const auto rows = one_sample_per_row(static_cast<int64_t>(samples.size()));
  ASSERT_EQ(rows.size(), samples.size());
  const std::vector<int64_t> batch = {1, 0, 2, 3, 4};
  const PackedBatch right = make_packed_batch(samples, rows, batch, /*pad_id=*/0, /*pad_left=*/false);
  const PackedBatch left = make_packed_batch(samples, rows, batch, /*pad_id=*/0, /*pad_left=*/true);
  ASSERT_EQ(right.input_ids.sizes(), (std::vector<int64_t>{5, 7}));  // padded to the longest sample
  ASSERT_EQ(left.input_ids.sizes(), (std::vector<int64_t>{5, 7}));
  // Sample 1 (3 tokens) in row 0: right-padded after its tokens, left-padded before them.
  for (int64_t t = 0; t < 7; ++t) {
    const bool right_pad = t >= 3, left_pad = t < 4;
    EXPECT_EQ(right.segment_ids[0][t].item<int64_t>(), right_pad ? -1 : 0) << t;
    EXPECT_EQ(left.segment_ids[0][t].item<int64_t>(), left_pad ? -1 : 0) << t;
    if (left_pad) {
      EXPECT_EQ(left.input_ids[0][t].item<int64_t>(), 0);
      EXPECT_EQ(left.labels[0][t].item<int64_t>(), kIgnoreLabel);
    } else {
      EXPECT_EQ(left.input_ids[0][t].item<int64_t>(), samples[1].ids[static_cast<size_t>(t - 4)]);
      EXPECT_EQ(left.labels[0][t].item<int64_t>(), samples[1].labels[static_cast<size_t>(t - 4)]);
    }
  }

  // Per sample: the loss sum and count, and the gradients of the batch's summed loss.
  struct Run {
    std::vector<double> sums;
    std::vector<int64_t> counts;
    std::map<std::string, torch::Tensor> grads;
  };
  auto grads_of = [&] {
    std::map<std::string, torch::Tensor> out;
    for (auto& item : model->named_parameters()) {
      out[item.key()] = item.value().grad().clone();
      item.value().mutable_grad() = torch::Tensor();
    }
    return out;
  };
  auto run_batch = [&](const PackedBatch& b) {
    Run r;
    const auto logits = model->forward(b.input_ids, {}, b.segment_ids);
    EXPECT_TRUE(torch::isfinite(logits).all().item<bool>()) << "a pad position produced a non-finite logit";
    torch::Tensor total = torch::zeros({});
    for (int64_t i = 0; i < b.input_ids.size(0); ++i) {
      const auto p = replica::models::causal_lm_loss_sum(logits.narrow(0, i, 1), b.labels.narrow(0, i, 1),
                                                         b.segment_ids.narrow(0, i, 1));
      r.sums.push_back(p.sum.item<double>());
      r.counts.push_back(p.count.item<int64_t>());
      total = total + p.sum;
    }
    total.backward();
    r.grads = grads_of();
    return r;
  };
  const Run r = run_batch(right), l = run_batch(left);
  Run alone;
  torch::Tensor total = torch::zeros({});
  for (int64_t s : batch) {
    const SftSample& x = samples[static_cast<size_t>(s)];
    const int64_t n = static_cast<int64_t>(x.ids.size());
    auto ids = torch::tensor(std::vector<int64_t>(x.ids.begin(), x.ids.end())).view({1, n});
    auto labels = torch::tensor(std::vector<int64_t>(x.labels.begin(), x.labels.end())).view({1, n});
    const auto p = replica::models::causal_lm_loss_sum(model->forward(ids), labels);
    alone.sums.push_back(p.sum.item<double>());
    alone.counts.push_back(p.count.item<int64_t>());
    EXPECT_EQ(p.count.item<int64_t>(), x.predicted());
    total = total + p.sum;
  }
  total.backward();
  alone.grads = grads_of();
  for (size_t i = 0; i < batch.size(); ++i) {
    EXPECT_EQ(r.counts[i], alone.counts[i]) << "sample " << batch[i];
    EXPECT_EQ(l.counts[i], alone.counts[i]) << "sample " << batch[i];
    EXPECT_NEAR(r.sums[i], alone.sums[i], 1e-5) << "right padding, sample " << batch[i];
    EXPECT_NEAR(l.sums[i], alone.sums[i], 1e-5) << "left padding, sample " << batch[i];
    EXPECT_NEAR(l.sums[i], r.sums[i], 1e-5) << "left against right, sample " << batch[i];
  }
  for (const auto& [name, g] : alone.grads) {
    EXPECT_LE((r.grads.at(name) - g).abs().max().item<double>(), 1e-5) << "right padding: " << name;
    EXPECT_LE((l.grads.at(name) - g).abs().max().item<double>(), 1e-5) << "left padding: " << name;
  }

  // Positions start at 0 at each sample's first token with left padding too: the logits of
  // the real tokens are exactly those given transformers' position_ids (cumsum of the attention
  // mask - 1, pads at 1). (RoPE's scores depend only on relative positions, so the loss alone
  // would not tell an offset apart.)
  {
    torch::NoGradGuard no_grad;
    const auto real = left.segment_ids.ge(0);
    const auto hf_positions = (real.to(torch::kLong).cumsum(1) - 1).masked_fill(real.logical_not(), 1);
    const auto implicit = model->forward(left.input_ids, {}, left.segment_ids);
    const auto explicit_ = model->forward(left.input_ids, hf_positions, left.segment_ids);
    const auto mask = real.unsqueeze(-1).expand_as(implicit);
    EXPECT_TRUE(implicit.masked_select(mask).equal(explicit_.masked_select(mask)));
    auto shifted = hf_positions + 3;  // an offset changes the rotary angles' rounding
    const auto offset = model->forward(left.input_ids, shifted, left.segment_ids);
    EXPECT_FALSE(implicit.masked_select(mask).equal(offset.masked_select(mask)));
  }

  // Packed rows may be left-padded too: the same loss as right-padded.
  const auto packed_rows = pack_first_fit(lengths, 10);  // {0,1,3} {2} {4}
  torch::NoGradGuard no_grad;
  const PackedBatch pr = make_packed_batch(samples, packed_rows, {0, 1, 2}, 0, false);
  const PackedBatch pl = make_packed_batch(samples, packed_rows, {0, 1, 2}, 0, true);
  const auto lr = replica::models::causal_lm_loss_sum(model->forward(pr.input_ids, {}, pr.segment_ids), pr.labels,
                                                      pr.segment_ids);
  const auto ll = replica::models::causal_lm_loss_sum(model->forward(pl.input_ids, {}, pl.segment_ids), pl.labels,
                                                      pl.segment_ids);
  EXPECT_EQ(lr.count.item<int64_t>(), ll.count.item<int64_t>());
  EXPECT_NEAR(lr.sum.item<double>(), ll.sum.item<double>(), 1e-4);
}

// ---------------------------------------------------------------------------------------
// End to end through the program.

class LlmEndToEnd : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
    ASSERT_NO_THROW(demo());
  }
  static fs::path root() { return demo().root; }
  static std::string model_dir() { return demo().demo.model_dir; }
  static std::string data_dir() { return demo().demo.data_dir; }
  static std::string valid_file() { return demo().demo.data_dir + "/valid.jsonl"; }

  // The seed command (plus a short schedule), run once for the tests that inspect its output.
  static const Result& seed_run() {
    static const Result r = replica({"llm", "--train", "--model", model_dir(), "--data-path", data_dir(),
                                     "--project-name", (root() / "seed").string(), "--trainer", "sft", "--peft",
                                     "--nproc-per-node", "2", "--lr", "3e-3", "--block-size", "128",
                                     "--lora_r", "8", "--lora-alpha", "16", "--max-steps", "16",
                                     "--gradient_accumulation", "1", "--logging-steps", "1", "--warmup-ratio", "0",
                                     "--checkpoint-every", "8", "--merge-adapter"});
    return r;
  }
  static fs::path seed_project() { return root() / "seed"; }
};

TEST_F(LlmEndToEnd, InitDemoWritesAModelAndPrintsTheCommand) {
  const fs::path dir = root() / "demo2";
  const Result r = replica({"llm", "init-demo", dir.string()});
  ASSERT_EQ(r.exit_code, 0) << r;
  EXPECT_NE(r.out.find("replica llm --train --model " + (dir / "model").string()), std::string::npos) << r;
  for (const char* f : {"config.json", "model.safetensors", "generation_config.json", "tokenizer.model",
                        "tokenizer_config.json", "special_tokens_map.json"}) {
    EXPECT_TRUE(fs::exists(dir / "model" / f)) << f;
  }
  // The same seed gives the same data, tokenizer and weights.
  EXPECT_EQ(read_file(dir / "data" / "train.jsonl"), read_file(fs::path(data_dir()) / "train.jsonl"));
  EXPECT_EQ(read_file(dir / "model" / "model.safetensors"), read_file(fs::path(model_dir()) / "model.safetensors"));
  const auto tok2 = replica::text::Tokenizer::from_dir((dir / "model").string());
  const auto tok1 = replica::text::Tokenizer::from_dir(model_dir());
  std::ifstream lines(dir / "data" / "train.jsonl");
  std::string line;
  while (std::getline(lines, line)) ASSERT_EQ(tok1.encode(line), tok2.encode(line));
  auto model = replica::models::load_hf_model((dir / "model").string());
  EXPECT_EQ(model->config().vocab_size, replica::text::Tokenizer::from_dir((dir / "model").string()).vocab_size());
  const Result again = replica({"llm", "init-demo", dir.string()});
  EXPECT_NE(again.exit_code, 0);
  EXPECT_NE(again.err.find("not empty"), std::string::npos) << again;
}

// The seed command on the demo, then everything its run leaves: one test, so that the run
// (the slow part) happens once per test process.
TEST_F(LlmEndToEnd, SeedCommandOnTheDemo) {
  {
    SCOPED_TRACE("SeedCommandTrainsWithTwoWorkersAndTheLossFalls");
    const Result& r = seed_run();
    ASSERT_EQ(r.exit_code, 0) << r;
    EXPECT_NE(r.err.find("2 workers"), std::string::npos) << r;
    const auto losses = losses_of(seed_project());
    ASSERT_EQ(losses.size(), 16u) << r;
    EXPECT_LT(losses.back(), losses.front() - 0.5) << r;
    const auto params = json::parse(read_file(seed_project() / "training_params.json"));
    EXPECT_EQ(params.at("lora_r"), 8);  // --lora_r and --lora-alpha: both spellings
    EXPECT_EQ(params.at("lora_alpha"), 16);
    EXPECT_EQ(params.at("peft"), true);
    EXPECT_EQ(params.at("block_size"), 128);
    EXPECT_EQ(params.at("trainer"), "sft");
    EXPECT_TRUE(metrics_of(seed_project()).front().contains("tokens_per_s"));
  }
  {
    SCOPED_TRACE("PeftRunLeavesAdapterCheckpointsFinalAndMerged");
    const fs::path p = seed_project();
    for (const char* f : {"adapter_model.safetensors", "adapter_config.json", "optimizer.safetensors",
                          "trainer_state.json", "rng_state.safetensors"}) {
      EXPECT_TRUE(fs::exists(p / "checkpoint-16" / f)) << f;
    }
    EXPECT_FALSE(fs::exists(p / "checkpoint-16" / "model.safetensors"));
    for (const char* f : {"adapter_model.safetensors", "adapter_config.json", "tokenizer.model", "tokenizer_config.json",
                          "special_tokens_map.json"}) {
      EXPECT_TRUE(fs::exists(p / "final" / f)) << f;
    }
    EXPECT_FALSE(fs::exists(p / "final" / "model.safetensors"));
    const auto cfg = json::parse(read_file(p / "final" / "adapter_config.json"));
    EXPECT_EQ(cfg.at("peft_type"), "LORA");
    EXPECT_EQ(cfg.at("r"), 8);
    EXPECT_EQ(cfg.at("lora_alpha"), 16);
    EXPECT_EQ(cfg.at("target_modules"),
              json({"down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"}));
    // PEFT's key names, never lm_head; only adapters.
    const auto adapter = load_tensors(p / "final" / "adapter_model.safetensors");
    EXPECT_EQ(adapter.size(), 4u * 7u * 2u);
    for (const auto& [name, t] : adapter) {
      EXPECT_EQ(name.rfind("base_model.model.model.layers.", 0), 0u) << name;
      EXPECT_TRUE(name.find(".lora_A.weight") != std::string::npos || name.find(".lora_B.weight") != std::string::npos)
          << name;
    }
    // The final adapter is the last checkpoint's.
    EXPECT_EQ(max_abs_diff(adapter, load_tensors(p / "checkpoint-16" / "adapter_model.safetensors")), 0.0);
    // merge_adapter: a plain HF model directory next to final/.
    for (const char* f : {"config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json"}) {
      EXPECT_TRUE(fs::exists(p / "merged" / f)) << f;
    }
  }
  {
    SCOPED_TRACE("EvalPrintsTheMeanTokenLossOfTheAdapter");
    const std::string adapter = (seed_project() / "final").string();
    const Result with = replica({"llm", "--eval", "--model", model_dir(), "--data-path", valid_file(), "--adapter", adapter});
    ASSERT_EQ(with.exit_code, 0) << with;
    const Result base = replica({"llm", "--eval", "--model", model_dir(), "--data-path", valid_file()});
    ASSERT_EQ(base.exit_code, 0) << base;
    const double loss = parse_eval_loss(with.out), base_loss = parse_eval_loss(base.out);

    // The same number from models::mean_token_loss over the samples' trained tokens.
    auto model = replica::models::load_hf_model(model_dir());
    replica::models::load_adapter(*model, adapter);
    SftEncoderOptions o;
    o.column_mapping = {{"text_column", "text"}};
    o.max_length = 2048;
    const SftEncoder enc(model_dir(), o);
    std::vector<Ids> ids;
    std::vector<std::vector<uint8_t>> masks;
    std::ifstream in(valid_file());
    std::string line;
    while (std::getline(in, line)) {
      const SftSample s = enc.encode(json::parse(line), "valid");
      ids.push_back(s.ids);
      masks.push_back(s.loss_mask());
    }
    ASSERT_EQ(ids.size(), 64u);
    EXPECT_NEAR(loss, replica::models::mean_token_loss(model, ids, &masks), 1e-6) << with;
    EXPECT_LT(loss, base_loss - 0.5) << "the adapter should have learned something: " << with << base;

    // Text data: every token after the first, through the plain model; EOS appended.
    const fs::path text_file = root() / "texts.jsonl";
    std::ofstream(text_file) << R"({"text": "What is 2 + 3? 2 + 3 = 5"})" << "\n"
                             << R"({"text": "Reverse the word \"cat\"."})" << "\n";
    const Result text = replica({"llm", "--eval", "--model", model_dir(), "--data-path", text_file.string()});
    ASSERT_EQ(text.exit_code, 0) << text;
    const auto tok = replica::text::Tokenizer::from_dir(model_dir());
    auto plain = replica::models::load_hf_model(model_dir());
    std::vector<Ids> texts;
    for (const char* t : {"What is 2 + 3? 2 + 3 = 5", "Reverse the word \"cat\"."}) {
      Ids x = tok.encode(t, true);
      x.push_back(*tok.eos_id());
      texts.push_back(x);
    }
    EXPECT_NEAR(parse_eval_loss(text.out), replica::models::mean_token_loss(plain, texts), 1e-6) << text;
  }
  {
    SCOPED_TRACE("MergeAdapterWritesAModelThatMatchesTheAdapter");
    const fs::path out = root() / "merged-cli";
    const Result r = replica({"merge-adapter", "--model", model_dir(), "--adapter", (seed_project() / "final").string(),
                              "--out", out.string()});
    ASSERT_EQ(r.exit_code, 0) << r;
    auto merged = replica::models::load_hf_model(out.string());
    auto adapted = replica::models::load_hf_model(model_dir());
    replica::models::load_adapter(*adapted, (seed_project() / "final").string());
    merged->eval();
    adapted->eval();
    torch::NoGradGuard no_grad;
    const auto tok = replica::text::Tokenizer::from_dir(out.string());  // the tokenizer came along
    const Ids ids = tok.encode("What is 12 + 30? 12 + 30 = 42");
    auto input = torch::tensor(std::vector<int64_t>(ids.begin(), ids.end())).view({1, -1});
    const auto a = merged->forward(input), b = adapted->forward(input);
    EXPECT_LE((a - b).abs().max().item<double>(), 1e-4);
    // Merged by the run (merge_adapter) and by the command: the same weights.
    EXPECT_EQ(max_abs_diff(load_tensors(out / "model.safetensors"), load_tensors(seed_project() / "merged" / "model.safetensors")),
              0.0);
  }
}

TEST_F(LlmEndToEnd, LoraAtWorldTwoEqualsWorldOneAtTheSameGlobalBatch) {
  // Global batch 4 rows: 1 worker x 4, 2 workers x 2, 2 workers x 1 x 2 accumulation steps.
  auto run = [&](const std::string& name, const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"llm", "--train", "--model", model_dir(), "--data-path", data_dir(),
                                     "--project-name", (root() / name).string(), "--trainer", "sft", "--peft",
                                     "--lora-dropout", "0", "--shuffle", "false", "--mixed-precision", "fp32",
                                     "--block-size", "96", "--max-steps", "10", "--warmup-ratio", "0",
                                     "--checkpoint-every", "0", "--logging-steps", "1", "--threads-per-worker", "1"};
    args.insert(args.end(), extra.begin(), extra.end());
    const Result r = replica(args);
    EXPECT_EQ(r.exit_code, 0) << r;
    return load_tensors(root() / name / "final" / "adapter_model.safetensors");
  };
  const std::vector<std::string> sgd = {"--optimizer", "sgd", "--lr", "0.5"};
  auto with = [](std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const auto one = run("w1", with(sgd, {"--nproc-per-node", "1", "--batch-size", "4", "--gradient-accumulation", "1"}));
  const auto two = run("w2", with(sgd, {"--nproc-per-node", "2", "--batch-size", "2", "--gradient-accumulation", "1"}));
  const auto acc = run("w2acc", with(sgd, {"--nproc-per-node", "2", "--batch-size", "1", "--gradient-accumulation", "2"}));
  if (HasFailure()) return;
  const double diff = max_abs_diff(one, two), diff_acc = max_abs_diff(one, acc);
  std::cerr << "LoRA SGD, adapter max abs diff after 10 steps: world 2 vs world 1 " << diff
            << ", world 2 with accumulation vs world 1 " << diff_acc << "\n";
  EXPECT_LE(diff, 1e-5);
  EXPECT_LE(diff_acc, 1e-5);
  // The adapters moved (B starts at zero), and the loss is the same number at every step
  // (the mean over every trained token of the global batch, however it is split).
  double moved = 0;
  for (const auto& [name, t] : one) {
    if (name.find("lora_B") != std::string::npos) moved = std::max(moved, t.abs().max().item<double>());
  }
  EXPECT_GT(moved, 1e-3);
  const auto l1 = losses_of(root() / "w1"), l2 = losses_of(root() / "w2");
  ASSERT_EQ(l1.size(), 10u);
  ASSERT_EQ(l1.size(), l2.size());
  for (size_t i = 0; i < l1.size(); ++i) EXPECT_NEAR(l1[i], l2[i], 1e-5) << i;
  EXPECT_LT(l1.back(), l1.front());

  // AdamW (the default) divides each update by the root of the running squared gradient,
  // which magnifies fp32 summation-order noise in elements whose gradient is near zero:
  // world 1 with 4 rows and with 2 x 2 accumulation differ by the same ~1e-5. Bounded, not
  // bit-equal.
  const std::vector<std::string> adamw = {"--optimizer", "adamw", "--lr", "1e-3"};
  const auto one_adam = run("a1", with(adamw, {"--nproc-per-node", "1", "--batch-size", "4", "--gradient-accumulation", "1"}));
  const auto two_adam = run("a2", with(adamw, {"--nproc-per-node", "2", "--batch-size", "2", "--gradient-accumulation", "1"}));
  if (HasFailure()) return;
  const double diff_adam = max_abs_diff(one_adam, two_adam);
  std::cerr << "LoRA AdamW lr 1e-3: world 2 vs world 1 adapter max abs diff " << diff_adam << "\n";
  EXPECT_LE(diff_adam, 1e-4);
}

TEST_F(LlmEndToEnd, SeedCommandWithZero3EqualsDdp) {
  // The seed command with --distributed-backend zero3 (and its DeepSpeed spelling): the base
  // sharded and frozen, the adapters sharded and trained, final/ the gathered PEFT adapter;
  // the same adapter as DDP at the same global batch. `replica consolidate` of the ZeRO-3
  // checkpoint is DDP's checkpoint adapter: the same PEFT names, dtypes and values.
  auto run = [&](const std::string& name, const std::string& backend) {
    const Result r = replica({"llm", "--train", "--model", model_dir(), "--data-path", data_dir(), "--project-name",
                              (root() / name).string(), "--trainer", "sft", "--peft", "--distributed-backend",
                              backend, "--nproc-per-node", "2", "--threads-per-worker", "1", "--lora-dropout", "0",
                              "--mixed-precision", "fp32", "--optimizer", "sgd", "--lr", "0.5", "--block-size", "96",
                              "--batch-size", "2", "--gradient-accumulation", "1", "--max-steps", "10",
                              "--warmup-ratio", "0", "--checkpoint-every", "10", "--logging-steps", "5"});
    EXPECT_EQ(r.exit_code, 0) << r;
    EXPECT_NE(r.err.find("backend " + std::string(backend == "ddp" ? "ddp" : "zero3")), std::string::npos) << r;
    return load_tensors(root() / name / "final" / "adapter_model.safetensors");
  };
  const auto ddp = run("z3_ddp", "ddp");
  const auto zero3 = run("z3_zero3", "deepspeed");
  if (HasFailure()) return;
  ASSERT_EQ(ddp.size(), zero3.size());
  const double diff = max_abs_diff(ddp, zero3);
  std::cerr << "LoRA SGD, adapter max abs diff after 10 steps: zero3 vs ddp " << diff << "\n";
  EXPECT_LE(diff, 1e-5);

  const fs::path out_dir = root() / "z3_consolidated";
  fs::create_directories(out_dir);
  const Result cons = replica({"consolidate", (root() / "z3_zero3" / "checkpoint-10").string(),
                               (out_dir / "adapter_model.safetensors").string()});
  ASSERT_EQ(cons.exit_code, 0) << cons;
  const auto consolidated = load_tensors(out_dir / "adapter_model.safetensors");
  const auto ddp_checkpoint = load_tensors(root() / "z3_ddp" / "checkpoint-10" / "adapter_model.safetensors");
  ASSERT_EQ(consolidated.size(), ddp_checkpoint.size());
  for (const auto& [name, t] : ddp_checkpoint) {
    ASSERT_TRUE(consolidated.count(name)) << name << " missing from the consolidated adapter";
    EXPECT_EQ(consolidated.at(name).scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(consolidated.at(name).sizes(), t.sizes()) << name;
  }
  EXPECT_LE(max_abs_diff(consolidated, ddp_checkpoint), 1e-5);
  EXPECT_EQ(read_file(out_dir / "adapter_config.json"),
            read_file(root() / "z3_zero3" / "checkpoint-10" / "adapter_config.json"));
  EXPECT_NE(cons.out.find((out_dir / "adapter_config.json").string()), std::string::npos) << cons;
}

TEST_F(LlmEndToEnd, ResumingFromAnAdapterCheckpointContinuesExactly) {
  auto run = [&](const std::string& name, const std::string& steps) {
    const Result r = replica({"llm", "--train", "--model", model_dir(), "--data-path", data_dir(), "--project-name",
                              (root() / name).string(), "--peft", "--nproc-per-node", "1", "--threads-per-worker", "1",
                              "--lr", "2e-3", "--block-size", "64", "--batch-size", "2", "--gradient-accumulation",
                              "1", "--max-steps", steps, "--checkpoint-every", "3", "--warmup-ratio", "0",
                              "--scheduler", "constant", "--logging-steps", "1"});
    EXPECT_EQ(r.exit_code, 0) << r;
    return r;
  };
  run("straight", "6");
  run("resumed", "3");
  const Result second = run("resumed", "6");
  if (HasFailure()) return;
  EXPECT_NE(second.err.find("resuming from"), std::string::npos) << second;
  EXPECT_EQ(max_abs_diff(load_tensors(root() / "straight" / "final" / "adapter_model.safetensors"),
                         load_tensors(root() / "resumed" / "final" / "adapter_model.safetensors")),
            0.0);
}

TEST_F(LlmEndToEnd, FullFineTuningWritesAModelDirectory) {
  const fs::path p = root() / "full";
  const Result r = replica({"llm", "--train", "--model", model_dir(), "--data-path", data_dir(), "--project-name",
                            p.string(), "--nproc-per-node", "1", "--threads-per-worker", "1", "--lr", "1e-3", "--block-size", "64",
                            "--batch-size", "2", "--gradient-accumulation", "1", "--max-steps", "3",
                            "--checkpoint-every", "3"});
  ASSERT_EQ(r.exit_code, 0) << r;
  for (const char* f : {"config.json", "model.safetensors", "generation_config.json", "tokenizer.model",
                        "tokenizer_config.json"}) {
    EXPECT_TRUE(fs::exists(p / "final" / f)) << f;
  }
  EXPECT_FALSE(fs::exists(p / "final" / "adapter_config.json"));
  EXPECT_TRUE(fs::exists(p / "checkpoint-3" / "model.safetensors"));
  auto tuned = load_tensors(p / "final" / "model.safetensors");
  auto base = load_tensors(fs::path(model_dir()) / "model.safetensors");
  EXPECT_GT(max_abs_diff(tuned, base), 1e-4);
  EXPECT_NO_THROW(replica::models::load_hf_model((p / "final").string()));
}

TEST_F(LlmEndToEnd, Bf16MixedPrecisionTrains) {
  const fs::path p = root() / "bf16";
  const Result r = replica({"llm", "--train", "--model", model_dir(), "--data-path", data_dir(), "--project-name",
                            p.string(), "--peft", "--nproc-per-node", "1", "--threads-per-worker", "1", "--mixed-precision", "bf16",
                            "--lr", "3e-3", "--block-size", "64", "--batch-size", "2", "--gradient-accumulation",
                            "1", "--max-steps", "6", "--logging-steps", "1", "--warmup-ratio", "0"});
  ASSERT_EQ(r.exit_code, 0) << r;
  const auto losses = losses_of(p);
  ASSERT_EQ(losses.size(), 6u);
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
  // The adapter is kept in fp32 (the master weights).
  for (const auto& [name, t] : load_tensors(p / "final" / "adapter_model.safetensors")) {
    EXPECT_EQ(t.scalar_type(), torch::kFloat32) << name;
  }
}

// packing: false through the program: one sample per row, and the same losses step by step
// whichever side the rows are padded on (fp32, the same data order).
TEST_F(LlmEndToEnd, UnpackedRowsTrainTheSameWithLeftOrRightPadding) {
  auto run = [&](const std::string& name, const std::string& padding) {
    const Result r = replica({"llm", "--train", "--model", model_dir(), "--data-path", data_dir(), "--project-name",
                              (root() / name).string(), "--peft", "--lora-dropout", "0", "--packing", "false",
                              "--padding", padding, "--nproc-per-node", "1", "--threads-per-worker", "1",
                              "--mixed-precision", "fp32", "--optimizer", "sgd", "--lr", "0.5", "--batch-size", "4",
                              "--gradient-accumulation", "1", "--max-steps", "4", "--warmup-ratio", "0",
                              "--checkpoint-every", "0", "--logging-steps", "1"});
    EXPECT_EQ(r.exit_code, 0) << r;
    EXPECT_NE(r.err.find("one per row (no packing)"), std::string::npos) << r;
    EXPECT_NE(r.err.find("padded on the " + padding), std::string::npos) << r;
    return losses_of(root() / name);
  };
  const auto right = run("unpacked_right", "right");
  const auto left = run("unpacked_left", "left");
  if (HasFailure()) return;
  ASSERT_EQ(right.size(), 4u);
  ASSERT_EQ(left.size(), right.size());
  for (size_t i = 0; i < right.size(); ++i) EXPECT_NEAR(left[i], right[i], 1e-5) << "step " << i + 1;
  const auto params = json::parse(read_file(root() / "unpacked_left" / "training_params.json"));
  EXPECT_EQ(params.at("packing"), false);
  EXPECT_EQ(params.at("padding"), "left");
}

TEST_F(LlmEndToEnd, UnsupportedSettingsAreClearErrors) {
  auto train = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"llm", "--train", "--model", model_dir(), "--data-path", data_dir(),
                                     "--project-name", (root() / "refused").string(), "--nproc-per-node", "2"};
    args.insert(args.end(), extra.begin(), extra.end());
    return replica(args, "", std::chrono::seconds(60));
  };
  // Unsloth's kernels are a CUDA-only Python library. (Quantization without peft is not refused:
  // AutoTrain ignores it, and so does replica with a note, AutoTrainKeys.KeysWithoutEffectAreNotedNotRefused.)
  const Result q = train({"--unsloth"});
  EXPECT_EQ(q.exit_code, 1) << q;
  EXPECT_NE(q.err.find("unsloth is not available in replica"), std::string::npos) << q;
  const Result typo = train({"--lora_rr", "8"});
  EXPECT_EQ(typo.exit_code, 1) << typo;
  EXPECT_NE(typo.err.find("unknown flag --lora_rr (did you mean --lora-r?)"), std::string::npos) << typo;
  const Result hub = train({"--push-to-hub"});
  EXPECT_NE(hub.err.find("Hugging Face Hub"), std::string::npos) << hub;
  // Nothing was started, nothing written.
  EXPECT_FALSE(fs::exists(root() / "refused"));
}

TEST_F(LlmEndToEnd, TokenizeRendersChatsWithTheModelsTemplate) {
  const std::string chat_line = R"([{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}])";
  const Result r = replica({"tokenize", "--tokenizer", model_dir(), "--chat"}, chat_line + "\n");
  ASSERT_EQ(r.exit_code, 0) << r;
  const SftSample s = demo_encoder().encode_chat(json::parse(chat_line));
  EXPECT_EQ(json::parse(r.out).get<Ids>(), s.ids);
  const Result plain = replica({"tokenize", "--tokenizer", model_dir()}, "What is 2 + 3?\n");
  ASSERT_EQ(plain.exit_code, 0) << plain;
  const auto tok = replica::text::Tokenizer::from_dir(model_dir());
  EXPECT_EQ(json::parse(plain.out).get<Ids>(), tok.encode("What is 2 + 3?"));
}

}  // namespace
