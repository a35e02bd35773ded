// Task llm-sft's own `params:` keys: AutoTrain's LLMTrainingParams (the key table, with each
// key's name, checks and help, is llm_sft_task() in llm_sft.cpp; the trainers dpo, orpo and
// reward read the same struct).
#pragma once

#include "replica/train/run_config.h"

#include <cstdint>
#include <string>
#include <vector>

namespace replica::train {

struct LlmParams {
  std::string trainer = "sft";
  bool peft = false;
  int64_t lora_r = 16;
  int64_t lora_alpha = 32;
  double lora_dropout = 0.05;
  std::vector<std::string> target_modules = {"all-linear"};
  bool merge_adapter = false;
  int64_t model_max_length = 2048;
  int64_t block_size = -1;                  // -1: model_max_length
  std::string padding = "right";
  bool packing = true;                      // false: one sample per row
  bool add_eos_token = true;
  bool response_only_loss = true;           // sft: loss on the completion / assistant turns only
  std::string quantization = "none";
  bool quantize_embeddings = false;         // also the embeddings and lm_head (with quantization)
  bool disable_gradient_checkpointing = false;
  bool use_flash_attention_2 = false;
  // The dtype the model's weights are held in (TRL's / transformers' torch_dtype): float32, or
  // bfloat16 with fp32 master weights stepped by the optimizer; auto: config.json's.
  std::string torch_dtype = "float32";
  bool unsloth = false;
  double router_aux_loss_coef = -1;         // -1: the model's config.json decides
  // The alignment trainers (dpo, orpo, reward; replica/tasks/llm_preference), AutoTrain's names
  // and defaults.
  std::string init_adapter;                 // peft: start from this PEFT adapter; "" = fresh adapters
  std::string model_ref;                    // dpo: the reference model; "" = the frozen base
  double dpo_beta = 0.1;                    // dpo and orpo: beta
  int64_t max_prompt_length = 128;          // prompt tokens kept (its end)
  int64_t max_completion_length = -1;       // completion tokens kept (their start); -1: no limit
};

// The llm keys of a run of task llm-sft.
inline const LlmParams& llm_params(const RunConfig& config) { return config.task_params.get<LlmParams>(); }
inline LlmParams& llm_params(RunConfig& config) { return config.task_params.get<LlmParams>(); }

}  // namespace replica::train
