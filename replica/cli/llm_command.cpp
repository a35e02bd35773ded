// `replica llm`, `replica tokenize`, `replica merge-adapter`.
//
// `replica llm` takes AutoTrain's flags (autotrain llm --train --model ... --data-path ...
// --project-name ... --trainer sft --peft ...): each is the twin of a YAML key of
// task llm-sft, set through train::set_flag (the key table's types, aliases and checks), so
// `replica llm` and `replica --config` runs are the same runs.
#include "replica/cli/llm_command.h"

#include "replica/cli/pod_launch.h"
#include "replica/core/error.h"
#include "replica/core/json.h"
#include "replica/models/hf_model_dir.h"
#include "replica/text/chat_template.h"
#include "replica/text/tokenizer.h"
#include "replica/train/deepspeed_config.h"
#include "replica/tasks/llm_sft/llm_sft.h"
#include "replica/train/trainer.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <map>
#include <set>

namespace fs = std::filesystem;

namespace replica::cli {
namespace {

// `replica llm` is the command of this task (AutoTrain's llm task; its trainers by --trainer).
constexpr const char* kLlmTask = "llm-sft";

// The command's own flags; every other flag is the run's (train::set_flag).
const std::vector<std::string> kCommandFlags = {"adapter", "train", "eval", "help"};

bool is_switch(const std::string& name) {
  static const std::set<std::string> own = {"train", "eval", "help"};
  return own.count(name) > 0 || train::is_switch_key(kLlmTask, name);
}

bool is_bool_literal(std::string v) {
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  return v == "true" || v == "false" || v == "yes" || v == "no" || v == "on" || v == "off";
}

bool truthy(std::string v) {
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  return v == "true" || v == "yes" || v == "on" || v == "1";
}

std::string dashed(std::string name) {
  std::replace(name.begin(), name.end(), '_', '-');
  return "--" + name;
}

// The flags that are not params: keys come first, by hand; every params: key of task llm-sft
// follows, from its key table.
const char* kLlmUsage = R"(replica llm: fine-tune (SFT) or evaluate a Llama-family model, AutoTrain-style

  replica llm --train --model DIR --data-path PATH --project-name OUT --trainer sft [--peft] [flags]
  replica llm --eval --model DIR --data-path PATH [--adapter DIR] [flags]   # prints eval_loss
  replica llm init-demo DIR          # a small model, tokenizer and data set to try it on

Data and model (defaults in brackets):
  --model DIR                            Hugging Face model directory (config.json, model*.safetensors,
                                         tokenizer.json or tokenizer.model, tokenizer_config.json)
  --data-path PATH                       a .jsonl/.csv file, or a directory with <train-split>.jsonl/.csv
  --project-name OUT                     the run's directory (checkpoints, metrics, final/)
  --train-split NAME                     [train]
  --valid-split NAME                     [none: no evaluation]
  --messages-column NAME, --prompt-column NAME, --completion-column NAME
                                         the columns of chats, or of prompt + completion pairs
  --log none|jsonl|tensorboard           [jsonl]
  --backend local                        [local]
  --adapter DIR                          --eval: a PEFT adapter over --model
)";

const char* kLlmFooter = R"(Every params: key of the llm-sft YAML is a flag; --x-y and --x_y are the same flag.
--quantization int4|int8 (with --peft): QLoRA, the frozen base's decoder linears held in NF4 or int8;
--quantize-embeddings: the embeddings and lm_head held in that format too (bitsandbytes keeps them in 16 bits);
with --eval, the adapter is evaluated over the base quantized the same way.
)";

}  // namespace

LlmArgs parse_llm_args(const std::vector<std::string>& args) {
  LlmArgs out;
  train::RunConfig& c = out.config;
  c = train::default_config(kLlmTask);
  c.source = "";
  std::vector<std::string> flags_given;  // the run's flags as typed: for the run's notes
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "-h") {
      out.help = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0 || arg.size() == 2) {
      fail("replica llm: unexpected argument '{}' (flags look like --lora-r 16)", arg);
    }
    std::string name = arg.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    const std::string given = name;
    std::replace(name.begin(), name.end(), '-', '_');
    const bool own = std::find(kCommandFlags.begin(), kCommandFlags.end(), name) != kCommandFlags.end();
    if (!own && !train::is_flag(kLlmTask, name)) {
      fail("replica llm: {}", train::unknown_flag_message(kLlmTask, given, kCommandFlags));
    }
    if (!has_value) {
      const bool next_is_value = i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0;
      if (is_switch(name)) {
        if (next_is_value && is_bool_literal(args[i + 1])) {
          value = args[++i];
        } else {
          value = "true";
        }
      } else if (next_is_value) {
        value = args[++i];
      } else {
        fail("replica llm: flag {} needs a value", dashed(name));
      }
    }

    if (name == "help") {
      out.help = truthy(value);
    } else if (name == "train") {
      out.train = truthy(value);
    } else if (name == "eval") {
      out.eval = truthy(value);
    } else if (name == "adapter") {
      out.adapter = value;
    } else {
      try {
        train::set_flag(c, given, value);
      } catch (const Error& e) {
        fail("replica llm: {}", e.what());
      }
      flags_given.push_back(given);
    }
  }
  train::note_flags(c, flags_given);
  return out;
}

int llm_command(const std::vector<std::string>& args, const std::vector<std::string>& self_argv) {
  if (!args.empty() && args.front() == "init-demo") {
    if (args.size() == 2 && (args[1] == "--help" || args[1] == "-h")) {
      std::cout << "replica llm init-demo DIR: writes DIR/model (a small random-init Llama with a trained\n"
                   "SentencePiece tokenizer and a chat template), DIR/data/{train,valid}.jsonl (synthetic\n"
                   "instruction chats) and DIR/data/preference/{train,valid}.jsonl (the same questions as\n"
                   "preference rows: prompt, chosen, rejected), then prints the commands that fine-tune it\n";
      return 0;
    }
    if (args.size() != 2 || args[1].rfind("-", 0) == 0) fail("usage: replica llm init-demo DIR");
    const train::LlmDemo demo = train::write_llm_demo(args[1]);
    std::cout << fmt::format("model: {} (Llama, vocabulary {}, random init)\n", demo.model_dir, demo.vocab_size)
              << fmt::format("data:  {}/train.jsonl ({} chats), {}/valid.jsonl ({} chats)\n", demo.data_dir,
                             demo.train_samples, demo.data_dir, demo.valid_samples)
              << "fine-tune it (LoRA, 2 workers on 2 cores):\n  " << demo.train_command << "\n"
              << "then evaluate the adapter:\n  " << demo.eval_command << "\n"
              << fmt::format("preference data: {}/{{train,valid}}.jsonl; align with DPO (or --trainer orpo | reward):\n  ",
                             demo.preference_dir)
              << demo.dpo_command << "\n";
    return 0;
  }
  LlmArgs parsed = parse_llm_args(args);
  if (parsed.help || args.empty()) {
    // A sentence, not a heading: the groups of the key table below are the headings.
    std::cout << kLlmUsage << "\nEvery params: key of task llm-sft follows, by group, with AutoTrain's "
                              "LLMTrainingParams names and defaults.\n\n"
              << train::keys_help(kLlmTask) << kLlmFooter;
    return 0;
  }
  train::RunConfig& c = parsed.config;
  if (parsed.train == parsed.eval) {
    fail("replica llm: give one of --train or --eval (see replica llm --help)");
  }
  if (c.base_model.empty()) fail("replica llm: --model DIR is required");
  if (c.data.path.empty()) fail("replica llm: --data-path PATH is required");

  if (parsed.eval) {
    if (!fs::is_directory(c.base_model)) fail("replica llm --eval: --model '{}' is not a directory", c.base_model);
    if (!fs::exists(c.data.path)) fail("replica llm --eval: --data-path '{}' does not exist", c.data.path);
    if (!parsed.adapter.empty() && !fs::is_directory(parsed.adapter)) {
      fail("replica llm --eval: --adapter '{}' is not a directory", parsed.adapter);
    }
    const auto r = train::evaluate_llm(c, parsed.adapter);
    std::cout << fmt::format("eval_loss: {:.8f}\n", r.loss)
              << fmt::format("eval_tokens: {}\neval_samples: {}\n", r.tokens, r.samples);
    return 0;
  }
  if (!parsed.adapter.empty()) fail("replica llm: --adapter is for --eval");
  if (c.project_name.empty()) fail("replica llm --train: --project-name OUT is required");
  train::apply_deepspeed_config(c);
  train::validate_config(c);
  if (auto code = run_in_pytorchjob_pod(c, self_argv)) return *code;  // Note [PyTorchJob pods]
  return train::run(c, self_argv);
}

int tokenize_command(const std::string& tokenizer_dir, bool chat, const std::string& chat_template,
                     bool json_lines) {
  // With --chat every line is a JSON messages list already: --json-lines changes nothing.
  text::ChatRenderer renderer;
  if (chat) {
    const text::ChatTemplateSource source = text::chat_template_source(chat_template, tokenizer_dir);
    if (source.text.empty()) fail("replica tokenize --chat: chat template '{}' renders nothing; use tokenizer, chatml or llama3", chat_template);
    auto tmpl = std::make_shared<const text::ChatTemplate>(source);  // its errors name the template
    auto special = text::chat_special_tokens(tokenizer_dir);
    renderer = [tmpl, special](const std::string& messages_json) {
      // text::tokenize_command has checked the line (a JSON list, bounded nesting) already.
      return tmpl->render(parse_ordered_json(messages_json, "replica tokenize --chat: stdin"),
                          /*add_generation_prompt=*/false, special);
    };
  }
  return text::tokenize_command(tokenizer_dir, chat, std::cin, std::cout, renderer, json_lines && !chat);
}

int merge_adapter_command(const std::string& model_dir, const std::string& adapter_dir, const std::string& out_dir) {
  if (fs::exists(out_dir) && !fs::is_empty(out_dir)) fail("replica merge-adapter: --out '{}' exists and is not empty", out_dir);
  models::merge_adapter_dir(model_dir, adapter_dir, out_dir);
  std::cout << fmt::format("merged {} into {}: {}\n", adapter_dir, model_dir, out_dir);
  return 0;
}

}  // namespace replica::cli
