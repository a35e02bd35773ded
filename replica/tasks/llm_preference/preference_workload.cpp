// The alignment trainers of task llm (trainer dpo | orpo | reward): preference rows through the
// Llama model, TRL's losses (preference.h), the reward model's score head, and what a run
// saves. The trainer (train/trainer.h) drives them as any workload.
#include "replica/tasks/llm_preference/preference_workload.h"

#include "replica/core/error.h"
#include "replica/core/files.h"
#include "replica/data/records.h"
#include "replica/io/files.h"
#include "replica/models/hf_model_dir.h"
#include "replica/models/llama.h"
#include "replica/models/lora.h"
#include "replica/tasks/llm_preference/preference.h"
#include "replica/tasks/llm_sft/llm_sft.h"

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <filesystem>

namespace fs = std::filesystem;

namespace replica::tasks {
namespace {

using json = nlohmann::json;
using train::EvalSums;
using train::RunConfig;
using train::WorkloadContext;

enum class Trainer { Dpo, Orpo, Reward };

Trainer trainer_of(const RunConfig& config) {
  const std::string& t = llm_params(config).trainer;
  if (t == "dpo") return Trainer::Dpo;
  if (t == "orpo") return Trainer::Orpo;
  if (t == "reward") return Trainer::Reward;
  fail("params.trainer {} is not a preference trainer", t);
}

// The reward model: the decoder and a scalar score head on the last token that is not padding
// (transformers' LlamaForSequenceClassification with num_labels 1; its parameter names, so
// that its state dict is that model's).
class RewardModelImpl : public torch::nn::Module, public models::HookedLayers {
 public:
  RewardModelImpl(models::LlamaModel decoder, models::LoraLinear head) {
    model = register_module("model", std::move(decoder));
    score = register_module("score", std::move(head));
  }
  // Scores [N] (fp32) of each row's last token whose id is not pad_id (transformers' rule, so a
  // pad_id equal to EOS scores the token before a final EOS, as there).
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& segment_ids, int64_t pad_id,
                        const models::PackedLayout& packed = {}) {
    auto hidden = model->forward(ids, {}, segment_ids, packed);  // [N, T, H]
    const int64_t T = ids.size(1);
    auto positions = torch::arange(T, ids.options());
    auto last = (positions.unsqueeze(0) * ids.ne(pad_id).to(torch::kInt64)).argmax(-1);  // [N]
    auto picked = hidden.gather(1, last.view({-1, 1, 1}).expand({-1, 1, hidden.size(2)})).squeeze(1);  // [N, H]
    // The head is fp32 (trained as an adapter is, over a bf16 decoder too): its input widened.
    picked = picked.to(score->weight.scalar_type());
    auto scores = run_layer(*score, [&] { return score->forward(picked); });
    return scores.squeeze(-1).to(torch::kFloat32);
  }
  std::vector<std::shared_ptr<torch::nn::Module>> hooked_layers() override {
    auto out = model->hooked_layers();
    out.push_back(score.ptr());
    return out;
  }
  void set_layer_hooks(models::LayerHooks* hooks) override {
    HookedLayers::set_layer_hooks(hooks);
    model->set_layer_hooks(hooks);
  }
  models::LlamaModel model{nullptr};
  models::LoraLinear score{nullptr};
};
TORCH_MODULE(RewardModel);

constexpr const char* kScoreKey = "base_model.model.score.weight";  // PEFT's name of the saved head

// Reads and encodes one split of preference rows (rows the reward trainer drops counted).
std::vector<std::pair<ScoredSequence, ScoredSequence>> encode_pairs(const PreferenceEncoder& encoder,
                                                                    const std::string& path, const std::string& split,
                                                                    int64_t* dropped) {
  const std::string file = data::resolve_records_file(path, split);
  const auto records = data::read_records(path, split);
  std::vector<std::pair<ScoredSequence, ScoredSequence>> pairs;
  pairs.reserve(records.size());
  int64_t skipped = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    auto pair = encoder.encode(records[i], fmt::format("{} record {}", file, i + 1));
    if (pair) pairs.push_back(std::move(*pair));
    else ++skipped;
  }
  if (dropped) *dropped = skipped;
  if (pairs.empty()) {
    fail("{}: no preference rows to train on ({} records{})", file, records.size(),
         skipped ? fmt::format(", {} longer than block_size", skipped) : std::string());
  }
  return pairs;
}

PreferenceOptions preference_options(const RunConfig& config) {
  PreferenceOptions o;
  const std::string& t = llm_params(config).trainer;
  o.format = t == "orpo" ? PreferenceFormat::Orpo : t == "reward" ? PreferenceFormat::Reward : PreferenceFormat::Dpo;
  o.chat_template = config.data.chat_template;
  o.column_mapping = config.data.column_mapping;
  o.max_prompt_length = llm_params(config).max_prompt_length > 0 ? llm_params(config).max_prompt_length : 0;
  o.max_completion_length = llm_params(config).max_completion_length > 0 ? llm_params(config).max_completion_length : 0;
  const auto settings = train::llm_sft_settings(config);
  o.max_length = settings.block_size;  // AutoTrain passes block_size as TRL's max_length
  return o;
}

class PreferenceWorkload final : public train::Workload {
 public:
  PreferenceWorkload(const RunConfig& config, const WorkloadContext& context)
      : config_(config), context_(context), trainer_(trainer_of(config)), settings_(train::llm_sft_settings(config)) {
    train::check_llm_sft_config(config);
    check_preference_config(config);
    const bool main = context.is_main();
    const std::string tag = "llm-" + llm_params(config).trainer;
    models::HfExtraTensors extra;
    if (trainer_ == Trainer::Reward) {
      extra.take = {"score.weight"};
      extra.may_be_missing = {"lm_head.weight"};
    }
    llm_ = train::load_llm_for_training(config, context, tag, &lora_, &extra);
    beta_ = llm_params(config).dpo_beta;

    PreferenceEncoder encoder(config.base_model, preference_options(config));
    const auto& tok = encoder.tokenizer();
    if (tok.vocab_size() > llm_->config().vocab_size) {
      fail("the tokenizer of '{}' has {} ids but the model's vocab_size is {}", config.base_model, tok.vocab_size(),
           llm_->config().vocab_size);
    }
    pad_id_ = tok.pad_id().value_or(tok.eos_id().value_or(0));
    int64_t dropped = 0;
    train_sequences_ = encode_pairs(encoder, config.data.path, config.data.train_split, &dropped);
    if (config.data.valid_split) {
      valid_sequences_ = encode_pairs(encoder, config.data.path, *config.data.valid_split, nullptr);
    }

    if (trainer_ == Trainer::Reward) {
      // The score head: from the checkpoint when it has one (a reward model trained further),
      // else new, drawn as transformers' _init_weights draws it.
      const auto& c = llm_->config();
      models::LoraLinear head(c.hidden_size, 1, /*bias=*/false, torch::kFloat32, /*init=*/true, c.initializer_range);
      if (auto it = extra.taken.find("score.weight"); it != extra.taken.end()) {
        if (it->second.sizes() != head->weight.sizes()) {
          fail("{}: score.weight has shape {}, a reward model's head is [1, {}] (num_labels 1)", config.base_model,
               c10::str(it->second.sizes()), c.hidden_size);
        }
        torch::NoGradGuard no_grad;
        head->weight.copy_(it->second);
      }
      head->weight.set_requires_grad(true);  // trained whole, also under peft (modules_to_save)
      reward_ = RewardModel(llm_->model, head);
      reward_->to(context.device);
      // The causal head is not part of a reward model: released.
      if (!llm_->lm_head.is_empty()) llm_->unregister_module("lm_head");
      llm_->lm_head = nullptr;
      if (settings_.peft) {
        lora_.task_type = "SEQ_CLS";
        lora_.modules_to_save = {"score"};
      }
    }
    if (trainer_ == Trainer::Dpo) {
      if (!llm_params(config).model_ref.empty()) {
        // A reference model of its own: frozen, never trained, in the policy's dtype.
        reference_ = models::load_hf_model(llm_params(config).model_ref, train::base_weight_dtype(config));
        check_same_vocabulary(reference_->config().vocab_size);
      } else if (!settings_.peft) {
        // Full fine-tuning: a frozen copy of the base, as TRL's create_reference_model.
        reference_ = models::load_hf_model(config.base_model, train::base_weight_dtype(config));
      }
      if (!reference_.is_empty()) {
        for (auto& p : reference_->parameters()) p.set_requires_grad(false);
        reference_->eval();
        reference_->to(context.device);
      }
      if (main) {
        spdlog::info("{}: reference model: {}", tag,
                     !llm_params(config).model_ref.empty() ? llm_params(config).model_ref
                     : settings_.peft              ? std::string("the base with the adapters disabled (no second copy)")
                                                   : std::string("a frozen copy of the base"));
      }
    }
    if (main) {
      int64_t tokens = 0;
      for (const auto& [c, r] : train_sequences_) tokens += static_cast<int64_t>(c.ids.size() + r.ids.size());
      spdlog::info("{}: {} preference pairs ({} tokens, chosen and rejected){}{}", tag, train_sequences_.size(), tokens,
                   trainer_ == Trainer::Reward ? "" : fmt::format(", beta {}", beta_),
                   dropped ? fmt::format("; {} rows with a side longer than block_size {} dropped", dropped,
                                         settings_.block_size)
                           : std::string());
    }
  }

  train::ModelCardInfo model_card() const override { return train::llm_model_card(config_); }
  std::shared_ptr<torch::nn::Module> model() override {
    if (trainer_ == Trainer::Reward) return reward_.ptr();
    return llm_.ptr();
  }
  int64_t train_size() const override { return static_cast<int64_t>(train_sequences_.size()); }
  int64_t valid_size() const override { return static_cast<int64_t>(valid_sequences_.size()); }
  int64_t tokens_in(const std::vector<int64_t>& indices) const override {
    int64_t n = 0;
    for (int64_t i : indices) {
      const auto& [c, r] = train_sequences_.at(static_cast<size_t>(i));
      n += static_cast<int64_t>(c.ids.size() + r.ids.size());
    }
    return n;
  }

  torch::Tensor train_loss(const std::vector<int64_t>& indices) override {
    PreferenceLoss l = loss_of(train_sequences_, indices);
    last_metrics_.clear();
    for (const auto& [name, value] : l.metrics) last_metrics_[name] = value.item<double>();
    return l.loss;
  }
  std::map<std::string, double> train_metrics() override { return std::exchange(last_metrics_, {}); }

  EvalSums evaluate(const std::vector<int64_t>& indices) override {
    torch::NoGradGuard no_grad;
    EvalSums sums;
    const size_t chunk = static_cast<size_t>(std::max(1, config_.params.batch_size));
    for (size_t at = 0; at < indices.size(); at += chunk) {
      const std::vector<int64_t> part(indices.begin() + static_cast<std::ptrdiff_t>(at),
                                      indices.begin() + static_cast<std::ptrdiff_t>(std::min(indices.size(), at + chunk)));
      const double n = static_cast<double>(part.size());
      PreferenceLoss l = loss_of(valid_sequences_, part);
      sums.loss_sum += l.loss.item<double>() * n;
      sums.count += n;
      const char* accuracy = trainer_ == Trainer::Reward ? "accuracy" : "rewards/accuracies";
      for (const auto& [name, value] : l.metrics) {
        if (name == accuracy) sums.correct += value.item<double>() * n;
        else sums.extra[name] += value.item<double>() * n;
      }
    }
    return sums;
  }

  json model_config() const override {
    json c = json::parse(llm_->config().to_json_string());
    if (trainer_ == Trainer::Reward) reward_config(c);
    return c;
  }

  std::string checkpoint_model_file() const override {
    return settings_.peft ? "adapter_model.safetensors" : "model.safetensors";
  }
  io::NamedTensors state_tensors() override {
    if (!settings_.peft) return Workload::state_tensors();
    io::NamedTensors out;
    for (const auto& [name, t] : models::lora_state_dict(*model())) out.emplace_back(name, t.detach());
    if (trainer_ == Trainer::Reward) out.emplace_back(kScoreKey, reward_->score->weight.detach());
    return out;
  }
  void load_state_tensors(const io::NamedTensors& tensors, const std::string& where) override {
    if (!settings_.peft) return Workload::load_state_tensors(tensors, where);
    io::NamedTensors adapters;
    bool score = false;
    for (const auto& [name, t] : tensors) {
      if (trainer_ == Trainer::Reward && name == kScoreKey) {
        if (t.sizes() != reward_->score->weight.sizes()) fail("{}: {} has shape {}", where, name, c10::str(t.sizes()));
        torch::NoGradGuard no_grad;
        reward_->score->weight.copy_(t);
        score = true;
      } else {
        adapters.emplace_back(name, t);
      }
    }
    if (trainer_ == Trainer::Reward && !score) fail("{}: tensor {} (the score head) is missing", where, kScoreKey);
    models::load_lora_state_dict(*model(), adapters, where);
  }
  void write_checkpoint_extras(const std::string& dir) const override {
    if (settings_.peft) {
      models::save_adapter(*model_const(), lora_, dir, score_tensors());
    } else {
      json c = json::parse(llm_->config().to_json_string());
      // The weights as held (fp32, or bf16 with their fp32 masters in optimizer.safetensors).
      c["torch_dtype"] = models::dtype_to_string(train::held_weight_dtype(*llm_));
      if (trainer_ == Trainer::Reward) reward_config(c);
      write_file_atomically((fs::path(dir) / "config.json").string(), c.dump(2) + "\n");
    }
  }

  void save_final(const std::string& final_dir) override {
    fs::create_directories(final_dir);
    if (settings_.peft) {
      models::save_adapter(*model_const(), lora_, final_dir, score_tensors());
      train::copy_tokenizer_files(config_.base_model, final_dir);
      if (settings_.merge_adapter) {
        // A reward model's adapter stays one (its config note says so: llm_sft_task).
        if (trainer_ != Trainer::Reward) train::merge_into_project(config_, final_dir, "llm-" + llm_params(config_).trainer);
      }
      return;
    }
    if (trainer_ != Trainer::Reward) {
      models::save_hf_model_dir(llm_, final_dir, config_.base_model);
      return;
    }
    // LlamaForSequenceClassification's directory: the decoder and score.weight in the base's dtype.
    const auto dtype = llm_->checkpoint_dtype();
    io::NamedTensors tensors;
    for (const auto& item : reward_->named_parameters()) {
      tensors.emplace_back(item.key(), item.value().detach().to(torch::kCPU, dtype).contiguous());
    }
    io::save_safetensors((fs::path(final_dir) / "model.safetensors").string(), tensors, {{"format", "pt"}});
    json c = model_config();
    c["torch_dtype"] = models::dtype_to_string(dtype);
    write_file_atomically((fs::path(final_dir) / "config.json").string(), c.dump(2) + "\n");
    train::copy_tokenizer_files(config_.base_model, final_dir);
  }

 private:
  using SequencePairs = std::vector<std::pair<ScoredSequence, ScoredSequence>>;

  std::shared_ptr<const torch::nn::Module> model_const() const {
    return trainer_ == Trainer::Reward ? std::static_pointer_cast<const torch::nn::Module>(reward_.ptr())
                                       : std::static_pointer_cast<const torch::nn::Module>(llm_.ptr());
  }
  io::NamedTensors score_tensors() const {
    if (trainer_ != Trainer::Reward) return {};
    return {{kScoreKey, reward_->score->weight.detach()}};
  }
  void reward_config(json& c) const {
    c["architectures"] = json::array({"LlamaForSequenceClassification"});
    c["num_labels"] = 1;
    c["id2label"] = {{"0", "LABEL_0"}};
    c["label2id"] = {{"LABEL_0", 0}};
    c["pad_token_id"] = pad_id_;
    c["problem_type"] = nullptr;
  }
  void check_same_vocabulary(int64_t ref_vocab) const {
    if (ref_vocab != llm_->config().vocab_size) {
      fail("params.model_ref '{}' has vocab_size {}, the model {} has {}: the reference must share the tokenizer",
           llm_params(config_).model_ref, ref_vocab, config_.base_model, llm_->config().vocab_size);
    }
  }

  // [chosen of each pair, then rejected of each pair], right-padded.
  DeviceSequenceBatch batch_of(const SequencePairs& pairs, const std::vector<int64_t>& indices) const {
    std::vector<ScoredSequence> seqs;
    for (int64_t i : indices) seqs.push_back(pairs.at(static_cast<size_t>(i)).first);
    for (int64_t i : indices) seqs.push_back(pairs.at(static_cast<size_t>(i)).second);
    return to_device(make_sequence_batch(seqs, pad_id_), llm_->config().vocab_size, context_);
  }

  PreferenceLoss loss_of(const SequencePairs& pairs, const std::vector<int64_t>& indices) {
    const int64_t n = static_cast<int64_t>(indices.size());
    const DeviceSequenceBatch d = batch_of(pairs, indices);
    const SequenceBatch& b = d.batch;
    if (trainer_ == Trainer::Reward) {
      auto scores = reward_->forward(b.ids, b.segment_ids, pad_id_, d.facts.packed);
      return reward_loss(scores.narrow(0, 0, n), scores.narrow(0, n, n));
    }
    auto logits = llm_->forward(b.ids, {}, b.segment_ids, d.facts);
    const SequenceLogps lp = completion_logps(logits, b);
    logits = torch::Tensor();
    auto chosen = lp.sum.narrow(0, 0, n), rejected = lp.sum.narrow(0, n, n);
    PreferenceLoss out;
    if (trainer_ == Trainer::Dpo) {
      torch::Tensor ref;
      {
        // The reference's log-probabilities, once per batch, without gradient.
        torch::NoGradGuard no_grad;
        if (!reference_.is_empty()) {
          ref = completion_logps(reference_->forward(b.ids, {}, b.segment_ids, d.facts), b).sum;
        } else {
          models::AdaptersDisabled base_only;
          ref = completion_logps(llm_->forward(b.ids, {}, b.segment_ids, d.facts), b).sum;
        }
      }
      out = dpo_loss(chosen, rejected, ref.narrow(0, 0, n), ref.narrow(0, n, n), beta_);
    } else {
      auto counts = lp.count.clamp_min(1);
      // TRL 0.13's ORPO: the NLL over every token of the chosen sequences after the first, the
      // prompt's included.
      auto chosen_nll = -lp.all_sum.narrow(0, 0, n).sum() / lp.all_count.narrow(0, 0, n).sum().clamp_min(1);
      out = orpo_loss(chosen / counts.narrow(0, 0, n), rejected / counts.narrow(0, n, n), chosen_nll, beta_);
    }
    // TRL's logits/chosen and logits/rejected: the mean logit over each half's completion positions.
    out.metrics["logits/chosen"] = lp.logit_sum.narrow(0, 0, n).sum() / lp.count.narrow(0, 0, n).sum().clamp_min(1);
    out.metrics["logits/rejected"] = lp.logit_sum.narrow(0, n, n).sum() / lp.count.narrow(0, n, n).sum().clamp_min(1);
    return out;
  }

  RunConfig config_;
  WorkloadContext context_;
  Trainer trainer_;
  train::LlmSftSettings settings_;
  models::LlamaForCausalLM llm_{nullptr};
  models::LlamaForCausalLM reference_{nullptr};
  RewardModel reward_{nullptr};
  models::LoraConfig lora_;
  SequencePairs train_sequences_, valid_sequences_;
  int64_t pad_id_ = 0;
  double beta_ = 0.1;
  std::map<std::string, double> last_metrics_;
};

}  // namespace

void check_preference_config(const RunConfig& config) {
  const std::string& t = llm_params(config).trainer;
  if (t == "sft") return;
  if (!llm_params(config).model_ref.empty()) {
    if (t != "dpo") fail("params.model_ref is DPO's reference model; trainer {} has none (leave model_ref unset)", t);
    if (!fs::is_directory(llm_params(config).model_ref)) fail("params.model_ref '{}' is not a model directory", llm_params(config).model_ref);
  }
  if (!(llm_params(config).dpo_beta > 0)) fail("params.dpo_beta must be > 0, got {}", llm_params(config).dpo_beta);
  if (t == "orpo") {
    // TRL's ORPO cuts a completion to block_size - max_prompt_length tokens when a pair is too long.
    const int64_t block_size = train::llm_sft_settings(config).block_size;
    if (block_size <= llm_params(config).max_prompt_length) {
      fail("params.block_size {} must be larger than params.max_prompt_length {} for trainer orpo (a pair too long "
           "keeps block_size - max_prompt_length completion tokens)",
           block_size, llm_params(config).max_prompt_length);
    }
  }
}

DeviceSequenceBatch to_device(const SequenceBatch& host, int64_t vocab_size, const train::WorkloadContext& context) {
  // Note [token ids checked on the host] (models/llama.cpp); the layout: Note [packed attention].
  DeviceSequenceBatch d;
  d.facts = models::host_batch_facts(host.ids, host.segment_ids, vocab_size, context.device,
                                     "llm preference batch ids");
  d.batch = host;
  d.batch.ids = context.on_device(host.ids);
  d.batch.completion = context.on_device(host.completion);
  d.batch.segment_ids = context.on_device(host.segment_ids);
  return d;
}

std::unique_ptr<train::Workload> make_preference_workload(const RunConfig& config, const WorkloadContext& context) {
  return std::make_unique<PreferenceWorkload>(config, context);
}

}  // namespace replica::tasks
