// Preference data and the losses of the alignment trainers (task llm, trainer dpo | orpo |
// reward), as TRL computes them (the pinned TRL is the referee:
// tests/preference_conformance_test.cpp).
//
// Data. A row holds a prompt, a chosen and a rejected completion: TRL's columns `prompt`,
// `chosen`, `rejected`, or AutoTrain's mapping (prompt_text_column, text_column for the chosen
// one, rejected_text_column). Each is plain text, or (TRL's conversational form) a list of
// {role, content} messages: the prompt is rendered by the model's chat template with the
// generation prompt, each completion as the rendering of prompt + completion after the
// prompt's text (TRL's maybe_apply_chat_template). A chat row without a prompt column has its
// prompt taken as the messages chosen and rejected share at their start (TRL's
// extract_prompt).
//
// Tokens, as each of TRL's trainers makes them (TRL 0.13, the version AutoTrain 0.8.36 pins):
//   dpo     the prompt and each completion encoded without special tokens (a chat template
//           writes BOS where the model has one), EOS after each completion; the prompt keeps
//           its last max_prompt_length tokens, each completion its first
//           max_completion_length; prompt + completion then keeps its first max_length
//           (block_size) tokens. Loss on the completion's tokens: their log-probs summed.
//   orpo    prompt + completion encoded as one text without special tokens, split where the
//           prompt's own tokens end (one token earlier when the two merged across the seam);
//           BOS prepended unless there, EOS appended unless there; when prompt + the longer
//           completion exceed max_length the prompt keeps its last max_prompt_length tokens,
//           and when still too long each completion its first max_length - max_prompt_length
//           (max_completion_length plays no part, as in TRL for decoder-only models). The
//           log-probs of the completion's tokens averaged; the NLL term over every token of
//           the chosen sequence after the first.
//   reward  the whole text (prompt + completion, a chat rendered whole) encoded with special
//           tokens (BOS from the tokenizer's post-processor), no EOS; a row with a side longer
//           than max_length is dropped. Scored at the last token that is not the pad id.
#pragma once

#include "replica/text/chat_template.h"
#include "replica/text/tokenizer.h"

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace replica::tasks {

// One sequence the model scores: prompt + completion, and which tokens are completion.
struct ScoredSequence {
  std::vector<int32_t> ids;
  std::vector<uint8_t> completion;  // 1 for the completion's tokens (reward: the scored token)
};

enum class PreferenceFormat { Dpo, Orpo, Reward };

struct PreferenceOptions {
  PreferenceFormat format = PreferenceFormat::Dpo;
  // tokenizer | chatml | llama3 | zephyr | none; zephyr also gives a chat without a system
  // message an empty one first, as AutoTrain's preference munging does.
  std::string chat_template = "tokenizer";
  std::map<std::string, std::string> column_mapping;  // prompt_text_column, text_column, rejected_text_column
  int64_t max_prompt_length = 0;                      // 0 = no limit
  int64_t max_completion_length = 0;                  // 0 = no limit
  int64_t max_length = 0;                             // prompt + completion; 0 = no limit
};

class PreferenceEncoder {
 public:
  // The tokenizer and chat template of `model_dir` (the template read lazily: text rows need none).
  PreferenceEncoder(const std::string& model_dir, PreferenceOptions options);
  // Explicit parts (tests): template_source "" = no template.
  PreferenceEncoder(text::Tokenizer tokenizer, std::string template_source,
                    nlohmann::ordered_json special_tokens, PreferenceOptions options);

  // The texts a record renders to, before tokenization: the prompt and the completions (a chat
  // rendered as TRL's maybe_apply_chat_template does), and each whole sequence (the reward
  // model's input).
  struct Texts {
    std::string prompt, chosen, rejected, full_chosen, full_rejected;
  };
  Texts texts(const nlohmann::json& record, const std::string& where) const;

  // One record's chosen and rejected sequences as the trainer scores them (`where`: "FILE
  // record N", named in errors); nullopt for a row the reward trainer drops (a side longer than
  // max_length).
  std::optional<std::pair<ScoredSequence, ScoredSequence>> encode(const nlohmann::json& record,
                                                                  const std::string& where) const;

  const text::Tokenizer& tokenizer() const { return tokenizer_; }
  const PreferenceOptions& options() const { return options_; }

 private:
  text::Tokenizer tokenizer_;
  PreferenceOptions options_;
  text::ModelChatTemplate template_;
};

// A batch of sequences, right-padded: ids [N, T] (pad_id beyond each sequence), completion
// [N, T] bool, segment_ids [N, T] (0 on a sequence's tokens, -1 on padding), lengths [N].
struct SequenceBatch {
  torch::Tensor ids;
  torch::Tensor completion;
  torch::Tensor segment_ids;
  torch::Tensor lengths;
};
SequenceBatch make_sequence_batch(const std::vector<ScoredSequence>& sequences, int32_t pad_id);

// Per sequence: the log-probability the model gives each completion token, summed (and the
// count of those tokens, and the sum over those positions of the mean logit, for TRL's
// logits/* metrics). logits [N, T, V]; token t is predicted at position t - 1.
struct SequenceLogps {
  torch::Tensor sum;          // [N] fp32, differentiable
  torch::Tensor count;        // [N] fp32
  torch::Tensor all_sum;      // [N] fp32, differentiable: over every token after the first (ORPO's NLL)
  torch::Tensor all_count;    // [N] fp32
  torch::Tensor logit_sum;    // [N] fp32: over the counted positions, the sum of their mean logit (no grad)
};
SequenceLogps completion_logps(const torch::Tensor& logits, const SequenceBatch& batch);

// ---- Losses. Each returns the loss (mean over the pairs, differentiable) and the metrics TRL
// logs for the step, under TRL's names (means over the pairs).
struct PreferenceLoss {
  torch::Tensor loss;
  std::map<std::string, torch::Tensor> metrics;  // detached fp32 scalars
};

// DPO's sigmoid loss: -log sigmoid(beta ((pc - rc) - (pr - rr))) with p = the policy's summed
// completion log-probs, r = the reference's; rewards = beta (p - r). Metrics: rewards/chosen,
// rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected.
PreferenceLoss dpo_loss(const torch::Tensor& policy_chosen, const torch::Tensor& policy_rejected,
                        const torch::Tensor& ref_chosen, const torch::Tensor& ref_rejected, double beta);

// ORPO: nll (the chosen completions' cross-entropy, averaged over their tokens) minus beta x
// mean log sigmoid(log odds(chosen) - log odds(rejected)), with odds over the mean per-token
// log-probability of each completion.
PreferenceLoss orpo_loss(const torch::Tensor& chosen_mean_logps, const torch::Tensor& rejected_mean_logps,
                         const torch::Tensor& chosen_nll, double beta);

// Reward modelling: -log sigmoid(r_chosen - r_rejected), r the score of each sequence.
PreferenceLoss reward_loss(const torch::Tensor& chosen_scores, const torch::Tensor& rejected_scores);

}  // namespace replica::tasks
