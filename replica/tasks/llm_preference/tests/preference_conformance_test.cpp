// The alignment trainers against TRL itself (referee/trl_referee.py, TRL 0.13.0 as AutoTrain
// 0.8.36 pins it): on a tiny random Llama made by transformers and a handful of preference rows
// (text and chat), one training step of replica's DPO, ORPO and reward workloads from the same
// initial weights has the same token ids, the same loss and every trainable gradient equal
// within 1e-5, and logs the same metrics.
#include <gtest/gtest.h>

#include "replica/io/safetensors.h"
#include "replica/testing/program_runner.h"
#include "replica/models/lora.h"
#include "replica/tasks/llm_preference/preference.h"
#include "replica/tasks/llm_sft/llm_params.h"
#include "replica/testing/referee.h"
#include "replica/train/run_config.h"
#include "replica/train/workload.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using replica::testing::run_python;

namespace {

fs::path referee() {
  return fs::path(REPLICA_SOURCE_DIR) / "replica" / "tasks" / "llm_preference" / "tests" / "referee" / "trl_referee.py";
}

struct Case {
  std::string name;
  std::string trainer;  // dpo | orpo | reward
  std::string data;     // text | chat
  bool peft = true;
  bool ref_model = false;  // dpo: params.model_ref
  int batch = 4;
};

std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.name; }

// The referee's model, reference model and data (text and chat), made once for the program;
// removed at the end when every test passed.
struct TrlFiles {
  replica::testing::ScratchDir dir{"replica-trl"};
  std::string error;  // what the referee printed when making them failed
  TrlFiles() {
    auto run = [&](const std::vector<std::string>& args) {
      const auto r = run_python(referee(), args);
      if (r.exit_code != 0) error += r.output;
    };
    run({"make-model", "--out", dir / "model"});
    run({"make-model", "--out", dir / "ref", "--seed", "1"});
    for (const char* kind : {"text", "chat"}) {
      fs::create_directories(dir / kind);
      run({"make-data", "--out", (fs::path(dir / kind) / "train.jsonl").string(), "--kind", kind});
    }
  }
};

TrlFiles* made_files = nullptr;

TrlFiles& trl_files() {
  if (!made_files) made_files = new TrlFiles;
  return *made_files;
}

// The directory goes when every test passed (kept for inspection otherwise).
class RemoveTrlFiles : public ::testing::Environment {
 public:
  void TearDown() override {
    if (!made_files) return;
    if (::testing::UnitTest::GetInstance()->Passed()) {
      std::error_code ignored;
      fs::remove_all(made_files->dir.path, ignored);
    } else {
      std::cerr << "(TRL referee directory kept for inspection: " << made_files->dir.path << ")\n";
    }
  }
};
[[maybe_unused]] ::testing::Environment* const remove_trl_files =
    ::testing::AddGlobalTestEnvironment(new RemoveTrlFiles);

class PreferenceVsTrl : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    REPLICA_REQUIRE_PYTHON("trl", "transformers", "peft", "safetensors");
    ASSERT_TRUE(trl_files().error.empty()) << trl_files().error;
  }
  static replica::testing::ScratchDir& dir() { return trl_files().dir; }
};

std::map<std::string, torch::Tensor> by_prefix(const replica::io::NamedTensors& tensors, const std::string& prefix) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : tensors) {
    if (name.rfind(prefix, 0) == 0) out[name.substr(prefix.size())] = t;
  }
  return out;
}

// The trainable parameters under the referee's names: PEFT's adapter keys (and the reward
// model's head as PEFT saves it) with peft, the HF state-dict names without.
std::map<std::string, torch::Tensor> trainable(replica::train::Workload& w, bool peft) {
  std::map<std::string, torch::Tensor> out;
  auto m = w.model();
  if (peft) {
    for (const auto& [name, p] : replica::models::lora_named_parameters(*m)) out[name] = p;
    for (const auto& item : m->named_parameters()) {
      if (item.key() == "score.weight") out["base_model.model.score.weight"] = item.value();
    }
  } else {
    for (const auto& item : m->named_parameters()) {
      if (item.value().requires_grad()) out[item.key()] = item.value();
    }
  }
  return out;
}

double max_abs(const torch::Tensor& t) { return t.abs().max().item<double>(); }

TEST_P(PreferenceVsTrl, OneStepEqualsTrl) {
  const Case& c = GetParam();
  const std::string data = (fs::path(dir() / c.data) / "train.jsonl").string();
  const std::string out = dir() / (c.name + ".safetensors");
  const int64_t block_size = c.trainer == "reward" ? 80 : 20;
  std::vector<std::string> args = {"step", "--trainer", c.trainer, "--model", dir() / "model", "--data", data,
                                   "--out", out, "--batch", std::to_string(c.batch),
                                   "--max-length", std::to_string(block_size)};
  if (c.peft) args.insert(args.end(), {"--peft", "--random-lora"});
  if (c.ref_model) args.insert(args.end(), {"--ref-model", dir() / "ref"});
  const auto r = run_python(referee(), args);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto ref = replica::io::load_safetensors(out).tensors;

  auto config = replica::train::default_config("llm-sft");
  config.base_model = dir() / "model";
  config.data.path = dir() / c.data;
  config.data.valid_split.reset();
  config.project_name = dir() / (c.name + "-project");
  llm_params(config).trainer = c.trainer;
  llm_params(config).peft = c.peft;
  llm_params(config).lora_r = 4;
  llm_params(config).lora_alpha = 8;
  llm_params(config).lora_dropout = 0;
  llm_params(config).block_size = block_size;
  llm_params(config).max_prompt_length = 12;
  llm_params(config).max_completion_length = 10;
  llm_params(config).dpo_beta = 0.1;
  if (c.ref_model) llm_params(config).model_ref = dir() / "ref";
  config.params.batch_size = c.batch;
  replica::train::validate_config(config);
  replica::train::WorkloadContext context;
  auto w = replica::train::make_workload(config, context);

  // The same tokens, batch row by batch row.
  const auto rows = by_prefix(ref, "rows");
  const auto ids = by_prefix(ref, "ids.");
  const auto masks = by_prefix(ref, "mask.");
  const int64_t batch = rows.at("").numel();
  {
    replica::tasks::PreferenceOptions o;
    o.format = c.trainer == "orpo"     ? replica::tasks::PreferenceFormat::Orpo
               : c.trainer == "reward" ? replica::tasks::PreferenceFormat::Reward
                                       : replica::tasks::PreferenceFormat::Dpo;
    o.max_prompt_length = 12;
    o.max_completion_length = 10;
    o.max_length = block_size;
    replica::tasks::PreferenceEncoder encoder(config.base_model, o);
    std::ifstream in(data);
    std::vector<nlohmann::json> records;
    for (std::string line; std::getline(in, line);) records.push_back(nlohmann::json::parse(line));
    for (int64_t i = 0; i < batch; ++i) {
      const int64_t row = rows.at("")[i].item<int64_t>();
      const auto pair = encoder.encode(records.at(static_cast<size_t>(row)), "row " + std::to_string(row));
      ASSERT_TRUE(pair.has_value()) << "row " << row << " was dropped; TRL kept it";
      for (const auto& [side, seq] : {std::make_pair("chosen", pair->first), std::make_pair("rejected", pair->second)}) {
        const std::string key = std::string(side) + "." + std::to_string(i);
        const auto want_ids = ids.at(key);
        const auto want_mask = masks.at(key);
        ASSERT_EQ(static_cast<int64_t>(seq.ids.size()), want_ids.numel()) << key << " (data row " << row << ")";
        for (int64_t t = 0; t < want_ids.numel(); ++t) {
          ASSERT_EQ(seq.ids[static_cast<size_t>(t)], want_ids[t].item<int64_t>()) << key << " token " << t;
          ASSERT_EQ(seq.completion[static_cast<size_t>(t)], want_mask[t].item<int64_t>()) << key << " mask " << t;
        }
      }
    }
  }

  // From the referee's initial values of every trainable parameter.
  auto params = trainable(*w, c.peft);
  const auto init = by_prefix(ref, "init.");
  const auto grads = by_prefix(ref, "grad.");
  ASSERT_EQ(params.size(), grads.size());
  {
    torch::NoGradGuard no_grad;
    for (auto& [name, p] : params) {
      ASSERT_TRUE(init.count(name)) << "the referee has no parameter " << name;
      ASSERT_EQ(p.sizes(), init.at(name).sizes()) << name;
      p.copy_(init.at(name));
    }
  }
  std::vector<int64_t> indices;
  for (int64_t i = 0; i < batch; ++i) indices.push_back(i);
  w->model()->train();
  auto loss = w->train_loss(indices);
  loss.backward();
  double trl_loss = 0;
  for (const auto& [name, t] : ref) {
    if (name == "loss") trl_loss = t.item<double>();
  }
  EXPECT_NEAR(loss.item<double>(), trl_loss, 1e-5 * std::max(1.0, std::abs(trl_loss)));
  double worst = 0;
  std::string worst_name;
  for (const auto& [name, p] : params) {
    ASSERT_TRUE(p.grad().defined()) << name << " got no gradient";
    const auto want = grads.at(name);
    const double diff = max_abs(p.grad() - want) / std::max(1e-3, max_abs(want));
    if (diff > worst) worst = diff, worst_name = name;
    EXPECT_LT(max_abs(p.grad() - want), 1e-5 * std::max(1.0, max_abs(want))) << name;
  }
  std::cout << c.name << ": loss " << loss.item<double>() << " (TRL " << trl_loss << "), " << params.size()
            << " gradients, largest relative difference " << worst << " (" << worst_name << ")\n";
  const auto metrics = w->train_metrics();
  for (const auto& [name, t] : by_prefix(ref, "metric.")) {
    if (name == "grad_norm") continue;  // the trainer's, not the workload's
    // ORPO's logits/*: TRL averages the logits over padding positions too, whose values depend
    // on how the batch was padded; replica's are over the completion positions (as DPO's).
    if (c.trainer == "orpo" && name.rfind("logits/", 0) == 0) continue;
    ASSERT_TRUE(metrics.count(name)) << "metric " << name << " not logged";
    EXPECT_NEAR(metrics.at(name), t.item<double>(), 1e-5 * std::max(1.0, std::abs(t.item<double>()))) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Trainers, PreferenceVsTrl,
    ::testing::Values(Case{"DpoTextLora", "dpo", "text", true, false, 4}, Case{"DpoChatLora", "dpo", "chat", true, false, 4},
                      Case{"DpoTextFullModelRef", "dpo", "text", false, true, 4},
                      Case{"DpoChatFull", "dpo", "chat", false, false, 4},
                      Case{"OrpoTextLora", "orpo", "text", true, false, 4}, Case{"OrpoChatFull", "orpo", "chat", false, false, 4},
                      Case{"RewardTextLoraDropsLongRows", "reward", "text", true, false, 5},
                      Case{"RewardChatFull", "reward", "chat", false, false, 4}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });


// 20 LoRA steps at world 2, AdamW, from the same initial adapter and in the same data order:
// replica's run (through the program, --init-adapter set to TRL's starting adapter) ends
// within 1e-4 of TRL's under accelerate at every weight, with the same loss at every step; the
// adapter replica writes loads in PEFT exactly.
class PreferenceTrainingVsTrl : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    REPLICA_REQUIRE_PYTHON("trl", "transformers", "peft", "safetensors", "accelerate");
    ASSERT_TRUE(trl_files().error.empty()) << trl_files().error;
  }
  static replica::testing::ScratchDir& dir() { return trl_files().dir; }
};

TEST_P(PreferenceTrainingVsTrl, TwentyLoraStepsAtWorldTwo) {
  const std::string trainer = GetParam();
  const std::string block_size = trainer == "reward" ? "80" : "20";
  const std::string data_dir = dir() / "text";
  const std::string trl_out = dir() / ("trl-" + trainer);
  const auto trl = run_python(referee(), {"train", "--trainer", trainer, "--model", dir() / "model", "--data",
                                          (fs::path(data_dir) / "train.jsonl").string(), "--out", trl_out, "--peft",
                                          "--random-lora", "--steps", "20", "--lr", "1e-3", "--world", "2", "--batch",
                                          "2", "--max-length", block_size});
  ASSERT_EQ(trl.exit_code, 0) << trl.output;

  // Which rows each rank trains on. TRL (accelerate's BatchSamplerShard) gives rank r the r-th
  // batch of consecutive rows (step 1: rows 0,1 to rank 0, rows 2,3 to rank 1); replica's sampler
  // deals rows out in turn, as torch's DistributedSampler does (rows 0,2 and 1,3). DPO's and the
  // reward model's losses are means over pairs, the same either way; ORPO's NLL is a mean over the
  // tokens of each rank's rows, so for ORPO replica reads the rows in the order that gives each
  // rank TRL's rows.
  std::string replica_data = data_dir;
  if (trainer == "orpo") {
    replica_data = dir() / "text-dealt";
    fs::create_directories(replica_data);
    std::ifstream in(fs::path(data_dir) / "train.jsonl");
    std::vector<std::string> rows;
    for (std::string line; std::getline(in, line);) rows.push_back(line);
    ASSERT_EQ(rows.size() % 4, 0u);
    std::ofstream out(fs::path(replica_data) / "train.jsonl");
    for (size_t g = 0; g < rows.size(); g += 4) {
      for (size_t k : {0, 2, 1, 3}) out << rows[g + k] << "\n";
    }
  }
  const std::string project = dir() / ("replica-" + trainer);
  const auto r = replica::testing::run_program(
      REPLICA_BIN,
      {"llm", "--train", "--model", dir() / "model", "--data-path", replica_data, "--project-name", project, "--trainer",
       trainer, "--peft", "--init-adapter", (fs::path(trl_out) / "init").string(), "--nproc-per-node", "2",
       "--threads-per-worker", "1", "--batch-size", "2", "--gradient-accumulation", "1", "--optimizer", "adamw",
       "--lr", "1e-3", "--scheduler", "constant", "--warmup-ratio", "0", "--weight-decay", "0", "--max-grad-norm",
       "1.0", "--max-steps", "20", "--shuffle", "false", "--block-size", block_size, "--max-prompt-length", "12",
       "--max-completion-length", "10", "--dpo-beta", "0.1", "--checkpoint-every", "0", "--logging-steps", "1",
       "--mixed-precision", "fp32"},
      {}, std::chrono::seconds(300));
  ASSERT_EQ(r.exit_code, 0) << r;

  const auto ours = replica::io::load_safetensors((fs::path(project) / "final" / "adapter_model.safetensors").string()).tensors;
  const auto theirs = replica::io::load_safetensors((fs::path(trl_out) / "adapter_model.safetensors").string()).tensors;
  std::map<std::string, torch::Tensor> want(theirs.begin(), theirs.end());
  ASSERT_EQ(ours.size(), want.size());
  double worst = 0, moved = 0;
  const auto init = replica::io::load_safetensors((fs::path(trl_out) / "init" / "adapter_model.safetensors").string()).tensors;
  std::map<std::string, torch::Tensor> start(init.begin(), init.end());
  for (const auto& [name, t] : ours) {
    ASSERT_TRUE(want.count(name)) << name << " is not in TRL's adapter";
    worst = std::max(worst, max_abs(t - want.at(name)));
    moved = std::max(moved, max_abs(want.at(name) - start.at(name)));
  }
  std::cout << trainer << ": 20 LoRA steps at world 2, largest |replica - TRL| " << worst << " (TRL moved the weights by up to "
            << moved << ")\n";
  EXPECT_LE(worst, 1e-4);
  EXPECT_GT(moved, 1e-3);

  // The loss of every step (TRL logs the mean over ranks, rounded to 4 digits).
  std::vector<double> trl_losses, our_losses;
  {
    std::ifstream in(fs::path(trl_out) / "log.jsonl");
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("loss")) trl_losses.push_back(j["loss"].get<double>());
    }
    std::ifstream ours_in(fs::path(project) / "metrics.jsonl");
    for (std::string line; std::getline(ours_in, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("loss") && !j["loss"].is_null()) our_losses.push_back(j["loss"].get<double>());
    }
  }
  ASSERT_EQ(trl_losses.size(), 20u);
  ASSERT_EQ(our_losses.size(), 20u);
  for (size_t i = 0; i < 20; ++i) EXPECT_NEAR(our_losses[i], trl_losses[i], 1.5e-4) << "step " << i + 1;
  std::cout << trainer << ": loss step 1 " << our_losses.front() << " (TRL " << trl_losses.front() << "), step 20 "
            << our_losses.back() << " (TRL " << trl_losses.back() << ")\n";

  // PEFT loads what replica wrote, exactly.
  const auto load = run_python(referee(), {"check-load", "--trainer", trainer, "--peft", "--base", dir() / "model",
                                           "--final", (fs::path(project) / "final").string()});
  EXPECT_EQ(load.exit_code, 0) << load.output;
}

INSTANTIATE_TEST_SUITE_P(Trainers, PreferenceTrainingVsTrl, ::testing::Values("dpo", "orpo", "reward"));

// Full fine-tuning: final/ is a model directory transformers loads without a missing or
// unexpected key, every tensor equal (the reward model as LlamaForSequenceClassification).
TEST_P(PreferenceTrainingVsTrl, FullFineTuningLoadsInTransformers) {
  const std::string trainer = GetParam();
  const std::string project = dir() / ("full-" + trainer);
  const auto r = replica::testing::run_program(
      REPLICA_BIN,
      {"llm", "--train", "--model", dir() / "model", "--data-path", dir() / "chat", "--project-name", project,
       "--trainer", trainer, "--nproc-per-node", "2", "--threads-per-worker", "1", "--batch-size", "2", "--max-steps",
       "2", "--block-size", trainer == "reward" ? "80" : "20", "--max-prompt-length", "12", "--checkpoint-every", "0"},
      {}, std::chrono::seconds(300));
  ASSERT_EQ(r.exit_code, 0) << r;
  const auto load = run_python(referee(), {"check-load", "--trainer", trainer, "--final", (fs::path(project) / "final").string()});
  EXPECT_EQ(load.exit_code, 0) << load.output;
}

}  // namespace
