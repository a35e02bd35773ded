// LLM supervised fine-tuning (task llm-sft): the data pipeline, the workload and the
// `replica llm --eval` / `replica llm init-demo` helpers.
//
// Data. A record (JSONL or CSV, replica/data/records.h) becomes one tokenized sample:
//   text column        the text as it is: encode(text) with the tokenizer's special tokens
//                      (BOS), EOS appended when the tokenizer has one (add_eos_token); loss
//                      on every token;
//   messages column    a chat (list of {role, content}) rendered with the chat template
//                      (data.chat_template: tokenizer | chatml | llama3; none refuses chats);
//                      the rendered text already holds the template's BOS, so it is encoded
//                      with add_special_tokens = false (no second BOS). Loss only on the
//                      assistant turns: their spans are found by rendering prefixes (the
//                      text of messages[:i] with add_generation_prompt = true ends where
//                      assistant turn i starts; messages[:i+1] ends where it ends) and the
//                      text is encoded segment by segment;
//   prompt + completion  encode(prompt) with special tokens, then the completion without,
//                      EOS appended; loss only on the completion (lists of messages in both
//                      columns are a chat whose completion turns are trained).
// Which: data.column_mapping's messages_column, or prompt_column/completion_column, when
// given; else the text column (default "text"), read as a chat when it holds a list; else
// the columns "messages", or "prompt" + "completion", when the records have them.
//
// Training rows. Samples are truncated to model_max_length (and to block_size, since a
// sample is never split). packing true (the default: AutoTrain's SFT trainer always packs,
// TRL's packing=True): they are packed first-fit, in data order, into rows of at most
// block_size tokens (AutoTrain's block_size -1 = model_max_length). packing false: one
// sample per row (TRL's packing=False). Each row carries segment ids, so attention stays
// inside each sample, positions restart at 0 at each sample's first token and no
// prediction crosses a sample boundary. A micro-batch is batch_size rows padded to its
// longest row only, on the side `padding` names (right: after a row's tokens; left: before
// them, as a tokenizer with padding_side left does). Padding is a segment of its own (id
// -1): no token of a sample attends to it, it is never a target, and a pad position attends
// only to pads (so no attention row is empty); a sample's positions, mask and loss are the
// same on either side, and the same as the sample alone. The trainer's unit ("sample" of
// the sampler, samples_per_s) is a row; the loss of a step is the mean over every trained
// token of the global batch.
//
// Model. The base model directory (HF layout) in fp32. peft: LoRA adapters (r, alpha,
// dropout, target_modules; all-linear never includes lm_head) on the frozen base, which is
// held in bf16 when mixed_precision is bf16 (the fp32 adapters are the master weights);
// full fine-tuning keeps fp32 master weights and computes in bf16 under autocast.
// quantization int4 / int8 (QLoRA, peft only): the base's decoder linears are quantized as
// they are loaded (models/quant.h: NF4 with double quantization, or per-row int8) and
// dequantized per layer on the fly; the adapter saved is the same PEFT adapter as over the
// unquantized base, which it loads onto.
#pragma once

#include "replica/tasks/llm_sft/llm_params.h"
#include "replica/train/run_config.h"
#include "replica/train/task.h"
#include "replica/models/hf_model_dir.h"
#include "replica/models/lora.h"
#include "replica/text/chat_template.h"
#include "replica/text/tokenizer.h"
#include "replica/train/workload.h"

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace replica::train {

constexpr int32_t kIgnoreLabel = -100;

// One tokenized sample: token ids and, per token, its label (the id when the token is a
// training target, kIgnoreLabel when not).
struct SftSample {
  std::vector<int32_t> ids;
  std::vector<int32_t> labels;
  // Tokens predicted with a loss: positions t >= 1 whose label is set (token 0 has no
  // prefix to be predicted from).
  int64_t predicted() const;
  // labels != kIgnoreLabel per token (models::mean_token_loss's loss_mask).
  std::vector<uint8_t> loss_mask() const;
};

struct SftEncoderOptions {
  std::string chat_template = "tokenizer";              // tokenizer | chatml | llama3 | none
  std::map<std::string, std::string> column_mapping;    // text_column, messages_column, ...
  bool add_eos_token = true;
  int64_t max_length = 0;                                // truncation; 0 = none
};

// Turns records into samples with a model directory's tokenizer and chat template.
class SftEncoder {
 public:
  // The tokenizer of `model_dir` (tokenizer.json or tokenizer.model, tokenizer_config.json)
  // and the template `options.chat_template` selects (read lazily: a data set without chats
  // needs none). The template gets the special tokens (bos_token, ...) as variables.
  SftEncoder(const std::string& model_dir, SftEncoderOptions options);
  // Explicit parts (tests): template_source "" = no template.
  SftEncoder(text::Tokenizer tokenizer, std::string template_source, nlohmann::ordered_json special_tokens,
             SftEncoderOptions options);

  // One record; `where` (e.g. "data/train.jsonl record 7") is named in errors.
  SftSample encode(const nlohmann::json& record, const std::string& where) const;
  SftSample encode_text(const std::string& text) const;
  SftSample encode_prompt_completion(const std::string& prompt, const std::string& completion) const;
  // messages: a JSON list of {role, content}; turns of role "assistant" at index >=
  // first_trained are trained.
  SftSample encode_chat(const nlohmann::json& messages, size_t first_trained = 0,
                        const std::string& where = "chat") const;
  // The rendered chat cut into consecutive (text, trained) segments (concatenated they are
  // the whole rendering).
  std::vector<std::pair<std::string, bool>> chat_segments(const nlohmann::json& messages, size_t first_trained,
                                                          const std::string& where) const;

  const text::Tokenizer& tokenizer() const { return tokenizer_; }

 private:
  const text::ChatTemplate& chat_template(const std::string& where) const;
  std::string render(const nlohmann::json& messages, size_t count, bool add_generation_prompt) const;
  void truncate(SftSample& s) const;

  text::Tokenizer tokenizer_;
  SftEncoderOptions options_;
  text::ModelChatTemplate template_;
};

// First-fit packing: each sample (by length, in order) goes into the first row with room
// left, a new row when none has. Returns the rows as lists of sample indices (in the order
// the samples were placed). Lengths must be in [1, block_size].
std::vector<std::vector<int64_t>> pack_first_fit(const std::vector<int64_t>& lengths, int64_t block_size);

// No packing: row i holds sample i alone.
std::vector<std::vector<int64_t>> one_sample_per_row(int64_t samples);

// A micro-batch of rows: [B, T] with T the longest row. Padding (after a row's tokens, or
// before them with pad_left): pad_id, label kIgnoreLabel, segment id -1. Segment ids count
// the samples of each row from 0.
struct PackedBatch {
  torch::Tensor input_ids;    // int64
  torch::Tensor labels;       // int64
  torch::Tensor segment_ids;  // int64
};
PackedBatch make_packed_batch(const std::vector<SftSample>& samples, const std::vector<std::vector<int64_t>>& rows,
                              const std::vector<int64_t>& row_indices, int32_t pad_id, bool pad_left = false);

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
// The dtype an llm run holds its base weights in: bf16 for peft with mixed_precision bf16, else
// fp32 (DPO's reference model is held the same way).
torch::ScalarType base_weight_dtype(const RunConfig& config);
// params.quantization and params.quantize_embeddings as the loader takes them.
models::QuantOptions quant_options_of(const RunConfig& config);
// Copies the tokenizer files of model directory FROM into TO (final/ carries them).
void copy_tokenizer_files(const std::string& from, const std::string& to);

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
