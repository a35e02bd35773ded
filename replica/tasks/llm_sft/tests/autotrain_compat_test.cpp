// AutoTrain's own LLM configs, as written (autotrain_configs/SOURCES.md), through `replica
// --config` on `llm init-demo`'s model and data: each trains, or stops with the reason replica
// states; what a run leaves besides replica's files (the model card, a merged model where
// AutoTrain writes it); and, without a worker, how AutoTrain's and AITraining's keys read.
#include <gtest/gtest.h>

#include "replica/tasks/llm_sft/llm_params.h"
#include "replica/tasks/llm_sft/llm_sft.h"
#include "replica/testing/llm_demo.h"
#include "replica/testing/paths.h"
#include "replica/testing/program_runner.h"
#include "replica/train/run_config.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using json = nlohmann::json;
using replica::testing::Result;
using replica::train::llm_params;
using replica::train::parse_config;
using replica::train::RunConfig;

namespace {

const fs::path kConfigs = fs::path(REPLICA_SOURCE_DIR) / "replica/tasks/llm_sft/tests/autotrain_configs";

std::string read(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
}

// The demo (model, chats, preference rows) and the same chats as AutoTrain's `text` rows, each
// data set with the splits the configs name (train, valid, test).
struct Demo {
  fs::path root;
  replica::train::LlmDemo demo;
  fs::path chats, texts, preference;
};

const Demo& demo() {
  static const Demo* d = [] {
    auto* out = new Demo;
    out->root = replica::testing::llm_demo().run_dir("autotrain");
    out->demo = replica::testing::llm_demo().demo;
    out->chats = out->root / "chats";
    out->texts = out->root / "texts";
    out->preference = out->root / "preference";
    for (const char* split : {"train", "valid"}) {
      const std::string name = std::string(split) + ".jsonl";
      const std::string chats = read(fs::path(out->demo.data_dir) / name);
      write(out->chats / name, chats);
      write(out->preference / name, read(fs::path(out->demo.preference_dir) / name));
      // openassistant-guanaco's form: "### Human: ...### Assistant: ..."
      std::istringstream lines(chats);
      std::string text_rows;
      for (std::string line; std::getline(lines, line);) {
        if (line.empty()) continue;
        std::string text;
        for (const auto& m : json::parse(line)["messages"]) {
          text += (m["role"] == "user" ? "### Human: " : "### Assistant: ") + m["content"].get<std::string>();
        }
        text_rows += json{{"text", text}}.dump() + "\n";
      }
      write(out->texts / name, text_rows);
    }
    fs::copy_file(out->chats / "train.jsonl", out->chats / "test.jsonl");  // qwen.yml trains on `test`
    return out;
  }();
  return *d;
}


// The config file as written, with only the model, the data and the project replaced.
fs::path as_written(const std::string& file) {
  std::string text = read(kConfigs / file);
  const std::string trainer_line = std::regex_search(text, std::regex("task: llm-(orpo|dpo|reward)")) ? "pref" : "";
  const bool texts = text.find("text_column: text") != std::string::npos;
  const fs::path data = trainer_line == "pref" ? demo().preference : texts ? demo().texts : demo().chats;
  const fs::path project = demo().root / "runs" / fs::path(file).stem();
  text = std::regex_replace(text, std::regex("(^|\n)base_model: [^\n]*"), "$1base_model: " + demo().demo.model_dir);
  text = std::regex_replace(text, std::regex("\n  path: [^\n]*"), "\n  path: " + data.string());
  text = std::regex_replace(text, std::regex("\nproject_name: [^\n]*"), "\nproject_name: " + project.string());
  const fs::path out = demo().root / "configs" / file;
  write(out, text);
  return out;
}

Result run_config(const fs::path& file, const std::vector<std::string>& flags = {}) {
  std::vector<std::string> args = {"--config", file.string(), "--max-steps", "2", "--nproc-per-node", "1",
                                   "--threads-per-worker", "1"};
  args.insert(args.end(), flags.begin(), flags.end());
  return replica::testing::run_program(REPLICA_BIN, args, {}, std::chrono::seconds(300));
}

fs::path project_of(const std::string& file) { return demo().root / "runs" / fs::path(file).stem(); }

struct Case {
  const char* file;
  const char* as_written;      // "" trains; else what the refusal says
  const char* with_hub_false;  // with --push-to-hub false: "" trains, else the refusal; nullptr: not run
  std::vector<std::string> notes;
};

const std::vector<Case>& cases() {
  static const std::vector<Case> c = {
      {"gpt2_sft.yml", "", nullptr,
       {"params.max_prompt_length has no effect for trainer sft", "params.merge_adapter has no effect without peft"}},
      {"llama3-70b-orpo-v1.yml", "hub.push_to_hub' must be false: replica does not upload", "", {}},
      {"llama3-70b-sft.yml", "hub.push_to_hub' must be false", "", {}},
      {"llama3-8b-dpo-qlora.yml", "", nullptr, {}},
      {"llama3-8b-orpo-space.yml", "backend 'spaces-a10g-largex4'", nullptr, {}},
      {"llama3-8b-orpo.yml", "hub.push_to_hub' must be false", "", {}},
      {"llama3-8b-sft-unsloth.yml", "hub.push_to_hub' must be false", "unsloth is not available in replica", {}},
      {"llama32-1b-sft.yml", "hub.push_to_hub' must be false", "", {}},
      {"qwen.yml", "hub.push_to_hub' must be false", "", {}},
      {"smollm2.yml", "hub.push_to_hub' must be false", "", {}},
      {"smollm2_guanaco.yml", "hub.push_to_hub' must be false", "", {}},
      {"smollm2_orpo.yml", "", nullptr, {}},
      {"aitraining_sft.yml", "", nullptr, {}},
      {"reward.yml", "", nullptr,
       {"hub.username has no effect", "params.merge_adapter has no effect for trainer reward"}},
      {"block_size_list.yml", "params.block_size' is a list of 2 values: AutoTrain reads 64,128 into a list", nullptr, {}},
  };
  return c;
}

class AutoTrainConfigs : public ::testing::TestWithParam<size_t> {
 protected:
  void SetUp() override { ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built"; }
};

TEST_P(AutoTrainConfigs, TrainAsWrittenOrStopWithTheStatedReason) {
  const Case& c = cases()[GetParam()];
  const fs::path file = as_written(c.file);
  const fs::path project = project_of(c.file);
  const Result r = run_config(file);
  if (std::string(c.as_written).empty()) {
    ASSERT_EQ(r.exit_code, 0) << r;
  } else {
    EXPECT_NE(r.exit_code, 0) << r;
    EXPECT_NE(r.all().find(c.as_written), std::string::npos) << r;
    EXPECT_NE(r.all().find(file.string() + ":"), std::string::npos) << "the refusal names the file: " << r;
    if (c.with_hub_false == nullptr) return;
    const Result again = run_config(file, {"--push-to-hub", "false"});
    if (std::string(c.with_hub_false).empty()) {
      ASSERT_EQ(again.exit_code, 0) << again;
    } else {
      EXPECT_NE(again.exit_code, 0) << again;
      EXPECT_NE(again.all().find(c.with_hub_false), std::string::npos) << again;
      return;
    }
  }
  for (const auto& note : c.notes) {
    const std::string all = r.all();
    EXPECT_NE(all.find(note), std::string::npos) << "note '" << note << "' missing: " << r;
  }
  // What AutoTrain leaves in project_name, besides replica's own files: the model card.
  const std::string card = read(project / "README.md");
  EXPECT_NE(card.find("base_model: " + demo().demo.model_dir), std::string::npos) << card;
  EXPECT_NE(card.find("## Training"), std::string::npos) << card;
  EXPECT_NE(card.find("train_loss"), std::string::npos) << card;
  const RunConfig config = replica::train::load_config((project / "config.yaml").string());
  if (llm_params(config).peft && llm_params(config).merge_adapter && llm_params(config).trainer != "reward") {
    // AutoTrain merges into project_name itself: the merged model loads from there.
    EXPECT_TRUE(fs::exists(project / "config.json"));
    EXPECT_TRUE(fs::exists(project / "model.safetensors"));
    EXPECT_TRUE(fs::exists(project / "merged" / "model.safetensors"));
  }
}

INSTANTIATE_TEST_SUITE_P(UpstreamAndAITraining, AutoTrainConfigs, ::testing::Range<size_t>(0, 15),
                         [](const ::testing::TestParamInfo<size_t>& info) {
                           std::string name = fs::path(cases()[info.param].file).stem().string();
                           for (char& ch : name) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return name;
                         });

TEST(AutoTrainResume, SaveStepsCheckpointsResumeAndAnOlderCheckpointIsRefusedWithTheReason) {
  const fs::path file = as_written("aitraining_sft.yml");
  const fs::path project = demo().root / "runs" / "resume";
  const Result first = run_config(file, {"--project-name", project.string()});
  ASSERT_EQ(first.exit_code, 0) << first;
  EXPECT_TRUE(fs::exists(project / "checkpoint-1"));  // save_steps 1, save_total_limit 2
  EXPECT_TRUE(fs::exists(project / "checkpoint-2"));
  // resume_from_checkpoint null: continue from the newest.
  const Result more = run_config(file, {"--project-name", project.string(), "--max-steps", "3"});
  ASSERT_EQ(more.exit_code, 0) << more;
  EXPECT_NE(more.all().find("resum"), std::string::npos) << more;
  EXPECT_TRUE(fs::exists(project / "checkpoint-3"));
  // An older checkpoint than the newest: refused, saying why.
  const Result older = run_config(file, {"--project-name", project.string(), "--max-steps", "4",
                                         "--resume-from-checkpoint", (project / "checkpoint-2").string()});
  EXPECT_NE(older.exit_code, 0) << older;
  EXPECT_NE(older.all().find("is older than"), std::string::npos) << older;
  // false: a fresh start only, and this project has checkpoints.
  const Result fresh = run_config(file, {"--project-name", project.string(), "--resume-from-checkpoint", "false"});
  EXPECT_NE(fresh.exit_code, 0) << fresh;
  EXPECT_NE(fresh.all().find("resume_from_checkpoint is false"), std::string::npos) << fresh;
}

TEST(AutoTrainCommandLine, NotesNameTheFlagsThatDoNothingAndTheDefaultsThatDiffer) {
  ASSERT_TRUE(fs::exists(REPLICA_BIN)) << REPLICA_BIN << " is not built";
  const fs::path project = demo().root / "runs" / "command-line";
  const Result r = replica::testing::run_program(
      REPLICA_BIN,
      {"llm", "--train", "--model", demo().demo.model_dir, "--data-path", demo().chats.string(), "--project-name",
       project.string(), "--max-steps", "1", "--nproc-per-node", "1", "--threads-per-worker", "1", "--max-prompt-length",
       "64", "--push-to-hub", "false", "--use-flash-attention-2", "--rejected-text-column", "rejected"},
      {}, std::chrono::seconds(300));
  ASSERT_EQ(r.exit_code, 0) << r;
  for (const char* note : {"note: --max-prompt-length: params.max_prompt_length has no effect for trainer sft",
                           "params.use_flash_attention_2 has no effect (attention is always PyTorch's fused SDPA",
                           "data.column_mapping.rejected_text_column has no effect for trainer sft",
                           "note: block_size -1: rows of model_max_length = 2048 tokens; AutoTrain's -1 is min(1024"}) {
    EXPECT_NE(r.all().find(note), std::string::npos) << note << "\n" << r;
  }
  EXPECT_EQ(r.all().find("params.push_to_hub has no effect"), std::string::npos) << "false does what it says";
}

// ---- How the keys read (no worker).

class AutoTrainKeys : public ::testing::Test {
 protected:
  std::string yaml(const std::string& task, const std::string& params, const std::string& extra = "") const {
    return "task: " + task + "\nbase_model: " + demo().demo.model_dir + "\nproject_name: " +
           (demo().root / "keys").string() + "\ndata:\n  path: " + demo().chats.string() + "\nparams:\n" + params +
           extra;
  }
  static std::string error_of(const std::string& text) {
    try {
      parse_config(text, "run.yaml");
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  }
};

TEST_F(AutoTrainKeys, TaskNamesSetTheTrainerAndParamsStillWin) {
  EXPECT_EQ(llm_params(parse_config(yaml("llm-dpo", "  lr: 1e-5\n"), "run.yaml")).trainer, "dpo");
  EXPECT_EQ(llm_params(parse_config(yaml("llm-orpo", "  lr: 1e-5\n"), "run.yaml")).trainer, "orpo");
  EXPECT_EQ(llm_params(parse_config(yaml("llm-reward", "  lr: 1e-5\n"), "run.yaml")).trainer, "reward");
  EXPECT_EQ(llm_params(parse_config(yaml("llm", "  lr: 1e-5\n"), "run.yaml")).trainer, "sft");
  EXPECT_EQ(llm_params(parse_config(yaml("llm-generic", "  lr: 1e-5\n"), "run.yaml")).trainer, "sft");
  // AutoTrain's parser updates the task's trainer with params: (read last).
  const RunConfig c = parse_config(yaml("llm-dpo", "  trainer: orpo\n"), "run.yaml");
  EXPECT_EQ(llm_params(c).trainer, "orpo");
  EXPECT_EQ(c.task, "llm-sft");  // config.yaml writes the task's own name
  EXPECT_EQ(parse_config(replica::train::to_yaml(c), "config.yaml"), c);
  EXPECT_NE(error_of(yaml("llm-ppo", "  lr: 1e-5\n")).find("llm-dpo, llm-orpo, llm-reward"), std::string::npos);
}

TEST_F(AutoTrainKeys, HubSectionAndAutoTrainParamsKeys) {
  const std::string hub = "hub:\n  username: ${HF_USERNAME}\n  token: ${HF_TOKEN}\n  push_to_hub: false\n";
  const RunConfig c = parse_config(yaml("llm-sft",
                                        "  eval_strategy: epoch\n  auto_find_batch_size: false\n  token: null\n"
                                        "  push_to_hub: false\n",
                                        hub),
                                   "run.yaml");
  EXPECT_EQ(c.params.username, "${HF_USERNAME}");
  EXPECT_EQ(c.params.token, "");  // params: wins over hub:, as AutoTrain reads it last
  std::string notes;
  for (const auto& n : c.notes) notes += n + "\n";
  EXPECT_NE(notes.find("run.yaml:12: hub.username has no effect (replica does not upload"), std::string::npos) << notes;
  EXPECT_EQ(error_of(yaml("llm-sft", "  lr: 1e-5\n", "hub:\n  push_to_hub: true\n")).rfind(
                "run.yaml:9: key 'hub.push_to_hub' must be false: replica does not upload to the Hugging Face Hub", 0),
            0u);
  EXPECT_NE(error_of(yaml("llm-sft", "  lr: 1e-5\n", "hub:\n  repo: x\n")).find("unknown key 'hub.repo'"),
            std::string::npos);
  EXPECT_NE(error_of(yaml("llm-sft", "  auto_find_batch_size: true\n")).find("does not search for a batch size"),
            std::string::npos);
}

TEST_F(AutoTrainKeys, KeysWithoutEffectAreNotedNotRefused) {
  const RunConfig dpo = parse_config(yaml("llm-dpo", "  packing: false\n  lora_r: 8\n  quantization: int4\n"), "run.yaml");
  std::string notes;
  for (const auto& n : dpo.notes) notes += n + "\n";
  EXPECT_NE(notes.find("run.yaml:7: params.packing has no effect for trainer dpo (only sft reads it"), std::string::npos)
      << notes;
  EXPECT_NE(notes.find("run.yaml:8: params.lora_r has no effect without peft"), std::string::npos) << notes;
  EXPECT_NE(notes.find("run.yaml:9: params.quantization has no effect without peft"), std::string::npos) << notes;
  // A key that does something is not noted; nor a key left out.
  const RunConfig sft = parse_config(yaml("llm-sft", "  packing: false\n  peft: true\n  lora_r: 8\n"), "run.yaml");
  for (const auto& n : sft.notes) {
    EXPECT_EQ(n.find("params.packing"), std::string::npos) << n;
    EXPECT_EQ(n.find("params.lora_r"), std::string::npos) << n;
  }
}

TEST_F(AutoTrainKeys, DefaultsThatDifferFromAutoTrainsAreNotedUnlessGiven) {
  auto joined = [](const RunConfig& c) {
    std::string s;
    for (const auto& n : c.notes) s += n + "\n";
    return s;
  };
  const std::string left = joined(parse_config(yaml("llm-sft", "  peft: true\n"), "run.yaml"));
  EXPECT_NE(left.find("block_size -1: rows of model_max_length = 2048 tokens; AutoTrain's -1 is min(1024"),
            std::string::npos)
      << left;
  EXPECT_NE(left.find("quantization none"), std::string::npos) << left;
  EXPECT_NE(left.find("merge_adapter false"), std::string::npos) << left;
  const std::string given = joined(parse_config(
      yaml("llm-sft", "  peft: true\n  block_size: 1024\n  quantization: null\n  merge_adapter: false\n"), "run.yaml"));
  EXPECT_EQ(given.find("block_size -1"), std::string::npos) << given;
  EXPECT_EQ(given.find("quantization none"), std::string::npos) << given;
  EXPECT_EQ(given.find("merge_adapter false"), std::string::npos) << given;
}

TEST_F(AutoTrainKeys, BlockSizeListsSaveStepsAndZephyr) {
  EXPECT_EQ(llm_params(parse_config(yaml("llm-sft", "  block_size: [256]\n"), "run.yaml")).block_size, 256);
  EXPECT_EQ(llm_params(parse_config(yaml("llm-sft", "  block_size: \"256\"\n"), "run.yaml")).block_size, 256);
  EXPECT_EQ(error_of(yaml("llm-sft", "  block_size: 64,128\n")).rfind("run.yaml:7: key 'params.block_size' is a list of 2 values", 0), 0u);
  EXPECT_NE(error_of(yaml("llm-sft", "  block_size: []\n")).find("got an empty list"), std::string::npos);
  const RunConfig saves = parse_config(yaml("llm-sft", "  save_strategy: steps\n  save_steps: 20\n"), "run.yaml");
  EXPECT_EQ(saves.params.checkpoint_every, 20);
  EXPECT_NE(replica::train::to_yaml(saves).find("checkpoint_every: 20"), std::string::npos);
  EXPECT_EQ(error_of(yaml("llm-sft", "  save_steps: 20\n  checkpoint_every: 10\n"))
                .rfind("run.yaml:8: key 'params.checkpoint_every' and 'params.save_steps' are the same key", 0),
            0u);
  const RunConfig epoch = parse_config(yaml("llm-sft", "  save_strategy: epoch\n  save_steps: 20\n"), "run.yaml");
  std::string notes;
  for (const auto& n : epoch.notes) notes += n + "\n";
  EXPECT_NE(notes.find("run.yaml:8: params.save_steps has no effect with save_strategy epoch"), std::string::npos)
      << notes;
  RunConfig z = parse_config(yaml("llm-sft", "  lr: 1e-5\n"), "run.yaml");
  replica::train::set_flag(z, "chat-template", "zephyr");
  EXPECT_EQ(z.data.chat_template, "zephyr");
  replica::train::validate_config(z);
}

}  // namespace
