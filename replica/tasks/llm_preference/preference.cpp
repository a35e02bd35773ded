// Preference rows -> tokens -> batches, and the DPO / ORPO / reward losses (preference.h).
#include "replica/tasks/llm_preference/preference.h"

#include "replica/core/error.h"
#include "replica/data/records.h"
#include "replica/text/chat_template.h"

#include <torch/torch.h>

#include <algorithm>
#include <utility>

namespace replica::tasks {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

using data::columns_of;


void check_messages(const json& messages, const std::string& what, const std::string& where) {
  if (messages.empty()) fail("{}: {} has no messages", where, what);
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content")) {
      fail("{}: {} message {} must be an object with a \"role\" string and \"content\"", where, what, i);
    }
  }
}

// The longest common prefix of two strings.
std::string common_prefix(const std::string& a, const std::string& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return a.substr(0, n);
}

}  // namespace

PreferenceEncoder::PreferenceEncoder(const std::string& model_dir, PreferenceOptions options)
    : tokenizer_(text::Tokenizer::from_dir(model_dir)),
      options_(std::move(options)),
      template_(options_.chat_template, model_dir) {}

PreferenceEncoder::PreferenceEncoder(text::Tokenizer tokenizer, std::string template_source,
                                     ordered_json special_tokens, PreferenceOptions options)
    : tokenizer_(std::move(tokenizer)), options_(std::move(options)), template_(template_source, std::move(special_tokens)) {}

PreferenceEncoder::Texts PreferenceEncoder::texts(const json& record, const std::string& where) const {
  if (!record.is_object()) fail("{}: a record must be an object", where);
  const auto& m = options_.column_mapping;
  const std::string pc = data::mapped_column(m, "prompt_text_column", "prompt");
  const std::string rc = data::mapped_column(m, "rejected_text_column", "rejected");
  // AutoTrain's text_column names the chosen completion; its default ("text") falls back to
  // TRL's "chosen" when the rows have no such column.
  std::string cc = data::mapped_column(m, "text_column", "chosen");
  if (!record.contains(cc) && record.contains("chosen")) cc = "chosen";
  auto field = [&](const std::string& name) -> const json& {
    auto it = record.find(name);
    if (it == record.end()) {
      fail("{}: column '{}' is missing (columns: {}; a preference row needs a prompt, a chosen and a rejected "
           "completion: TRL's prompt/chosen/rejected or data.column_mapping's prompt_text_column, text_column, "
           "rejected_text_column)",
           where, name, columns_of(record));
    }
    if (!it->is_string() && !it->is_array()) {
      fail("{}: column '{}' must be text or a list of messages, got {}", where, name, it->type_name());
    }
    return *it;
  };
  const json& chosen = field(cc);
  const json& rejected = field(rc);
  const bool has_prompt = record.contains(pc);
  if (chosen.is_array() != rejected.is_array()) {
    fail("{}: '{}' and '{}' must both be text or both be lists of messages", where, cc, rc);
  }
  if (!chosen.is_array()) {
    // Plain text: the prompt is required (TRL would take no prompt as an empty one, which
    // trains the whole text: say so instead).
    const json& prompt = field(pc);
    if (!prompt.is_string()) fail("{}: '{}' must be text when the completions are text", where, pc);
    const std::string p = prompt.get<std::string>(), c = chosen.get<std::string>(), r = rejected.get<std::string>();
    return {p, c, r, p + c, p + r};
  }
  check_messages(chosen, "'" + cc + "'", where);
  check_messages(rejected, "'" + rc + "'", where);
  json prompt, chosen_turns, rejected_turns;
  if (has_prompt) {
    prompt = field(pc);
    if (!prompt.is_array()) fail("{}: '{}' must be a list of messages when the completions are", where, pc);
    check_messages(prompt, "'" + pc + "'", where);
    chosen_turns = chosen;
    rejected_turns = rejected;
  } else {
    // TRL's extract_prompt: the messages both share at their start are the prompt.
    size_t n = 0;
    while (n < chosen.size() && n < rejected.size() && chosen[n] == rejected[n]) ++n;
    if (n == 0) {
      fail("{}: no '{}' column, and '{}' and '{}' share no first message to take as the prompt", where, pc, cc, rc);
    }
    if (n == chosen.size() || n == rejected.size()) fail("{}: '{}' and '{}' leave no completion after their shared messages", where, cc, rc);
    prompt = json(std::vector<json>(chosen.begin(), chosen.begin() + static_cast<std::ptrdiff_t>(n)));
    chosen_turns = json(std::vector<json>(chosen.begin() + static_cast<std::ptrdiff_t>(n), chosen.end()));
    rejected_turns = json(std::vector<json>(rejected.begin() + static_cast<std::ptrdiff_t>(n), rejected.end()));
  }
  if (options_.chat_template == "zephyr" && prompt.front()["role"] != "system") {
    // AutoTrain's preference munging with its zephyr template: an empty system message first.
    prompt.insert(prompt.begin(), json{{"role", "system"}, {"content", ""}});
  }
  template_.get(where);
  // TRL's maybe_apply_chat_template: the prompt with the generation prompt (continuing a final
  // assistant message instead is not supported), each completion the text of prompt +
  // completion after the part it shares with the prompt.
  const std::string last_role = prompt.back()["role"].get<std::string>();
  if (last_role == "assistant") {
    fail("{}: the prompt ends with an assistant message; continuing it (TRL's continue_final_message) is not "
         "supported",
         where);
  }
  std::string prompt_text = template_.render(ordered_json(prompt), /*add_generation_prompt=*/true, where);
  json with_chosen = prompt, with_rejected = prompt;
  for (const auto& t : chosen_turns) with_chosen.push_back(t);
  for (const auto& t : rejected_turns) with_rejected.push_back(t);
  const std::string prompt_chosen = template_.render(ordered_json(with_chosen), false, where);
  prompt_text = common_prefix(prompt_text, prompt_chosen);
  const std::string chosen_text = prompt_chosen.substr(prompt_text.size());
  const std::string prompt_rejected = template_.render(ordered_json(with_rejected), false, where);
  prompt_text = common_prefix(prompt_text, prompt_rejected);
  const std::string rejected_text = prompt_rejected.substr(prompt_text.size());
  return {prompt_text, chosen_text, rejected_text, prompt_chosen, prompt_rejected};
}

namespace {

void keep_first(std::vector<int32_t>& v, int64_t n) {
  if (n > 0 && static_cast<int64_t>(v.size()) > n) v.resize(static_cast<size_t>(n));
}
void keep_last(std::vector<int32_t>& v, int64_t n) {
  if (n > 0 && static_cast<int64_t>(v.size()) > n) v.erase(v.begin(), v.end() - n);
}

ScoredSequence join(const std::vector<int32_t>& prompt, const std::vector<int32_t>& completion) {
  ScoredSequence s;
  s.ids = prompt;
  s.ids.insert(s.ids.end(), completion.begin(), completion.end());
  s.completion.assign(prompt.size(), 0);
  s.completion.insert(s.completion.end(), completion.size(), 1);
  return s;
}

}  // namespace

std::optional<std::pair<ScoredSequence, ScoredSequence>> PreferenceEncoder::encode(const json& record,
                                                                                   const std::string& where) const {
  const Texts t = texts(record, where);
  const auto eos = tokenizer_.eos_id();
  const auto bos = tokenizer_.bos_id();
  const int64_t max_length = options_.max_length;
  switch (options_.format) {
    case PreferenceFormat::Dpo: {
      // TRL's DPOTrainer.tokenize_row (add_special_tokens False) and concatenated_forward.
      if (!eos) fail("{}: the tokenizer has no EOS token to end the completions with", where);
      auto prompt = tokenizer_.encode(t.prompt, /*add_special_tokens=*/false);
      auto chosen = tokenizer_.encode(t.chosen, false);
      auto rejected = tokenizer_.encode(t.rejected, false);
      chosen.push_back(*eos);
      rejected.push_back(*eos);
      keep_last(prompt, options_.max_prompt_length);
      keep_first(chosen, options_.max_completion_length);
      keep_first(rejected, options_.max_completion_length);
      auto c = join(prompt, chosen), r = join(prompt, rejected);
      for (auto* s : {&c, &r}) {
        if (max_length > 0 && static_cast<int64_t>(s->ids.size()) > max_length) {
          s->ids.resize(static_cast<size_t>(max_length));
          s->completion.resize(static_cast<size_t>(max_length));
        }
      }
      return std::make_pair(std::move(c), std::move(r));
    }
    case PreferenceFormat::Orpo: {
      // TRL's ORPOTrainer.build_tokenized_answer and tokenize_row.
      const auto prompt_alone = tokenizer_.encode(t.prompt, false);
      auto split = [&](const std::string& answer) {
        const auto full = tokenizer_.encode(t.prompt + answer, false);
        size_t start = std::min(prompt_alone.size(), full.size());
        if (!std::equal(prompt_alone.begin(), prompt_alone.begin() + static_cast<std::ptrdiff_t>(start), full.begin()) ||
            start < prompt_alone.size()) {
          start = start > 0 ? start - 1 : 0;  // the prompt's last token merged with the answer's first
        }
        std::pair<std::vector<int32_t>, std::vector<int32_t>> out;
        out.first.assign(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(start));
        out.second.assign(full.begin() + static_cast<std::ptrdiff_t>(start), full.end());
        if (bos && (out.first.empty() || out.first.front() != *bos)) out.first.insert(out.first.begin(), *bos);
        if (eos && (out.second.empty() || out.second.back() != *eos)) out.second.push_back(*eos);
        return out;
      };
      auto [chosen_prompt, chosen] = split(t.chosen);
      auto [rejected_prompt, rejected] = split(t.rejected);
      const int64_t longer = static_cast<int64_t>(std::max(chosen.size(), rejected.size()));
      for (auto* prompt : {&chosen_prompt, &rejected_prompt}) {
        if (max_length > 0 && static_cast<int64_t>(prompt->size()) + longer > max_length) {
          keep_last(*prompt, options_.max_prompt_length);
        }
      }
      const int64_t room = max_length - options_.max_prompt_length;
      for (auto [prompt, answer] : {std::make_pair(&chosen_prompt, &chosen), std::make_pair(&rejected_prompt, &rejected)}) {
        if (max_length > 0 && static_cast<int64_t>(prompt->size()) + longer > max_length) {
          if (room < 1) {
            fail("{}: block_size {} leaves no room for a completion after max_prompt_length {}", where, max_length,
                 options_.max_prompt_length);
          }
          keep_first(*answer, room);
        }
      }
      return std::make_pair(join(chosen_prompt, chosen), join(rejected_prompt, rejected));
    }
    case PreferenceFormat::Reward: {
      // AutoTrain's preprocess_reward: the whole texts with special tokens; TRL's RewardTrainer
      // drops a row with a side longer than max_length.
      auto whole = [&](const std::string& text) {
        ScoredSequence s;
        s.ids = tokenizer_.encode(text, /*add_special_tokens=*/true);
        s.completion.assign(s.ids.size(), 0);
        // The scored token: the last whose id is not the pad id (transformers' rule).
        const auto pad = tokenizer_.pad_id();
        for (size_t i = s.ids.size(); i-- > 0;) {
          if (!pad || s.ids[i] != *pad) {
            s.completion[i] = 1;
            break;
          }
        }
        return s;
      };
      auto c = whole(t.full_chosen), r = whole(t.full_rejected);
      if (c.ids.empty() || r.ids.empty()) fail("{}: a side of the pair encodes to no token", where);
      if (max_length > 0 && (static_cast<int64_t>(c.ids.size()) > max_length ||
                             static_cast<int64_t>(r.ids.size()) > max_length)) {
        return std::nullopt;
      }
      return std::make_pair(std::move(c), std::move(r));
    }
  }
  return std::nullopt;
}

SequenceBatch make_sequence_batch(const std::vector<ScoredSequence>& sequences, int32_t pad_id) {
  const int64_t n = static_cast<int64_t>(sequences.size());
  int64_t t_max = 1;
  for (const auto& s : sequences) t_max = std::max<int64_t>(t_max, static_cast<int64_t>(s.ids.size()));
  SequenceBatch b;
  b.ids = torch::full({n, t_max}, static_cast<int64_t>(pad_id), torch::kInt64);
  b.completion = torch::zeros({n, t_max}, torch::kBool);
  b.segment_ids = torch::full({n, t_max}, int64_t{-1}, torch::kInt64);
  b.lengths = torch::zeros({n}, torch::kInt64);
  auto ids = b.ids.accessor<int64_t, 2>();
  auto completion = b.completion.accessor<bool, 2>();
  auto segments = b.segment_ids.accessor<int64_t, 2>();
  auto lengths = b.lengths.accessor<int64_t, 1>();
  for (int64_t i = 0; i < n; ++i) {
    const auto& s = sequences[static_cast<size_t>(i)];
    for (size_t t = 0; t < s.ids.size(); ++t) {
      ids[i][static_cast<int64_t>(t)] = s.ids[t];
      completion[i][static_cast<int64_t>(t)] = s.completion[t] != 0;
      segments[i][static_cast<int64_t>(t)] = 0;
    }
    lengths[i] = static_cast<int64_t>(s.ids.size());
  }
  return b;
}

SequenceLogps completion_logps(const torch::Tensor& logits, const SequenceBatch& batch) {
  // Position t predicts token t + 1: scored where token t + 1 is a completion token.
  const int64_t T = logits.size(1);
  auto lp = logits.narrow(1, 0, T - 1).to(torch::kFloat32).log_softmax(-1);
  auto targets = batch.ids.narrow(1, 1, T - 1);
  auto mask = batch.completion.narrow(1, 1, T - 1).to(torch::kFloat32);
  auto token_lp = lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1);
  SequenceLogps out;
  out.sum = (token_lp * mask).sum(1);
  out.count = mask.sum(1);
  // Every token after the first within its sequence (padding is segment -1).
  auto real = batch.segment_ids.narrow(1, 1, T - 1).ge(0).to(torch::kFloat32);
  out.all_sum = (token_lp * real).sum(1);
  out.all_count = real.sum(1);
  {
    torch::NoGradGuard no_grad;
    auto mean_logit = logits.narrow(1, 0, T - 1).detach().to(torch::kFloat32).mean(-1);
    out.logit_sum = (mean_logit * mask).sum(1);
  }
  return out;
}

namespace {
torch::Tensor mean_of(const torch::Tensor& t) { return t.detach().to(torch::kFloat32).mean(); }

// TRL's rewards/* and logps/* (DPO's and ORPO's alike, from their own rewards and log-probs).
void reward_metrics(PreferenceLoss& out, const torch::Tensor& chosen_rewards, const torch::Tensor& rejected_rewards,
                    const torch::Tensor& chosen_logps, const torch::Tensor& rejected_logps) {
  out.metrics["rewards/chosen"] = mean_of(chosen_rewards);
  out.metrics["rewards/rejected"] = mean_of(rejected_rewards);
  out.metrics["rewards/accuracies"] = mean_of(chosen_rewards.gt(rejected_rewards));
  out.metrics["rewards/margins"] = mean_of(chosen_rewards - rejected_rewards);
  out.metrics["logps/chosen"] = mean_of(chosen_logps);
  out.metrics["logps/rejected"] = mean_of(rejected_logps);
}
}  // namespace

PreferenceLoss dpo_loss(const torch::Tensor& policy_chosen, const torch::Tensor& policy_rejected,
                        const torch::Tensor& ref_chosen, const torch::Tensor& ref_rejected, double beta) {
  auto logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected);
  PreferenceLoss out;
  out.loss = -torch::log_sigmoid(beta * logits).mean();
  reward_metrics(out, beta * (policy_chosen - ref_chosen).detach(), beta * (policy_rejected - ref_rejected).detach(),
                 policy_chosen, policy_rejected);
  return out;
}

PreferenceLoss orpo_loss(const torch::Tensor& chosen_mean_logps, const torch::Tensor& rejected_mean_logps,
                         const torch::Tensor& chosen_nll, double beta) {
  // log odds(p) = log p - log(1 - p), p = exp(mean log-prob).
  auto log_odds = (chosen_mean_logps - rejected_mean_logps) -
                  (torch::log1p(-torch::exp(chosen_mean_logps)) - torch::log1p(-torch::exp(rejected_mean_logps)));
  auto ratio = torch::log_sigmoid(log_odds);
  PreferenceLoss out;
  out.loss = chosen_nll - beta * ratio.mean();
  reward_metrics(out, beta * chosen_mean_logps.detach(), beta * rejected_mean_logps.detach(), chosen_mean_logps,
                 rejected_mean_logps);
  out.metrics["nll_loss"] = mean_of(chosen_nll);
  out.metrics["log_odds_ratio"] = mean_of(ratio);
  out.metrics["log_odds_chosen"] = mean_of(log_odds);
  return out;
}

PreferenceLoss reward_loss(const torch::Tensor& chosen_scores, const torch::Tensor& rejected_scores) {
  PreferenceLoss out;
  out.loss = -torch::log_sigmoid(chosen_scores - rejected_scores).mean();
  out.metrics["accuracy"] = mean_of(chosen_scores.gt(rejected_scores));
  out.metrics["margin"] = mean_of(chosen_scores - rejected_scores);
  return out;
}

}  // namespace replica::tasks
