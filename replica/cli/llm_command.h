// `replica llm`, `replica tokenize` and `replica merge-adapter`.
#pragma once

#include "replica/train/run_config.h"

#include <string>
#include <vector>

namespace replica::cli {

// `replica llm --train|--eval [flags]` and `replica llm init-demo DIR`. `args` are the
// arguments after "llm"; `self_argv` re-runs this command (the workers re-parse it).
int llm_command(const std::vector<std::string>& args, const std::vector<std::string>& self_argv);

// The llm-sft configuration the flags describe (AutoTrain's names, --x-y or --x_y; every
// `params:` key is a flag), with `train`/`eval`/`adapter` set from --train, --eval,
// --adapter. replica::Error for an unknown flag (with "did you mean"), a missing value or a
// bad one. No validation beyond the flags themselves.
struct LlmArgs {
  bool train = false;
  bool eval = false;
  bool help = false;
  std::string adapter;
  train::RunConfig config;
};
LlmArgs parse_llm_args(const std::vector<std::string>& args);

// `replica tokenize --tokenizer DIR [--chat] [--chat-template MODE] [--json-lines]` on
// stdin/stdout. With json_lines each stdin line is one text as a JSON string.
int tokenize_command(const std::string& tokenizer_dir, bool chat, const std::string& chat_template,
                     bool json_lines = false);

// `replica merge-adapter --model DIR --adapter DIR --out DIR`.
int merge_adapter_command(const std::string& model_dir, const std::string& adapter_dir, const std::string& out_dir);

}  // namespace replica::cli
