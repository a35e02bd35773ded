// `replica llm --train` on the decoder families of issue 19 (Olmo 2, Olmo 3, Gemma 3) at world
// 2, through the real program (REPLICA_BIN): LoRA SFT under DDP and under ZeRO-3 (the same
// adapter at the same global batch), and full fine-tuning under both (the same weights, a
// final/ that loads back). Each model is tiny and random (replica's HF init), in HF layout,
// with sliding windows shorter than the packed rows; Olmo uses the demo's SentencePiece
// tokenizer and ChatML template, Gemma 3 the Gemma-style tokenizer and Gemma 3 chat template
// of replica/text/tests/gemma_tokenizer/. The numbers against transformers and PEFT are in
// replica/models/tests/families_conformance_test.cpp.
#include "replica/tasks/llm_sft/llm_sft.h"
#include "replica/testing/paths.h"

#include "replica/models/hf_model_dir.h"
#include "replica/models/llama.h"
#include "replica/testing/program_runner.h"
#include "replica/testing/referee.h"
#include "replica/text/tokenizer.h"
#include "replica/train/tests/tensor_files.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using json = nlohmann::json;
using replica::testing::load_tensors;
using replica::testing::max_abs_diff;
using replica::testing::Result;

namespace {

Result replica_run(const std::vector<std::string>& args) {
  return replica::testing::run_program(REPLICA_BIN, args, {}, std::chrono::seconds(300), "");
}

fs::path gemma_tokenizer_dir() {
  return fs::path(REPLICA_SOURCE_DIR) / "replica" / "text" / "tests" / "gemma_tokenizer";
}

// The family's config.json for a tiny model: 64 wide, sliding window 16 (rows are 64 tokens).
json family_config(const std::string& family, int64_t vocab_size) {
  json c = {{"vocab_size", vocab_size},     {"hidden_size", 64},          {"intermediate_size", 128},
            {"num_attention_heads", 4},     {"num_key_value_heads", 2},   {"max_position_embeddings", 256},
            {"initializer_range", 0.02},    {"torch_dtype", "float32"},   {"rms_norm_eps", 1e-6}};
  if (family == "olmo2" || family == "olmo3") {
    c["model_type"] = family;
    c["architectures"] = {family == "olmo2" ? "Olmo2ForCausalLM" : "Olmo3ForCausalLM"};
    c["num_hidden_layers"] = family == "olmo2" ? 2 : 4;  // olmo3: three sliding layers, one full
    c["tie_word_embeddings"] = false;
    c["rope_theta"] = 500000.0;
    if (family == "olmo3") c["sliding_window"] = 16;
  } else if (family == "gpt_oss") {
    // 4 experts, top-2, sinks, biases, YaRN, a sliding and a full layer.
    c["model_type"] = "gpt_oss";
    c["architectures"] = {"GptOssForCausalLM"};
    c["num_hidden_layers"] = 2;
    c["head_dim"] = 16;
    c["num_local_experts"] = 4;
    c["num_experts_per_tok"] = 2;
    c["sliding_window"] = 16;
    c["layer_types"] = {"sliding_attention", "full_attention"};
    c["rope_theta"] = 150000.0;
    c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"truncate", false},
                         {"original_max_position_embeddings", 64}};
    c["attention_bias"] = true;
    c["tie_word_embeddings"] = false;
  } else {
    c["model_type"] = "gemma3_text";
    c["architectures"] = {"Gemma3ForCausalLM"};
    c["num_hidden_layers"] = 2;
    c["head_dim"] = 16;
    c["query_pre_attn_scalar"] = 16;
    c["sliding_window"] = 16;
    c["layer_types"] = {"sliding_attention", "full_attention"};
    c["bos_token_id"] = 2;
    c["eos_token_id"] = 1;
    c["pad_token_id"] = 0;
  }
  return c;
}

struct Fixture {
  fs::path root;
  replica::train::LlmDemo demo;
  std::map<std::string, std::string> models;  // family -> model directory
};

bool fixture_made = false;

// The demo's data and tokenizer, and one tiny model directory per family, made once.
const Fixture& fixture() {
  static const Fixture* f = [] {
    auto* out = new Fixture;
    std::string tmpl = (fs::temp_directory_path() / "replica-llm-families-XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    out->root = tmpl;
    out->demo = replica::train::write_llm_demo((out->root / "demo").string());
    fixture_made = true;
    for (const std::string family : {"olmo2", "olmo3", "gemma3_text", "gpt_oss"}) {
      const bool gemma = family == "gemma3_text";
      const fs::path tokenizer = gemma ? gemma_tokenizer_dir() : fs::path(out->demo.model_dir);
      const auto tok = replica::text::Tokenizer::from_dir(tokenizer.string());
      const auto config = replica::models::parse_llama_config(family_config(family, tok.vocab_size()).dump(),
                                                              family + " config");
      torch::manual_seed(11);
      replica::models::LlamaForCausalLM model(config);  // HF's init (Gemma's norms at zero)
      const fs::path dir = out->root / family;
      replica::models::save_hf_model_dir(model, dir.string());
      for (const auto& entry : fs::directory_iterator(tokenizer)) {
        const std::string name = entry.path().filename().string();
        if (name.rfind("tokenizer", 0) == 0 || name == "special_tokens_map.json") {
          fs::copy_file(entry.path(), dir / name, fs::copy_options::overwrite_existing);
        }
      }
      out->models[family] = dir.string();
    }
    return out;
  }();
  return *f;
}

class RemoveFixture : public ::testing::Environment {
 public:
  void TearDown() override {
    if (!fixture_made) return;
    if (::testing::UnitTest::GetInstance()->Passed()) {
      std::error_code ignored;
      fs::remove_all(fixture().root, ignored);
    } else {
      std::cerr << "(LLM families test directory kept for inspection: " << fixture().root << ")\n";
    }
  }
};
[[maybe_unused]] ::testing::Environment* const remove_fixture =
    ::testing::AddGlobalTestEnvironment(new RemoveFixture);

std::vector<double> losses_of(const fs::path& project) {
  std::vector<double> out;
  std::istringstream in(replica::testing::read_file(project / "metrics.jsonl"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const auto j = json::parse(line);
    if (j.contains("loss")) out.push_back(j["loss"].get<double>());
  }
  return out;
}

// One world-2 run: SGD (so that DDP and ZeRO-3 give the same numbers to rounding), packed rows
// of 64 tokens, 8 steps.
// `more` flags come last (a later flag wins).
Result train(const std::string& family, const std::string& name, const std::string& backend, bool peft,
             const std::vector<std::string>& more = {}) {
  const fs::path project = fixture().root / name;
  std::vector<std::string> args = {"llm", "--train", "--model", fixture().models.at(family), "--data-path",
                                   fixture().demo.data_dir, "--project-name", project.string(), "--trainer", "sft",
                                   "--distributed-backend", backend, "--nproc-per-node", "2",
                                   "--threads-per-worker", "1", "--mixed-precision", "fp32", "--optimizer", "sgd",
                                   "--lr", peft ? "0.5" : "0.05", "--block-size", "64", "--batch-size", "2",
                                   "--gradient-accumulation", "1", "--max-steps", "8", "--warmup-ratio", "0",
                                   "--checkpoint-every", "0", "--logging-steps", "1", "--lora-dropout", "0"};
  if (peft) args.push_back("--peft");
  args.insert(args.end(), more.begin(), more.end());
  return replica_run(args);
}

class LlmFamilies : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
    ASSERT_NO_THROW(fixture());
  }
};

}  // namespace

TEST_P(LlmFamilies, LoraSftAtWorldTwoWithDdpAndZero3) {
  const std::string family = GetParam();
  const Result ddp = train(family, family + "_lora_ddp", "ddp", true);
  ASSERT_EQ(ddp.exit_code, 0) << ddp;
  const Result zero3 = train(family, family + "_lora_zero3", "zero3", true);
  ASSERT_EQ(zero3.exit_code, 0) << zero3;
  // The log names the architecture and its sliding-window layers; all-linear is the seven
  // projections of every layer (GPT-OSS: the four attention projections; its router and
  // experts are not nn.Linear in PEFT's eyes either).
  const bool moe = family == "gpt_oss";
  const int64_t linears = moe ? 4 : 7;
  EXPECT_NE(ddp.err.find("llm-sft: model " + family), std::string::npos) << ddp;
  EXPECT_NE(ddp.err.find(moe ? "k_proj,o_proj,q_proj,v_proj" : "down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj"),
            std::string::npos)
      << ddp;
  const auto a = load_tensors(fixture().root / (family + "_lora_ddp") / "final" / "adapter_model.safetensors");
  const auto b = load_tensors(fixture().root / (family + "_lora_zero3") / "final" / "adapter_model.safetensors");
  ASSERT_EQ(a.size(), b.size());
  const int64_t layers = replica::models::read_hf_config(fixture().models.at(family)).num_hidden_layers;
  EXPECT_EQ(static_cast<int64_t>(a.size()), layers * linears * 2);  // lora_A and lora_B of each linear
  double moved = 0;
  for (const auto& [name, t] : a) {
    if (name.find("lora_B") != std::string::npos) moved = std::max(moved, t.abs().max().item<double>());
  }
  EXPECT_GT(moved, 1e-4);
  const double diff = max_abs_diff(a, b);
  EXPECT_LE(diff, 1e-5);
  const auto la = losses_of(fixture().root / (family + "_lora_ddp"));
  const auto lb = losses_of(fixture().root / (family + "_lora_zero3"));
  ASSERT_EQ(la.size(), 8u);
  ASSERT_EQ(la.size(), lb.size());
  for (size_t i = 0; i < la.size(); ++i) {
    EXPECT_TRUE(std::isfinite(la[i]));
    EXPECT_NEAR(la[i], lb[i], 1e-5) << i;
  }
  std::cerr << "[" << family << "] LoRA SGD world 2, 8 steps: loss " << la.front() << " -> " << la.back()
            << "; adapter max|B| " << moved << "; ZeRO-3 vs DDP adapter max abs diff " << diff << "\n";
}

TEST_P(LlmFamilies, FullFineTuningAtWorldTwoWithDdpAndZero3) {
  const std::string family = GetParam();
  const Result ddp = train(family, family + "_full_ddp", "ddp", false);
  ASSERT_EQ(ddp.exit_code, 0) << ddp;
  const Result zero3 = train(family, family + "_full_zero3", "zero3", false);
  ASSERT_EQ(zero3.exit_code, 0) << zero3;
  const fs::path final_ddp = fixture().root / (family + "_full_ddp") / "final";
  const fs::path final_zero3 = fixture().root / (family + "_full_zero3") / "final";
  const auto a = load_tensors(final_ddp / "model.safetensors");
  const auto b = load_tensors(final_zero3 / "model.safetensors");
  const auto base = load_tensors(fs::path(fixture().models.at(family)) / "model.safetensors");
  ASSERT_EQ(a.size(), base.size());
  const double moved = max_abs_diff(a, base), diff = max_abs_diff(a, b);
  EXPECT_GT(moved, 1e-5);
  EXPECT_LE(diff, 1e-5);
  // final/ is the family's HF directory again, with the tokenizer.
  const auto config = replica::models::read_hf_config(final_ddp.string());
  EXPECT_EQ(config.model_type, family);
  EXPECT_TRUE(fs::exists(final_ddp / "tokenizer_config.json"));
  EXPECT_NO_THROW(replica::models::load_hf_model(final_ddp.string()));
  std::cerr << "[" << family << "] full fine-tuning SGD world 2, 8 steps: weights moved by " << moved
            << "; ZeRO-3 vs DDP max abs diff " << diff << "\n";
}

INSTANTIATE_TEST_SUITE_P(Families, LlmFamilies, ::testing::Values("olmo2", "olmo3", "gemma3_text", "gpt_oss"));

// GPT-OSS's router load-balancing loss in training (router_aux_loss_coef), full fine-tuning
// with activation checkpointing (the default) so that the router itself trains: the loss is
// the token mean plus the coefficient times the load-balancing loss averaged over the step's
// forwards, so world 2 with one row each is world 1 accumulating the same two rows, and
// ZeRO-3 is DDP; the term changes the router's weights and adds to the logged loss.
TEST(LlmMoe, RouterLoadBalancingLossAtWorldTwoEqualsAccumulationAndZero3) {
  ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
  ASSERT_NO_THROW(fixture());
  const std::vector<std::string> rows = {"--batch-size", "1", "--max-steps", "4"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), rows.begin(), rows.end());
    return more;
  };
  const std::vector<std::string> aux = {"--router-aux-loss-coef", "0.5"};
  struct RunSpec {
    std::string name, backend;
    std::vector<std::string> more;
  };
  const std::vector<RunSpec> runs = {
      {"moe_aux_ddp", "ddp", with(aux)},
      {"moe_aux_zero3", "zero3", with(aux)},
      {"moe_aux_world1", "ddp", with({"--router-aux-loss-coef", "0.5", "--nproc-per-node", "1",
                                      "--gradient-accumulation", "2"})},
      {"moe_plain_ddp", "ddp", with({})},
  };
  std::map<std::string, std::map<std::string, torch::Tensor>> weights;
  std::map<std::string, std::vector<double>> losses;
  for (const auto& run : runs) {
    const Result r = train("gpt_oss", run.name, run.backend, false, run.more);
    ASSERT_EQ(r.exit_code, 0) << r;
    if (run.name != "moe_plain_ddp") {
      EXPECT_NE(r.err.find("load-balancing loss x 0.5 added"), std::string::npos) << r;
    }
    weights[run.name] = load_tensors(fixture().root / run.name / "final" / "model.safetensors");
    losses[run.name] = losses_of(fixture().root / run.name);
    ASSERT_EQ(losses[run.name].size(), 4u) << run.name;
  }
  const auto& ddp = weights["moe_aux_ddp"];
  const double zero3 = max_abs_diff(ddp, weights["moe_aux_zero3"]);
  const double world1 = max_abs_diff(ddp, weights["moe_aux_world1"]);
  EXPECT_LE(zero3, 1e-5);
  EXPECT_LE(world1, 1e-5);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_NEAR(losses["moe_aux_ddp"][i], losses["moe_aux_zero3"][i], 1e-5) << i;
    EXPECT_NEAR(losses["moe_aux_ddp"][i], losses["moe_aux_world1"][i], 1e-5) << i;
  }
  // The router's weights move differently with the term; the first step's loss (same weights
  // on both runs) is higher by 0.5 x the load-balancing loss, about top_k = 2 for balanced
  // routing (E x sum over the k choices and E experts of 1/E x 1/E), more for unbalanced.
  double router = 0;
  for (const auto& [name, t] : ddp) {
    if (name.find("mlp.router") != std::string::npos) {
      router = std::max(router, (t - weights["moe_plain_ddp"].at(name)).abs().max().item<double>());
    }
  }
  EXPECT_GT(router, 1e-6);
  const double added = losses["moe_aux_ddp"][0] - losses["moe_plain_ddp"][0];
  EXPECT_GT(added, 0.5 * 1.0 - 1e-6);
  std::cerr << "[gpt_oss] router_aux_loss_coef 0.5, full fine-tuning, 4 steps: ZeRO-3 vs DDP max abs diff " << zero3
            << ", world 1 x accumulation 2 vs world 2 " << world1 << "; first loss " << losses["moe_aux_ddp"][0]
            << " vs " << losses["moe_plain_ddp"][0] << " without the term; router weights differ by " << router
            << "\n";
}
