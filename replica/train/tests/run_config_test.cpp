#include "replica/train/run_config.h"
#include "replica/tasks/image_classification/image_classification.h"
#include "replica/tasks/llm_sft/llm_params.h"
#include "replica/tasks/two_tower/two_tower.h"

#include "replica/core/error.h"
#include "replica/core/suggest.h"
#include "replica/testing/program_runner.h"
#include "replica/train/task.h"
#include "replica/train/tests/parse_error.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;
using namespace replica::train;
using replica::did_you_mean;
using replica::train::testing::parse_error_of;

namespace {

class ConfigTest : public replica::testing::ScratchDirTest {
 protected:
  ConfigTest() : ScratchDirTest("replica-cfg") {}
  void SetUp() override {
    ScratchDirTest::SetUp();
    data_ = (dir_ / "data").string();
    model_ = (dir_ / "tiny-llama").string();
    fs::create_directories(data_);
    fs::create_directories(model_);
  }

  // parse_config's replica::Error message; fails the test when the text parses.
  static std::string error_of(const std::string& yaml) { return parse_error_of(yaml); }

  // A valid image-classification config; `params_lines` go on from line 7, under params:.
  std::string image_yaml(const std::string& params_lines = "") const {
    return fmt::format(
        "task: image-classification\n"
        "project_name: out/run\n"
        "data:\n"
        "  path: {}\n"
        "params:\n"
        "  epochs: 2\n"
        "{}",
        data_, params_lines);
  }

  // A valid llm-sft config; `params_lines` go on from line 7, under params:.
  std::string llm_yaml(const std::string& params_lines = "") const {
    return fmt::format(
        "task: llm-sft\n"
        "base_model: {}\n"
        "project_name: out/llm\n"
        "data:\n"
        "  path: {}\n"
        "params:\n"
        "{}",
        model_, data_, params_lines.empty() ? "  peft: true\n" : params_lines);
  }

  std::string data_;
  std::string model_;
};

TEST_F(ConfigTest, ParsesTheProductExample) {
  // PRODUCT.md's example, with paths that exist here.
  const std::string yaml = fmt::format(
      "task: llm-sft                 # llm-sft | image-classification | two-tower\n"
      "backend: local\n"
      "base_model: {}\n"
      "project_name: out/my-model\n"
      "data:\n"
      "  path: {}\n"
      "  train_split: train\n"
      "  valid_split: null\n"
      "  chat_template: tokenizer    # tokenizer | chatml | llama3 | none\n"
      "  column_mapping:\n"
      "    text_column: text\n"
      "log: tensorboard              # none | jsonl | tensorboard\n"
      "params:\n"
      "  distributed_backend: null   # null/ddp | deepspeed/zero3\n"
      "  nproc_per_node: auto\n"
      "  epochs: 3\n"
      "  batch_size: 2               # per worker, per micro-step\n"
      "  gradient_accumulation: 4\n"
      "  mixed_precision: bf16\n"
      "  peft: true\n"
      "  lora_r: 16\n",
      model_, data_);
  RunConfig c = parse_config(yaml, "run.yaml");
  EXPECT_EQ(c.source, "run.yaml");
  EXPECT_EQ(c.task, "llm-sft");
  EXPECT_EQ(c.backend, "local");
  EXPECT_EQ(c.base_model, model_);
  EXPECT_EQ(c.project_name, "out/my-model");
  EXPECT_EQ(c.data.path, data_);
  EXPECT_EQ(c.data.train_split, "train");
  EXPECT_FALSE(c.data.valid_split.has_value());
  EXPECT_EQ(c.data.chat_template, "tokenizer");
  EXPECT_EQ(c.data.column_mapping, (std::map<std::string, std::string>{{"text_column", "text"}}));
  EXPECT_EQ(c.log, LogFormat::TensorBoard);
  EXPECT_EQ(c.params.distributed_backend, DistributedBackend::Ddp);
  EXPECT_EQ(c.params.nproc_per_node, 0);
  EXPECT_EQ(c.params.epochs, 3);
  EXPECT_EQ(c.params.batch_size, 2);
  EXPECT_EQ(c.params.gradient_accumulation, 4);
  EXPECT_EQ(c.params.mixed_precision, Precision::Bf16);
  EXPECT_TRUE(llm_params(c).peft);
  EXPECT_EQ(llm_params(c).lora_r, 16);
  // AutoTrain LLMTrainingParams defaults for what the example leaves out.
  EXPECT_DOUBLE_EQ(c.params.lr, 3e-5);
  EXPECT_EQ(c.params.scheduler, SchedulerKind::Linear);
  EXPECT_EQ(c.params.optimizer, OptimizerKind::AdamW);
  EXPECT_DOUBLE_EQ(c.params.warmup_ratio, 0.1);
  EXPECT_EQ(llm_params(c).lora_alpha, 32);
  EXPECT_DOUBLE_EQ(llm_params(c).lora_dropout, 0.05);
  EXPECT_EQ(llm_params(c).target_modules, std::vector<std::string>{"all-linear"});
  EXPECT_EQ(llm_params(c).model_max_length, 2048);
  EXPECT_FALSE(llm_params(c).merge_adapter);
}

TEST_F(ConfigTest, ImageClassificationExampleAndDefaults) {
  const std::string yaml = fmt::format(
      "task: image-classification\n"
      "backend: local\n"
      "model: resnet18\n"
      "project_name: out/fmnist\n"
      "data:\n"
      "  path: {}\n"
      "  train_split: train\n"
      "log: none\n"
      "params:\n"
      "  nproc_per_node: 4\n"
      "  batch-size: 32\n"  // flag spelling
      "  hidden_sizes: [512, 256, 64]\n"
      "  optimizer: sgd\n"
      "  lr: 0.1\n"
      "  deterministic: true\n",
      data_);
  RunConfig c = parse_config(yaml, "run.yaml");
  EXPECT_EQ(c.model, "resnet18");
  EXPECT_EQ(c.log, LogFormat::None);
  EXPECT_EQ(c.data.valid_split, std::optional<std::string>("t10k"));  // absent: t10k
  EXPECT_EQ(c.params.nproc_per_node, 4);
  EXPECT_EQ(c.params.batch_size, 32);
  EXPECT_EQ(image_params(c).hidden_sizes, (std::vector<int64_t>{512, 256, 64}));
  EXPECT_EQ(c.params.optimizer, OptimizerKind::Sgd);
  EXPECT_DOUBLE_EQ(c.params.lr, 0.1);
  EXPECT_TRUE(c.params.deterministic);
  EXPECT_EQ(c.params.epochs, 1);
  EXPECT_EQ(c.params.gradient_accumulation, 1);
  EXPECT_TRUE(c.task_params.holds<ImageParams>());  // its own keys only: no LLM section
  EXPECT_FALSE(c.task_params.holds<LlmParams>());

  const RunConfig d = default_config("image-classification");
  EXPECT_EQ(d.model, "mlp");
  EXPECT_EQ(d.data.path, "/usr/share/datasets/fashion-mnist");
  EXPECT_EQ(d.data.valid_split, std::optional<std::string>("t10k"));
  EXPECT_EQ(d.params.optimizer, OptimizerKind::AdamW);
  EXPECT_DOUBLE_EQ(d.params.lr, 1e-3);
  EXPECT_EQ(d.params.batch_size, 64);
  EXPECT_EQ(d.params.gradient_accumulation, 1);
  EXPECT_EQ(d.params.epochs, 1);
  EXPECT_THROW(default_config("gan"), replica::Error);
}

TEST_F(ConfigTest, NullValidSplitTurnsEvaluationOff) {
  RunConfig c =
      parse_config("project_name: p\ndata:\n  path: " + data_ + "\n  valid_split: null\n", "run.yaml");
  EXPECT_FALSE(c.data.valid_split.has_value());
  RunConfig tilde =
      parse_config("project_name: p\ndata:\n  path: " + data_ + "\n  valid_split: ~\n", "run.yaml");
  EXPECT_FALSE(tilde.data.valid_split.has_value());
  RunConfig named =
      parse_config("project_name: p\ndata:\n  path: " + data_ + "\n  valid_split: test\n", "run.yaml");
  EXPECT_EQ(named.data.valid_split, std::optional<std::string>("test"));
}

TEST_F(ConfigTest, DistributedBackendNames) {
  auto backend = [&](const std::string& value) {
    return parse_config(image_yaml("  distributed_backend: " + value + "\n"), "run.yaml")
        .params.distributed_backend;
  };
  EXPECT_EQ(backend("null"), DistributedBackend::Ddp);
  EXPECT_EQ(backend("ddp"), DistributedBackend::Ddp);
  EXPECT_EQ(backend("deepspeed"), DistributedBackend::Zero3);
  EXPECT_EQ(backend("zero3"), DistributedBackend::Zero3);
  EXPECT_EQ(
      error_of(image_yaml("  distributed_backend: fsdp\n")),
      "run.yaml:7: key 'params.distributed_backend' must be one of null, ddp, deepspeed, zero3, got 'fsdp'");
}

TEST_F(ConfigTest, UnknownKeysNameTheLineAndSuggest) {
  EXPECT_EQ(error_of(image_yaml("  lrr: 0.1\n")),
            "run.yaml:7: unknown key 'params.lrr' (did you mean 'lr'?)");
  EXPECT_EQ(error_of(image_yaml("  batchsize: 3\n")),
            "run.yaml:7: unknown key 'params.batchsize' (did you mean 'batch_size'?)");
  EXPECT_EQ(error_of(image_yaml("  flux_capacitor: 3\n")), "run.yaml:7: unknown key 'params.flux_capacitor'");
  EXPECT_EQ(error_of("projct_name: x\n"),
            "run.yaml:1: unknown key 'projct_name' (did you mean 'project_name'?)");
  EXPECT_EQ(error_of("project_name: x\nepochs: 3\n"),
            "run.yaml:2: unknown key 'epochs' (did you mean 'params.epochs'?)");
  EXPECT_EQ(error_of("project_name: x\ndata:\n  pth: /tmp\n"),
            "run.yaml:3: unknown key 'data.pth' (did you mean 'path'?)");
  EXPECT_EQ(error_of("project_name: x\ndata:\n  path: " + data_ + "\n  column_mapping:\n    txt_column: a\n"),
            "run.yaml:5: unknown key 'data.column_mapping.txt_column' (did you mean 'text_column'?)");
  // LLM keys exist only for llm-sft.
  EXPECT_EQ(error_of(image_yaml("  lora_r: 8\n")),
            "run.yaml:7: key 'params.lora_r' applies only to task llm-sft");
  EXPECT_EQ(error_of(image_yaml("  batch_size: 3\n  batch-size: 4\n")),
            "run.yaml:8: key 'params.batch_size' is given twice");
}

TEST_F(ConfigTest, WrongTypesNameKeyAndValue) {
  EXPECT_EQ(error_of(image_yaml("  epochs: three\n")), "run.yaml:7: key 'params.epochs' is given twice");
  const std::string yaml = "project_name: x\ndata:\n  path: " + data_ + "\nparams:\n  epochs: three\n";
  EXPECT_EQ(error_of(yaml), "run.yaml:5: key 'params.epochs' must be an integer, got 'three'");
  EXPECT_EQ(error_of(image_yaml("  lr: fast\n")), "run.yaml:7: key 'params.lr' must be a number, got 'fast'");
  EXPECT_EQ(error_of(image_yaml("  batch_size: 2.5\n")),
            "run.yaml:7: key 'params.batch_size' must be an integer, got '2.5'");
  EXPECT_EQ(error_of(image_yaml("  shuffle: maybe\n")),
            "run.yaml:7: key 'params.shuffle' must be true or false, got 'maybe'");
  EXPECT_EQ(error_of(image_yaml("  seed: [1, 2]\n")),
            "run.yaml:7: key 'params.seed' must be an integer, got a list");
  EXPECT_EQ(error_of(image_yaml("  hidden_sizes: [64, 0]\n")),
            "run.yaml:7: key 'params.hidden_sizes' must be a list of positive integers, got '0'");
  EXPECT_EQ(error_of(image_yaml("  nproc_per_node: 0\n")),
            "run.yaml:7: key 'params.nproc_per_node' must be a positive integer or 'auto', got '0'");
  EXPECT_EQ(error_of(image_yaml("  shard_optimizer: sometimes\n")),
            "run.yaml:7: key 'params.shard_optimizer' must be true, false or 'auto', got 'sometimes'");
  EXPECT_EQ(error_of("project_name: x\ndata: /tmp\n"),
            "run.yaml:2: key 'data' must be a mapping, got '/tmp'");
  EXPECT_EQ(error_of(llm_yaml("  lora_r: sixteen\n")),
            "run.yaml:7: key 'params.lora_r' must be an integer, got 'sixteen'");
}

TEST_F(ConfigTest, EnumerationsAndRanges) {
  EXPECT_EQ(error_of(image_yaml("  optimizer: adam\n")),
            "run.yaml:7: key 'params.optimizer' must be one of sgd, adamw, adamw_bnb_8bit, paged_adamw_8bit, adafactor, got 'adam'");
  EXPECT_EQ(error_of(image_yaml("  scheduler: step\n")),
            "run.yaml:7: key 'params.scheduler' must be one of constant, linear, cosine, cosine_with_restarts, polynomial, "
            "constant_with_warmup, got 'step'");
  EXPECT_EQ(error_of(image_yaml("  mixed_precision: fp8\n")),
            "run.yaml:7: key 'params.mixed_precision' must be one of fp32, bf16, fp16, got 'fp8'");
  EXPECT_EQ(parse_config(image_yaml("  mixed_precision: fp16\n"), "r").params.mixed_precision, Precision::Fp16);
  EXPECT_EQ(error_of("task: gan\n"),
            "run.yaml:1: key 'task' must be one of llm-sft, llm, llm-generic, llm-dpo, llm-orpo, llm-reward, "
            "image-classification, two-tower, got 'gan'");
  EXPECT_EQ(
      error_of("project_name: x\nlog: wandb\ndata:\n  path: " + data_ + "\n"),
      "run.yaml:2: log 'wandb' is not available in replica (no Weights & Biases client); use one of none, "
      "jsonl, tensorboard");
  EXPECT_EQ(
      error_of("project_name: x\ndata:\n  path: " + data_ + "\n  chat_template: vicuna\n"),
      "run.yaml:4: key 'data.chat_template' must be one of tokenizer, chatml, llama3, zephyr, none, got 'vicuna'");
  EXPECT_EQ(error_of(image_yaml("  batch_size: 0\n")),
            "run.yaml:7: key 'params.batch_size' must be >= 1, got 0");
  EXPECT_EQ(error_of("project_name: x\ndata:\n  path: " + data_ + "\nparams:\n  epochs: 0\n"),
            "run.yaml:5: key 'params.epochs' must be >= 1, got 0");
  EXPECT_EQ(error_of(image_yaml("  gradient_accumulation: -2\n")),
            "run.yaml:7: key 'params.gradient_accumulation' must be >= 1, got -2");
  EXPECT_EQ(error_of(image_yaml("  lr: 0\n")), "run.yaml:7: key 'params.lr' must be > 0, got 0");
  EXPECT_EQ(error_of(image_yaml("  master_port: 70000\n")),
            "run.yaml:7: key 'params.master_port' must be a port number 0-65535, got 70000");
  EXPECT_EQ(error_of(llm_yaml("  lora_dropout: 1.5\n")),
            "run.yaml:7: key 'params.lora_dropout' must be in [0, 1), got 1.5");
  EXPECT_EQ(error_of(llm_yaml("  padding: middle\n")),
            "run.yaml:7: key 'params.padding' must be one of right, left, got 'middle'");
  // Accepted aliases.
  EXPECT_EQ(parse_config(image_yaml("  optimizer: adamw_torch\n"), "r").params.optimizer, OptimizerKind::AdamW);
  EXPECT_EQ(parse_config(image_yaml("  mixed_precision: null\n"), "r").params.mixed_precision, Precision::Fp32);
  EXPECT_EQ(parse_config(image_yaml("  logging_steps: -1\n"), "r").params.logging_steps,
            RunParams{}.logging_steps);
}

TEST_F(ConfigTest, RequiredKeysAndPaths) {
  EXPECT_EQ(error_of("data:\n  path: " + data_ + "\n"),
            "run.yaml: project_name is required (the output directory of the run)");
  EXPECT_EQ(error_of(""), "run.yaml: project_name is required (the output directory of the run)");
  EXPECT_EQ(error_of("project_name: x\ndata:\n  path: /nonexistent/x\n"),
            "run.yaml:3: data.path '/nonexistent/x' does not exist");
  EXPECT_EQ(error_of("task: llm-sft\nproject_name: x\ndata:\n  path: " + data_ + "\n"),
            "run.yaml: base_model is required for task llm-sft");
  EXPECT_EQ(
      error_of("task: llm-sft\nbase_model: /nonexistent/m\nproject_name: x\ndata:\n  path: " + data_ + "\n"),
      "run.yaml:2: base_model '/nonexistent/m' does not exist");
  EXPECT_EQ(error_of("task: llm-sft\nbase_model: " + model_ + "\nproject_name: x\n"),
            "run.yaml: data.path is required for task llm-sft");
  EXPECT_EQ(error_of("task: llm-sft\nmodel: mlp\n"),
            "run.yaml:2: key 'model' is for tasks image-classification, two-tower; llm-sft takes 'base_model'");
  EXPECT_EQ(error_of("project_name: [a\n").rfind("run.yaml:", 0), 0u);  // invalid YAML names the file
  EXPECT_EQ(error_of("- a\n- b\n"), "run.yaml:1: the configuration must be a mapping of keys to values");
}

TEST_F(ConfigTest, LlmKeysAndTwins) {
  RunConfig c = parse_config(llm_yaml("  lora-alpha: 64\n"
                                      "  target_modules: [q_proj, v_proj]\n"
                                      "  quantization: null\n"
                                      "  trainer: default\n"
                                      "  merge_adapter: yes\n"
                                      "  chat_template: chatml\n"
                                      "  text_column: content\n"),
                             "run.yaml");
  EXPECT_EQ(llm_params(c).lora_alpha, 64);
  EXPECT_EQ(llm_params(c).target_modules, (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_EQ(llm_params(c).quantization, "none");
  EXPECT_EQ(llm_params(c).trainer, "sft");
  EXPECT_TRUE(llm_params(c).merge_adapter);
  EXPECT_EQ(c.data.chat_template, "chatml");
  EXPECT_EQ(c.data.column_mapping.at("text_column"), "content");
  EXPECT_EQ(to_yaml(c).find("  chat_template: chatml\n", to_yaml(c).find("params:")), std::string::npos);  // kept in data:

  const std::string both = "task: llm-sft\nbase_model: " + model_ +
                           "\nproject_name: x\ndata:\n  path: " + data_ +
                           "\n  chat_template: llama3\nparams:\n  chat_template: chatml\n";
  EXPECT_EQ(error_of(both),
            "run.yaml:8: key 'params.chat_template' is 'chatml' but 'data.chat_template' is 'llama3'; give "
            "one of them");
}

TEST_F(ConfigTest, PreferenceTrainersKeysAndColumnTwins) {
  // AutoTrain's DPO config: its trainer, beta, lengths and flat column names.
  RunConfig c = parse_config(llm_yaml("  trainer: dpo\n"
                                      "  dpo_beta: 0.2\n"
                                      "  model_ref: null\n"
                                      "  max_prompt_length: 64\n"
                                      "  max_completion_length: null\n"
                                      "  prompt_text_column: question\n"
                                      "  text_column: good\n"
                                      "  rejected_text_column: bad\n"),
                             "run.yaml");
  EXPECT_EQ(llm_params(c).trainer, "dpo");
  EXPECT_EQ(llm_params(c).dpo_beta, 0.2);
  EXPECT_EQ(llm_params(c).model_ref, "");
  EXPECT_EQ(llm_params(c).max_prompt_length, 64);
  EXPECT_EQ(llm_params(c).max_completion_length, -1);
  EXPECT_EQ(c.data.column_mapping.at("prompt_text_column"), "question");
  EXPECT_EQ(c.data.column_mapping.at("text_column"), "good");
  EXPECT_EQ(c.data.column_mapping.at("rejected_text_column"), "bad");
  EXPECT_EQ(parse_config(to_yaml(c), "config.yaml"), c) << to_yaml(c);
  for (const char* trainer : {"orpo", "reward"}) {
    EXPECT_EQ(llm_params(parse_config(llm_yaml(std::string("  trainer: ") + trainer + "\n"), "run.yaml")).trainer, trainer);
  }
  const std::string beta = error_of(llm_yaml("  dpo_beta: 0\n"));
  EXPECT_NE(beta.find("run.yaml:"), std::string::npos) << beta;
  EXPECT_NE(beta.find("params.dpo_beta"), std::string::npos) << beta;
  const std::string trainer = error_of(llm_yaml("  trainer: ppo\n"));
  EXPECT_NE(trainer.find("sft, dpo, orpo, reward"), std::string::npos) << trainer;
}

TEST_F(ConfigTest, RoundTripsThroughYaml) {
  RunConfig image = parse_config(image_yaml("  distributed_backend: deepspeed\n"
                                            "  nproc_per_node: 3\n"
                                            "  lr: 2.5e-4\n"
                                            "  weight_decay: 0.01\n"
                                            "  max_steps: 100\n"
                                            "  hidden_sizes: []\n"
                                            "  master_addr: 10.0.0.1\n"
                                            "  rdzv_timeout: 30\n"
                                            "  scheduler: constant\n"
                                            "  shuffle: false\n"),
                                 "run.yaml");
  RunConfig llm =
      parse_config(llm_yaml("  peft: true\n  lora_dropout: 0.1\n  block_size: 512\n"), "run.yaml");
  RunConfig no_eval =
      parse_config("project_name: p\ndata:\n  path: " + data_ + "\n  valid_split: null\n", "run.yaml");
  for (const RunConfig& c : {image, llm, no_eval}) {
    const std::string text = to_yaml(c);
    RunConfig again = parse_config(text, "run.yaml");
    EXPECT_EQ(again, c) << text;
    EXPECT_EQ(to_yaml(again), text);
  }
  // Every resolved field is written, in the same layout the user writes.
  const std::string text = to_yaml(image);
  for (const char* needle :
       {"task: image-classification", "model: mlp", "data:\n  path: ", "valid_split: t10k", "params:\n",
        "distributed_backend: zero3", "nproc_per_node: 3", "lr: 0.00025", "epochs: 2", "batch_size: 64",
        "rdzv_timeout: 30.0", "hidden_sizes: []", "checkpoint_every: 500", "scheduler: constant"}) {
    EXPECT_NE(text.find(needle), std::string::npos) << needle << "\n" << text;
  }
  EXPECT_NE(to_yaml(no_eval).find("valid_split: null"), std::string::npos);
  EXPECT_NE(to_yaml(llm).find("lora_alpha: 32"), std::string::npos);
  EXPECT_NE(to_yaml(llm).find("base_model: " + model_), std::string::npos);
  EXPECT_NE(to_yaml(parse_config(image_yaml("  nproc_per_node: auto\n"), "r")).find("nproc_per_node: auto"),
            std::string::npos);
  // shard_optimizer: auto unless given (the trainer decides), written back as given.
  EXPECT_FALSE(parse_config(image_yaml(""), "r").params.shard_optimizer.has_value());
  EXPECT_NE(to_yaml(parse_config(image_yaml(""), "r")).find("shard_optimizer: auto"), std::string::npos);
  EXPECT_EQ(parse_config(image_yaml("  shard_optimizer: false\n"), "r").params.shard_optimizer, false);
  EXPECT_NE(to_yaml(parse_config(image_yaml("  shard_optimizer: true\n"), "r")).find("shard_optimizer: true"),
            std::string::npos);
}

TEST_F(ConfigTest, TokenIsAcceptedButNeverWritten) {
  RunConfig c = parse_config(image_yaml("  token: s3cret-value\n"), "run.yaml");
  EXPECT_EQ(c.params.token, "s3cret-value");
  const std::string text = to_yaml(c);
  EXPECT_EQ(text.find("s3cret-value"), std::string::npos);
  EXPECT_EQ(text.find("token:"), std::string::npos);
}

TEST_F(ConfigTest, LoadConfigNamesTheFile) {
  const std::string path = (dir_ / "run.yaml").string();
  std::ofstream(path) << image_yaml("  lrr: 1\n");
  try {
    load_config(path);
    ADD_FAILURE() << "loaded a bad config";
  } catch (const replica::Error& e) {
    EXPECT_EQ(std::string(e.what()), path + ":7: unknown key 'params.lrr' (did you mean 'lr'?)");
  }
  std::ofstream(path) << image_yaml();
  EXPECT_EQ(load_config(path).source, path);
  EXPECT_EQ(load_config(path).params.epochs, 2);
  try {
    load_config((dir_ / "absent.yaml").string());
    ADD_FAILURE() << "loaded a missing file";
  } catch (const replica::Error& e) {
    EXPECT_NE(std::string(e.what()).find("absent.yaml"), std::string::npos);
  }
}

TEST_F(ConfigTest, ValidateConfigChecksConfigsBuiltInCode) {
  RunConfig c = default_config("llm-sft");
  c.base_model = model_;
  c.data.path = data_;
  c.project_name = "out";
  EXPECT_NO_THROW(validate_config(c));
  c.params.batch_size = 0;
  try {
    validate_config(c);
    ADD_FAILURE() << "accepted batch_size 0";
  } catch (const replica::Error& e) {
    EXPECT_EQ(std::string(e.what()), "key 'params.batch_size' must be >= 1, got 0");
  }
  c.params.batch_size = 1;
  llm_params(c).lora_r = 0;
  EXPECT_THROW(validate_config(c), replica::Error);
}

TEST_F(ConfigTest, SetParamReadsFlagValuesLikeYaml) {
  RunConfig c = default_config("llm-sft");
  set_param(c, "distributed-backend", "deepspeed");
  set_param(c, "nproc_per_node", "auto");
  set_param(c, "epochs", "3");
  set_param(c, "lr", "2e-4");
  set_param(c, "lora-r", "8");
  set_param(c, "chat-template", "chatml");
  set_param(c, "shard-optimizer", "false");
  EXPECT_EQ(c.params.shard_optimizer, false);
  set_param(c, "shard_optimizer", "auto");
  EXPECT_FALSE(c.params.shard_optimizer.has_value());
  EXPECT_EQ(c.params.distributed_backend, DistributedBackend::Zero3);
  EXPECT_EQ(c.params.nproc_per_node, 0);
  EXPECT_EQ(c.params.epochs, 3);
  EXPECT_DOUBLE_EQ(c.params.lr, 2e-4);
  EXPECT_EQ(llm_params(c).lora_r, 8);
  EXPECT_EQ(c.data.chat_template, "chatml");
  RunConfig mlp = default_config("image-classification");
  set_param(mlp, "hidden_sizes", "[64, 32]");
  EXPECT_EQ(image_params(mlp).hidden_sizes, (std::vector<int64_t>{64, 32}));
  set_param(c, "distributed_backend", "null");
  EXPECT_EQ(c.params.distributed_backend, DistributedBackend::Ddp);

  auto error = [&](RunConfig& config, const std::string& key, const std::string& value) -> std::string {
    try {
      set_param(config, key, value);
    } catch (const replica::Error& e) {
      return e.what();
    }
    ADD_FAILURE() << key << "=" << value << " accepted";
    return "";
  };
  EXPECT_EQ(error(c, "epochs", "three"), "key 'params.epochs' must be an integer, got 'three'");
  EXPECT_EQ(error(c, "lrr", "1"), "unknown key 'params.lrr' (did you mean 'lr'?)");
  RunConfig image = default_config("image-classification");
  EXPECT_EQ(error(image, "lora_r", "8"), "key 'params.lora_r' applies only to task llm-sft");
}

TEST(DidYouMean, SuggestsOnlyCloseKeys) {
  const std::vector<std::string> keys = {"lr", "epochs", "batch_size", "gradient_accumulation",
                                         "project_name"};
  EXPECT_EQ(did_you_mean("lrr", keys), "lr");
  EXPECT_EQ(did_you_mean("epoch", keys), "epochs");
  EXPECT_EQ(did_you_mean("Epochs", keys), "epochs");
  EXPECT_EQ(did_you_mean("gradient_accumulations", keys), "gradient_accumulation");
  EXPECT_EQ(did_you_mean("gradient_acumulaton", keys), "gradient_accumulation");  // 2 edits
  EXPECT_EQ(did_you_mean("projectname", keys), "project_name");
  EXPECT_EQ(did_you_mean("temperature", keys), "");
  EXPECT_EQ(did_you_mean("xy", keys), "");  // replacing every letter is no typo
  EXPECT_EQ(did_you_mean("", keys), "");
  EXPECT_EQ(did_you_mean("lr", {}), "");
}

}  // namespace

TEST_F(ConfigTest, ResNetAndTwoTowerKeys) {
  EXPECT_FALSE(image_params(default_config("image-classification")).gradient_checkpointing);  // off for images
  const auto c = parse_config(
      image_yaml("  sync_batchnorm: true\n  augment: true\n  resnet_stem: small\n  gradient_checkpointing: true\n"),
      "run.yaml");
  EXPECT_TRUE(image_params(c).sync_batchnorm);
  EXPECT_TRUE(image_params(c).augment);
  EXPECT_TRUE(image_params(c).gradient_checkpointing);
  EXPECT_EQ(image_params(c).resnet_stem, ResnetStem::Small);
  EXPECT_EQ(parse_config(to_yaml(c), "again.yaml"), c);  // written back out and read again
  EXPECT_EQ(error_of(image_yaml("  resnet_stem: tiny\n")),
            "run.yaml:7: key 'params.resnet_stem' must be one of imagenet, pooled, small, got 'tiny'");
  // A task's keys belong to that task.
  EXPECT_EQ(error_of(image_yaml("  temperature: 0.1\n")),
            "run.yaml:7: key 'params.temperature' applies only to task two-tower");
  const std::string two_tower = "task: two-tower\nproject_name: p\ndata:\n  path: " + data_ + "\nparams:\n";
  EXPECT_EQ(error_of(two_tower + "  temperature: 0\n"), "run.yaml:6: key 'params.temperature' must be > 0, got 0");
  EXPECT_EQ(error_of(two_tower + "  top_k: 0\n"), "run.yaml:6: key 'params.top_k' must be >= 1, got 0");
  const RunConfig tt = default_config("two-tower");
  EXPECT_EQ(tt.data.valid_split, std::optional<std::string>("valid"));
  EXPECT_EQ(two_tower_params(tt).embedding_dim, 32);
  EXPECT_DOUBLE_EQ(two_tower_params(tt).temperature, 0.05);
  EXPECT_EQ(two_tower_params(tt).hidden_sizes, (std::vector<int64_t>{64}));
  EXPECT_EQ(tt.params.batch_size, 128);
}

// ---- The key tables (issue 16): one declaration per key gives everything below.

TEST_F(ConfigTest, TrainingParamsJsonHasRealTypesAndOnlyTheRunsKeys) {
  RunConfig llm = parse_config(llm_yaml("  peft: true\n  lora_dropout: 0.1\n  target_modules: [q_proj, v_proj]\n"
                                        "  token: s3cret\n"),
                               "run.yaml");
  const auto j = nlohmann::json::parse(training_params_json(llm));
  EXPECT_TRUE(j.at("peft").is_boolean());
  EXPECT_TRUE(j.at("lora_r").is_number_integer());
  EXPECT_EQ(j.at("lora_r"), 16);
  EXPECT_TRUE(j.at("lora_dropout").is_number_float());
  EXPECT_EQ(j.at("target_modules"), "q_proj,v_proj");  // AutoTrain's form
  EXPECT_EQ(j.at("lr"), 3e-5);
  EXPECT_EQ(j.at("optimizer"), "adamw");
  EXPECT_EQ(j.at("distributed_backend"), "ddp");
  EXPECT_EQ(j.at("nproc_per_node"), "auto");
  EXPECT_EQ(j.at("task"), "llm-sft");
  EXPECT_EQ(j.at("text_column"), "text");
  EXPECT_FALSE(j.contains("token"));
  EXPECT_FALSE(j.contains("stage3_prefetch_bucket_size"));  // ZeRO-3's keys only for zero3 runs
  EXPECT_FALSE(j.contains("hidden_sizes"));                 // another task's key
  EXPECT_EQ(training_params_json(llm).find("s3cret"), std::string::npos);

  RunConfig zero = parse_config(image_yaml("  distributed_backend: deepspeed\n"), "run.yaml");
  const auto z = nlohmann::json::parse(training_params_json(zero));
  EXPECT_EQ(z.at("distributed_backend"), "zero3");
  EXPECT_EQ(z.at("stage3_prefetch_bucket_size"), 5e7);
  EXPECT_EQ(z.at("overlap_comm"), true);
  EXPECT_EQ(z.at("hidden_sizes"), (std::vector<int64_t>{256, 128}));
  EXPECT_FALSE(z.contains("lora_r"));
}

TEST_F(ConfigTest, EveryKeyOfATaskIsAFlagInItsHelpWithItsDefault) {
  for (const auto& spec : task_specs()) {
    const std::string help = keys_help(spec.name);
    const RunConfig defaults = default_config(spec.name);
    std::vector<const KeySpec*> keys;
    for (const auto& k : common_keys()) keys.push_back(&k);
    for (const auto& k : spec.keys) keys.push_back(&k);
    for (const KeySpec* k : keys) {
      std::string flag = "--" + k->name;
      std::replace(flag.begin(), flag.end(), '_', '-');
      EXPECT_NE(help.find("  " + flag + " "), std::string::npos) << spec.name << ": " << flag;
      EXPECT_TRUE(is_flag(spec.name, k->name)) << k->name;
      EXPECT_EQ(is_switch_key(spec.name, k->name), k->value_hint.empty()) << k->name;
      if (!k->secret) {
        EXPECT_NE(help.find("[" + k->text(defaults) + "]"), std::string::npos) << k->name;
      }
    }
  }
}

TEST_F(ConfigTest, FlagsOverAFileNameTheFlagAsTyped) {
  const std::string path = (dir_ / "run.yaml").string();
  std::ofstream(path) << image_yaml("  lr: 0.5\n");
  const RunConfig c = load_config(path, {{"max-steps", "20"}, {"lr", "0.25"}, {"hidden_sizes", "64,32"},
                                         {"project_name", "out/other"}, {"log", "none"}, {"valid-split", "null"}});
  EXPECT_EQ(c.params.max_steps, 20);
  EXPECT_DOUBLE_EQ(c.params.lr, 0.25);  // the flag wins over the file
  EXPECT_EQ(c.params.epochs, 2);        // the file's
  EXPECT_EQ(image_params(c).hidden_sizes, (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(c.project_name, "out/other");
  EXPECT_EQ(c.log, LogFormat::None);
  EXPECT_FALSE(c.data.valid_split.has_value());

  auto error = [&](const std::vector<std::pair<std::string, std::string>>& flags) -> std::string {
    try {
      load_config(path, flags);
    } catch (const replica::Error& e) {
      return e.what();
    }
    ADD_FAILURE() << "accepted";
    return "";
  };
  EXPECT_EQ(error({{"lerning-rate", "0.1"}}), "unknown flag --lerning-rate (did you mean --lr?)");
  EXPECT_EQ(error({{"num_train_epochs", "3"}}), "unknown flag --num_train_epochs (did you mean --epochs?)");
  EXPECT_EQ(error({{"batch-sise", "3"}}), "unknown flag --batch-sise (did you mean --batch-size?)");
  EXPECT_EQ(error({{"lora-r", "8"}}), "flag --lora-r applies only to task llm-sft");
  EXPECT_EQ(error({{"epochs", "three"}}), "--epochs three: key 'params.epochs' must be an integer, got 'three'");
  EXPECT_EQ(error({{"epochs", "0"}}), "--epochs: key 'params.epochs' must be >= 1, got 0");
  EXPECT_EQ(error({{"task", "two-tower"}}), "--task cannot change the task of a run; set task: in the YAML file");
  EXPECT_EQ(error({{"log", "wandb"}}).find("--log wandb is not available"), 0u);

  RunConfig llm = default_config("llm-sft");
  set_flag(llm, "model", model_);
  set_flag(llm, "lora-r", "4");
  set_flag(llm, "chat_template", "chatml");
  EXPECT_EQ(llm.base_model, model_);
  EXPECT_EQ(llm_params(llm).lora_r, 4);
  EXPECT_EQ(llm.data.chat_template, "chatml");
  EXPECT_THROW(set_flag(llm, "hidden-sizes", "4"), replica::Error);
}

TEST_F(ConfigTest, EqualityComparesEveryKeyOfEveryTable) {
  // Each key set to a value other than its default makes the configs differ.
  for (const auto& spec : task_specs()) {
    const RunConfig base = default_config(spec.name);
    std::vector<const KeySpec*> keys;
    for (const auto& k : common_keys()) keys.push_back(&k);
    for (const auto& k : spec.keys) keys.push_back(&k);
    for (const KeySpec* k : keys) {
      RunConfig other = base;
      const std::string now = k->text(base);
      const std::string& hint = k->value_hint;
      const bool enumeration = hint.find('|') != std::string::npos && hint != "N|auto";
      std::string value = hint.empty()                       ? (now == "true" ? "false" : "true")
                          : hint == "N" || hint == "N|auto"  ? "7"
                          : hint == "X"                      ? "0.125"
                          : hint == "N,N,..."                ? "3,5"
                          : hint == "TEXT" || hint == "A,B,..." ? "other"
                                                             : "";
      if (enumeration) {  // the first allowed value that is not the default
        for (size_t start = 0; start <= hint.size();) {
          const size_t bar = std::min(hint.find('|', start), hint.size());
          const std::string candidate = hint.substr(start, bar - start);
          if (candidate != now && candidate != "auto") {
            value = candidate;
            break;
          }
          start = bar + 1;
        }
      }
      if (value.empty()) continue;  // one allowed value (trainer: sft)
      set_param(other, k->name, value);
      EXPECT_NE(other, base) << spec.name << ": " << k->name << " = " << value;
    }
  }
}

namespace {

// Found by fuzz_config (2026-11-27): a list given as a scalar with commas was parsed again as
// YAML, whose error named neither file nor key; a long made-up value came back whole in the
// message; a string that is not UTF-8 was accepted and then written back as another string.
TEST_F(ConfigTest, HostileScalarsAreNamedByFileLineAndKeyAndShownByExcerpt) {
  const std::string list = error_of(image_yaml("  hidden_sizes: \"1,]\"\n"));
  EXPECT_NE(list.find("run.yaml:7"), std::string::npos) << list;
  EXPECT_NE(list.find("hidden_sizes"), std::string::npos) << list;
  EXPECT_EQ(list.find("yaml-cpp"), std::string::npos) << list;
  EXPECT_NO_THROW(parse_config(image_yaml("  hidden_sizes: \"256, 128\"\n"), "run.yaml"));

  const std::string long_value = error_of(image_yaml("  lr: \"" + std::string(5000, 'x') + "\"\n"));
  EXPECT_NE(long_value.find("run.yaml:7"), std::string::npos) << long_value;
  EXPECT_LT(long_value.size(), 400u) << long_value;

  const std::string bytes = error_of("task: image-classification\nproject_name: \"\x17\x9d\"\n");
  EXPECT_EQ(bytes, "run.yaml:2: not valid UTF-8 (byte 43 of the file)");

  // Valid UTF-8 that yaml-cpp reads into invalid bytes (control characters and a NUL in a plain
  // scalar came out as a lone 0xA0): refused at its line, not thrown later by JSON's writer.
  const std::string controls =
      error_of(std::string("task: image-classification\nproject_name: r\x04\x05" "c\0_\x04\x04nis\n", 53));
  EXPECT_NE(controls.find("run.yaml:2"), std::string::npos) << controls;
  EXPECT_NE(controls.find("not valid UTF-8"), std::string::npos) << controls;

  // Aliases of aliases: refused by a count of values, in bounded time, not walked 10^k times.
  std::string bomb = "task: image-classification\nparams:\n  a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i < 9; ++i) {
    bomb += fmt::format("  a{1}: &a{1} [*a{0}, *a{0}, *a{0}, *a{0}, *a{0}, *a{0}, *a{0}, *a{0}, *a{0}, *a{0}]\n", i - 1, i);
  }
  const std::string expanded = error_of(bomb);
  EXPECT_NE(expanded.find("alias"), std::string::npos) << expanded;

  // A value yaml-cpp's emitter writes plain although it reads back as something else (line
  // breaks, then brackets): config.yaml quotes it, and reads back as the same run.
  const RunConfig odd = parse_config(std::string("task: image-classification\nmodel: mlp\nproject_name: \r\r\r[[[[\r\r\n"), "run.yaml");
  EXPECT_EQ(parse_config(to_yaml(odd), "config.yaml"), odd) << to_yaml(odd);
}

}  // namespace
