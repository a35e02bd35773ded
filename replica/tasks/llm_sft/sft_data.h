// The SFT data pipeline of task llm-sft: records -> tokenized samples -> rows -> micro-batches.
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
// block_size tokens (block_size -1 = model_max_length; AutoTrain's -1 is
// min(1024, model_max_length), which the run's first lines point out). packing false: one
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
#pragma once

#include "replica/text/chat_template.h"
#include "replica/text/tokenizer.h"

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include <cstdint>
#include <map>
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
  // false (AITraining's response_only_loss): every token of a sample is a target, the prompt's
  // and the chat's user turns too (TRL's completion_only_loss / assistant_only_loss off).
  bool response_only_loss = true;
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
  SftSample encode_record(const nlohmann::json& record, const std::string& where) const;
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

// Reads and encodes one split (data/records.h); samples with nothing to predict are dropped
// (counted into *dropped). replica::Error naming the file when no sample is left.
std::vector<SftSample> encode_split(const SftEncoder& encoder, const std::string& path, const std::string& split,
                                    int64_t* dropped);

// A split's samples placed into rows (packed first-fit into block_size, or one per row), with
// each row's token and trained-token counts.
struct SftRows {
  std::vector<SftSample> samples;
  std::vector<std::vector<int64_t>> rows;  // sample indices
  std::vector<int64_t> row_tokens;
  std::vector<int64_t> row_items;          // predicted tokens
  int64_t tokens = 0;                      // of every sample
  int64_t trained = 0;
  static SftRows build(std::vector<SftSample> samples, bool packing, int64_t block_size);
  int64_t tokens_in(const std::vector<int64_t>& row_indices) const;
  int64_t items_in(const std::vector<int64_t>& row_indices) const;
};

}  // namespace replica::train
