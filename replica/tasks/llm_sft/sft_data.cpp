// The SFT data pipeline: records -> tokenized samples (text, prompt + completion, or a chat
// rendered by the model's template) -> rows (first-fit packing or one sample per row) ->
// micro-batches with segment ids (see sft_data.h).
#include "replica/tasks/llm_sft/sft_data.h"

#include "replica/core/error.h"
#include "replica/data/records.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <utility>

namespace replica::train {
namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

using data::columns_of;

const json& string_field(const json& record, const std::string& name, const std::string& where) {
  auto it = record.find(name);
  if (it == record.end()) fail("{}: column '{}' is missing (columns: {})", where, name, columns_of(record));
  if (!it->is_string()) fail("{}: column '{}' must be text, got {}", where, name, it->type_name());
  return *it;
}

void append(SftSample& s, const std::vector<int32_t>& ids, bool trained) {
  s.ids.insert(s.ids.end(), ids.begin(), ids.end());
  for (int32_t id : ids) s.labels.push_back(trained ? id : kIgnoreLabel);
}

// A JSON list of {role, content} objects, or a replica::Error naming what is wrong.
void check_messages(const json& messages, const std::string& where) {
  if (!messages.is_array()) fail("{}: a chat must be a list of messages, got {}", where, messages.type_name());
  if (messages.empty()) fail("{}: the chat has no messages", where);
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
      fail("{}: message {} must be an object with a \"role\" string, got {}", where, i, m.dump());
    }
    if (!m.contains("content")) fail("{}: message {} has no \"content\"", where, i);
  }
}

std::string records_where(const std::string& file, size_t index) {
  return fmt::format("{} record {}", file, index + 1);
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Samples

int64_t SftSample::predicted() const {
  int64_t n = 0;
  for (size_t t = 1; t < labels.size(); ++t) n += labels[t] != kIgnoreLabel;
  return n;
}

std::vector<uint8_t> SftSample::loss_mask() const {
  std::vector<uint8_t> mask(labels.size());
  for (size_t t = 0; t < labels.size(); ++t) mask[t] = labels[t] != kIgnoreLabel;
  return mask;
}

SftEncoder::SftEncoder(const std::string& model_dir, SftEncoderOptions options)
    : tokenizer_(text::Tokenizer::from_dir(model_dir)),
      options_(std::move(options)),
      template_(options_.chat_template, model_dir) {}

SftEncoder::SftEncoder(text::Tokenizer tokenizer, std::string template_source, ordered_json special_tokens,
                       SftEncoderOptions options)
    : tokenizer_(std::move(tokenizer)), options_(std::move(options)), template_(template_source, std::move(special_tokens)) {}

const text::ChatTemplate& SftEncoder::chat_template(const std::string& where) const { return template_.get(where); }

std::string SftEncoder::render(const json& messages, size_t count, bool add_generation_prompt) const {
  ordered_json prefix = ordered_json::array();
  for (size_t i = 0; i < count; ++i) prefix.push_back(ordered_json(messages[i]));
  return template_.render(prefix, add_generation_prompt, "chat");
}

void SftEncoder::truncate(SftSample& s) const {
  if (options_.max_length > 0 && static_cast<int64_t>(s.ids.size()) > options_.max_length) {
    s.ids.resize(static_cast<size_t>(options_.max_length));
    s.labels.resize(static_cast<size_t>(options_.max_length));
  }
}

SftSample SftEncoder::encode_text(const std::string& text) const {
  SftSample s;
  auto ids = tokenizer_.encode(text, /*add_special_tokens=*/true);
  const auto eos = tokenizer_.eos_id();
  if (options_.add_eos_token && eos && (ids.empty() || ids.back() != *eos)) ids.push_back(*eos);
  append(s, ids, true);
  truncate(s);
  return s;
}

SftSample SftEncoder::encode_prompt_completion(const std::string& prompt, const std::string& completion) const {
  SftSample s;
  auto prompt_ids = tokenizer_.encode(prompt, /*add_special_tokens=*/true);
  const auto eos = tokenizer_.eos_id();
  // A post-processor that appends EOS puts it after the completion, not between the two.
  if (eos && !prompt_ids.empty() && prompt_ids.back() == *eos) prompt_ids.pop_back();
  auto completion_ids = tokenizer_.encode(completion, /*add_special_tokens=*/false);
  if (options_.add_eos_token && eos && (completion_ids.empty() || completion_ids.back() != *eos)) {
    completion_ids.push_back(*eos);
  }
  append(s, prompt_ids, false);
  append(s, completion_ids, true);
  truncate(s);
  return s;
}

std::vector<std::pair<std::string, bool>> SftEncoder::chat_segments(const json& messages, size_t first_trained,
                                                                     const std::string& where) const {
  check_messages(messages, where);
  chat_template(where);
  const size_t n = messages.size();
  const std::string full = render(messages, n, false);

  // Cuts the whole rendering at each trained assistant turn: the text before it (rendered with
  // the generation prompt) and the text through it must both start the whole chat's text.
  // Returns the segments, or why a turn could not be found.
  auto cut = [&](size_t first) -> std::pair<std::vector<std::pair<std::string, bool>>, std::string> {
    std::vector<std::pair<std::string, bool>> segments;
    size_t pos = 0;
    for (size_t i = first; i < n; ++i) {
      if (messages[i]["role"] != "assistant") continue;
      auto broken = [&](const std::string& what) {
        return std::make_pair(std::vector<std::pair<std::string, bool>>{},
                              fmt::format("cannot find assistant message {} in the rendered chat: {}", i, what));
      };
      if (i == 0) return broken("the chat starts with it, so no prompt renders before it");
      const std::string before = render(messages, i, /*add_generation_prompt=*/true);
      const std::string through = render(messages, i + 1, /*add_generation_prompt=*/false);
      if (through.compare(0, before.size(), before) != 0 || before.size() > through.size()) {
        return broken("the text up to it, with the generation prompt, does not start the text that includes it");
      }
      if (full.compare(0, through.size(), through) != 0) {
        return broken("the text through it does not start the text of the whole chat");
      }
      if (before.size() < pos) return broken("it overlaps the previous assistant message");
      if (before.size() > pos) segments.emplace_back(full.substr(pos, before.size() - pos), false);
      if (through.size() > before.size()) {
        segments.emplace_back(full.substr(before.size(), through.size() - before.size()), true);
      }
      pos = through.size();
    }
    if (pos < full.size()) segments.emplace_back(full.substr(pos), false);
    return {std::move(segments), ""};
  };

  auto [segments, error] = cut(first_trained);
  if (error.empty()) return segments;
  // Some templates render a turn differently once a later user message follows it: Qwen3
  // drops the <think> block of every assistant turn before the last user query, as its
  // authors ask for multi-turn chats. Those earlier turns are then context, as the model
  // sees them at inference, and the turns after the last user message are trained.
  size_t last_user = 0;
  for (size_t i = 0; i < n; ++i) {
    if (messages[i]["role"] == "user") last_user = i;
  }
  if (last_user + 1 > first_trained) {
    auto [answer_segments, answer_error] = cut(last_user + 1);
    if (answer_error.empty()) {
      static std::once_flag warned;
      // A structured binding cannot be captured in C++17 (clang refuses it): the lambda takes a copy.
      std::call_once(warned, [&, error = error] {
        spdlog::warn("{}: the chat template renders earlier assistant turns differently once a later user "
                     "message follows (as Qwen3's drops their reasoning), so only the assistant turns after "
                     "the last user message are trained; earlier ones are context ({})",
                     where, error);
      });
      return answer_segments;
    }
  }
  fail("{}: {} (the chat template must render a conversation's prefixes as prefixes of its text; try "
       "chat_template chatml)",
       where, error);
}

SftSample SftEncoder::encode_chat(const json& messages, size_t first_trained, const std::string& where) const {
  SftSample s;
  // The template writes BOS itself (when the model has one): no special tokens added here.
  for (const auto& [text, trained] : chat_segments(messages, first_trained, where)) {
    append(s, tokenizer_.encode(text, /*add_special_tokens=*/false), trained);
  }
  truncate(s);
  return s;
}

SftSample SftEncoder::encode(const json& record, const std::string& where) const {
  SftSample s = encode_record(record, where);
  if (!options_.response_only_loss) s.labels = s.ids;  // every token a target, the prompt's too
  return s;
}

SftSample SftEncoder::encode_record(const json& record, const std::string& where) const {
  if (!record.is_object()) fail("{}: a record must be an object", where);
  const auto& m = options_.column_mapping;
  auto prompt_completion = [&](const std::string& pc, const std::string& cc) {
    auto pit = record.find(pc);
    auto cit = record.find(cc);
    if (pit == record.end() || cit == record.end()) {
      fail("{}: columns '{}' and '{}' are needed (columns: {})", where, pc, cc, columns_of(record));
    }
    if (pit->is_array() || cit->is_array()) {
      // Conversational prompt + completion: one chat whose completion turns are trained.
      if (!pit->is_array() || !cit->is_array()) {
        fail("{}: '{}' and '{}' must both be text or both be lists of messages", where, pc, cc);
      }
      json messages = *pit;
      for (const auto& msg : *cit) messages.push_back(msg);
      return encode_chat(messages, pit->size(), where);
    }
    return encode_prompt_completion(string_field(record, pc, where).get<std::string>(),
                                    string_field(record, cc, where).get<std::string>());
  };
  if (m.count("messages_column")) {
    const std::string mc = m.at("messages_column");
    auto it = record.find(mc);
    if (it == record.end()) fail("{}: column '{}' is missing (columns: {})", where, mc, columns_of(record));
    return encode_chat(*it, 0, where);
  }
  if (m.count("prompt_column") || m.count("completion_column")) {
    return prompt_completion(data::mapped_column(m, "prompt_column", "prompt"),
                             data::mapped_column(m, "completion_column", "completion"));
  }
  const std::string tc = data::mapped_column(m, "text_column", "text");
  if (auto it = record.find(tc); it != record.end()) {
    if (it->is_array()) return encode_chat(*it, 0, where);  // AutoTrain: the text column holds the chat
    if (!it->is_string()) fail("{}: column '{}' must be text or a list of messages, got {}", where, tc, it->type_name());
    return encode_text(it->get<std::string>());
  }
  if (auto it = record.find("messages"); it != record.end()) return encode_chat(*it, 0, where);
  if (record.contains("prompt") && record.contains("completion")) return prompt_completion("prompt", "completion");
  fail("{}: no text to train on: none of the columns '{}' (text), 'messages', or 'prompt' + 'completion' "
       "(columns: {}; set data.column_mapping)",
       where, tc, columns_of(record));
}

// ---------------------------------------------------------------------------------------
// Packing

std::vector<std::vector<int64_t>> pack_first_fit(const std::vector<int64_t>& lengths, int64_t block_size) {
  if (block_size < 1) fail("pack_first_fit: block_size must be >= 1, got {}", block_size);
  const size_t n = lengths.size();
  if (n == 0) return {};
  // A max-tree over the room left in each possible row (there are at most n); unused rows
  // have all the room and lie after the used ones, so "the leftmost row with room" is
  // first-fit, in O(log n) per sample.
  size_t size = 1;
  while (size < n) size <<= 1;
  std::vector<int64_t> tree(2 * size, 0);
  for (size_t i = 0; i < n; ++i) tree[size + i] = block_size;
  for (size_t i = size - 1; i >= 1; --i) tree[i] = std::max(tree[2 * i], tree[2 * i + 1]);
  std::vector<std::vector<int64_t>> rows;
  for (size_t s = 0; s < n; ++s) {
    const int64_t len = lengths[s];
    if (len < 1 || len > block_size) {
      fail("pack_first_fit: sample {} has {} tokens, outside [1, {}]", s, len, block_size);
    }
    size_t node = 1;
    while (node < size) node = tree[2 * node] >= len ? 2 * node : 2 * node + 1;
    const size_t row = node - size;
    if (row >= rows.size()) rows.resize(row + 1);
    rows[row].push_back(static_cast<int64_t>(s));
    tree[node] -= len;
    for (node >>= 1; node >= 1; node >>= 1) tree[node] = std::max(tree[2 * node], tree[2 * node + 1]);
  }
  return rows;
}

std::vector<std::vector<int64_t>> one_sample_per_row(int64_t samples) {
  std::vector<std::vector<int64_t>> rows(static_cast<size_t>(samples));
  for (int64_t s = 0; s < samples; ++s) rows[static_cast<size_t>(s)] = {s};
  return rows;
}

PackedBatch make_packed_batch(const std::vector<SftSample>& samples, const std::vector<std::vector<int64_t>>& rows,
                              const std::vector<int64_t>& row_indices, int32_t pad_id, bool pad_left) {
  const int64_t B = static_cast<int64_t>(row_indices.size());
  int64_t T = 1;
  std::vector<int64_t> lengths;
  for (int64_t r : row_indices) {
    int64_t len = 0;
    for (int64_t s : rows.at(static_cast<size_t>(r))) len += static_cast<int64_t>(samples[static_cast<size_t>(s)].ids.size());
    lengths.push_back(len);
    T = std::max(T, len);
  }
  PackedBatch b;
  b.input_ids = torch::full({B, T}, static_cast<int64_t>(pad_id), torch::kInt64);
  b.labels = torch::full({B, T}, static_cast<int64_t>(kIgnoreLabel), torch::kInt64);
  b.segment_ids = torch::full({B, T}, int64_t{-1}, torch::kInt64);
  auto ids = b.input_ids.accessor<int64_t, 2>();
  auto labels = b.labels.accessor<int64_t, 2>();
  auto segments = b.segment_ids.accessor<int64_t, 2>();
  for (int64_t i = 0; i < B; ++i) {
    int64_t t = pad_left ? T - lengths[static_cast<size_t>(i)] : 0, segment = 0;
    for (int64_t s : rows.at(static_cast<size_t>(row_indices[static_cast<size_t>(i)]))) {
      const SftSample& sample = samples[static_cast<size_t>(s)];
      for (size_t k = 0; k < sample.ids.size(); ++k, ++t) {
        ids[i][t] = sample.ids[k];
        labels[i][t] = sample.labels[k];
        segments[i][t] = segment;
      }
      ++segment;
    }
  }
  return b;
}

// Reads and encodes one split; samples with nothing to predict are dropped (counted).
std::vector<SftSample> encode_split(const SftEncoder& encoder, const std::string& path, const std::string& split,
                                    int64_t* dropped) {
  const std::string file = data::resolve_records_file(path, split);
  const auto records = data::read_records(path, split);
  std::vector<SftSample> samples;
  samples.reserve(records.size());
  int64_t skipped = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    SftSample s = encoder.encode(records[i], records_where(file, i));
    if (s.predicted() == 0) {
      ++skipped;
      continue;
    }
    samples.push_back(std::move(s));
  }
  if (dropped) *dropped = skipped;
  if (samples.empty()) fail("{}: no sample has a token to train on ({} records)", file, records.size());
  return samples;
}

SftRows SftRows::build(std::vector<SftSample> samples, bool packing, int64_t block_size) {
  SftRows r;
  r.samples = std::move(samples);
  std::vector<int64_t> lengths;
  for (const auto& s : r.samples) {
    lengths.push_back(static_cast<int64_t>(s.ids.size()));
    r.tokens += lengths.back();
    r.trained += s.predicted();
  }
  r.rows = packing ? pack_first_fit(lengths, block_size) : one_sample_per_row(static_cast<int64_t>(lengths.size()));
  for (const auto& row : r.rows) {
    int64_t n = 0, items = 0;
    for (int64_t s : row) {
      n += lengths[static_cast<size_t>(s)];
      items += r.samples[static_cast<size_t>(s)].predicted();
    }
    r.row_tokens.push_back(n);
    r.row_items.push_back(items);
  }
  return r;
}

int64_t SftRows::tokens_in(const std::vector<int64_t>& row_indices) const {
  int64_t n = 0;
  for (int64_t r : row_indices) n += row_tokens.at(static_cast<size_t>(r));
  return n;
}

int64_t SftRows::items_in(const std::vector<int64_t>& row_indices) const {
  int64_t n = 0;
  for (int64_t r : row_indices) n += row_items.at(static_cast<size_t>(r));
  return n;
}

}  // namespace replica::train
