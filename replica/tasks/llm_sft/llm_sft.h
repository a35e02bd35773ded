// LLM supervised fine-tuning (task llm-sft): its registration, the model as training starts, the
// workload and the `replica llm --eval` / `replica llm init-demo` helpers.
//
// Data: sft_data.h (records -> samples -> packed rows).
//
// Model. The base model directory (HF layout) in fp32. peft: LoRA adapters (r, alpha,
// dropout, target_modules; all-linear never includes lm_head) on the frozen base, which is
// held in bf16 when mixed_precision is bf16 (the fp32 adapters are the master weights);
// full fine-tuning keeps fp32 weights and computes in bf16 under autocast. torch_dtype
// bfloat16 holds the weights themselves in bf16 (Note [bf16 weights] in llm_sft.cpp).
// quantization int4 / int8 (QLoRA, peft only): the base's decoder linears are quantized as
// they are loaded (models/quant.h: NF4 with double quantization, or per-row int8) and
// dequantized per layer on the fly; the adapter saved is the same PEFT adapter as over the
// unquantized base, which it loads onto.
#pragma once

#include "replica/tasks/llm_sft/llm_params.h"
#include "replica/tasks/llm_sft/sft_data.h"
#include "replica/train/run_config.h"
#include "replica/train/task.h"
#include "replica/models/hf_model_dir.h"
#include "replica/models/llama.h"
#include "replica/models/lora.h"
#include "replica/train/workload.h"

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace replica::train {

// An llm-sft config's LLM keys, resolved (block_size -1 -> model_max_length, PEFT's target names).
struct LlmSftSettings {
  bool peft = false;
  models::LoraConfig lora;      // r, lora_alpha, lora_dropout, target_modules
  int64_t model_max_length = 2048;
  int64_t block_size = 2048;    // resolved (-1 -> model_max_length)
  bool packing = true;          // false: one sample per row
  bool pad_left = false;        // padding: left
  bool merge_adapter = false;
  bool add_eos_token = true;
};
LlmSftSettings llm_sft_settings(const RunConfig& config);

std::unique_ptr<Workload> make_llm_sft(const RunConfig& config, const WorkloadContext& context);

// A micro-batch for the model: on the context's device, with what the model takes from its host
// copy instead of asking the device (models::BatchFacts: the ids checked against vocab_size,
// an out-of-range id named as "llm-sft batch input_ids: token id X is out of range for
// vocab_size V"; the packed layout of its segment ids).
struct DeviceBatch {
  PackedBatch batch;
  models::BatchFacts facts;
};
DeviceBatch to_device(const PackedBatch& host, int64_t vocab_size, const WorkloadContext& context);

// The task's registration: its keys (LlmParams), defaults (AutoTrain's), checks and the SFT
// workload; the registry adds the preference trainers (replica/tasks/registry.cpp).
TaskSpec llm_sft_task();

// The model of an llm run as training starts, whatever the trainer: loaded in the dtype and
// quantization the keys say (peft with bf16: a bf16 base under fp32 adapters), the router's
// loss, activation checkpointing, and with peft the LoRA adapters (their config into *lora);
// logged as "TAG: ...". `extra`: as models::load_hf_model's.
models::LlamaForCausalLM load_llm_for_training(const RunConfig& config, const WorkloadContext& context,
                                               const std::string& tag, models::LoraConfig* lora,
                                               models::HfExtraTensors* extra = nullptr);
// The dtype an llm run holds its base weights in: torch_dtype's (auto: config.json's, bfloat16
// or else float32), or bf16 for peft with mixed_precision bf16, else fp32 (DPO's reference model
// is held the same way).
torch::ScalarType base_weight_dtype(const RunConfig& config);
// The dtype the model's (unquantized) weights are held in: what a checkpoint's config.json says.
inline torch::ScalarType held_weight_dtype(const models::LlamaForCausalLMImpl& model) {
  return model.model->norm->weight.scalar_type();
}
// params.quantization and params.quantize_embeddings as the loader takes them.
models::QuantOptions quant_options_of(const RunConfig& config);
// Copies the tokenizer files of model directory FROM into TO (final/ carries them).
void copy_tokenizer_files(const std::string& from, const std::string& to);

// merge_adapter: merges final/'s adapter into the base as project_name/merged/ and places its
// files in project_name itself, where AutoTrain writes the merged model (project_dir.h: never over
// a file of the user's). `tag` names the trainer in the log.
void merge_into_project(const RunConfig& config, const std::string& final_dir, const std::string& tag);

// The llm trainers' part of the model card: PEFT or transformers, the trainer, how to load final/.
ModelCardInfo llm_model_card(const RunConfig& config);

// What can be refused before workers start: quantization without peft or with ZeRO-3, a
// base model directory without config.json or tokenizer, a missing data file.
void check_llm_sft_config(const RunConfig& config);

// `replica llm --eval`: every sample of the split (valid_split when set, else train_split)
// on its own (no packing; truncated only at model_max_length), through the base model (plus
// the PEFT adapter in adapter_dir when given) in fp32, its decoder linears quantized when
// config's quantization says so: cross-entropy summed over every
// trained token (models::mean_token_loss with the samples' loss masks) divided by their
// count.
struct LlmEvalResult {
  double loss = 0;
  int64_t tokens = 0;
  int64_t samples = 0;
};
LlmEvalResult evaluate_llm(const RunConfig& config, const std::string& adapter_dir = "");

// `replica llm init-demo DIR`: DIR/model, a small Llama (models::make_tiny_llama, random
// init) with a SentencePiece BPE tokenizer trained here on the demo data
// (tokenizer.model, tokenizer_config.json with a ChatML chat template), and
// DIR/data/{train,valid}.jsonl, synthetic instruction/response chats (arithmetic, word
// reversal, capitals, letter counts, number sequences) in messages form, and
// DIR/data/preference/{train,valid}.jsonl, the same kinds of question as preference rows (the
// right answer chosen, a wrong one rejected) for the dpo, orpo and reward trainers. Returns the
// directories and the command that fine-tunes the model on the data.
struct LlmDemo {
  std::string model_dir;
  std::string data_dir;
  int64_t train_samples = 0;
  int64_t valid_samples = 0;
  int64_t vocab_size = 0;
  std::string preference_dir;  // DIR/data/preference/{train,valid}.jsonl: prompt, chosen, rejected chats
  std::string train_command;   // replica llm --train ...
  std::string dpo_command;     // replica llm --train --trainer dpo ... on the preference data
  std::string eval_command;    // replica llm --eval ...
};
LlmDemo write_llm_demo(const std::string& dir, uint64_t seed = 1234);

}  // namespace replica::train
